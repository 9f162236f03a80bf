"""tk-tokenize with GPT-2's byte-level BPE against a reference encoder in Python.

    check_gpt2_bpe.py TK_TOKENIZE TK_RUN TK_SAMPLE WORK

A small GPT-2-style vocabulary (vocab.json, merges.txt) is learnt here from a corpus of English,
Unicode (accents, Greek, CJK, emoji, combining marks, no-break spaces), whitespace runs, digits and
contractions. The reference encoder below is GPT-2's algorithm as published (openai/gpt-2,
src/encoder.py): its pre-tokenizing pattern run by Debian's python3-regex, the byte-to-character
table, and pairwise merges, the lowest rank first, all occurrences left to right. With
GPT2_ENCODER_PY set to a copy of that encoder.py, its own Encoder is checked against the same
texts too. tk-tokenize must agree with it token for token: document by document in the shards
(each followed by <|endoftext|>), on single texts (--encode), from the same vocabulary written as
OpenAI named its files (encoder.json, vocab.bpe) and as a Hugging Face tokenizer.json; --decode gives
back the bytes; bad tokenizers and text that is not UTF-8 are refused, naming the file or document;
a GPT trained on the shards is sampled by tk-sample, which finds the tokenizer beside them.
"""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import unicodedata

import regex

from gpt2_vocab import BYTES, PATTERN, UNBYTES, learn, pieces, vocabulary, write_vocabulary
from shards import read_shard as shard

tokenize, tk_run, tk_sample, work = sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)

class Reference:
    """GPT-2's encoder as published: the lowest-ranked adjacent pair is merged everywhere, again
    and again, until no adjacent pair is a merge."""

    def __init__(self, vocab, merges):
        self.vocab, self.ranks = vocab, {m: i for i, m in enumerate(merges)}
        self.inverse = {i: p for p, i in vocab.items()}

    def bpe(self, piece):
        word = list(piece)
        while len(word) > 1:
            ranked = [(self.ranks[p], p) for p in zip(word, word[1:]) if p in self.ranks]
            if not ranked:
                break
            left, right = min(ranked)[1]
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    out.append(left + right)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        return [self.vocab[w] for w in word]

    def encode(self, text):
        return [i for p in pieces(text) for i in self.bpe(p)]

    def decode(self, ids):
        return bytes(UNBYTES[c] for i in ids for c in self.inverse[i])


def run(*args, ok=True, stdin=None):
    p = subprocess.run([tokenize, *map(str, args)], capture_output=True, input=stdin)
    assert (p.returncode == 0) == ok, (args, p.returncode, p.stdout, p.stderr)
    return p


fortunes = pathlib.Path("/usr/share/games/fortunes/cookie").read_text(encoding="utf-8")
docs = [d for d in fortunes.split("\n%\n") if d][:400]
docs += [
    "Don't, can't, won't: they're here, we've been, I'm sure you'll see it'd work. DON'T SHOUT'S",
    "Café déjà vu: naïve façade, Ærøskøbing, Straße; Ελληνικά κείμενα; русский текст; 中文字符和日本語のかな",
    "emoji 🙂🚀👩‍💻 and flags 🇫🇷, combining e\u0301 a\u0308, no-break\u00a0space, thin\u2009space, ideographic\u3000space",
    "runs   of    spaces\t\ttabs\n\n\nnewlines\r\nand  \n  mixed \t \n whitespace   ",
    "numbers 12345 3.14159 1,000,000 ٣٤٥ ⅓ ² and symbols @#$%^&*()_+-=[]{}|;':\",./<>?`~ «quotes» — dash…",
    "   leading spaces and trailing spaces   ",
    "<|endoftext|> inside a text is text",
]
merges = learn(docs, 600)
vocab = vocabulary(merges)
eos = vocab["<|endoftext|>"]
ref = Reference(vocab, merges)

gpt2 = work / "gpt2"
gpt2.mkdir()
write_vocabulary(gpt2, vocab, merges)

expected = [ref.encode(d) for d in docs]
if os.environ.get("GPT2_ENCODER_PY"):  # GPT-2's own encoder.py, when a copy is at hand
    spec = importlib.util.spec_from_file_location("gpt2_encoder", os.environ["GPT2_ENCODER_PY"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    theirs = module.Encoder(encoder=vocab, bpe_merges=merges)
    assert [theirs.encode(d) for d in docs] == expected, "the reference differs from GPT-2's encoder.py"
    print(f"GPT-2's encoder.py ({os.environ['GPT2_ENCODER_PY']}) agrees with the reference on {len(docs)} documents")

# The shards: every document's tokens and then <|endoftext|>, no validation split.
corpus = work / "corpus.txt"
corpus.write_text("\n%\n".join(docs), encoding="utf-8")
out = run(corpus, "--model", gpt2, "--separator", "\\n%\\n", "--validation", 0, "--out", work / "shards").stdout.decode()
tokens = shard(work / "shards/train_000.bin")
want = [t for ids in expected for t in ids + [eos]]
assert tokens == want, next(f"document {i}: {e} != {g}" for i, (e, g) in enumerate(zip(want, tokens)) if e != g)
assert f"vocabulary {len(vocab)}" in out, out
for name in ("vocab.json", "merges.txt"):  # beside the shards, where tk-sample finds them
    assert (work / "shards" / name).read_bytes() == (gpt2 / name).read_bytes(), name
merged = sum(len(d.encode("utf-8")) for d in docs) / sum(len(e) for e in expected)
print(f"{len(docs)} documents, {len(tokens)} tokens agree with the reference ({merged:.2f} bytes per token, "
      f"{len(merges)} merges)")

# Every code point of the Basic Multilingual Plane (and every 97th above it) beside letters, digits,
# spaces, newlines and an apostrophe: tk-tokenize cuts the text into python3-regex's pieces
# (--pieces: PCRE2's letters, digits and whitespace are Python's), and its tokens are the reference's.
# Left out: code points that python3-regex's Unicode tables assign and Python's own (the Unicode
# version of PCRE2's, 14.0 on Debian 12) do not, such as the Kaktovik numerals of Unicode 15.
def known(ch):
    return unicodedata.category(ch) != "Cn" or regex.match(r"\p{Cn}", ch) is not None


sweep = "".join(f"x{ch}y {ch}{ch} 1{ch}2 '{ch}s \n{ch} " for ch in map(chr, range(0x110000))
                if not 0xD800 <= ord(ch) < 0xE000 and (ord(ch) < 0x10000 or ord(ch) % 97 == 0) and known(ch))
cut = json.loads(run("--model", gpt2, "--pieces", stdin=sweep.encode("utf-8")).stdout)
want_cut = PATTERN.findall(sweep)
assert cut == want_cut, next(f"piece {i}: {a!r} != {b!r}" for i, (a, b) in enumerate(zip(cut, want_cut)) if a != b)
(work / "sweep.txt").write_text(sweep, encoding="utf-8")
run(work / "sweep.txt", "--model", gpt2, "--validation", 0, "--out", work / "sweep")
got, swept = shard(work / "sweep/train_000.bin")[:-1], ref.encode(sweep)
assert got == swept, next(f"token {i}: {ref.decode(swept[max(0, i - 4):i + 4])!r}"
                          for i, (a, b) in enumerate(zip(got, swept)) if a != b)
# The one code point where PCRE2's own \s and Python's differ (U+180E, a format character since
# Unicode 6.3): GPT-2's whitespace is Python's.
for text in ("x'\u180e", "a \u180e\u180eb", "\u180e \u180e"):
    assert json.loads(run("--model", gpt2, "--pieces", stdin=text.encode()).stdout) == PATTERN.findall(text), text

# Single texts, and the bytes back.
for text in docs[-7:]:
    ids = [int(x) for x in run("--model", gpt2, "--encode", text).stdout.split()]
    assert ids == ref.encode(text), (text, ids, ref.encode(text))
    back = run("--model", gpt2, "--decode", stdin=" ".join(map(str, ids)).encode()).stdout
    assert back == text.encode("utf-8"), (text, back)
assert run("--model", gpt2, "--encode", "").stdout.split() == [str(eos).encode()]
# A sequence cut inside a character decodes to the bytes so far, as the reference does.
cut = ref.encode("🙂")[:1]
assert run("--model", gpt2, "--decode", stdin=str(cut[0]).encode()).stdout == ref.decode(cut)

# The same vocabulary under OpenAI's names, and as a tokenizer.json: the same tokens.
openai = work / "openai"
openai.mkdir()
shutil.copy(gpt2 / "vocab.json", openai / "encoder.json")
shutil.copy(gpt2 / "merges.txt", openai / "vocab.bpe")
hf = work / "hf.json"
hf.write_text(json.dumps({
    "version": "1.0", "normalizer": None,
    "added_tokens": [{"id": eos, "content": "<|endoftext|>", "special": True}],
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": False,
              "vocab": {p: i for p, i in vocab.items() if p != "<|endoftext|>"},
              "merges": [f"{a} {b}" for a, b in merges]},
}, ensure_ascii=False), encoding="utf-8")
for model in (openai, hf):
    text = docs[-6]
    assert [int(x) for x in run("--model", model, "--encode", text).stdout.split()] == ref.encode(text), model
run(corpus, "--model", hf, "--separator", "\\n%\\n", "--validation", 0, "--out", work / "hf-shards")
assert shard(work / "hf-shards/train_000.bin") == want
assert (work / "hf-shards/tokenizer.json").exists()

# A merge listed twice ranks at its last place, as GPT-2's encoder reads its list into a dict.
twice = work / "twice"
twice.mkdir()
(twice / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
again = merges[:40] + [merges[0]] + merges[40:]
(twice / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in again), encoding="utf-8")
ref_twice = Reference(vocab, again)
assert ref_twice.ranks[merges[0]] == 40
for text in docs[:50]:
    assert [int(x) for x in run("--model", twice, "--encode", text).stdout.split()] == ref_twice.encode(text), text

# Refusals, each naming what is wrong and where.
bad = work / "bad"
bad.mkdir()
(bad / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
(bad / "merges.txt").write_text("#version: 0.2\nh e\nzz qq\n", encoding="utf-8")
err = run("--model", bad, "--encode", "x", ok=False).stderr.decode()
assert "merges.txt:3: the merge 'zz qq' joins 'zz', which the vocabulary does not hold" in err, err
(bad / "merges.txt").write_text("one-piece\n", encoding="utf-8")
err = run("--model", bad, "--encode", "x", ok=False).stderr.decode()
assert "merges.txt:1: not a merge (two pieces and one space): 'one-piece'" in err, err
(bad / "vocab.json").write_text("{not json", encoding="utf-8")
assert "vocab.json: not JSON" in run("--model", bad, "--encode", "x", ok=False).stderr.decode()
empty = work / "empty"
empty.mkdir()
err = run("--model", empty, "--encode", "x", ok=False).stderr.decode()
assert "no tokenizer in this folder" in err, err
unigram = work / "unigram.json"
unigram.write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}), encoding="utf-8")
err = run("--model", unigram, "--encode", "x", ok=False).stderr.decode()
assert "its model is not a BPE one" in err, err
latin1 = work / "latin1.txt"
latin1.write_bytes("ok\n%\ncaf\xe9 au lait".encode("latin-1"))
err = run(latin1, "--model", gpt2, "--separator", "\\n%\\n", "--validation", 0, "--out", work / "l1", ok=False)
assert "document 2 of 2: the text is not UTF-8 at byte 3" in err.stderr.decode(), err.stderr

# A GPT trained on the shards; tk-sample decodes with the tokenizer it finds beside them.
recipe = work / "gpt.toml"
recipe.write_text(f"""[run]
seed = 1
steps = 8
[model]
name = "gpt"
layers = 1
heads = 2
width = 32
[data]
name = "tokens"
train = "{work}/shards/train_*.bin"
seq_len = 32
[batch]
micro_batch = 4
[optimizer]
name = "adamw"
lr = 0.01
""")
p = subprocess.run([tk_run, recipe, "--progress", "none", "--set", f'run.output="{work}/run"'], capture_output=True, text=True)
assert p.returncode == 0, p.stdout + p.stderr


def sample(*args):
    q = subprocess.run([tk_sample, work / "run", *map(str, args)], capture_output=True)
    assert q.returncode == 0, q.stderr
    return q.stdout


a = sample("--prompt", "Don't", "--tokens", 12, "--seed", 3)
assert a == sample("--prompt", "Don't", "--tokens", 12, "--seed", 3, "--tokenizer", gpt2), "not the tokenizer beside the shards"
assert a.startswith(b"Don't"), a
# The continuation is the text of the pieces the model chose: the reference encodes it into pieces
# of this vocabulary, and decoding the sampled text's ids gives it back.
assert ref.decode(ref.encode(a.decode("utf-8", errors="replace"))) == a.decode("utf-8", errors="replace").encode()
print("GPT-2 byte-level BPE: shards, --encode, --decode, OpenAI's and Hugging Face's files, refusals, tk-sample: all agree")
