"""Writes <name>-f16.gguf and the name's entry in llama_cpp_gguf_logits.json for tiny random
models: Qwen 2 (its q/k/v biases and tied embeddings), Qwen 3 (its q/k norms and a head_dim
of its own), Granite (its four multipliers; Q and K rows permuted by the converter, as a
Llama's), OLMo 2 (its norms after attention and the MLP, its q/k norms across all
heads), five mixtures of 4 experts, 2 a token (Mixtral, written as a Llama with experts;
Qwen 3 MoE, its experts narrower than intermediate_size; OLMoE, its top-2 weights not
renormalized; Qwen 2 MoE, its shared expert; Granite MoE, its experts stacked, gate and up
together, in its checkpoint, Granite's multipliers), OLMo 3 (written as an OLMo 2 with a
window: 4 layers, windowed but the second; its full layer's RoPE YaRN-scaled), StableLM 2
(LayerNorms with biases, q/k/v biases, a quarter of each head turned), Phi-2 (GPT-NeoX's
layer with one LayerNorm, 40% of each head turned, a biased LM head) and StarCoder 2 (LayerNorms,
an MLP without a gate, biases everywhere), converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py, and the logits Hugging Face transformers computes for
token ids IDS before the conversion (at three positions). The tests convert the GGUFs back
and compare. transformers and llama.cpp are needed only to remake them:

    pip install transformers sentencepiece   # (llama.cpp's converter imports sentencepiece)
    python testdata/make_llama_cpp_ggufs.py path/to/llama.cpp [name ...]   # (default: all)

llama.cpp identifies a tokenizer's pre-tokenizer by hashing its output on a test text; the
tiny tokenizer (qwen2_tokenizer/) is unknown to it, so make its get_vocab_base_pre return
"qwen2" where it would raise NotImplementedError. Qwen's made with llama.cpp 0c1e570
(2026-10-01); Granite's, OLMo 2's, the mixtures', OLMo 3's, StableLM's, Phi-2's and StarCoder 2's with the
llama.cpp of llama-cpp-python 0.3.36's sdist (pip download llama-cpp-python==0.3.36
--no-binary :all: --no-deps).
"""
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
IDS = [5, 17, 99, 3, 42, 42, 0, 64, 7, 100, 23]
CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
        "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MODELS = {"qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
          "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=16)),
          "granite": (transformers.GraniteConfig, dict(tie_word_embeddings=True, embedding_multiplier=12.0,
                                                       residual_multiplier=0.22, attention_multiplier=0.3,
                                                       logits_scaling=4.0)),
          "olmo2": (transformers.Olmo2Config, dict(tie_word_embeddings=False)),
          "mixtral": (transformers.MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4,
                                                       num_experts_per_tok=2)),
          "qwen3moe": (transformers.Qwen3MoeConfig, dict(tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=24, norm_topk_prob=True)),
          "olmoe": (transformers.OlmoeConfig, dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2)),
          "qwen2moe": (transformers.Qwen2MoeConfig, dict(tie_word_embeddings=False, num_experts=4,
                                                         num_experts_per_tok=2, moe_intermediate_size=24,
                                                         shared_expert_intermediate_size=40)),
          "granitemoe": (transformers.GraniteMoeConfig, dict(
              tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
              residual_multiplier=0.22, attention_multiplier=0.3, logits_scaling=4.0)),
          # (rope_theta 500,000: transformers 5.25 turns OLMo 3's windowed layers by that, whatever the config says)
          "olmo3": (transformers.Olmo3Config, dict(
              tie_word_embeddings=False, num_hidden_layers=4, sliding_window=4, rope_theta=500_000.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                            "attention_factor": 1.2, "beta_fast": 16.0, "beta_slow": 2.0})),
          # (rope_theta 10,000: llama.cpp's converter writes none for a StableLM, and llama.cpp's default is that)
          "stablelm": (transformers.StableLmConfig, dict(tie_word_embeddings=False, use_qkv_bias=True,
                                                         rope_theta=10_000.0, use_parallel_residual=False,
                                                         layer_norm_eps=1e-5)),
          # (llama.cpp's converter writes 4 x hidden_size as a Phi's MLP width, and no RoPE base)
          "phi2": (transformers.PhiConfig, dict(intermediate_size=160, partial_rotary_factor=0.4, rope_theta=10_000.0,
                                                layer_norm_eps=1e-5, num_key_value_heads=4, hidden_size=40)),
          # (no window: llama.cpp runs a StarCoder 2 without one; BOS 0, Starcoder2Config's 50256 past this vocab)
          "starcoder2": (transformers.Starcoder2Config, dict(tie_word_embeddings=True, use_bias=True,
                                                             sliding_window=None, norm_epsilon=1e-5, bos_token_id=0))}
MOES = ("mixtral", "qwen3moe", "olmoe", "qwen2moe", "granitemoe")

llama_cpp, names = Path(sys.argv[1]), sys.argv[2:] or list(MODELS)
logits_file = HERE / "llama_cpp_gguf_logits.json"
out = json.loads(logits_file.read_text()) if logits_file.exists() else {}
for seed, (name, (config_class, extra)) in enumerate(MODELS.items()):
    if name not in names:
        continue
    config = config_class(**dict(vocab_size=763, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=4096,
                                 rms_norm_eps=1e-6, rope_theta=1e6, eos_token_id=758) | extra)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # random, non-trivial values: norms near 1, biases too
        for n, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in n
                    else 0.2 * torch.randn(p.shape, generator=g))
            if name in MOES:   # as float16 holds them: a router's choice of experts, rounded, could flip
                p.copy_(p.half().float())
        logits = model(torch.tensor([IDS])).logits[0]   # (T, V)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        shutil.copy(HERE / "qwen2_tokenizer" / "tokenizer.json", d)
        tj = json.loads((HERE / "qwen2_tokenizer" / "tokenizer.json").read_text())
        (Path(d) / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": CHAT, "eos_token": "<|im_end|>", "bos_token": None, "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": {str(t["id"]): t for t in tj["added_tokens"]}}))
        subprocess.run([sys.executable, llama_cpp / "convert_hf_to_gguf.py", d, "--outtype", "f16",
                        "--outfile", HERE / f"{name}-f16.gguf"], check=True)
    # three positions keep the file small: the last one has attended to every token
    out[name] = {str(t): [round(x, 5) for x in logits[t].tolist()] for t in (0, 5, len(IDS) - 1)}
    out.setdefault("transformers", {})[name] = transformers.__version__   # (which made its logits)
logits_file.write_text(json.dumps(out) + "\n")
