#!/usr/bin/env bash
# The memory story of gradient accumulation on the GPT: peak resident memory and time per
# optimizer step at batch B in one piece, (B/4) x 4 and (B/8) x 8 accumulated, and B/8 alone.
# The accumulated runs take the same optimizer steps as batch B, so their losses must agree.
#   bash bench/gpt-memory.sh [B] [steps]      (after tools/build.sh; default B = 64, 8 steps; B a multiple of 8, steps >= 3)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
B="${1:-64}"
steps="${2:-8}"
bench_int B "$B" 8
[ $((B % 8)) -eq 0 ] || bench_usage "B must be a multiple of 8 (it is split 4 and 8 ways), got $B"
bench_int steps "$steps" 3  # the time per step is taken over steps 2..steps
model=(--set model.layers=4 --set model.width=256 --set model.heads=8 --set data.seq_len=256)
run() {  # label, micro_batch, k
  bench_tk "$1" "$steps" "$bench_root/recipes/gpt-tiny.toml" --progress none --log-level warn \
    "${model[@]}" --set run.epochs=0 --set run.steps="$steps" --set run.validate_every=0 --set data.validation_fraction=0.0 \
    --set batch.micro_batch="$2" --set batch.accumulation="$3"
  /usr/bin/python3 - "$tk_dir/metrics.jsonl" "$1" "$2" "$3" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * (rows[-1]["wall_time"] - rows[1]["wall_time"]) / (len(rows) - 2)
losses = ", ".join(f"{r['loss']:.4f}" for r in rows)
print(f"| {sys.argv[2]} | {sys.argv[3]} x {sys.argv[4]} | {rows[-1]['peak_rss_mib']:.0f} | {ms:.0f} | {losses} |")
PY
}
echo "GPT 4 layers x 256 wide, 8 heads, 256-token sequences (fortunes, padded documents), AdamW, normalize = tokens, $steps steps"
bench_cpu
echo "| configuration | micro-batch x k | peak RSS (MiB) | ms / optimizer step | loss at each step |"
echo "|---|---|---|---|---|"
run "batch $B" "$B" 1
run "$((B / 4)) x 4 accumulated" "$((B / 4))" 4
run "$((B / 8)) x 8 accumulated" "$((B / 8))" 8
run "batch $((B / 8)) alone" "$((B / 8))" 1
