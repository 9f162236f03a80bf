#!/usr/bin/env bash
# The report in docs/: recipes/fashion-mnist.toml trained as 4 micro-batches of 32 per step and as
# one batch of 128, the two runs in one report, and a screenshot of it in headless Chromium.
#   bash tools/report-example.sh [OUT_DIR]   (default: runs/report-example; writes docs/report.png)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="${1:-runs/report-example}"
TK_BUILD_TARGETS="tk-run tk-report tk_plugins" bash "$root/tools/build.sh"
"$build/bin/tk-run" "$root/recipes/fashion-mnist.toml" --overwrite --progress plain \
  --set run.output="$out/accumulated-4x32"
"$build/bin/tk-run" "$root/recipes/fashion-mnist.toml" --overwrite --progress plain \
  --set run.output="$out/one-batch-128" --set batch.accumulation=1 --set batch.micro_batch=128
"$build/bin/tk-report" "$out/accumulated-4x32" "$out/one-batch-128" -o "$out/report.html"
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --hide-scrollbars \
  --window-size=1400,1900 --screenshot="$root/docs/report.png" "file://$(realpath "$out/report.html")"
echo "screenshot: docs/report.png (of $out/report.html)"
