#!/usr/bin/env bash
# Peak resident memory and time per step of an activation-heavy model: batch 128 in one piece,
# 4 x 32 with gradient accumulation, and 32 alone. Accumulation should cost about what 32 costs.
#   bash bench/memory.sh          (after tools/build.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -eq 0 ] || bench_usage "memory.sh takes no arguments"
steps=12  # bench/memory.toml's run.steps
run() {  # label, micro_batch, k
  bench_tk "$1" "$steps" "$bench_root/bench/memory.toml" --progress none --log-level warn \
    --set batch.micro_batch="$2" --set batch.accumulation="$3"
  /usr/bin/python3 - "$tk_dir/metrics.jsonl" "$1" "$2" "$3" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * (rows[-1]["wall_time"] - rows[1]["wall_time"]) / (len(rows) - 2)
print(f"| {sys.argv[2]} | {sys.argv[3]} x {sys.argv[4]} | {rows[-1]['peak_rss_mib']:.0f} | {ms:.0f} | "
      f"{rows[0]['loss']:.4f} | {rows[-1]['loss']:.4f} |")
PY
}
echo "MLP 64-1024x4-16 on every position of 128-long sequences, AdamW, normalize = tokens, 12 steps"
bench_cpu
echo "| configuration | micro-batch x k | peak RSS (MiB) | ms / optimizer step | loss step 1 | loss step 12 |"
echo "|---|---|---|---|---|---|"
run "batch 128" 128 1
run "4 x 32 accumulated" 32 4
run "batch 32" 32 1
