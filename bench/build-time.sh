#!/usr/bin/env bash
# Cold and warm build times on this machine, in a fresh clone with a ccache of its own:
#   1. what tools/run.sh builds (tk-run and the plugins), cold (empty cache) and warm (build folder
#      deleted, cache kept: what a second clone or a clean rebuild costs);
#   2. the whole build with the tests (tools/test.sh's build), cold and warm.
#   bash bench/build-time.sh [WORK_DIR]   (after tools/setup.sh)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
rm -rf "$work/clone" "$work/ccache"; mkdir -p "$work"
git clone -q "$root" "$work/clone"
export CCACHE_DIR="$work/ccache"
secs() { local t0=$SECONDS; "$@" > "$work/last.log" 2>&1; echo $((SECONDS - t0)); }
build() { BUILD_DIR="$work/clone/build" TK_BUILD_TARGETS="$1" bash "$work/clone/tools/build.sh"; }
hits() { ccache -s 2>/dev/null | grep -E "^ *(Hits|cache hit \(direct\)|cache hit \(preprocessed\))" | tr -s ' ' | head -2 | paste -sd';'; }

run_cold=$(secs build "tk-run tk_plugins"); rm -rf "$work/clone/build"; ccache -z > /dev/null
run_warm=$(secs build "tk-run tk_plugins"); run_hits=$(hits)
rm -rf "$work/clone/build" "$CCACHE_DIR"
all_cold=$(secs build ""); rm -rf "$work/clone/build"; ccache -z > /dev/null
all_warm=$(secs build ""); all_hits=$(hits)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "build times on $(nproc) cores ($cpu), ccache $(ccache --version | head -1 | awk '{print $3}')"
printf '| build | cold (empty ccache) | warm (ccache kept, build folder new) | warm-build ccache |\n|---|---|---|---|\n'
printf '| tools/run.sh: tk-run + plugins | %d s | %d s | %s |\n' "$run_cold" "$run_warm" "$run_hits"
printf '| tools/test.sh: everything, tests included | %d s | %d s | %s |\n' "$all_cold" "$all_warm" "$all_hits"
