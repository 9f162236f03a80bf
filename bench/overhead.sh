#!/usr/bin/env bash
# Time per optimizer step, steady state: tk-run vs a hand-written LibTorch loop vs the same loop in
# Python (Debian's python3-torch). Runs are interleaved, REPS times each; medians and ratios printed.
#   bash bench/overhead.sh [REPS] [THREADS]   (after tools/build.sh; THREADS 0: the libraries' default)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
reps=${1:-5}
threads=${2:-0}
bench_int REPS "$reps" 1
bench_int THREADS "$threads" 0
steps=300 warmup=50
shape=(mlp 256 512 2 10 16384 64 4 $steps $warmup "$threads")
times="$bench_work/times"
cpu=$(bench_cpu python)
# tk-run's run.threads reaches OpenBLAS; the hand-written loops' thread setters do not.
blas=()
if [ "$threads" -gt 0 ]; then blas=(OPENBLAS_NUM_THREADS="$threads"); fi

for i in $(seq "$reps"); do
  bench_tk "run-$i" "$steps" "$bench_root/bench/overhead.toml" --progress none --log-level warn \
    --set run.threads="$threads"
  ms=$(/usr/bin/python3 "$bench_root/bench/step_ms.py" "$tk_dir/metrics.jsonl" "$warmup" "$steps")
  echo "tk $ms" >>"$times"
  bench_cmd "tk-bench-loop (run $i)" ms_per_step env ${blas[@]+"${blas[@]}"} "$bench_bin/tk-bench-loop" "${shape[@]}"
  echo "cpp $cmd_value" >>"$times"
  bench_cmd "bench_loop.py (run $i)" ms_per_step env ${blas[@]+"${blas[@]}"} "$bench_python" "$bench_root/bench/bench_loop.py" "${shape[@]:1}"
  echo "py $cmd_value" >>"$times"
done

/usr/bin/python3 - "$times" "$reps" "$threads" "$cpu" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    times.setdefault(k, []).append(float(v))
med = {k: statistics.median(v) for k, v in times.items()}
print(f"MLP 256-512-512-10, micro-batch 64 x 4 accumulation, AdamW, {sys.argv[3]} threads, {sys.argv[2]} interleaved runs each")
print(sys.argv[4])
best = {k: min(v) for k, v in times.items()}
print("| loop | median ms/step | best ms/step | all runs (ms/step) | median vs C++ | best vs C++ |")
print("|---|---|---|---|---|---|")
names = {"tk": "tk-run (grad_accum plugin)", "cpp": "hand-written LibTorch loop", "py": "same loop, Python"}
for k in ("tk", "cpp", "py"):
    runs = ", ".join(f"{v:.2f}" for v in times[k])
    print(f"| {names[k]} | {med[k]:.2f} | {best[k]:.2f} | {runs} | {med[k] / med['cpp']:.3f} | "
          f"{best[k] / best['cpp']:.3f} |")
PY
