#!/usr/bin/env bash
# Data parallel on this machine: 2 ranks (Gloo, loopback) vs 1 process at the same global batch,
# for k = 1, 4, 8 micro-batches per step, and what syncing once per window saves over syncing
# once per micro-batch (which would cost k all-reduces of the same gradient per step).
#   bash bench/ddp.sh              (after tools/build.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -eq 0 ] || bench_usage "ddp.sh takes no arguments"
steps=120 warmup=20
{ cat "$bench_root/bench/overhead.toml"; printf '\n[[plugins]]\nname = "ddp"\n'; } >"$bench_work/ddp.toml"

summary() {  # metrics.jsonl, one|two -> "ms_per_step sync_ms_median syncs_per_step"
  /usr/bin/python3 - "$1" "$warmup" "$steps" "$2" <<'PY'
import json, statistics, sys
rows = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[1]))}
w, n, ranks = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ms = 1000 * (rows[n]['wall_time'] - rows[w]['wall_time']) / (n - w)
if ranks == "one":
    print(f"{ms:.2f} - -")
else:  # the ddp plugin's metrics must be there: a 2-rank run without them did not sync
    sync = [rows[s]["ddp_sync_ms"] for s in range(w + 1, n + 1)]
    per_step = (rows[n]["ddp_syncs"] - rows[w]["ddp_syncs"]) / (n - w)
    print(f"{ms:.2f} {statistics.median(sync):.3f} {per_step:g}")
PY
}

echo "MLP 256-512-512-10 (AdamW), global batch 128 x k; 2 ranks: micro-batch 64 each; 1 process: micro-batch 128"
bench_cpu
echo "| k | 1 process ms/step | 2 ranks ms/step | all-reduce ms per sync | syncs per step | per-micro-batch syncing would add (ms/step) |"
echo "|---|---|---|---|---|---|"
for k in 1 4 8; do
  bench_tk "one-k$k" "$steps" "$bench_root/bench/overhead.toml" --progress none --log-level warn \
    --set run.steps=$steps --set data.micro_batch=128 --set plugins.grad_accum.steps="$k"
  one=$(summary "$tk_dir/metrics.jsonl" one)
  bench_tk "two-k$k" "$steps" --nproc 2 "$bench_work/ddp.toml" --progress none --log-level warn \
    --set run.steps=$steps --set plugins.grad_accum.steps="$k"
  two=$(summary "$tk_dir/metrics.jsonl" two)
  read -r one_ms _ _ <<<"$one"
  read -r two_ms sync_ms syncs <<<"$two"
  extra=$(/usr/bin/python3 -c "print(f'{($k - $syncs) * $sync_ms:.2f}')")
  echo "| $k | $one_ms | $two_ms | $sync_ms | $syncs | $extra |"
done
