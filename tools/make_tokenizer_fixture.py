#!/usr/bin/env python3
"""Creates the tokenizer oracle fixture: tests/fixtures/tokenizer/{tokenizer.json,cases.json}.

Trains a small byte-level BPE with Hugging Face `tokenizers` in exactly the structure Qwen2/Qwen3
ship (NFC normalizer; Split(Qwen regex, Isolated) + ByteLevel(no prefix space, no regex)
pre-tokenizer; BPE model; ByteLevel decoder), adds special and non-special added tokens, and
records what tokenizers returns for a set of texts and id sequences. tests/test_tokenizer.cpp
(TokenizerFixture.MatchesHuggingFaceTokenizers) checks tandem against the recording.

Requirements: Python 3.10+, tokenizers (written against 0.23). Deterministic for a given Python
installation (the training corpus is that installation's standard library).
Run from anywhere: python3 tools/make_tokenizer_fixture.py
"""

import json
import pathlib
import random
import sys
import sysconfig

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

REPO = pathlib.Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "tokenizer"

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 500  # special tokens + 256 byte alphabet + merges
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS_BYTES = 3_000_000

# Repeated in the corpus so non-Latin scripts and emoji earn merges in a 500-token vocabulary.
MULTILINGUAL = """\
The quick brown fox jumps over the lazy dog. It's a test; they'll see what we've done, and
I'm sure you'd agree the results are what we're after. Tokenizers split text into pieces.
你好，世界！这是一个测试。我们正在训练一个分词器，中文文本也需要合并。
日本語のテキストです。ひらがなとカタカナと漢字。
한국어 텍스트입니다. 안녕하세요.
Emoji: 😀 😂 👍 👍🏽 🎉 🍕 👩‍💻 ❤️ 🇯🇵
Ελληνικά, Русский язык, العربية, हिन्दी, café, naïve, résumé.
"""

# (text, parse_special). Covers code, whitespace runs, numbers, contractions, punctuation,
# scripts, emoji (ZWJ sequences, skin tones, flags), combining marks (NFC), added tokens.
TEXTS = [
    ("", True),
    (" ", True),
    ("Hello, world!", True),
    ("def fibonacci(n):\n    if n < 2:\n        return n\n"
     "    return fibonacci(n - 1) + fibonacci(n - 2)\n", True),
    ("class Foo(Base):\n\tdef __init__(self, *args, **kwargs) -> None:\n"
     "\t\tsuper().__init__(*args, **kwargs)  # call parent\n", True),
    ("#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n"
     "  for (auto& x : v) x *= 2;\n  return v[0] == 2 ? 0 : 1;\n}\n", True),
    ("const add = (a, b) => a + b;\nconsole.log(`sum: ${add(40, 2)}`); // 42\n", True),
    ("   leading spaces", True),
    ("trailing spaces   ", True),
    ("tabs\tand\t\ttabs\t", True),
    ("\n\n  \n", True),
    ("mixed \t \n \r\n end\r\n\r\n", True),
    ("a  b   c    d     e", True),
    ("    ", True),
    ("line1\nline2\r\nline3\rline4\n", True),
    ("12345678901234567890", True),
    ("3.14159 2.71828 -42 1e10 0x1F 1,000,000", True),
    ("Version 3.12.1 (2024-10-01) build #4521", True),
    ("I'M here, they'LL see, it's fine, we'VE done, she'D go, you'RE right, don't", True),
    ("'s 'S 'Ss IT'ſ", True),
    ("!!! ??? ... --- *** ((())) {{}} [[]] <<>> ;;; ,,,", True),
    ("a.b,c;d:e!f?g print('hi');;  ##  //  /* */ \"quoted\"", True),
    ("你好，世界！这是一个测试。", True),
    ("日本語のテキストとカタカナ、ひらがな。", True),
    ("한국어 텍스트입니다.", True),
    ("Ελληνικά Русский العربية हिन्दी", True),
    ("I love 🍕 and 🎉!", True),
    ("👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈", True),
    ("👍🏽👍🏿 ✌🏻 🇺🇸🇯🇵", True),
    ("cafe\u0301 re\u0301sume\u0301 nai\u0308ve", True),
    ("\u00c5 vs A\u030a vs \u212b; \u1100\u1161\u11a8; s\u0323\u0307 vs s\u0307\u0323", True),
    ("a\u00a0b\u3000c\u2003d\u180ee\u0085f \u2028g", True),
    ("<|im_start|>user\nhi<|im_end|>", True),
    ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n", True),
    ("text with <|endoftext|> inside", True),
    (" <|endoftext|> ", True),
    ("<|im_start|><|im_end|><|endoftext|><|im_start", True),
    ("<|endoftext|>", False),
    ("a <|im_end|> b <think>", False),
    ("<think>\nreasoning here\n</think>\n\nanswer", True),
    ("prefix<think>suffix</think>", True),
    ("fill   <mask>   here<mask>", True),
    ("naïve nai\u0308ve", True),
    ("foo bar (foo) foobar", True),
]

# Id sequences decoded directly: lone bytes of multi-byte characters and other ill-formed UTF-8.
# Each entry is (list of raw byte strings or token strings, skip_special).
DECODE_SEQUENCES = [
    ([b"\xf0", b"\x9f", b"\x98", b"\x80"], False),  # 😀 byte by byte
    ([b"\xf0", b"\x9f", b"\x98"], False),           # truncated emoji
    ([b"\xf0", b"\x9f", b"A"], False),
    ([b"\x80"], False),                             # lone continuation byte
    ([b"\xc0", b"\x80"], False),                    # overlong
    ([b"\xed", b"\xa0", b"\x80"], False),           # surrogate
    ([b"\xa9", b"\xc3"], False),                    # é's bytes reversed
    ([b"\xe4", b"\xbd", b"\xa0", b"\xe5"], False),  # 你 then a cut-off character
    (["<|im_start|>", b"h", b"i", "<|im_end|>"], True),
    (["<|im_start|>", b"h", b"i", "<|im_end|>"], False),
    (["<think>", "</think>", "naïve", "<mask>"], False),
]

# Random texts are drawn from these pools: every kind of Unicode whitespace (U+180E and U+200B
# are not White_Space), combining marks, scripts, emoji parts, contraction fragments (with
# U+017F, which case-folds to 's'), added-token text and fragments of it.
RANDOM_POOLS = [
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3,
    list("0123456789") * 2,
    list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    [" ", " ", " ", "\t", "\n", "\r", "\x0b", "\x0c", "\r\n", "\u00a0", "\u1680", "\u180e",
     "\u2000", "\u2003", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u0085",
     "\u200b", "\ufeff"],
    ["\u0301", "\u0300", "\u0308", "\u0323", "\u0327", "\u030a", "\u0302", "\u20dd", "\u0e31",
     "\u093f"],
    list("你好世界中文测试日本語ひらがなカタカナ한국어텍스트") + ["\u1100", "\u1161", "\u11a8"],
    ["😀", "👍", "🏽", "\u200d", "👩", "💻", "\ufe0f", "🇯", "🇵", "❤", "🎉", "🏳"],
    list("éèêëàâäïîôöüûçñÅΩαβγδΑΒΓабвгдАБВعربيةहिन्दीſ"),
    ["'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'LL", "'d", "'D", "'ſ", "'"],
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<mask>", "foo",
     "naïve", "nai\u0308ve", "<|im", "<th"],
    ["def ", "return ", "    ", "\n\n", "  \n", " = ", "()", "{}", "123", "1.5"],
]
RANDOM_TEXTS = 250
RANDOM_DECODES = 60
RANDOM_SEED = 20261129


def random_texts(rng: random.Random) -> list:
    texts = []
    for _ in range(RANDOM_TEXTS):
        n = rng.randrange(0, 40)
        text = "".join(rng.choice(rng.choice(RANDOM_POOLS)) for _ in range(n))
        texts.append((text, rng.random() > 0.15))
    return texts


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> character map (the ByteLevel alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) +
          list(range(0xAE, 0x100)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def training_corpus() -> list:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    texts = []
    total = 0
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= CORPUS_BYTES:
            break
    texts.extend([MULTILINGUAL] * 300)
    print(f"corpus: {len(files)} stdlib files available, {total} bytes of them used, "
          f"plus {300 * len(MULTILINGUAL.encode('utf-8'))} bytes multilingual")
    return texts


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    model_size = tok.get_vocab_size(with_added_tokens=False)
    if model_size != VOCAB_SIZE:
        print(f"warning: trained vocabulary has {model_size} tokens, expected {VOCAB_SIZE}")
    # Non-special added tokens: "<think>" matched on raw text (as Qwen3 ships it), "</think>"
    # and "naïve" matched after NFC, "foo" only as a whole word.
    tok.add_tokens([
        AddedToken("<think>", special=False, normalized=False),
        AddedToken("</think>", special=False, normalized=True),
        AddedToken("naïve", special=False, normalized=True),
        AddedToken("foo", special=False, normalized=False, single_word=True),
    ])
    tok.add_special_tokens([
        AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True),
    ])
    return tok


def encode(tok: Tokenizer, text: str, parse_special: bool) -> list:
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


def make_cases(tok: Tokenizer) -> list:
    byte_char = bytes_to_unicode()
    cases = []
    for text, parse_special in TEXTS:
        ids = encode(tok, text, parse_special)
        case = {"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}
        if not parse_special:
            case["parse_special"] = False
        cases.append(case)
    # A realistic longer sample: source text the tokenizer was not trained on.
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sample_path = stdlib / "textwrap.py"
    if sample_path.exists():
        sample = sample_path.read_text(encoding="utf-8")[:3000]
        ids = encode(tok, sample, True)
        cases.append({"text": sample, "ids": ids,
                      "decoded": tok.decode(ids, skip_special_tokens=False)})
    rng = random.Random(RANDOM_SEED)
    for text, parse_special in random_texts(rng):
        ids = encode(tok, text, parse_special)
        case = {"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}
        if not parse_special:
            case["parse_special"] = False
        cases.append(case)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    for _ in range(RANDOM_DECODES):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]
        skip_special = rng.random() < 0.3
        case = {"decode_ids": ids, "decoded": tok.decode(ids, skip_special_tokens=skip_special)}
        if skip_special:
            case["skip_special"] = True
        cases.append(case)
    for pieces, skip_special in DECODE_SEQUENCES:
        ids = []
        for piece in pieces:
            token = byte_char[piece[0]] if isinstance(piece, bytes) else piece
            token_id = tok.token_to_id(token)
            if token_id is None:
                raise SystemExit(f"no token for {piece!r}")
            ids.append(token_id)
        case = {"decode_ids": ids, "decoded": tok.decode(ids, skip_special_tokens=skip_special)}
        if skip_special:
            case["skip_special"] = True
        cases.append(case)
    return cases


def main() -> None:
    print(f"tokenizers {tokenizers.__version__}, Python {sys.version.split()[0]}")
    tok = build_tokenizer()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer_path = OUT_DIR / "tokenizer.json"
    tok.save(str(tokenizer_path), pretty=True)

    # The saved file must reproduce the in-memory tokenizer: that file is what tandem reads.
    reloaded = Tokenizer.from_file(str(tokenizer_path))
    cases = make_cases(reloaded)
    original = make_cases(tok)
    if cases != original:
        raise SystemExit("reloaded tokenizer disagrees with the trained one")
    for case in cases[:len(TEXTS)]:
        if case.get("parse_special", True):
            expected = normalizers.NFC().normalize_str(case["text"])
            if case["decoded"] != expected:
                print(f"note: decode(encode(x)) != NFC(x) for {case['text'][:40]!r}")

    cases_path = OUT_DIR / "cases.json"
    # One case per line keeps the file small and its diffs readable.
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
    cases_path.write_text("[\n" + lines + "\n]\n", encoding="utf-8")
    sizes = {p.name: p.stat().st_size for p in (tokenizer_path, cases_path)}
    print(f"wrote {tokenizer_path} and {cases_path}: {len(cases)} cases, sizes {sizes}")
    if sum(sizes.values()) > 200_000:
        print("warning: fixture is larger than 200 KB")


if __name__ == "__main__":
    main()
