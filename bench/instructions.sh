#!/usr/bin/env bash
# The loop's cost in instructions: tk-run vs the same training hand-written in LibTorch (tk-bench-loop)
# vs the same training in Python (Debian's python3-torch), counted by Valgrind's callgrind. A count
# of executed instructions does not move with the machine's load the way time does, so it resolves a
# difference of a fraction of a percent where interleaved timings on a shared machine cannot.
#   bash bench/instructions.sh [WORKLOAD...]   (default: mlp-small gpt-small mlp cnn)
# Each program runs twice, for LOW and for HIGH optimizer steps; the difference of the two counts over
# HIGH - LOW is what one step costs, start-up (loading libraries, the data, the first steps' one-time
# work) taken out. Workloads:
#   mlp-small  the MLP of bench/overhead.toml narrowed to 16-16-16-10 (64 x 4, AdamW): almost all of its
#              step is the loop and the per-operator dispatch, the part a framework adds to
#   gpt-small  gpt-tiny's 2 layers and 4 heads at width 32, 2 x 4 sequences of 16 bytes
#   mlp        bench/overhead.toml as it is (256-512-512-10), the shape bench/loop-gaps.sh times
#   cnn        recipes/fashion-mnist.toml's CNN on Fashion-MNIST, 32 x 4 (bench/fashion_loop.py)
#   gpt        recipes/gpt-tiny.toml as it is, 8 x 4 sequences of 128 bytes (not in the default: about
#              a minute a step under Valgrind, half an hour in all)
# Everything at one thread. Under Valgrind the CPU shows no AVX-512, so LibTorch's kernels are its AVX2
# ones in all three programs: the counts compare the programs, not this CPU's native step.
# Where Valgrind cannot start tk-run (a CPU without RDTSCP: see probe_valgrind), the script says so in
# one line and exits 77 (bench_cannot) before it counts anything.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(mlp-small gpt-small mlp cnn)
for w in "${workloads[@]}"; do
  case "$w" in mlp-small | gpt-small | mlp | cnn | gpt) ;; *) bench_usage "no workload '$w' (mlp-small, gpt-small, mlp, cnn, gpt)" ;; esac
done
command -v valgrind >/dev/null || bench_usage "valgrind is not installed (bash tools/setup.sh installs it)"
# Valgrind emulates the CPU it runs on, and stops at an instruction the CPU's flags do not list. A
# program linking Debian's LibTorch runs RDTSCP in a static initializer (Highway's timer, through
# OpenCV and libjxl), so on a CPU whose flags lack rdtscp (some AMD EPYC virtual machines) no program
# of the three can start. Probe once, before any figure is taken; where it fails, exit 77 (bench_cannot).
probe_valgrind() {
  local log="$bench_work/valgrind-probe.log" rc=0 why
  # tk-run alone must start: a tk-run that cannot is a failure, not this machine's limit.
  bench_checked "tk-run --version" "$bench_work/version.log" "$bench_bin/tk-run" --version
  # In a subshell that waits for it, so that the shell's "Illegal instruction" notice goes to /dev/null too.
  (valgrind --tool=none --log-file="$log" "$bench_bin/tk-run" --version >/dev/null 2>&1; exit $?) 2>/dev/null || rc=$?
  [ "$rc" -ne 0 ] || return 0
  # Valgrind names the instruction it stopped at (its first bytes): "0xF 0x1 0xF9" is RDTSCP.
  why=$(sed -n 's/^\(vex [^:]*: unhandled instruction bytes: \(0x[0-9A-F]* \)\{0,2\}0x[0-9A-F]*\).*/\1/p' "$log" | head -n 1)
  if [[ " $(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo | head -n 1) " != *" rdtscp "* ]]; then
    why+="${why:+; }this CPU's flags do not list rdtscp, which LibTorch's libraries use at start-up"
  fi
  bench_cannot "count instructions on this machine: Valgrind $(valgrind --version | sed 's/^valgrind-//') cannot start tk-run \
(exit status $rc${why:+: $why}); count where \`valgrind --tool=none build/bin/tk-run --version\` runs"
}
[ -x "$bench_bin/tk-run" ] || bench_die "no $bench_bin/tk-run (build first: bash tools/build.sh)"
probe_valgrind
# One thread for LibTorch and OpenBLAS in all three; PASSIVE as tk-run sets it (it would run itself again).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
cpu=$(bench_cpu python)
quiet=(--progress none --log-level warn --set run.epochs=0 --set run.validate_every=0 --set run.threads=1)
counts="$bench_work/counts"

# LOG: the instructions callgrind counted, from its log.
collected() {
  local n
  n=$(sed -n 's/^==[0-9]*== Collected : \([0-9]*\)$/\1/p' "$1" | tail -n 1)
  [ -n "$n" ] || bench_die "callgrind counted nothing (no 'Collected' line in its log)" "$1"
  echo "$n"
}

# WORKLOAD PROGRAM STEPS: one counted run; appends "WORKLOAD PROGRAM STEPS INSTRUCTIONS" to $counts.
count_run() {
  local w=$1 prog=$2 steps=$3 log tk=() shape=() cpp=() py=()
  log=$(mktemp "$bench_work/callgrind.XXXXXX")
  local vg=(valgrind --tool=callgrind --callgrind-out-file=/dev/null --log-file="$log")
  # The hand-written loops take the same shape words (bench_loop.cpp's and the .py files' usage).
  case "$w" in
    mlp-small | mlp)
      tk=("$bench_root/bench/overhead.toml")
      shape=(256 512 2 10 16384 64 4 "$steps" 1)
      if [ "$w" = mlp-small ]; then
        shape=(16 16 "${shape[@]:2}")
        tk+=(--set 'model.hidden=[16,16]' --set data.features=16)
      fi
      cpp=(mlp "${shape[@]}" 1) py=("$bench_root/bench/bench_loop.py" "${shape[@]}" 1) ;;
    gpt-small | gpt)
      tk=("$bench_root/recipes/gpt-tiny.toml" --set data.validation_fraction=0.0)
      shape=(2 128 4 128 8 4 "$steps" 1)
      if [ "$w" = gpt-small ]; then
        tk+=(--set model.width=32 --set data.seq_len=16 --set batch.micro_batch=2)
        shape=(2 32 4 16 2 "${shape[@]:5}")
      fi
      cpp=(gpt "${shape[@]}" 1) py=("$bench_root/bench/gpt_loop.py" "${shape[@]}") ;;  # gpt_loop.py takes no THREADS
    cnn)
      # Without the validation split: the end-of-run validation over its 10000 images cancels out of
      # the difference, but triples the time Valgrind takes over each tk-run (loop-gaps.sh does the same).
      tk=("$bench_root/recipes/fashion-mnist.toml" --set data.validation_samples=0)
      cpp=(cnn "$steps" 1 1) py=("$bench_root/bench/fashion_loop.py" "$steps" 1) ;;
  esac
  case "$prog" in
    tk) bench_wrap=("${vg[@]}")
        bench_tk "$w-$steps" "$steps" "${tk[@]}" "${quiet[@]}" --set run.steps="$steps"
        bench_wrap=() ;;
    cpp) bench_cmd "tk-bench-loop $w ($steps steps)" ms_per_step "${vg[@]}" "$bench_bin/tk-bench-loop" "${cpp[@]}" ;;
    py) bench_cmd "$(basename "${py[0]}") $w ($steps steps)" ms_per_step "${vg[@]}" "$bench_python" "${py[@]}" ;;
  esac
  echo "$w $prog $steps $(collected "$log")" >>"$counts"
}

for w in "${workloads[@]}"; do
  case "$w" in mlp | cnn) low=2 high=5 ;; gpt) low=2 high=4 ;; *) low=10 high=50 ;; esac
  for prog in tk cpp py; do
    for steps in $low $high; do
      count_run "$w" "$prog" "$steps"
      echo "bench: $(tail -n 1 "$counts")" >&2
    done
  done
done

/usr/bin/python3 - "$counts" "$cpu" <<'PY'
import sys
runs = {}
for line in open(sys.argv[1]):
    w, prog, steps, n = line.split()
    runs.setdefault(w, {}).setdefault(prog, {})[int(steps)] = int(n)
names = {"mlp-small": "MLP 16-16-16-10, 64 x 4", "gpt-small": "GPT 2 layers, width 32, 2 x 4 x 16 tokens",
         "mlp": "MLP 256-512-512-10, 64 x 4", "cnn": "Fashion-MNIST CNN, 32 x 4",
         "gpt": "gpt-tiny (2 layers, width 128), 8 x 4 x 128 tokens"}
print("Instructions per optimizer step (callgrind; the difference of two runs' counts over their difference in steps),"
      " one thread")
print(sys.argv[2] + "; under Valgrind LibTorch runs its AVX2 kernels")
print("| workload | tk-run | C++ | Python | tk-run - C++ | tk/C++ | tk/Python |")
print("|---|---|---|---|---|---|---|")
for w, r in runs.items():
    per = {}
    for prog, c in r.items():
        (lo, a), (hi, b) = sorted(c.items())
        per[prog] = (b - a) / (hi - lo)
    m = lambda x: f"{x / 1e6:.3f} M"
    print(f"| {names[w]} | {m(per['tk'])} | {m(per['cpp'])} | {m(per['py'])} | {(per['tk'] - per['cpp']) / 1e3:+.0f} k |"
          f" {per['tk'] / per['cpp']:.4f} | {per['tk'] / per['py']:.4f} |")
PY
