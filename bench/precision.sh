#!/usr/bin/env bash
# Time per optimizer step with bf16 autocast vs fp32, same model and data (bench/overhead.toml),
# interleaved REPS times. On CUDA builds the same script measures the GPU (run.device = auto).
#   bash bench/precision.sh [REPS]         (after tools/build.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
reps=${1:-5}
bench_int REPS "$reps" 1
steps=300 warmup=50
cp "$bench_root/bench/overhead.toml" "$bench_work/fp32.toml"
{ cat "$bench_root/bench/overhead.toml"; printf '\n[[plugins]]\nname = "mixed_precision"\ndtype = "bf16"\n'; } >"$bench_work/bf16.toml"
times="$bench_work/times"
cpu=$(bench_cpu)

for i in $(seq "$reps"); do
  for p in fp32 bf16; do
    bench_tk "$p-$i" "$steps" "$bench_work/$p.toml" --progress none --log-level warn
    r=$(bench_step_ms "$tk_dir/metrics.jsonl" "$warmup" "$steps")
    echo "$p $r" >>"$times"
  done
done
/usr/bin/python3 - "$times" "$reps" "$cpu" <<'PY'
import statistics, sys
t, loss = {}, {}
for line in open(sys.argv[1]):
    k, ms, l = line.split()
    t.setdefault(k, []).append(float(ms))
    loss[k] = float(l)
print(f"MLP 256-512-512-10, micro-batch 64 x 4 accumulation, AdamW, {sys.argv[2]} interleaved runs each")
print(sys.argv[3])
print("| precision | median ms/step | all runs | loss at step 300 | vs fp32 |")
print("|---|---|---|---|---|")
for k in ("fp32", "bf16"):
    m = statistics.median(t[k])
    print(f"| {k} | {m:.2f} | {', '.join(f'{v:.2f}' for v in t[k])} | {loss[k]:.4f} | "
          f"{m / statistics.median(t['fp32']):.2f} |")
PY
