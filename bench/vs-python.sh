#!/usr/bin/env bash
# Time per optimizer step of a shipped real-data recipe: tk-run vs the same training written by hand
# in Python with Debian's python3-torch. Interleaved REPS times; medians and the ratio printed.
#   bash bench/vs-python.sh fashion [REPS]   recipes/fashion-mnist.toml vs bench/fashion_loop.py
#   bash bench/vs-python.sh gpt [REPS]       recipes/gpt-tiny.toml vs bench/gpt_loop.py
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BUILD_DIR:-$root/build}/bin"
workload=${1:-fashion}
reps=${2:-3}
case "$workload" in
  fashion)
    steps=300 warmup=50
    recipe="$root/recipes/fashion-mnist.toml"
    title="Fashion-MNIST CNN 16-32-128, micro-batch 32 x 4, AdamW"
    no_validation=(--set data.validation_samples=0)
    py=("$root/bench/fashion_loop.py" $steps $warmup) ;;
  gpt)
    steps=60 warmup=10
    recipe="$root/recipes/gpt-tiny.toml"
    title="GPT 2 layers x 128 wide, 4 heads, 128-byte sequences, micro-batch 8 x 4, AdamW"
    no_validation=(--set data.validation_fraction=0.0)
    py=("$root/bench/gpt_loop.py" 2 128 4 128 8 4 $steps $warmup) ;;
  *) echo "usage: bash bench/vs-python.sh fashion|gpt [REPS]" >&2; exit 2 ;;
esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in $(seq "$reps"); do
  "$bin/tk-run" "$recipe" --progress none --log-level warn --set run.epochs=0 --set run.steps=$steps \
    --set run.validate_every=0 "${no_validation[@]}" --set run.output="$out/tk" >/dev/null
  echo "tk $(/usr/bin/python3 "$root/bench/step_ms.py" "$out/tk/metrics.jsonl" $warmup $steps)" >>"$out/times"
  echo "py $(/usr/bin/python3 "${py[@]}" | awk '{print $2}')" >>"$out/times"
done
/usr/bin/python3 - "$out/times" "$reps" "$title" "$warmup" "$steps" "$(basename "$recipe")" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    times.setdefault(k, []).append(float(v))
med = {k: statistics.median(v) for k, v in times.items()}
print(f"{sys.argv[3]}; {sys.argv[2]} interleaved runs, steps {sys.argv[4]}..{sys.argv[5]}")
print("| loop | median ms/step | all runs (ms/step) | vs tk-run |")
print("|---|---|---|---|")
for k, name in (("tk", f"tk-run recipes/{sys.argv[6]}"), ("py", "same training by hand, Python")):
    runs = ", ".join(f"{v:.2f}" for v in times[k])
    print(f"| {name} | {med[k]:.2f} | {runs} | {med[k] / med['tk']:.3f} |")
PY
