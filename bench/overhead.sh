#!/usr/bin/env bash
# Time per optimizer step, steady state: tk-run vs a hand-written LibTorch loop vs the same loop in
# Python (Debian's python3-torch). Runs are interleaved, REPS times each; medians and ratios printed.
#   bash bench/overhead.sh [REPS] [THREADS]   (after tools/build.sh; THREADS 0: the libraries' default)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BUILD_DIR:-$root/build}/bin"
reps=${1:-5}
threads=${2:-0}
steps=300 warmup=50
shape="256 512 2 10 16384 64 4 $steps $warmup $threads"
out=$(mktemp -d)

tk_ms() {
  "$bin/tk-run" "$root/bench/overhead.toml" --progress none --log-level warn \
    --set run.threads="$threads" --set run.output="$out/tk" >/dev/null
  /usr/bin/python3 "$root/bench/step_ms.py" "$out/tk/metrics.jsonl" "$warmup" "$steps"
}

for i in $(seq "$reps"); do
  echo "tk $(tk_ms)" >>"$out/times"
  echo "cpp $("$bin/tk-bench-loop" $shape | awk '{print $2}')" >>"$out/times"
  echo "py $(/usr/bin/python3 "$root/bench/bench_loop.py" $shape | awk '{print $2}')" >>"$out/times"
done

/usr/bin/python3 - "$out/times" "$reps" "$threads" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    times.setdefault(k, []).append(float(v))
med = {k: statistics.median(v) for k, v in times.items()}
print(f"MLP 256-512-512-10, micro-batch 64 x 4 accumulation, AdamW, {sys.argv[3]} threads, {sys.argv[2]} interleaved runs each")
best = {k: min(v) for k, v in times.items()}
print("| loop | median ms/step | best ms/step | all runs (ms/step) | median vs C++ | best vs C++ |")
print("|---|---|---|---|---|---|")
names = {"tk": "tk-run (grad_accum plugin)", "cpp": "hand-written LibTorch loop", "py": "same loop, Python"}
for k in ("tk", "cpp", "py"):
    runs = ", ".join(f"{v:.2f}" for v in times[k])
    print(f"| {names[k]} | {med[k]:.2f} | {best[k]:.2f} | {runs} | {med[k] / med['cpp']:.3f} | "
          f"{best[k] / best['cpp']:.3f} |")
PY
rm -rf "$out"
