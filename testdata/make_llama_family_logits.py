"""Writes llama_family_logits.json: for each of the test suite's FAMILY_VARIANTS, the
logits that Hugging Face transformers computes for the token ids IDS from the checkpoint the
tests build (variant_tensors, seed 0). The tests compare nanopaged's logits with these, so
transformers (an independent implementation of Qwen 2, Qwen 3, Mistral, Ministral, Phi-3, SmolLM3,
Gemma 1, 2 and 3, StarCoder 2, OLMo 2 and 3, EXAONE 4, Ernie 4.5, Seed-OSS, Cohere 1 and 2, Granite,
StableLM, Qwen 2 and 3 MoE, Mixtral, OLMoE, Granite MoE, Llama, GPT-NeoX, Phi, GPT-J and OPT) is
needed only to remake the file:

    pip install transformers && python testdata/make_llama_family_logits.py

The bfloat16 logits are transformers' bits on the CPU that ran it, which depend on the kernels
its torch picks there (bfloat16_kernels): they are kept per kind of CPU, and a run adds (or
remakes) its own kind's, keeping the others' where a variant's config is unchanged. (The
"onednn-bf16-AVX512" set came from the machine of the sessions up to 2026-12-07, which had
AVX-512 BF16 instructions: a label given afterwards, from that, not read there; had it AMX too,
its kind reads "onednn-amx-AVX512", and those tests skip there, naming it. "aten-AVX2" came from
an AMD EPYC without AVX-512.)
"""
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from test_nanopaged import (BFLOAT16_VARIANTS, FAMILY_VARIANTS, IDS, bfloat16_kernels, variant_tensors,  # noqa: E402
                            write_checkpoint)

GOLDENS = HERE / "llama_family_logits.json"
before = json.loads(GOLDENS.read_text()) if GOLDENS.exists() else {}
kernels = bfloat16_kernels()
out = {"transformers": transformers.__version__}
# float32 for every variant; then bfloat16 for a few, under "<name>_bfloat16", kept exactly
# (a bfloat16 number prints exactly in a few digits), one set of logits for each kind of CPU
runs = [(name, name, torch.float32) for name in FAMILY_VARIANTS]
runs += [(name + "_bfloat16", name, torch.bfloat16) for name in BFLOAT16_VARIANTS]
for key, name, dtype in runs:
    config = FAMILY_VARIANTS[name]
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_checkpoint(Path(d), config, variant_tensors(config))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, output_loading_info=True)
        # every tensor of the checkpoint used, none left random
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        with torch.no_grad():
            logits = model(torch.tensor([IDS])).logits[0]   # (T, V)
    if dtype == torch.bfloat16:
        kept = before.get(key, {})
        others = kept["logits"] if kept.get("config") == config else {}
        out[key] = {"config": config, "logits": others | {kernels: logits.tolist()}}
    else:
        out[key] = {"config": config, "logits": [[round(x, 6) for x in row] for row in logits.tolist()]}
GOLDENS.write_text(json.dumps(out) + "\n")
print(f"wrote {GOLDENS} with transformers {transformers.__version__}, bfloat16 on {kernels}")
