#!/usr/bin/env bash
# Every bench script must stop, with a non-zero exit and the failing run's own message, when a run
# it starts fails: refused, killed, ended short of its steps, or a hand-written loop that fails.
# Each case runs one script in its cheapest form with one such failure made to happen, and fails
# this check if the script exits 0 or does not show the run's message.
# A script that cannot take its figures on this machine at all (it exits 77 with "bench: cannot ...",
# e.g. instructions.sh where Valgrind cannot start tk-run) has its case reported as skipped, with the
# reason, neither passed nor failed; the other cases run on.
#   bash bench/check-fails-loudly.sh [BUILD_DIR] [--only GLOB | --except GLOB]
#   (default: build/; needs bin/tk-run and bin/tk-bench-loop). GLOB picks cases by name (a shell
#   pattern). Exits 0 when every case that ran passed and at least one passed, 1 when one failed, 77
#   when every case that ran was skipped (ctest's SKIP_RETURN_CODE for it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_arg="" only="*" except=""
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only needs a pattern}; shift 2 ;;
    --except) except=${2:?--except needs a pattern}; shift 2 ;;
    -*) echo "check-fails-loudly: unknown option '$1' (--only GLOB, --except GLOB)" >&2; exit 2 ;;
    *) build_arg=$1; shift ;;
  esac
done
build="$(cd "${build_arg:-$here/../build}" && pwd)"
for p in tk-run tk-bench-loop; do
  [ -x "$build/bin/$p" ] || { echo "check-fails-loudly: no $build/bin/$p (build first: bash tools/build.sh)" >&2; exit 2; }
done
tmp="$(mktemp -d "${TMPDIR:-/tmp}/tk-check-fails.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# Builds with one program replaced, and a Python and a git that fail on purpose.
mkdir -p "$tmp/loop-fails/bin" "$tmp/second-refused/bin" "$tmp/git-fails"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$build/bin/tk-run" >"$tmp/loop-fails/bin/tk-run"
cat >"$tmp/loop-fails/bin/tk-bench-loop" <<'SH'
#!/bin/sh
echo "terminate called after throwing an instance of 'c10::Error' (injected failure of tk-bench-loop)" >&2
exit 134
SH
# tk-run that sends every run after the first into the first run's folder: what the scripts did
# when they reused an output folder. tk-run itself refuses the second run.
cat >"$tmp/second-refused/bin/tk-run" <<SH
#!/usr/bin/env bash
real="$build/bin/tk-run" first="$tmp/second-refused/first-output"
SH
cat >>"$tmp/second-refused/bin/tk-run" <<'SH'
[ "${1:-}" != --version ] || exec "$real" "$@"
if [ ! -e "$first" ]; then
  for a in "$@"; do case $a in run.output=*) echo "${a#run.output=}" >"$first" ;; esac; done
  exec "$real" "$@"
fi
exec "$real" "$@" --set run.output="$(cat "$first")"
SH
printf '#!/bin/sh\nexec "%s" "$@"\n' "$build/bin/tk-bench-loop" >"$tmp/second-refused/bin/tk-bench-loop"
cat >"$tmp/python" <<'SH'
#!/bin/sh
case "$1" in
  *_loop.py) printf 'Traceback (most recent call last):\nRuntimeError: injected failure of %s\n' "${1##*/}" >&2; exit 1 ;;
esac
exec /usr/bin/python3 "$@"
SH
printf '#!/bin/sh\necho "fatal: injected failure of git $1" >&2\nexit 128\n' >"$tmp/git-fails/git"
chmod +x "$tmp"/*/bin/* "$tmp/python" "$tmp/git-fails/git"

passed=0 failed=0 skipped=0 t_all=$SECONDS
# NAME PATTERN [VAR=VALUE...] -- SCRIPT ARG...: the script must exit non-zero and print PATTERN.
case_() {
  local name=$1 pattern=$2 rc=0 t0=$SECONDS reason
  # shellcheck disable=SC2053  # the patterns are globs on purpose
  if [[ $name != $only ]] || { [ -n "$except" ] && [[ $name == $except ]]; }; then return 0; fi
  shift 2
  local env=()
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  env BUILD_DIR="$build" ${env[@]+"${env[@]}"} bash "$here/$1" "${@:2}" >"$tmp/out" 2>&1 </dev/null || rc=$?
  reason=$(grep -m 1 '^bench: cannot ' "$tmp/out" || true)
  if [ "$rc" -eq 77 ] && [ -n "$reason" ]; then
    skipped=$((skipped + 1))
    printf 'skip  %-58s exit %d, %3d s: %s\n' "$name" "$rc" $((SECONDS - t0)) "${reason#bench: }"
  elif [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && grep -qF -- "$pattern" "$tmp/out"; then
    passed=$((passed + 1))
    printf 'ok    %-58s exit %d, %3d s\n' "$name" "$rc" $((SECONDS - t0))
  else
    failed=$((failed + 1))
    printf 'FAIL  %-58s exit %d, %3d s: expected a non-zero exit and "%s"; its output:\n' "$name" "$rc" $((SECONDS - t0)) "$pattern"
    sed 's/^/      | /' "$tmp/out"
  fi
}

refuse=(TK_BENCH_EXTRA="--set optimizer.lr=-1")
refused="lr: must be > 0"
case_ "overhead.sh: tk-run refused"                   "$refused" "${refuse[@]}" -- overhead.sh 1 1
case_ "vs-python.sh fashion: tk-run refused"          "$refused" "${refuse[@]}" -- vs-python.sh fashion 1
case_ "vs-python.sh gpt: tk-run refused"              "$refused" "${refuse[@]}" -- vs-python.sh gpt 1
case_ "loop-gaps.sh: tk-run refused"                  "$refused" "${refuse[@]}" -- loop-gaps.sh 1 1
case_ "precision.sh: tk-run refused"                  "$refused" "${refuse[@]}" -- precision.sh 1
case_ "memory.sh: tk-run refused"                     "$refused" "${refuse[@]}" -- memory.sh
case_ "gpt-memory.sh: tk-run refused"                 "$refused" "${refuse[@]}" -- gpt-memory.sh 8 3
case_ "recompute.sh: tk-run refused"                 "$refused" "${refuse[@]}" -- recompute.sh 3 1 2
case_ "auto-batch.sh: tk-run refused"                 "$refused" "${refuse[@]}" -- auto-batch.sh 8 2 300MiB
case_ "instructions.sh: tk-run refused"               "$refused" "${refuse[@]}" -- instructions.sh mlp-small
case_ "ddp.sh: tk-run refused"                        "$refused" "${refuse[@]}" -- ddp.sh 1
case_ "gpt2.sh: tk-run refused"                       "$refused" "${refuse[@]}" -- gpt2.sh 2 1 1
case_ "precision.sh: 2nd tk-run refused (folder in use)" "holds another run" BUILD_DIR="$tmp/second-refused" -- precision.sh 1
case_ "overhead.sh: tk-run killed mid-run"            "ended by signal SIGKILL" TK_FAULT=metrics-written:10 -- overhead.sh 1 1
case_ "precision.sh: tk-run ends short, exit 0"       "holds 20 step records" TK_BENCH_EXTRA="--set run.steps=20" -- precision.sh 1
case_ "overhead.sh: the C++ loop fails"               "injected failure of tk-bench-loop" BUILD_DIR="$tmp/loop-fails" -- overhead.sh 1 1
case_ "overhead.sh: the Python loop fails"            "RuntimeError: injected failure of bench_loop.py" TK_BENCH_PYTHON="$tmp/python" -- overhead.sh 1 1
case_ "loop-gaps.sh: the C++ loop fails"              "injected failure of tk-bench-loop" BUILD_DIR="$tmp/loop-fails" -- loop-gaps.sh 1 1
case_ "loop-gaps.sh: THREADS x refused"               "THREADS must be an integer >= 0" -- loop-gaps.sh 1 x
case_ "recompute.sh: the Python loop fails"           "RuntimeError: injected failure of recompute_loop.py" TK_BENCH_PYTHON="$tmp/python" -- recompute.sh 3 1 2
case_ "gpt2.sh: the Python loop fails"                "RuntimeError: injected failure of gpt2_loop.py" TK_BENCH_PYTHON="$tmp/python" -- gpt2.sh 2 1 1
case_ "gpt2.sh: WARMUP not below STEPS"               "WARMUP (2) must be below STEPS (2)" -- gpt2.sh 2 1 2
case_ "gpt2.sh: LLMC_DIR without train_gpt2.c"        "holds no train_gpt2.c" LLMC_DIR="$tmp" -- gpt2.sh 2 1 1
case_ "vs-python.sh fashion: the Python loop fails"   "RuntimeError: injected failure of fashion_loop.py" TK_BENCH_PYTHON="$tmp/python" -- vs-python.sh fashion 1
case_ "build-time.sh: git clone fails"                "fatal: injected failure of git clone" PATH="$tmp/git-fails:$PATH" -- build-time.sh
case_ "overhead.sh: REPS 0 refused"                   "REPS must be an integer >= 1" -- overhead.sh 0
case_ "gpt-memory.sh: B not a multiple of 8"          "B must be a multiple of 8" -- gpt-memory.sh 12 3
case_ "instructions.sh: no workload x"               "no workload 'x'" -- instructions.sh x
case_ "recompute.sh: steps 2 refused"                 "steps must be an integer >= 3" -- recompute.sh 2

echo "$passed passed, $failed failed, $skipped skipped in $((SECONDS - t_all)) s"
[ "$failed" -eq 0 ] || exit 1
if [ "$passed" -eq 0 ]; then
  [ "$skipped" -gt 0 ] || { echo "check-fails-loudly: no case matches --only '$only' --except '$except'" >&2; exit 2; }
  echo "SKIPPED: every case that ran was skipped"
  exit 77
fi
