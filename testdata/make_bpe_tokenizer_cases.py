"""Make small Qwen 2, Llama 3, GPT-NeoX and OPT shaped byte-level BPE tokenizers and their encode cases.

Trains four byte-level BPEs (~500 merges each) with Hugging Face `tokenizers` on a small
built-in multilingual corpus and writes, next to this script:
  qwen2_tokenizer/   tokenizer.json set up as Qwen 2's (NFC; Split(regex, Isolated) +
                     ByteLevel(use_regex=False); ByteLevel post-processor and decoder; special
                     <|endoftext|> <|im_start|> <|im_end|>, non-special <tool_call> </tool_call>
                     <think> </think>) and a tiny config.json
  llama3_tokenizer/  set up as Llama 3's (no normalizer; Split(regex) + ByteLevel; [ByteLevel,
                     TemplateProcessing(<|begin_of_text|> $A)] post-processor; ignore_merges;
                     merges made from the ranks as transformers' TikTokenConverter makes them)
  gpt_neox_tokenizer/  set up as GPT-NeoX's (Pythia's): NFC; ByteLevel(use_regex=True) alone;
                     special <|endoftext|> <|padding|>, and runs of 2 to 8 spaces as added,
                     non-special, normalized tokens
  opt_tokenizer/     set up as OPT's, an older save's "slow" files: vocab.json (fairseq's <s>
                     <pad> </s> <unk> first, then the BPE's tokens renumbered at random: ids
                     not in merge order), merges.txt, tokenizer_config.json (</s> its BOS, EOS
                     and UNK, put before every text: add_bos_token), special_tokens_map.json
  opt_saved_tokenizer/  the tokenizer.json transformers' save_pretrained writes of it
  bpe_tokenizer_cases.jsonl  {"tokenizer", "text", "add_special_tokens", "ids"} per line, ids
                     from `tokenizers` (version printed at the end); OPT's from transformers'
                     GPT2Tokenizer reading the slow files (its `tokenizers` backend), with
                     "decoded", its decode of them
Left out on purpose: Llama 3 and OPT text that starts with its BOS encoded with special
tokens (nanopaged adds no second BOS), characters newer than the Unicode tables of either
side (only old scripts are used), and very long whitespace runs.
Usage: python make_bpe_tokenizer_cases.py   (deterministic: fixed seeds; the OPT part needs
transformers)
"""
import json, random, unicodedata
from pathlib import Path
import tokenizers
from tokenizers import Tokenizer, Regex, models, trainers, pre_tokenizers, normalizers

OUT = Path(__file__).parent
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's true that we've lost, but they'll win.",
    "I'M SURE HE'LL COME, BUT THEY'VE SAID WE'D WAIT. YOU'RE RIGHT; SHE'S GONE. DON'T! I'd've.",
    "In 1984, 3,141,592 people paid $12.99 each (40.7% of 7,000,000,000). Call 555-0123 at 10:45.",
    'def fib(n: int) -> int:\n    """Fibonacci."""\n    if n < 2:\n        return n\n'
    "    return fib(n - 1) + fib(n - 2)\n",
    "class Foo:\r\n\tdef __init__(self, x=0x1F):\r\n\t\tself.x = x  # comment\r\n",
    'for (int i = 0; i < 100; ++i) { printf("%d\\n", i); }  // C\n{"key": [1, 2, 3], "b": null}',
    "我们今天去公园散步，天气非常好。人工智能正在改变世界。日本語の文章です。東京は日本の首都です。",
    "한국어 문장입니다. 서울은 대한민국의 수도입니다. 안녕하세요!",
    "Привет, как дела? Москва — столица России. Γεια σου κόσμε! Η Αθήνα. مرحبا بالعالم.",
    "Café, naïve, résumé, façade, jalapeño, über, Straße, Ångström, Tiếng Việt, Łódź.",
    "Emoji: 😀😃 👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️ 🔥🔥 ✨ 🤖  Math: ∀x∈ℝ, x² ≥ 0; α β γ → ∞ ≠ ±",
    "Ａ　全角　スペース　１２３  and\xa0no-break\u3000ideographic\tspace",
]


def corpus(n=1500, seed=0):
    rnd = random.Random(seed)
    words = " ".join(TEXTS).split()
    ws = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "    ", " \n ", "\u3000"]
    for _ in range(n):
        k = rnd.random()
        if k < 0.5:
            yield rnd.choice(TEXTS)
        elif k < 0.65:
            yield unicodedata.normalize("NFD", rnd.choice(TEXTS))
        elif k < 0.8:
            yield " ".join(str(rnd.randrange(10 ** rnd.randrange(1, 12))) for _ in range(6))
        else:
            yield "".join(rnd.choice(words) + rnd.choice(ws) for _ in range(12))


def train(pattern, nfc, merges):
    """pattern: the Split regex before ByteLevel; None: ByteLevel's own (GPT-2's) regex."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC() if nfc else None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if pattern is None else (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    made = [vocab[a + b] for a, b in merges]
    assert made == sorted(made), "ids must follow merge order (nanopaged uses ids as ranks)"
    return vocab, merges


def converter_merges(vocab):
    """transformers' TikTokenConverter: every split of a token into two tokens, by rank."""
    out = []
    for t, rank in vocab.items():
        local = sorted(((vocab[t[:k]], vocab[t[k:]], rank, t[:k], t[k:]) for k in range(1, len(t))
                        if t[:k] in vocab and t[k:] in vocab))
        out += [(rank, l, r) for _, _, rank, l, r in local]
    return [[l, r] for _, l, r in sorted(out, key=lambda x: x[0])]


def added(i, content, special, normalized=False):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": normalized, "special": special}


def byte_level(prefix, trim, regex):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim, "use_regex": regex}


def write(name, pattern, nfc, ignore_merges, vocab, merges, adds, post, decoder, eos, bos=None):
    d = OUT / f"{name}_tokenizer"
    d.mkdir(exist_ok=True)
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": adds,
          "normalizer": {"type": "NFC"} if nfc else None,
          "pre_tokenizer": byte_level(False, True, True) if pattern is None else {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
              byte_level(False, name == "llama3", False)]},
          "post_processor": post, "decoder": decoder,
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                    "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                    "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}}
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False, indent=1) + "\n")
    config = {"model_type": "llama", "vocab_size": len(vocab) + len(adds), "hidden_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "bos_token_id": bos, "eos_token_id": eos}
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def cases(name, hf, special, seed):
    """About 110 adversarial texts, then random mixes up to 160; add_special_tokens alternates."""
    rnd = random.Random(seed)
    nfd = lambda s: unicodedata.normalize("NFD", s)
    texts = ["", " ", "a", "Hello world", " Hello  world ", *TEXTS[:3], TEXTS[3][:60], TEXTS[4],
             "it's don't we'll you're I've she'd I'm", "IT'S DON'T WE'LL YOU'RE I'VE SHE'D I'M",
             "'S 'lL 'Re 'vE x'Dy ''s ’s 'x", "HE'LL'VE we're'd",
             *["".join(rnd.choice("0123456789") for _ in range(n)) for n in (1, 2, 3, 4, 5, 6, 7, 9, 12, 16)],
             "x1y22z333w4444v55555", "3.14159 -2e10 1,000,000 $12.99", "١٢٣ ४५६ １２３ ²³½ Ⅻ",
             " " * 7 + "x", "a\n\n  b", "a \r\n\r\n b\r\n", "\t\tx\t", "x\u3000\u3000y\u3000", "  \n  ",
             "end   ", "\n \n\t\n", " \t \r\n  \r\n", "x\xa0\xa0y", " " * 40, "\n" * 9 + "z", "\r\r\n\n\r",
             nfd("café naïve résumé"), nfd("Ångström Tiếng Việt"), "\u2126hm \u212b", "e\u0301\u0327 e\u0327\u0301",
             "\u1100\u1161\u11a8 가\u11a8", "<\u0338 >\u0338 =\u0338", "a\u0300\u0315\u0300", nfd("ÉCOLE Ça"),
             "👨‍👩‍👧‍👦 family", "👍🏽👍", "🇺🇸🇯🇵🇩🇪", "❤️‍🔥 🏳️‍🌈", "🤖🤖🤖 ok",
             TEXTS[6][:20], TEXTS[7][:16], "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم",
             "Hello世界Мир123ΩΔ", "東京2024年オリンピック", "naïve—“quoted”…", "x = [1,2];\n  y++;"]
    for i, a in enumerate(special):  # each added token alone, inside a word, and in 3 more contexts
        more = [f" {a} ", f"\n{a}\n\n", a + a, a[:-1], a[1:] + "é", f"é{a}中", f"1{a}'s"]
        texts += [a, f"x{a}y"] + [more[(3 * i + j) % 7] for j in range(3)]
    for a in special[1:4]:
        texts += [a + "\u0338", a + "\u030f\u0338", a + "\u0301x", f"e{a}\u0301"]
    if name == "gpt_neox":
        texts += ["def f():\n        return  1", "a  b   c    d", "x" + " " * 11 + "y", "  \t  x", "é  \u0301  e"]
    elif name == "qwen2":
        texts += ["<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>",
                  '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "<think>\u0338", "</think>\u030f\u0338 x",
                  "</think>\u0301", "<think>" + nfd("é") + "</think>"]
    else:
        texts += ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>", "Hi<|begin_of_text|>"]
    pool = (list("abcdeXYZ  \n\t0123456789'.,!?-_()[]{}<>|/\\\"@#$%^&*=+~`:;") + ["\r\n", "\u3000", "\xa0"]
            + list("éüßçñÅøŁ") + ["\u0301", "\u0308", "\u0338", "\u0327"] + list("我们日本語한국어") + list("ПриветΓειαمرحب")
            + ["😀", "👍", "🏽", "\u200d", "\ufe0f", "🔥"] + ["'s", "'LL", "'Re", "'T"] + special
            + [w for w in " ".join(TEXTS).split() if len(w) > 2])
    while len(texts) < 160:
        texts.append("".join(rnd.choice(pool) for _ in range(rnd.randrange(1, 25))))
    out = []
    for k, t in enumerate(texts):
        add = k % 2 == 1 and not (name == "llama3" and t.startswith("<|begin_of_text|>")
                                  or name == "opt" and t.startswith("</s>"))
        if hf.normalizer and unicodedata.normalize("NFC", t) != hf.normalizer.normalize_str(t):
            continue  # the two sides' Unicode versions differ (not expected with these pools)
        out.append({"tokenizer": name, "text": t, "add_special_tokens": add,
                    "ids": hf.encode(t, add_special_tokens=add).ids})
    return out


def opt():
    """OPT's slow files, its cases from transformers, and the tokenizer.json it saves."""
    import transformers
    vocab, merges = train(None, False, 500)
    tokens = sorted(vocab, key=vocab.get)
    random.Random(5).shuffle(tokens)   # (fairseq numbered GPT-2's tokens by frequency)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    d = OUT / "opt_tokenizer"
    d.mkdir(exist_ok=True)
    vocab_json = {t: i for i, t in enumerate(specials + tokens)}
    (d / "vocab.json").write_text(json.dumps(vocab_json, ensure_ascii=False) + "\n")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    token = lambda c: {"content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True}
    roles = {"bos_token": token("</s>"), "eos_token": token("</s>"), "unk_token": token("</s>"),
             "pad_token": token("<pad>")}
    (d / "tokenizer_config.json").write_text(json.dumps(roles | {
        "errors": "replace", "add_prefix_space": False, "add_bos_token": True, "tokenizer_class": "GPT2Tokenizer"},
        indent=1) + "\n")
    (d / "special_tokens_map.json").write_text(json.dumps(roles, indent=1) + "\n")
    config = {"model_type": "opt", "vocab_size": len(specials) + len(tokens), "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "ffn_dim": 64, "max_position_embeddings": 128, "bos_token_id": 2,
              "eos_token_id": 2, "pad_token_id": 1}
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    saved = OUT / "opt_saved_tokenizer"
    hf.save_pretrained(saved)
    (saved / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    out = cases("opt", hf.backend_tokenizer, ["</s>", "<pad>", "<s>", "<unk>"], seed=5)
    for c in out:
        assert hf(c["text"], add_special_tokens=c["add_special_tokens"])["input_ids"] == c["ids"]
        c["decoded"] = hf.decode(c["ids"])
    return out


def main():
    lines = []
    vocab, merges = train(QWEN2_PATTERN, True, 500)
    n = len(vocab)
    names = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
             ("</tool_call>", False), ("<think>", False), ("</think>", False)]
    adds = [added(n + k, c, s) for k, (c, s) in enumerate(names)]
    qwen_bl = byte_level(False, False, False)
    hf = write("qwen2", QWEN2_PATTERN, True, False, vocab, merges, adds, qwen_bl, qwen_bl, eos=n + 2)
    lines += cases("qwen2", hf, [c for c, _ in names], seed=2)

    vocab, _ = train(LLAMA3_PATTERN, False, 500)
    n = len(vocab)
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eot_id|>"]
    adds = [added(n + k, c, True) for k, c in enumerate(names)]
    bos = {"id": "<|begin_of_text|>", "type_id": 0}
    post = {"type": "Sequence", "processors": [byte_level(True, False, True), {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": bos | {"type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [n], "tokens": ["<|begin_of_text|>"]}}}]}
    hf = write("llama3", LLAMA3_PATTERN, False, True, vocab, converter_merges(vocab), adds, post,
               byte_level(True, True, True), eos=[n + 1, n + 5], bos=n)
    lines += cases("llama3", hf, names, seed=3)

    vocab, merges = train(None, True, 500)
    n = len(vocab)
    names = [("<|endoftext|>", True), ("<|padding|>", True)] + [(" " * k, False) for k in range(8, 1, -1)]
    adds = [added(n + k, c, s, normalized=not s) for k, (c, s) in enumerate(names)]
    neox_bl = byte_level(False, True, True)
    hf = write("gpt_neox", None, True, False, vocab, merges, adds, neox_bl, neox_bl, eos=n)
    lines += cases("gpt_neox", hf, [c for c, _ in names], seed=4)

    lines += opt()
    with open(OUT / "bpe_tokenizer_cases.jsonl", "w", encoding="utf-8") as f:
        for c in lines:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"tokenizers {tokenizers.__version__}: {len(lines)} cases")


if __name__ == "__main__":
    main()
