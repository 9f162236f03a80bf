#!/usr/bin/env bash
# The loop's cost, side by side: tk-run vs the same training hand-written in LibTorch (tk-bench-loop)
# vs the same training in Python (Debian's python3-torch), on the MLP (bench/overhead.toml), the
# Fashion-MNIST CNN (recipes/fashion-mnist.toml) and gpt-tiny (recipes/gpt-tiny.toml). REPS runs of
# each, interleaved; time per optimizer step, median and best; ratios of tk-run to each by both.
#   bash bench/loop-gaps.sh [REPS] [THREADS...]   (default: 9 runs, at 1 thread and at the default)
# THREADS 0 is every library's default; N > 0 is N threads for all three, the BLAS's included
# (tk-run: run.threads = N; the hand-written loops: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS = N).
# Each round starts with the next program (tk, C++, Python; then C++, Python, tk; ...), so that a
# load that comes and goes on a shared machine does not fall on one program's runs.
# TK_BENCH_WORKLOADS picks some of the workloads (default "mlp cnn gpt").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
reps=${1:-9}
bench_int REPS "$reps" 1
shift $(($# > 0 ? 1 : 0))
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(1 0)
for t in "${settings[@]}"; do bench_int THREADS "$t" 0; done
cpu=$(bench_cpu python)
quiet=(--progress none --log-level warn --set run.epochs=0 --set run.validate_every=0)

# WORKLOAD THREADS REP: one run of each program; appends "WORKLOAD THREADS PROGRAM MS" to $times.
one_round() {
  local w=$1 t=$2 i=$3 steps warmup recipe data cpp py env_=() ms
  case "$w" in
    mlp) steps=300 warmup=50 recipe="$bench_root/bench/overhead.toml" data=()
         cpp=(mlp 256 512 2 10 16384 64 4 $steps $warmup "$t")
         py=("$bench_root/bench/bench_loop.py" 256 512 2 10 16384 64 4 $steps $warmup "$t") ;;
    cnn) steps=300 warmup=50 recipe="$bench_root/recipes/fashion-mnist.toml" data=(--set data.validation_samples=0)
         cpp=(cnn $steps $warmup "$t")
         py=("$bench_root/bench/fashion_loop.py" $steps $warmup) ;;
    gpt) steps=30 warmup=6 recipe="$bench_root/recipes/gpt-tiny.toml" data=(--set data.validation_fraction=0.0)
         cpp=(gpt 2 128 4 128 8 4 $steps $warmup "$t")
         py=("$bench_root/bench/gpt_loop.py" 2 128 4 128 8 4 $steps $warmup) ;;
  esac
  if [ "$t" -gt 0 ]; then env_=(OMP_NUM_THREADS="$t" OPENBLAS_NUM_THREADS="$t"); fi
  local order=(tk cpp py tk cpp) prog
  for prog in "${order[@]:$((i % 3)):3}"; do
    case "$prog" in
      tk) bench_tk "$w-$t-$i" "$steps" "$recipe" "${quiet[@]}" ${data[@]+"${data[@]}"} --set run.steps=$steps \
            --set run.threads="$t"
          ms=$(/usr/bin/python3 "$bench_root/bench/step_ms.py" "$tk_dir/metrics.jsonl" $warmup $steps) ;;
      cpp) bench_cmd "tk-bench-loop $w (run $i)" ms_per_step env ${env_[@]+"${env_[@]}"} "$bench_bin/tk-bench-loop" \
             "${cpp[@]}"
           ms=$cmd_value ;;
      py) bench_cmd "$(basename "${py[0]}") (run $i)" ms_per_step env ${env_[@]+"${env_[@]}"} "$bench_python" "${py[@]}"
          ms=$cmd_value ;;
    esac
    echo "$w $t $prog $ms" >>"$times"
  done
}

times="$bench_work/times"
for t in "${settings[@]}"; do
  for i in $(seq "$reps"); do
    for w in ${TK_BENCH_WORKLOADS:-mlp cnn gpt}; do
      case "$w" in mlp | cnn | gpt) ;; *) bench_usage "TK_BENCH_WORKLOADS: no workload '$w' (mlp, cnn, gpt)" ;; esac
      one_round "$w" "$t" "$i"
    done
  done
done

/usr/bin/python3 - "$times" "$reps" "$cpu" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    w, t, prog, ms = line.split()
    runs.setdefault((w, int(t)), {}).setdefault(prog, []).append(float(ms))
names = {"mlp": "MLP 256-512-512-10, 64 x 4", "cnn": "Fashion-MNIST CNN, 32 x 4", "gpt": "gpt-tiny, 8 x 4 x 128 tokens"}
print(f"Time per optimizer step (ms), {sys.argv[2]} interleaved runs of each; tk-run / hand-written LibTorch (C++)"
      " and tk-run / Python, by median and by best run")
print(sys.argv[3])
print("| workload | threads | tk-run median / best | C++ median / best | Python median / best |"
      " tk/C++ median | tk/C++ best | tk/Python median | tk/Python best |")
print("|---|---|---|---|---|---|---|---|---|")
for (w, t), r in runs.items():
    med = {k: statistics.median(v) for k, v in r.items()}
    best = {k: min(v) for k, v in r.items()}
    cell = lambda k: f"{med[k]:.2f} / {best[k]:.2f}"
    print(f"| {names[w]} | {t or 'default'} | {cell('tk')} | {cell('cpp')} | {cell('py')} | "
          f"{med['tk'] / med['cpp']:.3f} | {best['tk'] / best['cpp']:.3f} | "
          f"{med['tk'] / med['py']:.3f} | {best['tk'] / best['py']:.3f} |")
print()
print("Every run, in the order they ran (ms per step):")
for (w, t), r in runs.items():
    for k in ("tk", "cpp", "py"):
        print(f"  {w} {t or 'default'} {k}: " + ", ".join(f"{v:.2f}" for v in r[k]))
PY
