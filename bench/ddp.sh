#!/usr/bin/env bash
# Data parallel on this machine: 2 ranks (Gloo, loopback) vs 1 process at the same global batch,
# for k = 1, 4, 8 micro-batches per step, and what syncing once per window saves over syncing
# once per micro-batch (which would cost k all-reduces of the same gradient per step).
#   bash bench/ddp.sh              (after tools/build.sh)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BUILD_DIR:-$root/build}/bin"
out=$(mktemp -d)
steps=120 warmup=20
{ sed -e 's/^steps = 300/steps = 120/' "$root/bench/overhead.toml"
  printf '\n[[plugins]]\nname = "ddp"\n'; } >"$out/ddp.toml"
sed -e 's/^steps = 300/steps = 120/' "$root/bench/overhead.toml" >"$out/one.toml"

summary() {  # metrics.jsonl -> "ms_per_step sync_ms_median"
  /usr/bin/python3 - "$1" "$warmup" "$steps" <<'PY'
import json, statistics, sys
rows = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[1]))}
w, n = int(sys.argv[2]), int(sys.argv[3])
sync = [rows[s].get("ddp_sync_ms", 0.0) for s in range(w + 1, n + 1)]
print(f"{1000 * (rows[n]['wall_time'] - rows[w]['wall_time']) / (n - w):.2f} {statistics.median(sync):.3f}")
PY
}

echo "MLP 256-512-512-10 (AdamW), global batch 128 x k; 2 ranks: micro-batch 64 each; 1 process: micro-batch 128"
echo "| k | 1 process ms/step | 2 ranks ms/step | all-reduce ms per sync | syncs per step | per-micro-batch syncing would add (ms/step) |"
echo "|---|---|---|---|---|---|"
for k in 1 4 8; do
  "$bin/tk-run" "$out/one.toml" --progress none --log-level warn --set data.micro_batch=128 \
    --set plugins.grad_accum.steps="$k" --set run.output="$out/one" >/dev/null
  read -r one_ms _ < <(summary "$out/one/metrics.jsonl")
  "$bin/tk-run" --nproc 2 "$out/ddp.toml" --progress none --log-level warn \
    --set plugins.grad_accum.steps="$k" --set run.output="$out/two" >/dev/null 2>&1
  read -r two_ms sync_ms < <(summary "$out/two/metrics.jsonl")
  extra=$(/usr/bin/python3 -c "print(f'{($k - 1) * $sync_ms:.2f}')")
  echo "| $k | $one_ms | $two_ms | $sync_ms | 1 | $extra |"
done
rm -rf "$out"
