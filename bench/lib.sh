# The parts every bench/*.sh shares: checked runs, fresh run folders, the CPU line, cleanup.
# Sourced, not run:  source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# A benchmark is evidence, so a run that fails stops the script at once: exit code 1, the run's
# command, its exit status and its own stderr on stderr. Figures are only computed from files
# the run that was just checked wrote itself.
#
# Sets
#   bench_root     the source tree
#   bench_bin      the build's bin folder: $BUILD_DIR/bin (default: build/bin of the source tree)
#   bench_work     a new temporary folder for this script's runs, removed when the script exits
#   bench_python   the Python that runs the hand-written Python loops: $TK_BENCH_PYTHON, default
#                  /usr/bin/python3 (Debian's python3-torch)
#   bench_extra    the words of $TK_BENCH_EXTRA
#
# Functions
#   bench_tk NAME STEPS ARG...     runs "$bench_bin/tk-run ARG... --set run.output=DIR $TK_BENCH_EXTRA"
#                                  (under the words of the array bench_wrap first, when a script sets it)
#                                  with DIR a new empty folder; stops the script unless it exits 0 and
#                                  DIR/metrics.jsonl then holds exactly the step records 1..STEPS.
#                                  Sets tk_dir (DIR), tk_out and tk_err (files with its stdout, stderr).
#   bench_cmd NAME KEY CMD ARG...  runs any other program (a hand-written loop); stops the script unless
#                                  it exits 0 and prints "KEY NUMBER". Sets cmd_value (NUMBER), cmd_out,
#                                  cmd_err.
#   bench_checked NAME LOG CMD ARG...  runs CMD with stdout and stderr in the file LOG; stops the script
#                                  unless it exits 0.
#   bench_fresh NAME               prints the path of a new empty folder under bench_work.
#   bench_cpu [python]             prints the CPU line: model, cores, the ISA flags that decide which
#                                  kernels run (avx2, avx512f, avx512_bf16, amx_tile, amx_bf16), tk-run's
#                                  LibTorch and, with "python", the Python loops' torch.
#   bench_int NAME VALUE MIN       stops with the script's usage (exit 2) unless VALUE is an integer >= MIN.
#   bench_usage MESSAGE            prints MESSAGE and the script's usage lines, exits 2.
#   bench_die MESSAGE [FILE]       prints MESSAGE (and the end of FILE) on stderr, exits 1.
#   bench_cannot MESSAGE           this machine cannot take the script's figures (a tool it needs cannot
#                                  run here): prints "bench: cannot MESSAGE" on stderr, exits 77
#                                  ($bench_cannot_status), the status ctest reads as "skipped".
#
# Environment
#   BUILD_DIR          the build folder (default: build/ in the source tree)
#   TK_BENCH_EXTRA     extra arguments for every tk-run the script starts, split at white space and
#                      given last, e.g. TK_BENCH_EXTRA="--set run.prefetch=off"
#   TK_BENCH_PYTHON    the Python of the hand-written Python loops
#   TK_BENCH_KEEP=1    keep bench_work (its path is printed on stderr) to look at the runs' folders
#   TK_BENCH_OMP       an OMP_WAIT_POLICY (PASSIVE, ACTIVE) for every program the script starts; unset,
#                      each runs as a user's would: tk-run with PASSIVE (it sets it for itself), the
#                      hand-written loops with libgomp's default. The CPU line says which.
# Call the run functions from the script's own shell, not inside $(...) or a pipeline: they set
# variables, and a failure must stop the script, not a subshell.

set -euo pipefail

bench_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench_bin="${BUILD_DIR:-$bench_root/build}/bin"
bench_python="${TK_BENCH_PYTHON:-/usr/bin/python3}"
if [ -n "${TK_BENCH_OMP:-}" ]; then export OMP_WAIT_POLICY="$TK_BENCH_OMP"; fi
read -r -a bench_extra <<<"${TK_BENCH_EXTRA:-}"
bench_pid=$$
bench_work="$(mktemp -d "${TMPDIR:-/tmp}/tk-bench.XXXXXX")"

bench_cleanup() {
  if [ "${TK_BENCH_KEEP:-0}" = 1 ]; then
    echo "bench: kept the runs in $bench_work" >&2
  else
    rm -rf "$bench_work"
  fi
}
trap bench_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

bench_die() {  # MESSAGE [FILE]
  {
    echo "bench: $1"
    if [ -n "${2:-}" ]; then
      local lines
      lines=$(wc -l <"$2")
      if [ ! -s "$2" ]; then
        echo "  (empty)"
      elif [ "$lines" -gt 60 ]; then
        echo "  (its last 60 of $lines lines)"
        tail -n 60 "$2" | sed 's/^/  | /'
      else
        sed 's/^/  | /' "$2"
      fi
    fi
  } >&2
  [ "${TK_BENCH_KEEP:-0}" = 1 ] || echo "(TK_BENCH_KEEP=1 keeps the runs' folders and logs to look at)" >&2
  # From a subshell, an exit would only end the subshell: stop the script itself.
  if [ "$BASH_SUBSHELL" -gt 0 ]; then kill -s TERM "$bench_pid"; fi
  exit 1
}

readonly bench_cannot_status=77
bench_cannot() {  # MESSAGE
  echo "bench: cannot $1" >&2
  exit "$bench_cannot_status"
}

bench_usage() {  # MESSAGE
  {
    echo "bench: $1"
    sed -n 's/^#   \(bash bench\/.*\)/usage: \1/p' "$0"
  } >&2
  exit 2
}

bench_int() {  # NAME VALUE MIN
  [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || bench_usage "$1 must be an integer >= $3, got '$2'"
}

bench_fresh() {  # NAME
  mktemp -d "$bench_work/${1//[^A-Za-z0-9._-]/_}.XXXXXX"
}

# NAME RC STDERR STDOUT CMD...: the report of a run that failed, then exit.
bench_failed() {
  local name=$1 rc=$2 err=$3 out=$4 how
  shift 4
  if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then
    how="ended by signal SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128))) (exit status $rc)"
  else
    how="failed with exit code $rc"
  fi
  echo "bench: $name $how; the benchmark stops here" >&2
  echo "  command: $(printf '%q ' "$@")" >&2
  if [ -s "$err" ]; then
    bench_die "$name's stderr:" "$err"
  elif [ -s "$out" ]; then
    bench_die "$name wrote nothing on stderr; its stdout:" "$out"
  fi
  bench_die "$name wrote nothing on stdout or stderr"
}

bench_checked() {  # NAME LOG CMD...
  local name=$1 log=$2 rc=0
  shift 2
  "$@" >"$log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || bench_failed "$name" "$rc" "$log" "$log" "$@"
}

# The step records (those with a wall_time) of metrics.jsonl must be exactly steps 1..STEPS.
bench_check_metrics() {  # METRICS STEPS -> prints what is wrong, exit 1
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
try:
    lines = open(path).read().splitlines()
except OSError as e:
    sys.exit(f"{path}: {e.strerror}: the run wrote no metrics")
steps = []
for i, line in enumerate(lines, 1):
    try:
        record = json.loads(line)
    except ValueError:
        sys.exit(f"{path}:{i}: not a JSON record: {line[:80]!r}")
    if "wall_time" in record:
        steps.append(record.get("step"))
if steps != list(range(1, n + 1)):
    got = f"steps {steps[0]}..{steps[-1]}" if steps else "none"
    sys.exit(f"{path} holds {len(steps)} step records ({got}), the benchmark expects steps 1..{n}")
PY
}

bench_tk() {  # NAME STEPS ARG...
  local name=$1 steps=$2 rc=0 problem
  shift 2
  tk_dir=$(bench_fresh "$name")
  tk_out="$tk_dir.stdout" tk_err="$tk_dir.stderr"
  local cmd=(${bench_wrap[@]+"${bench_wrap[@]}"} "$bench_bin/tk-run" "$@" --set run.output="$tk_dir" ${bench_extra[@]+"${bench_extra[@]}"})
  "${cmd[@]}" >"$tk_out" 2>"$tk_err" || rc=$?
  [ "$rc" -eq 0 ] || bench_failed "tk-run ($name)" "$rc" "$tk_err" "$tk_out" "${cmd[@]}"
  if ! problem=$(bench_check_metrics "$tk_dir/metrics.jsonl" "$steps" 2>&1); then
    echo "bench: tk-run ($name) exited 0 but its records are not the run the benchmark asked for: $problem" >&2
    echo "  command: $(printf '%q ' "${cmd[@]}")" >&2
    bench_die "tk-run ($name)'s stderr:" "$tk_err"
  fi
}

bench_step_ms() {  # METRICS WARMUP STEPS -> "ms_per_step loss_at_step_STEPS" (the loss exactly, as repr)
  /usr/bin/python3 - "$1" "$2" "$3" <<'PY'
import json, sys
t = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[1]))}
w, n = int(sys.argv[2]), int(sys.argv[3])
print(f"{1000 * (t[n]['wall_time'] - t[w]['wall_time']) / (n - w):.4f} {t[n]['loss']!r}")
PY
}

bench_cmd() {  # NAME KEY CMD...
  local name=$1 key=$2 rc=0
  shift 2
  cmd_out=$(mktemp --suffix=.stdout "$bench_work/${name//[^A-Za-z0-9._-]/_}.XXXXXX")
  cmd_err="${cmd_out%.stdout}.stderr"
  "$@" >"$cmd_out" 2>"$cmd_err" || rc=$?
  [ "$rc" -eq 0 ] || bench_failed "$name" "$rc" "$cmd_err" "$cmd_out" "$@"
  cmd_value=$(awk -v k="$key" '{ for (i = 1; i < NF; i++) if ($i == k) { print $(i + 1); exit } }' "$cmd_out")
  if ! [[ $cmd_value =~ ^[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then
    echo "bench: $name exited 0 but printed no '$key NUMBER'; the benchmark stops here" >&2
    echo "  command: $(printf '%q ' "$@")" >&2
    bench_die "$name's stdout:" "$cmd_out"
  fi
}

bench_cpu() {  # [python]
  local model flags f isa="" line torch
  model=$({ lscpu 2>/dev/null || true; } | sed -n 's/^Model name: *//p' | head -n 1)
  [ -n "$model" ] || model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
  flags=" $(sed -n 's/^\(flags\|Features\)[[:space:]]*: //p' /proc/cpuinfo | head -n 1) "
  for f in avx2 avx512f avx512_bf16 amx_tile amx_bf16; do
    if [[ $flags == *" $f "* ]]; then isa+=", $f yes"; else isa+=", $f no"; fi
  done
  local cores  # the cores this process may use (nproc alone would count OMP_NUM_THREADS)
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  line="CPU: ${model:-unknown}, $cores cores"
  [ "$cores" = "$(nproc --all)" ] || line+=" (of $(nproc --all))"
  line+="; ${isa#, }"
  if [ -x "$bench_bin/tk-run" ]; then
    torch=$("$bench_bin/tk-run" --version | sed -n 's/.*(LibTorch \([^,)]*\).*/\1/p')
    line+="; tk-run's LibTorch ${torch:-unknown}"
  fi
  if [ "${1:-}" = python ]; then
    torch=$("$bench_python" -c 'import torch; print(torch.__version__)')
    line+="; Python loops' torch $torch"
  fi
  if [ -n "${OMP_WAIT_POLICY:-}" ]; then line+="; OMP_WAIT_POLICY=$OMP_WAIT_POLICY for every program"
  else line+="; OMP_WAIT_POLICY: tk-run PASSIVE (its own), the hand-written loops libgomp's default"; fi
  echo "$line"
}
