#!/usr/bin/env bash
# Installs the Debian packages (tools/setup.sh) and builds trainkit into build/ (or $BUILD_DIR).
# TK_BUILD_TARGETS limits the build to some targets (tools/run.sh builds only tk-run and plugins).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
bash "$root/tools/setup.sh"
# ccache may reuse objects compiled against the precompiled LibTorch headers (CMake passes them
# with -include, which ccache supports given this sloppiness), and across clones of the tree.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TK_CMAKE_ARGS:-} >/dev/null
targets=()
for t in ${TK_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" "${targets[@]}"
