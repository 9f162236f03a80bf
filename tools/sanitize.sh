#!/usr/bin/env bash
# Builds trainkit with AddressSanitizer and UndefinedBehaviorSanitizer into build-asan/ (or
# $BUILD_DIR) and runs the test suite under them. Any report fails the run. The suppressions in
# tools/sanitize/ cover LibTorch's own code only, each with the reason.
#   bash tools/sanitize.sh [ctest arguments, e.g. -R core]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build-asan}"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
bash "$root/tools/setup.sh"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-time_macros,include_file_mtime,include_file_ctime}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTK_USE_PCH=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build"
# LibTorch is not built with the sanitizers: their runtimes must be loaded first, so every
# process the tests start (tk-run, the test programs) preloads them.
asan_lib="$(g++ -print-file-name=libasan.so)"
ubsan_lib="$(g++ -print-file-name=libubsan.so)"
# Leaks: LibTorch and its thread pools keep allocations for the process's life by design.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/tools/sanitize/ubsan.supp"
# The SDK test (-E sdk) builds projects outside this tree with their own flags.
LD_PRELOAD="$asan_lib:$ubsan_lib" ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 1800 -E "^sdk$" "$@"
