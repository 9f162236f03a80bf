#!/usr/bin/env bash
# Time per optimizer step with bf16 autocast vs fp32, same model and data (bench/overhead.toml),
# interleaved REPS times. On CUDA builds the same script measures the GPU (run.device = auto).
#   bash bench/precision.sh [REPS]         (after tools/build.sh)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${BUILD_DIR:-$root/build}/bin"
reps=${1:-5}
steps=300 warmup=50
out=$(mktemp -d)
cp "$root/bench/overhead.toml" "$out/fp32.toml"
{ cat "$root/bench/overhead.toml"; printf '\n[[plugins]]\nname = "mixed_precision"\ndtype = "bf16"\n'; } >"$out/bf16.toml"

ms() {  # recipe
  "$bin/tk-run" "$1" --progress none --log-level warn --set run.output="$out/run" >/dev/null
  /usr/bin/python3 - "$out/run/metrics.jsonl" "$warmup" "$steps" <<'PY'
import json, sys
t = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[1]))}
w, n = int(sys.argv[2]), int(sys.argv[3])
print(f"{1000 * (t[n]['wall_time'] - t[w]['wall_time']) / (n - w):.4f} {t[n]['loss']:.4f}")
PY
}
for i in $(seq "$reps"); do
  echo "fp32 $(ms "$out/fp32.toml")" >>"$out/times"
  echo "bf16 $(ms "$out/bf16.toml")" >>"$out/times"
done
/usr/bin/python3 - "$out/times" "$reps" <<'PY'
import statistics, sys
t, loss = {}, {}
for line in open(sys.argv[1]):
    k, ms, l = line.split()
    t.setdefault(k, []).append(float(ms))
    loss[k] = float(l)
print(f"MLP 256-512-512-10, micro-batch 64 x 4 accumulation, AdamW, {sys.argv[2]} interleaved runs each")
print("| precision | median ms/step | all runs | loss at step 300 | vs fp32 |")
print("|---|---|---|---|---|")
for k in ("fp32", "bf16"):
    m = statistics.median(t[k])
    print(f"| {k} | {m:.2f} | {', '.join(f'{v:.2f}' for v in t[k])} | {loss[k]:.4f} | "
          f"{m / statistics.median(t['fp32']):.2f} |")
PY
rm -rf "$out"
