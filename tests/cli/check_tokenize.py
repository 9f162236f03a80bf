"""tk-tokenize against Debian's python3-sentencepiece and the shard format read by hand.

    check_tokenize.py TK_TOKENIZE TK_RUN TK_SAMPLE WORK

Trains a BPE model on the fortunes `cookie` file (documents split at "\\n%\\n"), then checks that
the shards hold, document by document, what Python's SentencePiece encodes with that same model
(each document followed by the model's end-of-sequence id), that a tenth of the documents, spread
evenly, are the validation shards, that the same text trains the same model again, that --bytes writes
the bytes, that bad input is refused, that a long line is encoded in bounded memory into exactly
the tokens of the whole line, that tk-run trains the GPT on the shards, and that tk-sample writes
the same text for the same seed from that run, decoded with the run's tokenizer.
"""
import array
import io
import math
import pathlib
import random
import shutil
import subprocess
import sys

import sentencepiece as spm
from shards import read_shard as shard

tokenize, tk_run, tk_sample, work = sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)
corpus = pathlib.Path("/usr/share/games/fortunes/cookie")
text = corpus.read_bytes().decode("utf-8")
docs = [d for d in text.split("\n%\n") if d]


def run(*args, ok=True):
    p = subprocess.run([tokenize, *map(str, args)], capture_output=True, text=True)
    assert (p.returncode == 0) == ok, (args, p.returncode, p.stdout, p.stderr)
    return p


out = run(corpus, "--vocab", 500, "--separator", "\\n%\\n", "--out", work / "bpe").stdout
assert "tokens per byte" in out, out
sp = spm.SentencePieceProcessor(model_file=str(work / "bpe/tokenizer.model"))
assert sp.get_piece_size() == 500
expected = [sp.encode(d) + [sp.eos_id()] for d in docs]
# A tenth held out, spread evenly: document i when floor((i + 1) / 10) > floor(i / 10).
held = [math.floor((i + 1) * 0.1) > math.floor(i * 0.1) for i in range(len(docs))]
train = [t for ids, h in zip(expected, held) if not h for t in ids]
val = [t for ids, h in zip(expected, held) if h for t in ids]
assert sum(held) == int(0.1 * len(docs))
assert shard(work / "bpe/train_000.bin") == train, "the training shard differs from Python's SentencePiece"
assert shard(work / "bpe/val_000.bin") == val, "the validation shard differs from Python's SentencePiece"
assert f"{len(docs)} documents" in out, out

# The same text trains the same model; an existing model tokenizes the same.
run(corpus, "--vocab", 500, "--separator", "\\n%\\n", "--out", work / "again")
again = spm.SentencePieceProcessor(model_file=str(work / "again/tokenizer.model"))  # its file names its folder
assert [(again.id_to_piece(i), again.get_score(i)) for i in range(500)] == \
    [(sp.id_to_piece(i), sp.get_score(i)) for i in range(500)], "the same text trained another model"
run(corpus, "--model", work / "bpe/tokenizer.model", "--separator", "\\n%\\n", "--out", work / "given",
    "--shard-tokens", 10000)
given = sorted((work / "given").glob("train_*.bin"))
assert len(given) > 1, given
assert [t for f in given for t in shard(f)] == train

# Bytes need no model.
run(corpus, "--bytes", "--validation", 0, "--out", work / "bytes")
assert shard(work / "bytes/train_000.bin") == list(corpus.read_bytes()), "--bytes is not the file's bytes"

# Refused, with a reason and exit code 1 (2 for the command line).
p = run(corpus, "--out", work / "none", ok=False)
assert "give one of --bytes, --model FILE or --vocab N" in p.stderr, p.stderr
p = run(corpus, "--bytes", "--vocab", 300, "--out", work / "both", ok=False)
assert "give one of" in p.stderr, p.stderr
p = run(work / "absent.txt", "--bytes", "--out", work / "x", ok=False)
assert p.returncode == 2 and "absent.txt" in p.stderr, p.stderr
# The output folder is tk-tokenize's alone: tokenize.json lists what it wrote, a folder holding
# anything else is refused untouched, a new tokenization replaces exactly the earlier one's files
# (no stale shard stays to join a glob), and an input is never written over.
import json
import os
import resource
import signal


def listed(folder):
    m = json.loads((folder / "tokenize.json").read_text())
    assert m["written_by"] == "tk-tokenize" and m["complete"] is True, m
    return sorted(m["files"])


def files_of(folder):
    return sorted(p.name for p in folder.iterdir())


assert listed(work / "given") == sorted(["tokenizer.model", "val_000.bin", "val_001.bin"] + [f.name for f in given])
assert files_of(work / "given") == sorted(listed(work / "given") + ["tokenize.json"])
# the model the shards were made with is beside them, byte for byte
assert (work / "given/tokenizer.model").read_bytes() == (work / "bpe/tokenizer.model").read_bytes()
run(corpus, "--model", work / "bpe/tokenizer.model", "--separator", "\\n%\\n", "--out", work / "given")
assert files_of(work / "given") == ["tokenize.json", "tokenizer.model", "train_000.bin", "val_000.bin"], \
    files_of(work / "given")
assert shard(work / "given/train_000.bin") == train
# its own tokenizer.model, given back to it, stays
run(corpus, "--model", work / "given/tokenizer.model", "--separator", "\\n%\\n", "--out", work / "given")
assert shard(work / "given/train_000.bin") == train and listed(work / "given")[0] == "tokenizer.model"

mine = work / "mine"
mine.mkdir()
(mine / "tokenizer.model").write_text("the user's")
(mine / "train_000.bin").write_text("the user's too")
p = run(corpus, "--bytes", "--validation", 0, "--out", mine, ok=False)
assert "holds files tk-tokenize did not write (tokenizer.model, train_000.bin)" in p.stderr, p.stderr
assert files_of(mine) == ["tokenizer.model", "train_000.bin"]
assert (mine / "tokenizer.model").read_text() == "the user's"

p = run(work / "bytes/train_000.bin", "--bytes", "--validation", 0, "--out", work / "bytes", ok=False)
assert "is a file of the tokenization in" in p.stderr and "never writes over its input" in p.stderr, p.stderr
assert shard(work / "bytes/train_000.bin") == list(corpus.read_bytes()), "the input was written over"
p = run(corpus, "--bytes", "--prefix", "../../x_", "--out", work / "pre", ok=False)
assert "--prefix '../../x_' holds a '/'" in p.stderr, p.stderr
assert not list(work.parent.glob("x_*")) and not list(work.parent.parent.glob("x_*"))

# No input is read forever: a FIFO or a device is refused at once.
os.mkfifo(work / "fifo")
for path in (work / "fifo", "/dev/zero"):
    q = subprocess.run([tokenize, str(path), "--bytes", "--out", str(work / "dev")], capture_output=True, text=True,
                       timeout=60)
    assert q.returncode == 1 and "not a regular file" in q.stderr, (path, q.stderr)

# A write that fails (here: the file-size limit, as a full disk would) says why and leaves the
# earlier tokenization whole, no half shard under a shard's name.
before = {f: (work / "bytes" / f).read_bytes() for f in files_of(work / "bytes") if f != "tokenize.json"}


def small_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


q = subprocess.run([tokenize, str(corpus), "--bytes", "--validation", "0", "--out", str(work / "bytes")],
                   capture_output=True, text=True, preexec_fn=small_files)
assert q.returncode == 1 and "cannot write it: File too large" in q.stderr, q.stderr
assert {f: (work / "bytes" / f).read_bytes() for f in before} == before, "a failed tokenization changed the earlier one"
run(corpus, "--bytes", "--validation", 0, "--out", work / "bytes")  # the next one cleans up after it
assert files_of(work / "bytes") == ["tokenize.json", "train_000.bin"], files_of(work / "bytes")

# Text with no line SentencePiece can train on is told so, in tk-tokenize's words.
(work / "long.txt").write_text(("word " * 1000 + "\n") * 20)
p = run(work / "long.txt", "--vocab", 50, "--validation", 0, "--out", work / "long", ok=False)
assert "no line of the inputs is shorter than 4192 bytes" in p.stderr, p.stderr
# A vocabulary the text cannot fill, or one smaller than its characters: told with SentencePiece's
# numbers in tk-tokenize's words, its trainer's command line and options left out.
(work / "small.txt").write_text("ab ab\nab ab ab\n")
p = run(work / "small.txt", "--vocab", 50, "--validation", 0, "--out", work / "deep/small", ok=False)
assert "--vocab 50 is more pieces than the inputs hold: at most 9 for this text" in p.stderr, p.stderr
assert "Running command" not in p.stderr and "sentencepiece" not in p.stderr.lower(), p.stderr
(work / "chars.txt").write_text("".join(chr(0x4e00 + i) + " ab\n" for i in range(40)))
p = run(work / "chars.txt", "--vocab", 20, "--validation", 0, "--out", work / "chars", ok=False)
assert "--vocab 20 is fewer pieces than the inputs need: at least" in p.stderr, p.stderr
assert "character_coverage" not in p.stderr, p.stderr
# A tokenization that fails in a folder it made leaves no folder (nor a temporary file in one), nor
# the folders it made to hold it.
assert not (work / "deep").exists() and not (work / "chars").exists()
# One document, the default tenth held out: refused before any folder is made or model trained,
# saying what would do.
p = run(work / "small.txt", "--vocab", 9, "--out", work / "new/one", ok=False)
assert "--validation 0.1 holds out no document of 1 (the inputs are one document): split them into documents with " \
    "--separator, or give --validation 0" in p.stderr, p.stderr
assert "--validation 0 for no validation shards" in p.stderr and not (work / "new").exists(), p.stderr

# A document longer than 64 KiB is encoded in pieces of about 64 KiB cut at whitespace, not at once
# (SentencePiece takes about 100 bytes of memory for each byte it encodes): a line of 1 MB fits in
# 64 MB of address space (encoded whole it takes 150), and its tokens are those Python's
# SentencePiece gives the whole line; so are those of documents just under, at and over the piece
# size, and of a long stretch without whitespace, which is encoded whole.
rng = random.Random(0)
words = text.split()
line = " ".join(rng.choice(words) for _ in range(200_000))
assert len(line.encode()) > 1_000_000
piece = 64 << 10
long_docs = [line, line[:piece - 1], line[:piece], line[:piece + 1], "y" * piece + " z", "y" * (piece - 1) + " z",
             "x" * 100_000 + " tail"]
(work / "long_line.txt").write_text("\n%\n".join(long_docs))


def small_memory():
    resource.setrlimit(resource.RLIMIT_AS, (64 << 20, 64 << 20))


def tokenize_long(model, out):
    q = subprocess.run([tokenize, str(work / "long_line.txt"), "--model", str(model), "--separator", "\\n%\\n",
                        "--validation", "0", "--out", str(work / out)], capture_output=True, text=True,
                       preexec_fn=small_memory)
    assert q.returncode == 0, (q.returncode, q.stderr)
    return q


tokenize_long(work / "bpe/tokenizer.model", "long_line")
assert shard(work / "long_line/train_000.bin") == [t for d in long_docs for t in sp.encode(d) + [sp.eos_id()]], \
    "a long line's tokens differ from Python's SentencePiece's for the whole line"
# A model with pieces across whitespace (trained with split_by_whitespace=false) cannot be cut
# there: each document is encoded whole, and tk-tokenize says so.
model = io.BytesIO()
spm.SentencePieceTrainer.train(input=str(corpus), model_writer=model, vocab_size=500, model_type="bpe",
                               split_by_whitespace=False, minloglevel=2)
(work / "across.model").write_bytes(model.getvalue())
across = spm.SentencePieceProcessor(model_proto=model.getvalue())
assert any("\u2581" in across.id_to_piece(i)[1:] for i in range(500))
long_docs = long_docs[1:]  # the 1 MB line encoded whole would not fit in the memory limit
(work / "long_line.txt").write_text("\n%\n".join(long_docs))
q = tokenize_long(work / "across.model", "across")
assert "reaches across whitespace" in q.stderr and "each document is encoded whole" in q.stderr, q.stderr
assert shard(work / "across/train_000.bin") == [t for d in long_docs for t in across.encode(d) + [across.eos_id()]]
# A normalization that keeps U+2581 in the text (nfkc: nmt_nfkc makes it a space) would drop it at
# the end of a piece: a long document is never cut after one.
model = io.BytesIO()
spm.SentencePieceTrainer.train(input=str(corpus), model_writer=model, vocab_size=500, model_type="bpe",
                               normalization_rule_name="nfkc", minloglevel=2)
(work / "nfkc.model").write_bytes(model.getvalue())
nfkc = spm.SentencePieceProcessor(model_proto=model.getvalue())
long_docs = [" ".join(rng.choice(words) + rng.choice(["", "", "\u2581"]) for _ in range(40_000))]
(work / "long_line.txt").write_text("\n%\n".join(long_docs))
tokenize_long(work / "nfkc.model", "nfkc")
assert shard(work / "nfkc/train_000.bin") == nfkc.encode(long_docs[0]) + [nfkc.eos_id()]

# The GPT trains on the shards, its vocabulary read from them.
recipe = work / "gpt.toml"
recipe.write_text(f"""[run]
seed = 1
steps = 30
validate_every = 30
[model]
name = "gpt"
layers = 1
heads = 2
width = 32
[data]
name = "tokens"
train = "{work}/bpe/train_*.bin"
validation = "{work}/bpe/val_*.bin"
seq_len = 32
[batch]
micro_batch = 8
[optimizer]
name = "adamw"
lr = 0.01
""")
p = subprocess.run([tk_run, str(recipe), "--progress", "plain", "--set", f'run.output="{work}/run"'],
                   capture_output=True, text=True)
assert p.returncode == 0, p.stdout + p.stderr
assert "unigram baseline" in p.stdout + p.stderr, p.stdout + p.stderr



def refused(train, expect):
    """tk-run --dry-run with data.train = train fails at once, saying `expect`."""
    q = subprocess.run([tk_run, str(recipe), "--dry-run", "--set", f'data.train="{train}"'], capture_output=True,
                       text=True, timeout=60)
    assert q.returncode != 0 and expect in q.stderr, (train, q.returncode, q.stderr)


# A shard the folder's tokenize.json does not list (another tokenization's) does not join the glob;
# nor does a tokenization that did not finish; a FIFO or a device is no shard; a link to nothing
# is named as one.
shutil.copy(work / "bpe/train_000.bin", work / "bpe/train_007.bin")
refused(f"{work}/bpe/train_*.bin", "train_007.bin is not a shard of the tokenization in")
(work / "bpe/train_007.bin").unlink()
m = json.loads((work / "bpe/tokenize.json").read_text())
(work / "bpe/tokenize.json").write_text(json.dumps(dict(m, complete=False)))
refused(f"{work}/bpe/train_*.bin", "did not finish")
(work / "bpe/tokenize.json").write_text(json.dumps(m))
refused(work / "fifo", "not a regular file (a FIFO)")
refused("/dev/zero", "not a regular file (a character device)")
(work / "links").mkdir()
shutil.copy(work / "bpe/train_000.bin", work / "links/train_000.bin")
(work / "links/train_001.bin").symlink_to(work / "gone.bin")
refused(f"{work}/links/train_*.bin", "train_001.bin: a symbolic link to")


def sample(*args, ok=True):
    p = subprocess.run([tk_sample, str(work / "run"), *map(str, args)], capture_output=True, text=True)
    assert (p.returncode == 0) == ok, (args, p.returncode, p.stdout, p.stderr)
    return p


a = sample("--prompt", "You will", "--tokens", 40, "--seed", 3, "--top-k", 20).stdout
b = sample("--prompt", "You will", "--tokens", 40, "--seed", 3, "--top-k", 20).stdout
c = sample("--prompt", "You will", "--tokens", 40, "--seed", 4, "--top-k", 20).stdout
assert a == b, (a, b)
assert a != c, "another seed wrote the same text"
assert a.startswith("You will") and len(a) > len("You will\n"), a
greedy = sample("--prompt", "You will", "--tokens", 20, "--temperature", 0).stdout
assert greedy == sample("--prompt", "You will", "--tokens", 20, "--temperature", 0, "--seed", 9).stdout
# The run's tokenizer was found beside its shards: the continuation is the text of its pieces,
# which Python's SentencePiece encodes back into ids of that model.
assert all(0 <= i < 500 for i in sp.encode(a)), a
# It is the text of the whole sequence less the prompt's: a piece that starts a word keeps its space
# right after the prompt (decoded alone, SentencePiece drops a text's leading space). The greedy
# pieces, one at a time from the prompt's logits (read from the safetensors file by hand).
ids = sp.encode("You will")
for _ in range(4):
    sample("--ids", " ".join(map(str, ids)), "--logits", work / "logits.safetensors")
    raw = (work / "logits.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8:8 + n])["logits"]
    assert entry["dtype"] == "F32" and entry["shape"] == [len(ids), 500], entry
    first, end = entry["data_offsets"]
    row = array.array("f", raw[8 + n + first:8 + n + end])[-500:]
    ids.append(max(range(500), key=row.__getitem__))
want = "You will" + sp.decode(ids)[len(sp.decode(sp.encode("You will"))):] + "\n"
assert sample("--prompt", "You will", "--tokens", 4, "--temperature", 0).stdout == want, want
# Decoded alone, a first piece that starts a word would lose its space: no sample could then read
# "You will " and a word. Among ten seeds' first pieces (most of this model's pieces start a word)
# some do.
firsts = [sample("--prompt", "You will", "--tokens", 1, "--seed", s, "--top-k", 50).stdout for s in range(10)]
assert any(f.startswith("You will ") and len(f.strip()) > len("You will") for f in firsts), firsts
p = sample("--tokenizer", work / "absent.model", ok=False)
assert "absent.model" in p.stderr, p.stderr
# With the shards moved away (their tokenizer.model with them), the model is built from what the
# run's weights.safetensors records, and the same seed writes the same text.
(work / "bpe").rename(work / "bpe-moved")
p = sample("--prompt", "You will", "--tokens", 40, "--seed", 3, "--top-k", 20, ok=False)
assert "no tokenizer beside the run's shards (tokenizer.model, tokenizer.json, or vocab.json and merges.txt): give --tokenizer" in p.stderr, p.stderr
p = sample("--prompt", "You will", "--tokens", 40, "--seed", 3, "--top-k", 20, "--tokenizer",
           work / "bpe-moved/tokenizer.model")
assert p.stdout == a, (p.stdout, a)
assert "the run's data cannot be read" in p.stderr and "a vocabulary of 500 tokens and a context of 32" in p.stderr, \
    p.stderr
(work / "bpe-moved").rename(work / "bpe")
# A vocabulary padded beyond the tokenizer's 500 ids: nothing decodes ids 500-799, and they are
# never sampled (untrained after 2 steps, each is about as likely as any other id: a hot sample of
# 300 tokens would draw some), with a note.
size = subprocess.run([tokenize, "--model", str(work / "bpe/tokenizer.model"), "--size"], capture_output=True, text=True)
assert size.returncode == 0 and size.stdout == "500\n", (size.stdout, size.stderr)
p = subprocess.run([tk_run, str(recipe), "--progress", "none", "--set", f'run.output="{work}/padded"', "--set",
                    "data.vocab=800", "--set", "run.steps=2"], capture_output=True, text=True)
assert p.returncode == 0, p.stdout + p.stderr
p = subprocess.run([tk_sample, str(work / "padded"), "--prompt", "You will", "--tokens", "300", "--temperature", "3",
                    "--seed", "1"], capture_output=True, text=True)
assert p.returncode == 0, p.stderr
assert "the tokenizer has 500 ids, the model's vocabulary 800: ids from 500 up are never sampled" in p.stderr, p.stderr
# Bad options say what is wrong in tk-sample's words.
p = sample("--temperature", "nan", ok=False)
assert p.returncode == 2 and "--temperature: is nan, not a number in [0, 100]" in p.stderr, p.stderr
p = sample("--top-k", -1, ok=False)
assert p.returncode == 2 and "16777216" in p.stderr and len(p.stderr) < 300, p.stderr
p = sample("--device", "bogus", ok=False)
assert "tk-sample: --device bogus: expected one of" in p.stderr and "--set" not in p.stderr, p.stderr
mlp = work / "mlp.toml"
mlp.write_text('[run]\nsteps = 2\n[model]\nname = "mlp"\n[data]\nname = "synthetic-classification"\n'
               '[optimizer]\nname = "sgd"\n')
q = subprocess.run([tk_run, str(mlp), "--progress", "none", "--set", f'run.output="{work}/mlp"'], capture_output=True,
                   text=True)
assert q.returncode == 0, q.stdout + q.stderr
q = subprocess.run([tk_sample, str(work / "mlp")], capture_output=True, text=True)
assert q.returncode == 1 and "is no language model" in q.stderr, q.stderr
print(f"tk-sample: {a.strip()!r}")
print(f"tk-tokenize: {len(docs)} documents, {len(train)} + {len(val)} tokens equal to python3-sentencepiece's")
