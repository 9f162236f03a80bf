#!/usr/bin/env bash
# Installs the Debian packages (tools/setup.sh) and builds trainkit into build/ (or $BUILD_DIR).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
bash "$root/tools/setup.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TK_CMAKE_ARGS:-} >/dev/null
cmake --build "$build"
