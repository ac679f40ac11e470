"""Writes gemma_tokenizer/ and gemma_tokenizer_cases.jsonl: the SentencePiece BPE of
llama2_tokenizer/ (1,500 tokens; make_llama2_tokenizer.py) in the tokenizer.json shape that
transformers writes for Gemma (GemmaTokenizer; Gemma 3's 270M and 1B ship this shape): a
normalizer Replace(" ", "▁") and no "▁" prepended, a Split(" ") pre-tokenizer, byte fallback,
<bos> from the post-processor, a decoder without Strip; <start_of_turn> and <end_of_turn> added
as special tokens. The expected ids and texts are Hugging Face tokenizers' (the library reading
the file written here), for every text of llama2_tokenizer_cases.jsonl and a few chat turns.
nanopaged's tests compare its own tokenizer with them; `tokenizers` is needed only to remake them:

    pip install tokenizers==0.23.3 && python testdata/make_gemma_tokenizer.py
"""
import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

HERE = Path(__file__).resolve().parent
OUT = HERE / "gemma_tokenizer"

source = json.loads((HERE / "llama2_tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))["model"]
names = {"<s>": "<bos>", "</s>": "<eos>"}
vocab = {names.get(token, token): i for token, i in source["vocab"].items()}
vocab |= {"<start_of_turn>": len(vocab), "<end_of_turn>": len(vocab) + 1}
merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in source["merges"]]

tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
tok.normalizer = normalizers.Replace(" ", "\u2581")
tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                   special_tokens=[("<bos>", vocab["<bos>"])])
tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                        for t in ("<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")])
OUT.mkdir(exist_ok=True)
tok.save(str(OUT / "tokenizer.json"))
tok = Tokenizer.from_file(str(OUT / "tokenizer.json"))   # (what a reader of the file gets)

# A chat template of Gemma's format, written for these tests: turns between <start_of_turn>role
# and <end_of_turn>, the assistant's role named "model", a system prompt put before the first
# user turn.
template = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
(OUT / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "add_bos_token": True,
    "tokenizer_class": "GemmaTokenizer", "chat_template": template}, indent=1) + "\n")
(OUT / "config.json").write_text(json.dumps({
    "model_type": "gemma3_text", "vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
    "max_position_embeddings": 256, "sliding_window": 8, "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 16, "bos_token_id": vocab["<bos>"],
    "eos_token_id": [vocab["<eos>"], vocab["<end_of_turn>"]]}, indent=1) + "\n")

texts = [c["text"] for c in map(json.loads, (HERE / "llama2_tokenizer_cases.jsonl").open(encoding="utf-8"))
         if "text" in c]
texts += ["<start_of_turn>user\nHello world<end_of_turn>\n<start_of_turn>model\n",
          "<bos><start_of_turn>user\n  two spaces, then <eos> and <unk>.<end_of_turn>\n",
          " leading space", "trailing space ", "  ", "\u2581already a meta space", "<start_of_turn><end_of_turn>"]
with (HERE / "gemma_tokenizer_cases.jsonl").open("w", encoding="utf-8") as f:
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.encode(text).ids == [vocab["<bos>"]] + ids
        f.write(json.dumps({"text": text, "ids": ids, "decode": tok.decode(ids, skip_special_tokens=False),
                            "decode_skip": tok.decode(ids)}, ensure_ascii=False) + "\n")
print(f"wrote {OUT} and gemma_tokenizer_cases.jsonl ({len(texts)} texts) with tokenizers {tokenizers.__version__}")
