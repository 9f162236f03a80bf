#!/usr/bin/env bash
# Time per optimizer step with each optimizer step form (optimizer.implementation = per_tensor,
# foreach, and for AdamW fused: one pass over each parameter), interleaved REPS times, on the overhead
# benchmark's MLP (bench/overhead.toml: 4 micro-batches of 64 a step, 8 parameter tensors) with
# AdamW and with SGD + momentum, clipping on. The losses must agree to the bit between
# per_tensor and foreach; the script fails when they do not. On CUDA builds the same script
# measures the GPU (run.device = auto), where foreach rounds differently: TK_BENCH_ROUNDING=1
# reports the difference instead of failing.
#   bash bench/foreach.sh [REPS]           (after tools/build.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 1 ] || bench_usage "foreach.sh takes at most one argument, the interleaved runs of each form"
reps=${1:-5}
bench_int REPS "$reps" 1
steps=300 warmup=50
forms=(per_tensor foreach fused)  # fused: trainkit's one-pass kernel on a CPU, at::_fused_adamw_ on CUDA
times="$bench_work/times"
cpu=$(bench_cpu)
clip=$(printf '\n[[plugins]]\nname = "clip"\nmax_norm = 1.0\n')
{ cat "$bench_root/bench/overhead.toml"; echo "$clip"; } >"$bench_work/adamw.toml"
{ sed 's/^name = "adamw"/name = "sgd"\nmomentum = 0.9/; s/^lr = 0.001/lr = 0.01/' "$bench_root/bench/overhead.toml"
  echo "$clip"; } >"$bench_work/sgd.toml"

for i in $(seq "$reps"); do
  for opt in adamw sgd; do
    for f in "${forms[@]}"; do
      [ "$opt" = sgd ] && [ "$f" = fused ] && continue
      bench_tk "$opt-$f-$i" "$steps" "$bench_work/$opt.toml" --progress none --log-level warn \
        --set optimizer.implementation="\"$f\""
      echo "$opt $f $(bench_step_ms "$tk_dir/metrics.jsonl" "$warmup" "$steps")" >>"$times"
    done
  done
done
/usr/bin/python3 - "$times" "$reps" "$cpu" <<'PY'
import os, statistics, sys
t, loss = {}, {}
for line in open(sys.argv[1]):
    opt, form, ms, l = line.split()
    t.setdefault((opt, form), []).append(float(ms))
    loss.setdefault((opt, form), set()).add(l)
print(f"MLP 256-512-512-10, micro-batch 64 x 4 accumulation, clip max_norm 1, {sys.argv[2]} interleaved runs each")
print(sys.argv[3])
print("| optimizer | implementation | median ms/step | all runs | loss at step 300 | vs per_tensor |")
print("|---|---|---|---|---|---|")
bad = []
for (opt, form), v in t.items():
    base = statistics.median(t[(opt, "per_tensor")])
    print(f"| {opt} | {form} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} | "
          f"{float(sorted(loss[(opt, form)])[0]):.6f} | {statistics.median(v) / base:.3f} |")
    if form == "foreach" and loss[(opt, form)] != loss[(opt, "per_tensor")]:
        bad.append(f"{opt}: foreach's last loss {loss[(opt, form)]} is not per_tensor's {loss[(opt, 'per_tensor')]}")
if bad and os.environ.get("TK_BENCH_ROUNDING") == "1":
    print("rounding differs: " + "; ".join(bad))
elif bad:
    sys.exit("bench: " + "; ".join(bad))
PY
