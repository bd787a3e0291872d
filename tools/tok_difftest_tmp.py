# TEMPORARY (not for commit): random differential cases from HF tokenizers for local comparison.
import json, random, sys, pathlib
from tokenizers import Tokenizer, pre_tokenizers, normalizers, Regex
out = pathlib.Path(sys.argv[1])
base = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/tokenizer/tokenizer.json"
Q35 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
pools = [
  list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3,
  list("0123456789") * 2,
  list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
  [" ", " ", " ", "\t", "\n", "\r", "\x0b", "\x0c", "\r\n", "\u00a0", "\u1680", "\u180e", "\u2000", "\u2003", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u0085", "\u200b", "\ufeff"],
  ["\u0301", "\u0300", "\u0308", "\u0323", "\u0327", "\u030a", "\u0302", "\u20dd", "\u0e31", "\u093f"],
  list("你好世界中文测试日本語ひらがなカタカナ한국어텍스트") + ["\u1100", "\u1161", "\u11a8"],
  ["😀", "👍", "🏽", "\u200d", "👩", "💻", "\ufe0f", "🇯", "🇵", "❤", "🎉", "🏳"],
  list("éèêëàâäïîôöüûçñÅΩαβγδΑΒΓабвгдАБВعربيةहिन्दीſ"),
  ["'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'LL", "'d", "'D", "'ſ", "'"],
  ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<mask>", "foo", "naïve", "nai\u0308ve", "<|im", "<th"],
  ["def ", "return ", "    ", "\n\n", "  \n", " = ", "()", "{}", "123", "1.5"],
]
def rand_text(r):
    n = r.randrange(0, 40)
    return "".join(r.choice(r.choice(pools)) for _ in range(n))
def cases_for(tok, seed, n=2500):
    r = random.Random(seed); cases = []
    for i in range(n):
        t = rand_text(r); ps = r.random() > 0.15
        tok.encode_special_tokens = not ps
        ids = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        c = {"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}
        if not ps: c["parse_special"] = False
        cases.append(c)
    V = tok.get_vocab_size(with_added_tokens=True)
    for i in range(800):
        ids = [r.randrange(V) for _ in range(r.randrange(0, 12))]
        sk = r.random() < 0.3
        c = {"decode_ids": ids, "decoded": tok.decode(ids, skip_special_tokens=sk)}
        if sk: c["skip_special"] = True
        cases.append(c)
    return cases
variants = {}
t = Tokenizer.from_file(str(base)); variants["qwen2"] = t
t = Tokenizer.from_file(str(base)); t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(Q35), behavior="isolated", invert=False), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]); variants["qwen35"] = t
t = Tokenizer.from_file(str(base)); t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True); t.normalizer = normalizers.Sequence([]); variants["gpt2"] = t
for k, (name, tok) in enumerate(variants.items()):
    doc = {"tokenizer": tok.to_str(), "cases": cases_for(tok, 100 + k)}
    (out / f"diff_{name}.json").write_text(json.dumps(doc, ensure_ascii=False))
    print(name, len(doc["cases"]))
