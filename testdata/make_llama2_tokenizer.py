#!/usr/bin/env python3
"""Generate offline test data for a SentencePiece-style (Llama 2 family) BPE tokenizer.

Produces, under OUT (default: directory of this script):
  llama2_sp.model                         sentencepiece BPE model trained here (Llama-2-like trainer settings)
  llama2_tokenizer/tokenizer.json         HF "legacy" shape (Prepend+Replace normalizer, no pre_tokenizer)
  llama2_tokenizer/tokenizer_config.json
  llama2_tokenizer/config.json            a tiny Llama config (vocab 1500), for nanopaged's load_tokenizer
  llama2_metaspace_tokenizer/tokenizer.json         HF "Metaspace" shape (legacy=False)
  llama2_metaspace_tokenizer/tokenizer_config.json
  llama2_tokenizer_cases.jsonl            encode/decode cases from sentencepiece and both HF shapes

Data was made with: Python 3.11.7, sentencepiece 0.2.3, protobuf 7.36.2, tokenizers 0.23.3,
transformers 5.24.0, huggingface_hub 2.4.0 (venv: pip install sentencepiece protobuf tokenizers==0.23.3 transformers).
The training corpus includes text from the running Python's standard library (pydoc_data/topics.py and a few
modules), so the same Python version (3.11.7) is needed for a byte-identical model.

Reference semantics: "legacy"/"metaspace" ids and decodes come from the `tokenizers` library reading each
tokenizer.json (tokenizers.Tokenizer.from_file(...).encode(text, add_special_tokens=...) / .decode(ids,
skip_special_tokens=...)).  Caution: transformers 5.24 AutoTokenizer.from_pretrained(llama2_tokenizer/) does NOT
honour the legacy normalizer; its LlamaTokenizer rebuilds the pipeline as Metaspace(prepend_scheme="always")
and encodes differently (e.g. " " -> [1182] instead of [259]).  "sp" = SentencePieceProcessor.encode(text).

Case file fields (text cases): text, sp, legacy_plain, metaspace_plain (ids without <s>; with
add_special_tokens both shapes put <s> first: asserted here), decode_legacy and decode_legacy_skip (of <s> +
legacy_plain), decode_plain_legacy (of legacy_plain).  Decode-only cases: decode_ids, decode_legacy,
decode_legacy_skip.  The two shapes share one decoder (asserted here: their decodes are equal).

Run:  python make_llama2_tokenizer.py [OUT_DIR]
"""
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile

import sentencepiece as spm

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
SP_MODEL = os.path.join(OUT, "llama2_sp.model")
LEGACY_DIR = os.path.join(OUT, "llama2_tokenizer")
META_DIR = os.path.join(OUT, "llama2_metaspace_tokenizer")
CASES = os.path.join(OUT, "llama2_tokenizer_cases.jsonl")

# ---------------------------------------------------------------------------------------------------------------
# 1. corpus
# ---------------------------------------------------------------------------------------------------------------
MULTILINGUAL = [
    "Le café de la gare est fermé le dimanche ; où est l'hôtel ? À bientôt, élève déçu.",
    "Ça coûte très cher : naïve, Noël, œuvre, français, garçon, château, forêt.",
    "Die Größe der Straße überrascht mich. Grüße aus München, schöne Äpfel und Öl.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Привет, как дела? Я люблю читать книги и пить чай по утрам.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Γειά σου κόσμε! Η γλώσσα μου είναι ελληνική, αλφάβητο: α β γ δ ε.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "你好，世界！我喜欢学习中文。今天天气很好，我们去公园吧。",
    "中文的字符很多，机器学习和自然语言处理是人工智能的一部分。",
    "こんにちは、世界。私は日本語を勉強しています。東京は大きい都市です。",
    "ひらがなとカタカナ：あいうえお、アイウエオ。ありがとうございます。",
    "안녕하세요, 세계! 저는 한국어를 공부하고 있습니다. 감사합니다.",
    "مرحبا بالعالم! أنا أحب اللغة العربية. شكرا جزيلا.",
    "Emoji: 😀 😂 👍 🎉 ❤️ 🚀 — fun times 🙂",
    "Mixed: naïve café 東京 Москва Αθήνα 서울 🍣 3.14159",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 1,000,000 -17 +8 1e-9 0x1F",
    "Prices: $19.99, €5,50, £3; dates 2023-10-05 and 12/31/1999, time 23:59:59.",
    "def f(x):\n\treturn x * 2  # tab-indented",
    "\tif x > 0:\n\t\tprint('positive')\n\telse:\n\t\tprint('non-positive')",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "    return {\"key\": [1, 2, 3], 'other': None}",
]


def build_corpus(path):
    """Deterministic corpus: stdlib docs/code (fixed file list, fixed order) + multilingual lines (repeated)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lines = []
    # English prose: the pydoc topics (Python reference docs), one paragraph per line
    sys.path.insert(0, stdlib)
    from pydoc_data.topics import topics
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = para.strip("\n")
            if para and len(para.encode()) < 4000:
                lines.append(para.replace("\n", " ") if not para.startswith("   ") else para)
    # Code with indentation
    for rel in ["textwrap.py", "difflib.py", "argparse.py", "collections/__init__.py", "json/decoder.py", "this.py"]:
        with open(os.path.join(stdlib, rel), encoding="utf-8") as f:
            lines.extend(l for l in f.read().split("\n") if l.strip())
    for _ in range(30):
        lines.extend(MULTILINGUAL)
    with open(path, "w", encoding="utf-8") as f:
        for l in lines:
            # sentencepiece reads one sentence per line; keep embedded newlines out of the file
            f.write(l.replace("\n", " ") + "\n")
    return len(lines)


def train(workdir):
    # relative paths inside a temp dir: the trainer_spec stored in the .model records input/model_prefix,
    # so absolute temp paths would make the file differ between runs
    os.chdir(workdir)
    corpus = "corpus.txt"
    n = build_corpus(corpus)
    print(f"corpus: {n} lines, {os.path.getsize(corpus)} bytes")
    spm.set_random_generator_seed(1234)
    prefix = "llama2_sp"
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=1500,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        split_by_unicode_script=True,
        split_by_whitespace=True,
        split_by_number=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=0.9995,
        max_sentencepiece_length=16,
        max_sentence_length=4192,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    shutil.copy(prefix + ".model", SP_MODEL)


# ---------------------------------------------------------------------------------------------------------------
# 2. conversion to Hugging Face tokenizer.json (two shapes)
# ---------------------------------------------------------------------------------------------------------------
# transformers 5.x note: LlamaTokenizerFast is an alias of LlamaTokenizer (tokenizers backend) and
# LlamaTokenizerFast(vocab_file=..., legacy=True, from_slow=True) ignores vocab_file: it yields a 3-token empty BPE
# with a Metaspace(prepend_scheme="always") pre-tokenizer.  Also LlamaConverter's SpmConverter.tokenizer() calls
# SentencePieceExtractor.extract() with the 4.x signature and crashes.  So we run transformers' own LlamaConverter
# (the slow->fast converter that produced TinyLlama/Mistral-v0.1 tokenizer.json files) with the 4.x extractor
# behaviour restored: merges = transformers.generate_merges(vocab, vocab_scores), ordered by piece score.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def convert(legacy, out_dir):
    import types
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import LlamaConverter, SentencePieceExtractor
    from transformers.tokenization_utils_base import generate_merges

    class Extractor4x(SentencePieceExtractor):
        def extract(self, vocab_scores=None):
            vocab = {p.piece: i for i, p in enumerate(self.proto.pieces)}
            return vocab, generate_merges(vocab, vocab_scores)

    class Converter(LlamaConverter):
        SpmExtractor = Extractor4x

    sp = spm.SentencePieceProcessor(model_file=SP_MODEL)
    slow_standin = types.SimpleNamespace(
        vocab_file=SP_MODEL, legacy=legacy, add_prefix_space=True, convert_ids_to_tokens=sp.id_to_piece
    )
    backend = Converter(slow_standin).converted()
    tok = LlamaTokenizer(
        tokenizer_object=backend, legacy=legacy, add_bos_token=True, add_eos_token=False,
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )  # add_bos_token=True -> update_post_processor() installs TemplateProcessing "<s> $A"
    shutil.rmtree(out_dir, ignore_errors=True)
    tok.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # keep only tokenizer.json + tokenizer_config.json
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(out_dir, name))
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "legacy": legacy, "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    cfg.pop("model_max_length", None)  # 1e30 sentinel written by transformers; not useful
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------------
# 3. test cases
# ---------------------------------------------------------------------------------------------------------------
def random_unicode(rng, n):
    ranges = [
        (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
        (0x900, 0x97F), (0x0E00, 0x0E7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF), (0x300, 0x36F), (0xE000, 0xE0FF), (0x10000, 0x1007F), (0x2000, 0x206F),
        (0x9, 0xA), (0x20, 0x20),
    ]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def case_texts():
    T = []
    add = T.extend
    # plain English
    add([
        "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.", "hello", "Hello", "HELLO",
        "a", "I", "x y z", "This is a test.", "Tokenizers split text into pieces.",
        "Python is a programming language that lets you work quickly.",
        "The return statement leaves the current function call with the expression list.",
        "It's a dog's life; isn't it? Yes -- it is.", "e.g. i.e. etc. Mr. Smith vs. Dr. Jones",
        "What is the capital of France?", "Once upon a time, there was a little tokenizer.",
        "Supercalifragilisticexpialidocious", "antidisestablishmentarianism", "pneumonoultramicroscopic",
        "class Foo(object): pass", "import os, sys", "print('hello')", "x = [i ** 2 for i in range(10)]",
    ])
    # spaces: leading / trailing / multiple / only
    add([
        " ", "  ", "   ", "    ", "        ", " " * 17, " Hello", "  Hello", "   Hello", "Hello ", "Hello  ",
        " Hello ", "  Hello  world  ", "Hello   world", "a b  c   d    e", " a", "a ", " a ", "\u00a0Hello",
        "Hello\u00a0world", "\u3000全角", " \n", "\n ", " \t ", "  \n  \n  ", "word ▁ word", "▁", "▁▁", "▁Hello",
        " ▁Hello", "Hello▁world", "▁ ▁",
    ])
    # empty
    add([""])
    # newlines and tabs
    add([
        "\n", "\n\n", "\t", "\t\t", "\r\n", "\r", "line1\nline2", "line1\n\nline2", "line1\r\nline2", "a\tb",
        "\tindented", "\t\tdouble", "col1\tcol2\tcol3\n1\t2\t3\n", "def f():\n    return 1\n",
        "def f(x):\n\treturn x * 2", "if x:\n\tif y:\n\t\tpass\n", "\n\nHello", "Hello\n", "Hello\n\n",
        "  \tmixed  \t whitespace\t  ", "\v\f", "x\u2028y\u2029z", "\x00\x01\x1f\x7f",
        "for i in range(3):\n    for j in range(3):\n        print(i, j)\n",
    ])
    # digits and numbers
    add([
        "0", "7", "42", "123", "2024", "1234567890", "3.14159265358979", "1,000,000", "-17", "+8", "1e-9",
        "0x1F", "0b1010", "12:30", "2023-10-05", "$19.99", "€5,50", "100%", "1/2", "9" * 40,
        "31415926535897932384626433832795028841971693993751", "The year 1999 had 365 days.", "abc123def456",
        "v1.2.3", "1st 2nd 3rd 4th", "٠١٢٣٤٥٦٧٨٩", "０１２３", "½ ¼ ¾ ² ³", "Ⅻ ⅷ",
    ])
    # punctuation
    add([
        ".", ",", "!", "?", "...", "!!!", "?!", "()", "[]", "{}", "<>", "\"quoted\"", "'single'", "`backtick`",
        "a-b_c.d", "--flag=value", "==", "!=", "<=>", "->", "=>", "::", "#include <stdio.h>", "@decorator",
        "~!@#$%^&*()_+`-={}|[]\\:\";'<>?,./", "—", "–", "…", "“curly” ‘quotes’", "«guillemets»", "¿Qué?", "¡Hola!",
        "a.b,c;d:e", "http://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Windows\\System32",
        "/usr/local/bin", "<html><body>Hi</body></html>", "{\"a\": [1, 2, {\"b\": null}]}", "***bold***",
    ])
    # accented Latin and European
    add([
        "café", "naïve", "résumé", "Noël", "œuvre", "garçon", "château", "forêt", "élève déçu",
        "Le café de la gare est fermé le dimanche.", "À bientôt !", "Ça va ?", "Größe", "Straße", "Äpfel Öl Übel",
        "Grüße aus München", "ñandú", "São Paulo", "Łódź", "Dvořák", "Ærøskøbing", "İstanbul", "ÿ",
        "e\u0301", "cafe\u0301", "Ａｂｃ", "ﬁ ligature", "Ǆ ǅ ǆ", "ẞ", "Zwölf Boxkämpfer jagen Viktor",
    ])
    # other scripts
    add([
        "Привет, мир!", "Москва", "Съешь же ещё этих мягких французских булок", "Γειά σου κόσμε!", "Αθήνα",
        "ψυχή", "你好", "你好，世界！", "中文的字符很多", "机器学习", "東京", "こんにちは", "カタカナ", "ひらがな",
        "日本語を勉強しています。", "안녕하세요", "한국어", "서울", "مرحبا بالعالم", "شكرا", "שלום עולם",
        "नमस्ते दुनिया", "สวัสดีครับ", "ሰላም", "Բարեւ", "ქართული", "தமிழ்", "བོད་ཡིག", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    ])
    # emoji (byte fallback)
    add([
        "😀", "😀😀", "😀 😀", "👍", "🎉 party", "I ❤️ you", "❤", "🚀🚀🚀", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇩🇪", "👍🏽",
        "Emoji: 😀 😂 👍 🎉 ❤️ 🚀", "🙂", " 🙂", "🙂 ", "a😀b", "😀a", "a😀", "🦀 Rust", "🐍 Python",
        "\U0001F9D1\u200D\U0001F4BB", "⌚", "☃", "✓", "★☆", "♠♣♥♦", "∑∫∂√∞", "≠≤≥", "→←↑↓",
    ])
    # rare characters (not in vocab)
    add([
        "\ue000", "\U000F0000", "\U0010FFFF", "\ufffd", "\ufeff", "\u200b", "\u200d", "\u2060",
        "\U0001D11E music", "𓀀 hieroglyph", "ꙮ", "\U00020000", "龘", "鬱", "𠜎", "\u0378", "\u1680",
        "zero\u200bwidth", "x\u0000y", "\U000E0001", "Ⓐⓑⓒ", "\u02bc", "ǂ", "ⱥ", "ꝏ",
    ])
    # mixed scripts
    add([
        "Mixed: naïve café 東京 Москва Αθήνα 서울 🍣 3.14159", "abcАБВαβγ", "Hello你好Привет",
        "日本語 English Русский 한국어", "price: 100円", "x=東京+1", "ЁжикA1β2", "مرحبا hello", "テストtest123",
        "emoji😀中文🚀English", "The word 'ψυχή' means soul.", "Tokyo (東京) is big.", "Zürich → 苏黎世",
    ])
    # literal special-token strings
    specials = [
        "<s>", "</s>", "<unk>", "<s></s>", "<s><s>", "</s></s>", "<unk><unk>", "<s>Hello", "Hello<s>",
        "Hello</s>", "</s>Hello", "<unk>Hello", "Hello<unk>", "Hello <s> world", "Hello </s> world",
        "Hello <unk> world", "Hello<s>world", "Hello</s>world", "Hello<unk>world", " <s>", "<s> ", " </s> ",
        "  </s>  ", "<s> Hello", " <s>Hello", "<s>  Hello", "a</s> b", "a </s>b", "a</s>  b", "</s> x",
        "Hello world </s> x", "<s>[INST] Hi [/INST]", "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]",
        "[INST] What is 2+2? [/INST] 4 </s><s>[INST] And 3+3? [/INST]", "<s> <s> <s>", "<s>\n</s>",
        "\n<s>", "</s>\n", "<s>😀</s>", "<s>東京</s>", "<unk> <unk>", "x<unk>y<unk>z", "<s>1</s>2<unk>3",
        "<S>", "< s>", "<s", "s>", "</s", "<\\s>", "<<s>>", "<</s>>", "<unk", "unk>", "<pad>", "<0x41>", "<0xE6>",
        "text with <s> in the middle", "text with </s> in the middle", "text with <unk> in the middle",
        "<s>twice<s>twice", "</s>twice</s>", "\t</s>\t", "</s>\n\nNext turn",
    ]
    add(specials)
    # random unicode from a fixed seed
    rng = random.Random(20240501)
    for i in range(60):
        T.append(random_unicode(rng, rng.randint(1, 40)))
    # random ASCII-ish with lots of spaces / specials
    pieces = ["a", "b", " ", "  ", "\n", "\t", "1", "23", "<s>", "</s>", "<unk>", "é", "東", "😀", "▁", ".", "the"]
    for i in range(40):
        T.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 25))))
    # long texts (BPE runs over a whole text at once: no pre-tokenizer splits it)
    stdlib = sysconfig.get_paths()["stdlib"]
    with open(os.path.join(stdlib, "textwrap.py"), encoding="utf-8") as f:
        src = f.read()
    T.append(src[:2500])
    T.append(" ".join(MULTILINGUAL))
    T.append("😀" * 100)
    T.append(" " * 2100)
    T.append("1234567890" * 20)
    T.append("<s>" + "</s>".join(MULTILINGUAL) + "</s>")
    T.append(random_unicode(random.Random(7), 800))
    # de-duplicate, keep first occurrence (order deterministic)
    seen, out = set(), []
    for t in T:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def decode_id_lists(sp):
    rng = random.Random(99)
    n = sp.get_piece_size()
    byte_id = lambda b: 3 + b  # <0x00> is id 3
    normal = [i for i in range(259, n)]
    meta = [i for i in normal if sp.id_to_piece(i).startswith("\u2581")]
    plain = [i for i in normal if not sp.id_to_piece(i).startswith("\u2581")]
    L = []
    # valid UTF-8 as byte tokens
    for s in ["é", "東", "😀", "Привет", "a😀b", "\n", " ", "\t", "👨‍👩‍👧"]:
        L.append([byte_id(b) for b in s.encode("utf-8")])
    # invalid UTF-8: lone continuation, truncated sequences, 0xFF, overlong, surrogate
    for bs in [[0x80], [0xBF, 0x41], [0xE6], [0xE6, 0x9D], [0xF0, 0x9F, 0x98], [0xFF], [0xC0, 0xAF],
               [0xED, 0xA0, 0x80], [0xE6, 0x41, 0x9D], [0xF0, 0x9F, 0x98, 0x80, 0x80], [0xC3], [0xC3, 0xA9, 0xA9]]:
        L.append([byte_id(b) for b in bs])
    # mixtures of byte tokens with normal tokens / specials
    L.append([meta[0]] + [byte_id(b) for b in "é".encode()] + [plain[5]])
    L.append([byte_id(0xE6)] + [meta[3]] + [byte_id(0x9D), byte_id(0xB1)])
    L.append([1, byte_id(0xF0), byte_id(0x9F), byte_id(0x98), byte_id(0x80), 2])
    # ▁ tokens at position 0 and later, specials at position 0 / in the middle
    L.append([meta[0], meta[1], meta[2]])
    L.append([plain[0], meta[1], meta[2]])
    L.append([1, meta[0], plain[1]])
    L.append([2, meta[0]])
    L.append([0, meta[0]])
    L.append([1])
    L.append([2])
    L.append([0])
    L.append([])
    L.append([1, 2, 0])
    L.append([meta[0], 2, meta[1]])
    L.append([meta[0], 1, plain[1]])
    L.append([sp.piece_to_id("\u2581\u2581")] if sp.piece_to_id("\u2581\u2581") else [meta[0]])
    L.append([sp.piece_to_id("\u2581"), plain[0]])
    L.append([sp.piece_to_id("\u2581"), sp.piece_to_id("\u2581")])
    # random lists
    while len(L) < 100:
        k = rng.randint(1, 20)
        ids = []
        for _ in range(k):
            r = rng.random()
            if r < 0.05:
                ids.append(rng.choice([0, 1, 2]))
            elif r < 0.3:
                ids.append(byte_id(rng.randint(0, 255)))
            elif r < 0.65:
                ids.append(rng.choice(meta))
            else:
                ids.append(rng.choice(plain))
        if rng.random() < 0.2:
            ids.insert(0, rng.choice([0, 1, 2]))
        L.append(ids)
    return L


def make_cases():
    from tokenizers import Tokenizer

    sp = spm.SentencePieceProcessor(model_file=SP_MODEL)
    leg = Tokenizer.from_file(os.path.join(LEGACY_DIR, "tokenizer.json"))
    met = Tokenizer.from_file(os.path.join(META_DIR, "tokenizer.json"))
    n_text = n_dec = 0
    with open(CASES, "w", encoding="utf-8") as f:
        for text in case_texts():
            # (the two shapes share one decoder; each puts <s> before the text with add_special_tokens)
            c = {"text": text, "sp": sp.encode(text)}
            c["legacy_plain"] = leg.encode(text, add_special_tokens=False).ids
            c["metaspace_plain"] = met.encode(text, add_special_tokens=False).ids
            legacy = leg.encode(text, add_special_tokens=True).ids
            assert legacy == [1] + c["legacy_plain"]
            assert met.encode(text, add_special_tokens=True).ids == [1] + c["metaspace_plain"]
            c["decode_legacy"] = leg.decode(legacy, skip_special_tokens=False)
            c["decode_legacy_skip"] = leg.decode(legacy, skip_special_tokens=True)
            assert met.decode([1] + c["metaspace_plain"], skip_special_tokens=False) == leg.decode(
                [1] + c["metaspace_plain"], skip_special_tokens=False)
            c["decode_plain_legacy"] = leg.decode(c["legacy_plain"], skip_special_tokens=False)
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
            n_text += 1
        for ids in decode_id_lists(sp):
            c = {"decode_ids": ids}
            c["decode_legacy"] = leg.decode(ids, skip_special_tokens=False)
            c["decode_legacy_skip"] = leg.decode(ids, skip_special_tokens=True)
            assert met.decode(ids, skip_special_tokens=False) == c["decode_legacy"]
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
            n_dec += 1
    print(f"cases: {n_text} text cases, {n_dec} decode-only cases -> {CASES}")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as wd:
        train(wd)
        os.chdir(cwd)
    convert(True, LEGACY_DIR)
    convert(False, META_DIR)
    for d in (LEGACY_DIR, META_DIR):   # a tiny Llama config beside each, for nanopaged's load_tokenizer
        config = {"model_type": "llama", "vocab_size": 1500, "hidden_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                  "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
                  "bos_token_id": 1, "eos_token_id": 2}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    make_cases()
