#!/usr/bin/env bash
# tk-run under torchrun's restarts (Debian's python3-torch; on Python 3.11 with --redirects 1 --tee 1):
#  1. a worker killed mid-run under --max_restarts 1: the restarted workers resume by themselves
#     (TORCHELASTIC_RESTART_COUNT) and the run ends bit-identical to an uninterrupted one, every
#     record once;
#  2. workers killed at random moments 5 times in one run (--max_restarts 5): still identical;
#  3. a resize: a job of 2 workers killed, then the job again with 1 worker and then 3 (another
#     --nproc_per_node): the steps of one process, to 1e-12 in float64.
#   torchrun_restart.sh TK_RUN WORK
set -euo pipefail
tk_run=$1 work=$2
py=/usr/bin/python3
$py -c 'import torch.distributed.run' 2>/dev/null || { echo "SKIPPED: no python3-torch (torchrun)"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
cat > "$work/recipe.toml" <<'EOF'
[run]
seed = 9
steps = 60
checkpoint_every = 5
dtype = "float64"
[model]
name = "mlp"
hidden = [16]
activation = "tanh"
[data]
name = "synthetic-classification"
samples = 240
validation_samples = 0
features = 8
classes = 4
[batch]
micro_batch = 2
effective_batch = 12
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
[[plugins]]
name = "grad_accum"
[[plugins]]
name = "ddp"
EOF

fail() { echo "torchrun_restart: $*"; exit 1; }

# torchrun NPROC MAX_RESTARTS OUT [tk-run options...]: one job of NPROC workers on this machine.
torchrun() {
  local nproc=$1 restarts=$2 out=$3
  shift 3
  timeout 600 $py -m torch.distributed.run --nnodes 1 --nproc_per_node "$nproc" --max_restarts "$restarts" \
    --monitor_interval 1 --master_addr 127.0.0.1 --master_port $(( 20000 + RANDOM % 20000 )) \
    --redirects 1 --tee 1 --no_python "$tk_run" "$work/recipe.toml" --progress plain \
    --set run.output="\"$work/$out\"" "$@"
}

# same OUT REFERENCE TOLERANCE: weights within TOLERANCE (0: bit-identical), and the records step by
# step (each once) with the same counts and losses within TOLERANCE.
same() {
  $py - "$work/$1" "$work/$2" "$3" <<'EOF' || fail "$1 differs from $2"
import json, sys, torch
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
wa, wb = torch.load(a + "/weights.pt"), torch.load(b + "/weights.pt")
assert wa.keys() == wb.keys(), (wa.keys(), wb.keys())
for k in wa:
    d = (wa[k] - wb[k]).abs().max().item()
    assert d <= tol, f"{k}: {d}"
ra = [json.loads(l) for l in open(a + "/metrics.jsonl")]
rb = [json.loads(l) for l in open(b + "/metrics.jsonl")]
assert [r["step"] for r in ra] == [r["step"] for r in rb], ([r["step"] for r in ra], [r["step"] for r in rb])
for x, y in zip(ra, rb):
    for key in ("epoch", "micro_batches", "effective_batch", "samples", "tokens", "lr"):
        assert x[key] == y[key], (x["step"], key, x[key], y[key])
    assert abs(x["loss"] - y["loss"]) <= tol, (x["step"], x["loss"], y["loss"])
print(f"{a}: the same steps as {b} (weights and {len(ra)} records, tolerance {tol})")
EOF
}

set +e
torchrun 2 0 whole > "$work/whole.log" 2>&1
rc=$?
set -e
# Debian 13's PyTorch 2.6 is built without libuv, which its torchrun's own store asks for.
if [ $rc != 0 ] && grep -q 'use_libuv was requested but PyTorch was build without libuv support' "$work/whole.log"; then
  echo "SKIPPED: this PyTorch's torchrun cannot start its own store (built without libuv)"
  exit 77
fi
[ $rc = 0 ] || { cat "$work/whole.log"; fail "the uninterrupted job failed"; }

# 1. Rank 0 kills itself after its 3rd checkpoint (step 15); torchrun restarts both workers once.
TK_FAULT=checkpoint-done:3 torchrun 2 1 restarted > "$work/restarted.log" 2>&1 || { cat "$work/restarted.log"; fail "the restarted job failed"; }
grep -q "resuming from .*step-00000015" "$work/restarted.log" || { cat "$work/restarted.log"; fail "the restart did not resume step 15"; }
same restarted whole 0

# 2. Five kills of a random worker at random moments. A kill waits until the restart the previous
#    kill caused has resumed (its "resuming from" line) and the new workers then wrote a checkpoint:
#    a kill that lands on workers already going down (a checkpoint finishing after its peer died)
#    would cost no restart of its own.
torchrun 2 5 killed --set run.steps=3000 --set run.checkpoint_every=20 > "$work/killed.log" 2>&1 &
job=$!
kills=0 last=""
resumes() { local n; n=$(grep -c '\[rank 0\] \[info\] resuming from' "$work/killed.log" 2>/dev/null || true); echo "${n:-0}"; }
for _ in $(seq 1 1200); do
  [ $kills -ge 5 ] && break
  kill -0 $job 2>/dev/null || break
  now=$(cat "$work/killed/checkpoints/latest" 2>/dev/null || true)
  if [ -z "$last" ] && [ "$(resumes)" = $kills ]; then
    last=${now:-none}
  elif [ -n "$last" ] && [ -n "$now" ] && [ "$now" != "$last" ]; then
    sleep "0.$(( RANDOM % 4 ))"
    victim=$(pgrep -f -- "^$tk_run .*run.output=\"$work/killed\"" | shuf -n 1 || true)
    if [ -n "$victim" ] && kill -KILL "$victim" 2>/dev/null; then kills=$((kills + 1)) last=""; fi
  fi
  sleep 0.1
done
set +e
wait $job
rc=$?
set -e
[ $rc = 0 ] || { tail -40 "$work/killed.log"; fail "the job killed $kills times failed (exit $rc)"; }
[ $kills = 5 ] || { tail -40 "$work/killed.log"; fail "only $kills kills landed before the job ended"; }
[ "$(grep -c '\[rank 0\] \[info\] resuming from' "$work/killed.log")" = 5 ] || { tail -40 "$work/killed.log"; fail "the job did not resume 5 times"; }
torchrun 2 0 whole-long --set run.steps=3000 --set run.checkpoint_every=20 > "$work/whole-long.log" 2>&1 || fail "the long uninterrupted job failed"
same killed whole-long 0

# 3. Resized: 2 workers to step 10, 1 to step 30, 3 to the end; against one process.
"$tk_run" "$work/recipe.toml" --progress none --set run.output="\"$work/alone\"" > "$work/alone.log" 2>&1 || fail "the single process failed"
TK_FAULT=checkpoint-done:2 torchrun 2 0 resized --resume auto > "$work/resized-2.log" 2>&1 && fail "the job of 2 was not killed"
TK_FAULT=checkpoint-done:4 torchrun 1 0 resized --resume auto > "$work/resized-1.log" 2>&1 && fail "the job of 1 was not killed"
grep -q "continuing the run of 2 ranks on 1" "$work/resized-1.log" || { cat "$work/resized-1.log"; fail "2 -> 1 not said"; }
torchrun 3 0 resized --resume auto > "$work/resized-3.log" 2>&1 || { cat "$work/resized-3.log"; fail "the job of 3 failed"; }
grep -q "continuing the run of 1 rank on 3" "$work/resized-3.log" || { cat "$work/resized-3.log"; fail "1 -> 3 not said"; }
same resized alone 1e-12
echo "torchrun_restart: a restart, 5 random kills and a resize 2 -> 1 -> 3 end with the uninterrupted run's steps"
