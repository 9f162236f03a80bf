#!/usr/bin/env bash
# Data parallel on this machine: 2 ranks (Gloo, loopback) on a model with 42 MB of float32
# gradients, c10d's Reducer with its default buckets (each launched as soon as its gradients are
# ready in the window's last backward) against the same reducer with one bucket for everything
# (launched when the last gradient is ready: the all-reduce after backward, as a post-backward
# sync does it), interleaved over rounds; and 1 process at the same global batch for scale.
#   bash bench/ddp.sh [ROUNDS]      (after tools/build.sh; ROUNDS default 3)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 1 ] || bench_usage "ddp.sh takes at most one argument, the number of rounds"
rounds=${1:-3}
bench_int ROUNDS "$rounds" 1
steps=25 warmup=5
cat >"$bench_work/ddp.toml" <<'TOML'
[run]
name = "bench-ddp"
seed = 0
steps = 25
threads = 0

[model]
name = "mlp"
hidden = [2048, 2048, 2048]
activation = "gelu"

[data]
name = "synthetic-classification"
samples = 4096
validation_samples = 0
features = 1024
classes = 10

[batch]
micro_batch = 32

[optimizer]
name = "sgd"
lr = 0.01
momentum = 0.9

[[plugins]]
name = "ddp"
TOML
sed '/^\[\[plugins\]\]/,$d' "$bench_work/ddp.toml" >"$bench_work/one.toml"

summary() {  # metrics.jsonl, one|two -> "ms_per_step backward_ms overlap_ms wait_ms boundary_ms buckets"
  /usr/bin/python3 - "$1" "$warmup" "$steps" "$2" <<'PY'
import json, statistics, sys
rows = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[1]))}
w, n, ranks = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ms = 1000 * (rows[n]["wall_time"] - rows[w]["wall_time"]) / (n - w)
if ranks == "one":
    print(f"{ms:.1f} - - - - -")
else:  # the ddp plugin's figures must be there: a 2-rank run without them did not reduce
    med = lambda k: statistics.median(rows[s][k] for s in range(w + 1, n + 1))
    print(f"{ms:.1f} {med('ddp_backward_ms'):.1f} {med('ddp_overlap_ms'):.1f} {med('ddp_wait_ms'):.1f} "
          f"{med('ddp_boundary_ms'):.2f} {rows[n]['ddp_buckets']:g}")
PY
}

echo "MLP 1024-2048x3-10 (42 MB of float32 gradients), SGD; global batch 64: 2 ranks x micro-batch 32, or 1 process x 64"
bench_cpu
echo "| round | configuration | buckets | ms / step | last backward (ms) | first launch to last (ms) | wait after last launch (ms) | boundary (ms) |"
echo "|---|---|---|---|---|---|---|---|"
declare -A total
for round in $(seq 1 "$rounds"); do
  for cfg in reducer post one; do
    case $cfg in
      reducer) bench_tk "$cfg-$round" "$steps" --nproc 2 "$bench_work/ddp.toml" --progress none --log-level warn
               label="reducer, default buckets (1 MiB, then 25 MiB)" ;;
      post) bench_tk "$cfg-$round" "$steps" --nproc 2 "$bench_work/ddp.toml" --progress none --log-level warn \
              --set plugins.ddp.bucket_mb=1e6 --set plugins.ddp.first_bucket_mb=1e6
            label="one bucket: all-reduce after backward" ;;
      one) bench_tk "$cfg-$round" "$steps" "$bench_work/one.toml" --progress none --log-level warn \
             --set batch.micro_batch=64
           label="1 process, micro-batch 64" ;;
    esac
    read -r ms bwd overlap wait boundary buckets <<<"$(summary "$tk_dir/metrics.jsonl" "$([ $cfg = one ] && echo one || echo two)")"
    total[$cfg]=$(/usr/bin/python3 -c "print(${total[$cfg]:-0} + $ms)")
    echo "| $round | $label | $buckets | $ms | $bwd | $overlap | $wait | $boundary |"
  done
done
/usr/bin/python3 - "${total[reducer]}" "${total[post]}" "${total[one]}" <<'PY'
import sys
r, p, o = map(float, sys.argv[1:])
print(f"\nover all rounds: one bucket after backward / reducer = {p / r:.3f} (ms per step); "
      f"2 ranks with the reducer / 1 process = {r / o:.3f}")
PY
