"""recipes/gpt2-finetune.toml end to end, with a GPT-2-shaped checkpoint made here in its place
(no published file is at hand): a byte-level BPE learnt from the fortunes and written as GPT-2's
vocab.json and merges.txt; the fortunes tokenized with it; a small GPT-2 (learned positions,
LayerNorm, GELU's tanh form, tied head) trained on them and exported as a Hugging Face folder with
the tokenizer beside it. The recipe then fine-tunes that folder as it would GPT-2's: accumulation,
the warmup-cosine schedule, validation, the tables frozen. Checked: the frozen tensors are the
published ones to the bit and every other one moved; the fine-tuned validation loss is below the
checkpoint's; tk-sample continues a prompt with the tokenizer beside the shards; the fine-tuned run,
exported and read back through [model] pretrained, gives the run's own logits to the bit.

usage: python3 check_finetune.py TK_TOKENIZE TK_RUN TK_SAMPLE TK_EXPORT SOURCE_DIR WORK"""
import json
import pathlib
import shutil
import struct
import subprocess
import sys

from gpt2_vocab import learn, vocabulary, write_vocabulary

tokenize, tk_run, tk_sample, tk_export = sys.argv[1:5]
source, work = pathlib.Path(sys.argv[5]), pathlib.Path(sys.argv[6])
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)


def run(*args):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    assert p.returncode == 0, f"{args[0]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {k: raw[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]] for k, e in header.items()
            if k != "__metadata__"}


# The tokenizer and the tokens.
cookie = pathlib.Path("/usr/share/games/fortunes/cookie")
docs = [d for d in cookie.read_text(encoding="utf-8").split("\n%\n") if d]
merges = learn(docs[:300], 300)
vocab = vocabulary(merges)
tok = work / "tokenizer"
write_vocabulary(tok, vocab, merges)
shards = work / "shards"
run(tokenize, cookie, "--model", tok, "--separator", "\\n%\\n", "--out", shards)

# The checkpoint in GPT-2's place: a small GPT-2 trained on the same text, exported.
pre = work / "pre.toml"
pre.write_text(f"""[run]
name = "pre"
output = "{work / 'pre'}"
steps = 150
validate_every = 150

[model]
name = "gpt"
layers = 2
heads = 2
width = 32
context = 64
mlp = "gelu_tanh"

[data]
name = "tokens"
train = "{shards}/train_*.bin"
validation = "{shards}/val_*.bin"
seq_len = 32
vocab = {len(vocab)}

[batch]
micro_batch = 16

[optimizer]
name = "adamw"
lr = 0.01
""")
run(tk_run, pre)
published = work / "published"
run(tk_export, work / "pre", "--format", "huggingface", "--out", published)
for name in ("vocab.json", "merges.txt"):  # the run's tokenizer, beside the weights
    assert (published / name).read_bytes() == (tok / name).read_bytes(), f"{name} not exported with the weights"
config = json.loads((published / "config.json").read_text())
assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new", config

# The recipe, pointed at the stand-in and shortened.
fine = work / "fine"
run(tk_run, source / "recipes/gpt2-finetune.toml", "--set", f'model.pretrained="{published}"',
    "--set", f'data.train="{shards}/train_*.bin"', "--set", f'data.validation="{shards}/val_*.bin"',
    "--set", f"data.vocab={len(vocab)}", "--set", "data.seq_len=32", "--set", f'run.output="{fine}"',
    "--set", "run.steps=12", "--set", "run.validate_every=6", "--set", "run.checkpoint_every=6",
    "--set", "batch.micro_batch=4", "--set", "batch.accumulation=2", "--set", "schedule.warmup_steps=2",
    "--set", "optimizer.lr=0.002", "--set", "schedule.min_lr=0.0002")
start = [r["validation_loss"] for r in records(work / "pre") if "validation_loss" in r][-1]
steps = records(fine)
assert [r["micro_batches"] for r in steps] == [2] * 12, [r.get("micro_batches") for r in steps]
end = [r["validation_loss"] for r in steps if "validation_loss" in r]
assert len(end) == 2 and end[-1] < start, f"validation loss: the checkpoint's {start}, fine-tuned {end}"
print(f"validation loss: the checkpoint {start:.4f}, fine-tuned {end[0]:.4f} then {end[-1]:.4f}")

before, after = safetensors(published / "model.safetensors"), safetensors(fine / "weights.safetensors")
for name in ("wte.weight", "wpe.weight"):
    assert before[name] == after[name], f"frozen '{name}' moved"
exported = work / "fine-out"
run(tk_export, fine, "--format", "huggingface", "--out", exported)
again = safetensors(exported / "model.safetensors")
changed = [n for n in before if n not in ("wte.weight", "wpe.weight") and before[n] != again[n]]
assert len(changed) == len(before) - 2, f"unchanged by fine-tuning: {sorted(set(before) - set(changed))}"
print(f"frozen: wte.weight and wpe.weight as published; the other {len(changed)} tensors moved")

text = run(tk_sample, fine, "--prompt", "The", "--tokens", "20", "--seed", "1")
assert text.startswith("The") and len(text) > 3, text
print(f"tk-sample: {text.strip()!r}")
# Shards with no tokenizer beside them: the one in the pretrained checkpoint's folder decodes.
bare = work / "bare-shards"
bare.mkdir()
for f in shards.glob("*.bin"):
    shutil.copy(f, bare / f.name)
moved = work / "moved.toml"
moved.write_text((fine / "recipe.toml").read_text().replace(str(shards), str(bare)))
assert str(bare) in moved.read_text() and str(shards) + "/" not in moved.read_text(), moved.read_text()
again = run(tk_sample, moved, "--weights", fine / "weights.safetensors", "--prompt", "The", "--tokens", "20", "--seed", "1")
assert again == text, f"with the checkpoint folder's tokenizer: {again!r}, beside the shards: {text!r}"

ids = "5 17 300 42 7 99"
run(tk_sample, fine, "--ids", ids, "--logits", work / "run-logits.safetensors")
back = work / "back.toml"
back.write_text((fine / "recipe.toml").read_text().replace(str(published), str(exported)))
run(tk_sample, back, "--ids", ids, "--logits", work / "back-logits.safetensors")
assert safetensors(work / "run-logits.safetensors") == safetensors(work / "back-logits.safetensors")
print("the fine-tuned run exported and read back: the same logits, to the bit")
