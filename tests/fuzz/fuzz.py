#!/usr/bin/env python3
"""Feeds tk-run damaged input and checks that every case ends in a clear refusal or a valid plan.

Recipes: every shipped recipe mutated (lines deleted, values swapped, random bytes, extreme
numbers, wrong types) through `tk-run --dry-run`. Files: damaged IDX, text, tensor and checkpoint
files, token shards and their folder's tokenize.json, `[model] init` files (weights.pt and
weights.safetensors) through the readers that take them, and a damaged tokenizer.model through
tk-tokenize. A case fails on a signal exit, an exit code other than
0, 1 or 2, a hang, or a C++ stack trace in the output.

    fuzz.py TK_RUN SOURCE_DIR WORK_DIR [--cases N] [--seed S] [--jobs J]

The bounded run (ctest `fuzz`) takes a few hundred cases; `--cases 5000` is the long one.
"""
import argparse
import concurrent.futures
import gzip
import os
import random
import re
import shutil
import struct
import subprocess
import sys

STACK_MARKERS = ("frame #", "Exception raised from", "(most recent call first)", "INTERNAL ASSERT",
                 "terminate called", "Segmentation fault", "core dumped")
EXTREMES = ["0", "-1", "-9223372036854775808", "9223372036854775807", "288230376151711745", "1e300", "-1e300",
            "nan", "inf", "-inf", "2e17", "1e15", "4294967296", "0.0", "-0.0"]
WRONG_TYPES = ['"text"', "true", "[1, 2]", "[]", "{ a = 1 }", '["a", 1]', "1979-05-27", "[[1], [2]]", '""']


def mutate(text, rng):
    lines = text.split("\n")
    kind = rng.randrange(7)
    assign = [i for i, l in enumerate(lines) if re.match(r"^\s*[A-Za-z_]+\s*=", l)]
    if kind == 0 and lines:  # delete lines
        for _ in range(rng.randint(1, 3)):
            if lines:
                del lines[rng.randrange(len(lines))]
    elif kind == 1 and len(assign) > 1:  # swap two values
        a, b = rng.sample(assign, 2)
        ka, va = lines[a].split("=", 1)
        kb, vb = lines[b].split("=", 1)
        lines[a], lines[b] = ka + "=" + vb, kb + "=" + va
    elif kind == 2:  # random bytes somewhere
        data = bytearray("\n".join(lines).encode())
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(len(data) + 1)
            data[pos:pos] = bytes([rng.randrange(256)])
        return bytes(data)
    elif kind == 3 and assign:  # extreme numbers
        for _ in range(rng.randint(1, 2)):
            i = rng.choice(assign)
            k = lines[i].split("=", 1)[0]
            lines[i] = k + "= " + rng.choice(EXTREMES)
    elif kind == 4 and assign:  # wrong types
        i = rng.choice(assign)
        k = lines[i].split("=", 1)[0]
        lines[i] = k + "= " + rng.choice(WRONG_TYPES)
    elif kind == 5:  # truncated
        cut = rng.randrange(len(text) + 1)
        return text[:cut].encode()
    else:  # duplicated or shuffled lines
        if lines:
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return "\n".join(lines).encode()


def damage(data, rng):
    data = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 and data:
        return bytes(data[: rng.randrange(len(data))])
    if kind == 1:
        for _ in range(rng.randint(1, 16)):
            if data:
                data[rng.randrange(min(len(data), 64 if rng.random() < 0.5 else len(data)))] = rng.randrange(256)
        return bytes(data)
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 2048)))
    return bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


def shard(tokens):
    """A token shard in llm.c's format: 256 int32 of header (magic, version 1, count), uint16 tokens."""
    return struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)) + struct.pack("<%dH" % len(tokens), *tokens)


def run_case(cmd, cwd, timeout):
    """Runs `cmd` (a program and its arguments); what is wrong with how it ended, or None, and its output."""
    try:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE"))
    except subprocess.TimeoutExpired:
        return "hung (no exit within %d s)" % timeout, ""
    out = p.stdout.decode(errors="replace")
    if p.returncode < 0:
        return "killed by signal %d" % -p.returncode, out
    if p.returncode not in (0, 1, 2):
        return "exit code %d" % p.returncode, out
    for m in STACK_MARKERS:
        if m in out:
            return "output has '%s'" % m, out
    return None, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tk_run")
    ap.add_argument("source_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    # A hang is a case that never ends. A mutation can leave a recipe valid, and the dry run of a valid
    # recipe with micro_batch = "auto" measures its trials: gpt-recompute.toml's takes 40 s alone at one
    # thread and 95 s beside the other suites on 2 cores. The limit leaves room for that.
    ap.add_argument("--timeout", type=int, default=240)
    a = ap.parse_args()
    a.tk_run = os.path.abspath(a.tk_run)
    rng = random.Random(a.seed)
    shutil.rmtree(a.work_dir, ignore_errors=True)
    os.makedirs(a.work_dir)
    recipes_dir = os.path.join(a.source_dir, "recipes")
    recipes = {f: open(os.path.join(recipes_dir, f)).read() for f in sorted(os.listdir(recipes_dir)) if f.endswith(".toml")}

    # Inputs for the file readers: a small text, an IDX pair, a tensors file, a checkpoint.
    files = os.path.join(a.work_dir, "inputs")
    os.makedirs(files)
    text = "".join("line %d of a small text, with some words in it.\n%%\n" % i for i in range(200))
    with open(os.path.join(files, "text.txt"), "w") as f:
        f.write(text)
    fm = "/usr/share/datasets/fashion-mnist"
    idx = {}
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        src = os.path.join(fm, name + ".gz")
        if os.path.exists(src):
            with gzip.open(src) as g:
                idx[name] = g.read(16 + 200 * 784 if "images" in name else 8 + 200)
    quick = recipes["quickstart.toml"]
    tiny = re.sub(r"samples = 8192", "samples = 256", quick)
    tiny = re.sub(r"validation_samples = 2048", "validation_samples = 64", tiny)
    tiny = re.sub(r"epochs = 8", "epochs = 1", tiny)
    ck_dir = os.path.join(files, "ck")
    with open(os.path.join(files, "tiny.toml"), "w") as f:
        f.write(tiny)
    err, out = run_case([a.tk_run, os.path.join(files, "tiny.toml"), "--progress", "none", "--set",
                                   'run.output="%s"' % ck_dir, "--set", "run.checkpoint_every=2"], a.work_dir, a.timeout)
    if err or not os.path.isdir(os.path.join(ck_dir, "checkpoints")):
        print("cannot make the checkpoint to damage: %s\n%s" % (err, out))
        return 1
    checkpoint = os.path.join(ck_dir, "checkpoints", open(os.path.join(ck_dir, "checkpoints", "latest")).read().strip())
    tensors = os.path.join(checkpoint, "model.pt")
    # A token shard and the tokenize.json of the folder it lies in; a tokenizer.model tk-tokenize trained.
    tokens = [(i * 13) % 97 for i in range(600)]
    manifest = '{"files": ["train_000.bin"], "complete": true}'
    tokenize = os.path.join(os.path.dirname(os.path.abspath(a.tk_run)), "tk-tokenize")
    model = None
    if os.path.exists(tokenize):
        subprocess.run([tokenize, os.path.join(files, "text.txt"), "--vocab", "60", "--out", os.path.join(files, "tok")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.path.exists(os.path.join(files, "tok", "tokenizer.model")):
            model = open(os.path.join(files, "tok", "tokenizer.model"), "rb").read()
    if model is None:
        print("fuzz: no tokenizer.model from tk-tokenize (%s): damaged tokenizer models are not tried" % tokenize)
    tokens_recipe = ('[run]\nsteps = 2\n[model]\nname = "gpt"\nlayers = 1\nheads = 2\nwidth = 16\n[data]\n'
                     'name = "tokens"\ntrain = "%s"\nseq_len = 8\n[optimizer]\nname = "adamw"\n')

    def make_case(i):
        d = os.path.join(a.work_dir, "case-%d" % i)
        os.makedirs(d)
        kind = rng.random()
        if kind < 0.6:  # a mutated recipe, dry run
            name = rng.choice(sorted(recipes))
            path = os.path.join(d, name)
            with open(path, "wb") as f:
                f.write(mutate(recipes[name], rng))
            return "mutated " + name, [a.tk_run, path, "--dry-run"], d
        kinds = ["text", "tensors", "checkpoint", "shard", "manifest", "init"] + (["idx"] if idx else [])
        what = rng.choice(kinds + (["tokenizer"] if model else []))
        if what in ("shard", "manifest"):  # a damaged shard, or a sound one beside a damaged tokenize.json
            os.makedirs(os.path.join(d, "data"))
            with open(os.path.join(d, "data", "train_000.bin"), "wb") as f:
                f.write(damage(shard(tokens), rng) if what == "shard" else shard(tokens))
            with open(os.path.join(d, "data", "tokenize.json"), "wb") as f:
                f.write(damage(manifest.encode(), rng) if what == "manifest" else manifest.encode())
            rpath = os.path.join(d, "r.toml")
            with open(rpath, "w") as f:
                f.write(tokens_recipe % os.path.join(d, "data", "train_*.bin"))
            return "damaged " + ("shard" if what == "shard" else "tokenize.json"), [a.tk_run, rpath, "--dry-run"], d
        if what == "init":  # a damaged weights file as [model] init
            name = rng.choice(["weights.pt", "weights.safetensors"])
            path = os.path.join(d, name)
            with open(path, "wb") as f:
                f.write(damage(open(os.path.join(ck_dir, name), "rb").read(), rng))
            return "damaged " + name + " as model.init", [a.tk_run, os.path.join(files, "tiny.toml"), "--dry-run", "--set",
                                                           'model.init="%s"' % path], d
        if what == "tokenizer":  # a damaged tokenizer.model given to tk-tokenize
            path = os.path.join(d, "tokenizer.model")
            with open(path, "wb") as f:
                f.write(damage(model, rng))
            return "damaged tokenizer.model", [tokenize, os.path.join(files, "text.txt"), "--model", path, "--out",
                                               os.path.join(d, "out")], d
        if what == "text":
            path = os.path.join(d, "text.txt")
            with open(path, "wb") as f:
                f.write(damage(text.encode(), rng))
            recipe = recipes["gpt-tiny.toml"]
            return "damaged text", [a.tk_run, os.path.join(recipes_dir, "gpt-tiny.toml"), "--dry-run", "--set",
                                    'data.path="%s"' % path, "--set", "data.seq_len=16"], d
        if what == "idx":
            for name, data in idx.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(damage(data, rng) if rng.random() < 0.5 else data)
            return "damaged IDX", [a.tk_run, os.path.join(recipes_dir, "fashion-mnist.toml"), "--dry-run", "--set",
                                   'data.dir="%s"' % d], d
        if what == "tensors":
            path = os.path.join(d, "data.pt")
            x = open(tensors, "rb").read()
            with open(path, "wb") as f:
                f.write(damage(x, rng))
            rpath = os.path.join(d, "r.toml")
            with open(rpath, "w") as f:
                f.write('[model]\nname = "mlp"\n[data]\nname = "tensors"\npath = "%s"\ninputs = "%s"\ntargets = "%s"\n'
                        '[optimizer]\nname = "sgd"\n' % (path, rng.choice(["layers.0.weight", "inputs"]),
                                                         rng.choice(["layers.0.bias", "targets"])))
            return "damaged tensors file", [a.tk_run, rpath, "--dry-run"], d
        # A checkpoint with one file damaged, resumed (into a copy of its run folder).
        run = os.path.join(d, "run")
        shutil.copytree(ck_dir, run)
        ck = os.path.join(run, "checkpoints", os.path.basename(checkpoint))
        victim = os.path.join(ck, rng.choice(sorted(os.listdir(ck))))
        data = open(victim, "rb").read()
        with open(victim, "wb") as f:
            f.write(damage(data, rng))
        return "damaged " + os.path.basename(victim), [a.tk_run, os.path.join(files, "tiny.toml"), "--progress", "none", "--set",
                                                      'run.output="%s"' % run, "--resume", "latest"], d

    cases = [make_case(i) for i in range(a.cases)]
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = pool.map(lambda c: (c, run_case(c[1], c[2], a.timeout)), cases)
        for (label, args, d), (err, out) in results:
            if err:
                failures.append("%s: %s\n  %s\n%s" % (label, err, " ".join(args), out[-3000:]))
            else:
                shutil.rmtree(d, ignore_errors=True)
    print("fuzz: %d cases, %d failed" % (len(cases), len(failures)))
    for f in failures[:20]:
        print("----\n" + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
