"""nanopaged's GGUF tokenizers against llama.cpp's own tokenizer tests: real vocabularies.

llama.cpp keeps, for many models, a GGUF holding only the tokenizer
(models/ggml-vocab-<name>.gguf) with test texts (.inp) and the ids Hugging Face's tokenizer
gives them (.out, without special tokens). The PyPI source package of llama-cpp-python
carries them. This script gives each vocabulary a tiny Llama body (zero weights, one layer),
loads it with nanopaged's GGUF converter and compares. Not part of the test suite: it
downloads the package (about 75 MB), and the vocabularies are the models' own.

Usage (from the repository's directory; needs network to PyPI):
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp --wildcards '*/models/ggml-vocab-*'
    python testdata/check_llama_cpp_vocabs.py /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models
"""
import os
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import load_tokenizer  # noqa: E402

# the vocabularies nanopaged's tokenizers can read: SentencePiece (Llama 2, Phi-3), byte-level BPE
NAMES = ["llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2"]
TOKENIZER_KEYS = ["model", "pre", "tokens", "token_type", "scores", "merges", "bos_token_id", "eos_token_id",
                  "add_bos_token", "add_eos_token", "add_space_prefix"]


def with_tiny_body(vocab_gguf: Path, out: Path):
    """The vocab GGUF's tokenizer keys, and a Llama of one layer, hidden size 8, zero weights."""
    meta = {name: field.contents() for name, field in gguf.GGUFReader(vocab_gguf).fields.items()}
    writer = gguf.GGUFWriter(out, "llama")
    C, H, I = 8, 2, 16
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(C)
    writer.add_feed_forward_length(I)
    writer.add_head_count(H)
    writer.add_head_count_kv(H)
    writer.add_layer_norm_rms_eps(1e-5)
    setters = {"model": writer.add_tokenizer_model, "pre": writer.add_tokenizer_pre, "tokens": writer.add_token_list,
               "token_type": writer.add_token_types, "scores": writer.add_token_scores,
               "merges": writer.add_token_merges, "bos_token_id": writer.add_bos_token_id,
               "eos_token_id": writer.add_eos_token_id, "add_bos_token": writer.add_add_bos_token,
               "add_eos_token": writer.add_add_eos_token, "add_space_prefix": writer.add_add_space_prefix}
    for key in TOKENIZER_KEYS:
        if f"tokenizer.ggml.{key}" in meta:
            setters[key](meta[f"tokenizer.ggml.{key}"])
    if "general.name" in meta:   # (Phi-3's added tokens take their rstrip flags from it)
        writer.add_name(meta["general.name"])
    V = len(meta["tokenizer.ggml.tokens"])
    shapes = {"token_embd.weight": (V, C), "output_norm.weight": (C,), "blk.0.attn_norm.weight": (C,),
              "blk.0.ffn_norm.weight": (C,), "blk.0.attn_q.weight": (C, C), "blk.0.attn_k.weight": (C, C),
              "blk.0.attn_v.weight": (C, C), "blk.0.attn_output.weight": (C, C), "blk.0.ffn_gate.weight": (I, C),
              "blk.0.ffn_up.weight": (I, C), "blk.0.ffn_down.weight": (C, I)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(models: Path) -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["NANOPAGED_CACHE"] = tmp   # (the conversions are not kept)
        for name in NAMES:
            path = Path(tmp) / f"{name}.gguf"
            with_tiny_body(models / f"ggml-vocab-{name}.gguf", path)
            tok = load_tokenizer(path)
            texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
            texts[-1] = texts[-1].removesuffix("\n__ggml_vocab_test__")
            wants = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
            assert len(wants) == len(texts), f"{name}: {len(texts)} texts but {len(wants)} lines of ids"
            wrong = [t for t, want in zip(texts, wants) if tok.encode(t, add_special_tokens=False) != list(map(int, want.split()))]
            print(f"{name:>10}: {len(texts) - len(wrong)} of {len(texts)} texts encode as llama.cpp's test expects"
                  + "".join(f"\n{'':>12}differs: {t[:60]!r}" for t in wrong))
            failed += bool(wrong)
    return failed


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
