#!/usr/bin/env bash
# micro_batch = "auto" on the GPT: for each memory budget, the micro-batch picked for an effective
# batch of B, the trial's measured peak, and the peak the training steps really reached (the
# step_peak_mib of every metrics record: tensor memory counted at LibTorch's CPU allocator, with
# the parameters and buffers), next to the process's peak RSS and the time per optimizer step.
#   bash bench/auto-batch.sh [B] [steps] [budget...]   (after tools/build.sh; default 64, 4, 300MiB 600MiB 1.2GiB)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
B="${1:-64}"
steps="${2:-4}"
bench_int B "$B" 1
bench_int steps "$steps" 2  # the time per step is taken over steps 1..steps
shift $(( $# < 2 ? $# : 2 ))
budgets=("$@")
[ ${#budgets[@]} -gt 0 ] || budgets=(300MiB 600MiB 1.2GiB)
model=(--set model.layers=4 --set model.width=256 --set model.heads=8 --set data.seq_len=256)
echo "GPT 4 layers x 256 wide, 8 heads, 256-token sequences, AdamW; effective batch $B; $steps steps per budget"
bench_cpu
echo "| budget | picked | trial peak (MiB) | steps' peak reached (MiB) | reached / budget | peak RSS (MiB) | s / step |"
echo "|---|---|---|---|---|---|---|"
for budget in "${budgets[@]}"; do
  bench_tk "budget-$budget" "$steps" "$bench_root/recipes/gpt-tiny.toml" --progress none "${model[@]}" \
    --set run.epochs=0 --set run.steps="$steps" --set run.validate_every=0 --set data.validation_fraction=0.0 \
    --set batch.micro_batch=auto --set batch.accumulation=0 --set batch.effective_batch="$B" \
    --set batch.memory_budget="\"$budget\"" --set run.measure_memory=true
  trial=$(sed -n 's/.*a step.s peak \([0-9.]*\) \(MiB\|GiB\).*/\1 \2/p' "$tk_err")
  [ "$(wc -l <<<"$trial")" -eq 1 ] && [ -n "$trial" ] ||
    bench_die "tk-run (budget $budget) did not report the trial's peak once ('a step's peak N MiB'); its stderr:" "$tk_err"
  /usr/bin/python3 - "$tk_dir/metrics.jsonl" "$budget" "$trial" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
value, unit = sys.argv[3].split()
trial = float(value) * (1024 if unit == "GiB" else 1)
reached = max(r["step_peak_mib"] for r in rows)
budget = rows[0]["memory_budget_mib"]
per_step = (rows[-1]["wall_time"] - rows[0]["wall_time"]) / max(1, len(rows) - 1)
r = rows[-1]
print(f"| {sys.argv[2]} | {r['micro_batch']} x {r['micro_batches']} | {trial:.0f} | {reached:.0f} | "
      f"{reached / budget:.2f} | {max(x['peak_rss_mib'] for x in rows):.0f} | {per_step:.1f} |")
PY
done
