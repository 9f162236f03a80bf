#!/usr/bin/env python3
"""Each bad input is refused before training in one line that says what and where.

    bad_input.py TK_RUN SOURCE_DIR PLUGIN_DIR WORK_DIR

Every case runs tk-run and checks its exit code, that the expected words are in its output, and
that no C++ stack trace is.
"""
import os
import shutil
import subprocess
import sys

STACK = ("frame #", "Exception raised from", "(most recent call first)", "INTERNAL ASSERT")


def main():
    tk_run, src, plugins, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    quick = os.path.join(src, "recipes", "quickstart.toml")
    gpt = os.path.join(src, "recipes", "gpt-tiny.toml")
    base = ('[run]\nsteps = 4\n[model]\nname = "mlp"\nhidden = [8]\n[data]\nname = "tensors"\npath = "%s"\n'
            'classes = 10\n[batch]\nmicro_batch = 8\n[optimizer]\nname = "sgd"\n')

    def write(name, data):
        path = os.path.join(work, name)
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        return path

    # A truncated copy of a real plugin library, a text file and a fake ELF header as plugins.
    with open(os.path.join(plugins, "tk_clip.so"), "rb") as f:
        lib = f.read()
    trunc = write("trunc.so", lib[:30000])
    text = write("text.so", "not a library\n")
    fake = write("fake.so", b"\x7fELF" + b"\x02\x01\x01" + bytes(200))
    zeros = write("zeros.so", lib[:30000] + bytes(len(lib) - 30000))  # an interrupted, preallocated copy
    plugin_recipe = lambda path: write(os.path.basename(path) + ".toml", '[model]\nname = "mlp"\n[data]\nname = '
                                       '"synthetic-classification"\n[optimizer]\nname = "sgd"\n[[plugins]]\npath = "%s"\n' % path)
    os.makedirs(os.path.join(work, "folder"))

    have_torch = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0
    tensor_cases = []
    if have_torch:
        subprocess.run(["/usr/bin/python3", "-c", """
import collections, torch, sys
d = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(64, 8)
oob = torch.randint(0, 10, (64,)); oob[5] = 10  # one target outside the 10 classes, whatever the draw
torch.save({"inputs": x, "targets": oob}, d + "/oob.pt")
torch.save({"inputs": x, "targets": torch.randint(-5, 0, (64,))}, d + "/negative.pt")
torch.save({"inputs": x, "targets": torch.randn(64)}, d + "/float.pt")
y = torch.randint(0, 10, (64,))
nan = x.clone(); nan[7, 3] = float("nan")
torch.save({"inputs": nan, "targets": y}, d + "/nan.pt")
torch.save({"inputs": torch.randn(64, 2, 2, 2, 2), "targets": y}, d + "/five_d.pt")
torch.save(collections.OrderedDict(inputs=x, targets=y), d + "/ordered.pt")
torch.save({"inputs": x}, d + "/one_key.pt")
torch.save({"model": {"inputs": x, "targets": y}, "iter_num": torch.tensor(3)}, d + "/nested.pt")
torch.save({"model": {"inputs": x, "targets": y}}, d + "/nested_one.pt")
torch.save({"inputs": x, "labels": y}, d + "/no_targets.pt")
torch.save({"inputs": torch.zeros(64, 0), "targets": y}, d + "/no_features.pt")
# A NaN past the first million examples (which the check before training reads), in the first
# micro-batch the run reaches when it is not shuffled.
big = torch.zeros(1000016, 1); big[1000008, 0] = float("nan")
torch.save({"inputs": big, "targets": torch.zeros(1000016, dtype=torch.long)}, d + "/late_nan.pt")
"""
                        , work], check=True)
        # TorchScript models that do not fit 8-feature data of 10 classes.
        subprocess.run(["/usr/bin/python3", os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_bad_models.py"),
                        work], check=True)
        ts = lambda f: write("ts_" + f + ".toml", '[run]\nsteps = 2\n[model]\ntorchscript = "%s"\n[data]\nname = '
                             '"synthetic-classification"\nfeatures = 8\nclasses = 10\nsamples = 64\n[optimizer]\n'
                             'name = "sgd"\n' % os.path.join(work, f + ".ts"))
        tensor_cases += [
            ("a TorchScript forward of two arguments", [ts("two_args"), "--dry-run"], 2, "does not go through the model", "missing value for argument 'y'"),
            ("a TorchScript model that returns [N]", [ts("flat"), "--dry-run"], 2, "its output [32] has no class dimension"),
            ("a TorchScript model with 5 outputs for 10 classes", [ts("five_out"), "--dry-run"], 2, "gives 5 scores per prediction", "10 classes"),
            ("a TorchScript model for 64 inputs on 8 features", [ts("wide"), "--dry-run"], 2, "mat1 and mat2 shapes cannot be multiplied"),
            ("a TorchScript model that returns integers", [ts("ints"), "--dry-run"], 2, "its output is Long, not floating point"),
            ("a TorchScript model with every parameter frozen", [ts("frozen"), "--dry-run"], 2, "ts_frozen.toml:3:1: model 'torchscript' has no trainable parameter"),
        ]
        t = lambda f: write(f + ".toml", base % os.path.join(work, f + ".pt"))
        late = [t("late_nan"), "--set", "data.shuffle=false", "--set", "batch.micro_batch=200002", "--set",
                "data.classes=2", "--set", "run.steps=5", "--set", "run.output=\"%s\"" % os.path.join(work, "late-run"),
                "--overwrite", "--progress", "none"]
        tensor_cases += [
            ("a NaN past the first million examples", late, 1, "training example 1000008 of data 'tensors' has a NaN or "
             "infinite input"),
            ("a model whose output is NaN", [ts("nan_out"), "--progress", "none", "--overwrite", "--set",
                                              "run.output=\"%s\"" % os.path.join(work, "nan-run")], 1,
             "model 'torchscript' (%s) gives a non-finite output for finite inputs and its initial parameters" % os.path.join(work, "nan_out.ts")),
            ("a model whose output is detached", [ts("detached"), "--progress", "none", "--overwrite", "--set",
                                                  "run.output=\"%s\"" % os.path.join(work, "detached-run")], 1,
             "model 'torchscript' (%s): its output does not depend on a trainable parameter" % os.path.join(work, "detached.ts")),
        ]
        tensor_cases += [
            ("target out of the class range", [t("oob"), "--dry-run"], 2, "example", "has target 10, outside the 10 classes"),
            ("negative targets", [t("negative"), "--dry-run"], 2, "outside the 10 classes"),
            ("float targets with classes", [t("float"), "--dry-run"], 2, "data.classes: is 10, but the targets are Float"),
            ("NaN in the data", [t("nan"), "--dry-run"], 2, "example 7 has NaN or infinite inputs"),
            ("5-D inputs for an MLP", [t("five_d"), "--dry-run"], 2, "does not go through the model"),
            ("an OrderedDict", [t("ordered"), "--dry-run"], 2, "ordered.pt"),
            ("a checkpoint with the tensors under a key", [t("nested"), "--dry-run"], 2,
             "nested.pt: its entry 'model' is a dict, not a tensor: a checkpoint that keeps the weights under a key"),
            # LibTorch 1.13 cannot unpickle a dict of one entry; 2.x reads it and finds the dict inside.
            ("a checkpoint with one key", [t("nested_one"), "--dry-run"], 2,
             ("be it one tensor or one dict under one key", "nested_one.pt: its entry 'model' is a dict, not a tensor")),
            ("a file without targets", [t("no_targets"), "--dry-run"], 2, "data.targets: the file has no tensor 'targets'"),
            ("inputs of no features", [t("no_features"), "--dry-run"], 2, "data.inputs: the inputs [64, 0] and targets [64] hold no values"),
            # LibTorch 1.13 cannot unpickle a dict of one entry; 2.x reads it and finds no targets.
            ("a dict of one tensor", [t("one_key"), "--dry-run"], 2,
             ("one_key.pt: not a tensor file written by torch.save or trainkit (a plain dict of name -> tensor): its "
              "pickle has an opcode LibTorch cannot read", "data.targets: the file has no tensor 'targets'; it has: inputs")),
        ]

    cases = [
        ("a truncated plugin library", [plugin_recipe(trunc), "--dry-run"], 2, "trunc.so: truncated or damaged"),
        ("a text file as plugin", [plugin_recipe(text), "--dry-run"], 2, "text.so: not a shared library"),
        ("a fake ELF as plugin", [plugin_recipe(fake), "--dry-run"], 2, "fake.so"),
        ("a folder as plugin", [plugin_recipe(os.path.join(work, "folder")), "--dry-run"], 2, "is a folder"),
        ("/dev/null as plugin", [plugin_recipe("/dev/null"), "--dry-run"], 2, "/dev/null: is not a regular file"),
        ("/dev/zero as recipe", ["/dev/zero", "--dry-run"], 2, "is not a regular file"),
        ("a folder as recipe", [work, "--dry-run"], 2, "is a folder"),
        ("a huge recipe", [write("huge.toml", "[model]\nhidden = [" + "1, " * 600000 + "1]\n"), "--dry-run"], 2, "at most 1 MiB"),
        ("threads without bound", [quick, "--dry-run", "--set", "run.threads=100000"], 2, "run.threads: is 100000"),
        ("an unknown component by --set", [quick, "--dry-run", "--set", "optimizer.name=lbfgs"], 2,
         "--set optimizer.name=lbfgs: unknown optimizer 'lbfgs'; known: "),
        ("epochs beyond any machine", [quick, "--dry-run", "--set", "run.epochs=288230376151711745"], 2, "run.epochs: is 288230376151711745, beyond"),
        ("epochs that overflow", [quick, "--dry-run", "--set", "run.epochs=1099511627776"], 2, "beyond what any machine can train"),
        ("accumulation that overflows", [quick, "--dry-run", "--set", "batch.accumulation=9223372036854775807"], 2, "effective batch"),
        ("a model larger than memory", [quick, "--dry-run", "--set", "model.hidden=[100000000,100000000]"], 2, "model.hidden: a model of 1e+16 parameters"),
        ("data larger than memory", [quick, "--dry-run", "--set", "data.samples=4000000000"], 2,
         "data.samples: 4000000000 training and 2048 validation examples"),
        ("an empty text file", [gpt, "--dry-run", "--set", 'data.path="%s"' % write("empty.txt", "")], 2,
         "empty.txt gives no training sequence: its longest document has 0 tokens"),
        ("validation data larger than memory", [quick, "--dry-run", "--set", "data.validation_samples=9223372036854775807"], 2,
         "data.validation_samples: 8192 training and 9223372036854775807 validation examples"),
        ("seq_len longer than the text", [gpt, "--dry-run", "--set", "data.seq_len=100000000"], 2, "data.seq_len: is 100000000, more than twice the longest document"),
        ("noise = nan", [quick, "--dry-run", "--set", "data.noise=nan"], 2, "data.noise: is nan"),
        ("a collective wait without end", [quick, "--dry-run", "--set", "world.timeout_s=inf"], 2,
         "world.timeout_s: must be > 0 and at most a week (604800 seconds), got inf"),
        ("a collective wait of no time", [quick, "--dry-run", "--set", "world.timeout_s=0"], 2,
         "world.timeout_s: must be > 0 and at most a week (604800 seconds), got 0\n"),
        ("a rotary base of one half", [gpt, "--dry-run", "--set", "model.rotary_base=0.5"], 2,
         "model.rotary_base: must be > 1, got 0.5\n"),
        ("one class", [quick, "--dry-run", "--set", "data.classes=1"], 2,
         "data.classes: must be >= 2, got 1: with one class every target is that class"),
        ("a float past double", [quick, "--dry-run", "--set", "optimizer.lr=1e400"], 2,
         "--set optimizer.lr=1e400: optimizer.lr: 1e400 is not a number TOML can hold ("),
        ("an integer past 64 bits", [quick, "--dry-run", "--set", "run.steps=99999999999999999999"], 2,
         "run.steps: 99999999999999999999 is not a number TOML can hold ("),
        ("a data set of one example", [quick, "--dry-run", "--set", "data.samples=1"], 2,
         "is more than an epoch holds (1 micro-batch, 1 example); the command line sets --set data.samples=1: every step"),
        ("a warmup longer than the run (said in the plan, not refused)", [quick, "--dry-run", "--set", "run.epochs=0",
         "--set", "run.steps=5"], 0,
         "its rate still rises at the last step, to 0.00075 of the optimizer's 0.003 (a warmup longer than the run's 5 steps?)"),
        ("a warmup as long as the run (it reaches the rate: said nothing)", [quick, "--dry-run", "--set", "run.epochs=0",
         "--set", "run.steps=20"], 0, ("schedule      warmup_cosine, advanced once per optimizer step\n",)),
        ("no class", [quick, "--dry-run", "--set", "data.classes=0"], 2, "data.classes: must be >= 2, got 0"),
        ("a learning rate without end", [quick, "--dry-run", "--set", "optimizer.lr=inf"], 2,
         "optimizer.lr: must be > 0 and finite, got inf"),
        ("a negative final learning rate", [quick, "--dry-run", "--set", "schedule.min_lr=-1"], 2,
         "schedule.min_lr: must be >= 0 and at most the optimizer's lr (0.003), which the cosine decays from; got -1"),
        ("a rendezvous wait of a year", [quick, "--dry-run", "--set", "world.rendezvous_timeout_s=31536000"], 2,
         "world.rendezvous_timeout_s: must be > 0 and at most a week"),
        ("an empty key in --set", [quick, "--dry-run", "--set", "run.=2"], 2, "--set run.=2: empty component in key"),
        ("the verifier with a resume", [quick, "--verify-accumulation", "--resume", "latest"], 2,
         "tk-run: error: --verify-accumulation trains nothing: --resume would be ignored"),
        ("a dry run with a report", [quick, "--dry-run", "--report"], 2, "tk-run: error: --dry-run trains nothing: --report would be ignored"),
        ("a micro-batch that is a float", [quick, "--dry-run", "--set", "batch.micro_batch=8.5"], 2,
         'batch.micro_batch: expected an integer or one of auto, got float'),
        ("a memory budget without a unit", [quick, "--dry-run", "--set", "batch.micro_batch=auto", "--set",
         'batch.memory_budget="512"'], 2, 'batch.memory_budget: "512" has no unit'),
        ("a NUL in run.name", [write("nul.toml", open(quick).read().replace('name = "quickstart"', 'name = "a\\u0000b"')), "--dry-run"],
         2, "run.name: contains a NUL character"),
        ("a text path that is a folder", [gpt, "--dry-run", "--set", 'data.path="%s"' % os.path.join(work, "folder")], 2, "is a folder, not a file"),
        ("a zero-filled plugin library", [plugin_recipe(zeros), "--dry-run"], 2, "zeros.so: damaged ("),
        ("an effective batch larger than an epoch", [quick, "--dry-run", "--set", "batch.accumulation=0", "--set",
         "batch.effective_batch=16384"], 2,
         "batch.effective_batch: an optimizer step of 512 micro-batches of 32 (16384 examples) is more "
         "than an epoch holds (256 micro-batches, 8192 examples)"),
        ("a ramp longer than the run", [quick, "--dry-run", "--set", "run.epochs=0", "--set", "run.steps=20", "--set",
         "batch.accumulation=0", "--set", "batch.effective_batch=128", "--set",
         "batch.ramp_from=32", "--set", "batch.ramp_steps=100000000"], 2,
         "batch.ramp_steps: the batch ramp lasts 100000000 optimizer steps, longer than the run's 20"),
        ("a ramp of more examples than the run takes", [quick, "--dry-run", "--set", "run.epochs=0", "--set", "run.steps=20",
         "--set", "batch.accumulation=0", "--set", "batch.effective_batch=128", "--set",
         "batch.ramp_from=32", "--set", "batch.ramp_samples=100000000"], 2,
         "batch.ramp_samples: the batch ramp lasts 100000000 examples, longer than the run's 20 optimizer "
         "steps take"),
        # A machine's memory that is no size: refused once, before a launch starts any worker.
        ("a machine's memory that is no size", [{"TK_MACHINE_MEMORY": "lots"}, quick, "--dry-run"], 2,
         'environment variable TK_MACHINE_MEMORY: expected a size > 0 like "1.5GiB", "800MiB" or "2GB", got "lots"'),
        ("a machine's memory that is no size, for a launch", [{"TK_MACHINE_MEMORY": "lots"}, quick, "--nproc", "2"], 2,
         'environment variable TK_MACHINE_MEMORY: expected a size > 0'),
    ] + tensor_cases
    failed = 0
    for label, args, rc, *expect in cases:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        if args and isinstance(args[0], dict):  # the case's own environment variables first
            env.update(args[0])
            args = args[1:]
        p = subprocess.run([tk_run] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, env=env)
        out = p.stdout.decode(errors="replace")
        problems = []
        if p.returncode != rc:
            problems.append("exit code %d, expected %d" % (p.returncode, rc))
        # An expectation is a text, or a tuple of texts of which one must be there.
        problems += ["no '%s'" % (e,) for e in expect
                     if not any(x in out for x in (e if isinstance(e, tuple) else (e,)))]
        problems += ["a C++ stack trace ('%s')" % m for m in STACK if m in out]
        errors = [l for l in out.splitlines() if "error" in l]
        if rc == 2 and len(errors) != 1:
            problems.append("%d error lines, expected one" % len(errors))
        if problems:
            failed += 1
            print("FAIL %s: %s\n  tk-run %s\n%s" % (label, "; ".join(problems), " ".join(args)[:300], out[-2000:]))
        else:
            print("ok   %s: %s" % (label, errors[0].strip() if errors else ""))
    print("%d of %d cases failed" % (failed, len(cases)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
