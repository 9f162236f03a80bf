#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test suite.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
start=$(date +%s)
bash "$root/tools/build.sh"
# A hung test fails after 15 minutes instead of holding the run.
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900
echo "tools/test.sh: build and tests took $(( $(date +%s) - start ))s"
