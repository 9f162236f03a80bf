#!/usr/bin/env bash
# Cold and warm build times on this machine, in a fresh clone with a ccache of its own:
#   1. what tools/run.sh builds (tk-run and the plugins), cold (empty cache) and warm (build folder
#      deleted, cache kept: what a second clone or a clean rebuild costs);
#   2. the whole build with the tests (tools/test.sh's build), cold and warm.
#   bash bench/build-time.sh [WORK_DIR]   (after tools/setup.sh; without WORK_DIR, a temporary one, removed at the end)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 1 ] || bench_usage "build-time.sh takes one argument at most"
work="${1:-$bench_work}"
rm -rf "$work/clone" "$work/ccache"; mkdir -p "$work"
bench_checked "git clone" "$work/clone.log" git clone -q "$bench_root" "$work/clone"
export CCACHE_DIR="$work/ccache"
secs() {  # VAR CMD...: runs CMD (its output in $work/last.log), puts its seconds in VAR; a failed build stops the script
  local t0=$SECONDS
  bench_checked "the build ($2)" "$work/last.log" "${@:3}"
  printf -v "$1" '%d' $((SECONDS - t0))
}
build() { BUILD_DIR="$work/clone/build" TK_BUILD_TARGETS="$1" bash "$work/clone/tools/build.sh"; }
hits() { ccache -s 2>/dev/null | grep -E "^ *(Hits|cache hit \(direct\)|cache hit \(preprocessed\))" | tr -s ' ' | head -2 | paste -sd';' || true; }

secs run_cold "tk-run + plugins, cold" build "tk-run tk_plugins"; rm -rf "$work/clone/build"; ccache -z > /dev/null
secs run_warm "tk-run + plugins, warm" build "tk-run tk_plugins"; run_hits=$(hits)
rm -rf "$work/clone/build" "$CCACHE_DIR"
secs all_cold "everything, cold" build ""; rm -rf "$work/clone/build"; ccache -z > /dev/null
secs all_warm "everything, warm" build ""; all_hits=$(hits)
echo "build times on $(nproc) cores, ccache $(ccache --version | head -1 | awk '{print $3}')"
bench_bin="$work/clone/build/bin" bench_cpu
printf '| build | cold (empty ccache) | warm (ccache kept, build folder new) | warm-build ccache |\n|---|---|---|---|\n'
printf '| tools/run.sh: tk-run + plugins | %d s | %d s | %s |\n' "$run_cold" "$run_warm" "$run_hits"
printf '| tools/test.sh: everything, tests included | %d s | %d s | %s |\n' "$all_cold" "$all_warm" "$all_hits"
