#!/usr/bin/env bash
# Time per optimizer step of a shipped real-data recipe: tk-run vs the same training written by hand
# in Python with Debian's python3-torch. Interleaved REPS times; medians and the ratio printed.
#   bash bench/vs-python.sh fashion [REPS]   recipes/fashion-mnist.toml vs bench/fashion_loop.py
#   bash bench/vs-python.sh gpt [REPS]       recipes/gpt-tiny.toml vs bench/gpt_loop.py
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
workload=${1:-fashion}
reps=${2:-3}
case "$workload" in
  fashion)
    steps=300 warmup=50
    recipe="$bench_root/recipes/fashion-mnist.toml"
    title="Fashion-MNIST CNN 16-32-128, micro-batch 32 x 4, AdamW"
    no_validation=(--set data.validation_samples=0)
    py=("$bench_root/bench/fashion_loop.py" $steps $warmup) ;;
  gpt)
    steps=60 warmup=10
    recipe="$bench_root/recipes/gpt-tiny.toml"
    title="GPT 2 layers x 128 wide, 4 heads, 128-byte sequences, micro-batch 8 x 4, AdamW"
    no_validation=(--set data.validation_fraction=0.0)
    py=("$bench_root/bench/gpt_loop.py" 2 128 4 128 8 4 $steps $warmup) ;;
  *) bench_usage "unknown workload '$workload'" ;;
esac
bench_int REPS "$reps" 1
times="$bench_work/times"
cpu=$(bench_cpu python)
for i in $(seq "$reps"); do
  bench_tk "run-$i" "$steps" "$recipe" --progress none --log-level warn --set run.epochs=0 --set run.steps=$steps \
    --set run.validate_every=0 "${no_validation[@]}"
  ms=$(/usr/bin/python3 "$bench_root/bench/step_ms.py" "$tk_dir/metrics.jsonl" $warmup $steps)
  echo "tk $ms" >>"$times"
  bench_cmd "$(basename "${py[0]}") (run $i)" ms_per_step "$bench_python" "${py[@]}"
  echo "py $cmd_value" >>"$times"
done
/usr/bin/python3 - "$times" "$reps" "$title" "$warmup" "$steps" "$(basename "$recipe")" "$cpu" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    k, v = line.split()
    times.setdefault(k, []).append(float(v))
med = {k: statistics.median(v) for k, v in times.items()}
print(f"{sys.argv[3]}; {sys.argv[2]} interleaved runs, steps {sys.argv[4]}..{sys.argv[5]}")
print(sys.argv[7])
print("| loop | median ms/step | all runs (ms/step) | vs tk-run |")
print("|---|---|---|---|")
for k, name in (("tk", f"tk-run recipes/{sys.argv[6]}"), ("py", "same training by hand, Python")):
    runs = ", ".join(f"{v:.2f}" for v in times[k])
    print(f"| {name} | {med[k]:.2f} | {runs} | {med[k] / med['tk']:.3f} |")
PY
