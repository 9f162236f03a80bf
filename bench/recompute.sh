#!/usr/bin/env bash
# Recomputation on the GPT of bench/gpt-memory.sh (4 blocks x 256 wide, 8 heads, 256-token
# sequences, AdamW): each step's peak memory (step_peak_mib, every allocation counted) and time per
# step with no block, every other block and every block recomputed, at micro-batches 8, 16 and 32
# (one micro-batch per step). The activations are the step's peak less the parameters, their
# gradients and AdamW's two moments (16 bytes a parameter). Recomputation changes no step, so the
# losses of the three runs at one micro-batch must be equal; the script stops if they are not.
# Next to each run, the same step written by hand in Python with PyTorch's own recomputation
# (torch.utils.checkpoint, bench/recompute_loop.py), run right after it: its time per step, and
# the share of its step that forward takes (what one more forward of every block costs).
#   bash bench/recompute.sh [steps] [micro-batches...]   (after tools/build.sh; default 6 steps, 8 16 32)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
steps="${1:-6}"
bench_int steps "$steps" 3  # the time per step is taken over steps 2..steps
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(8 16 32)
for m in "${sizes[@]}"; do bench_int micro-batch "$m" 1; done

# The recipes: gpt-tiny's data and optimizer; no recomputation, every other block, every block.
recipes="$(bench_fresh recipes)"
cp "$bench_root/recipes/gpt-tiny.toml" "$recipes/none.toml"
printf '\n[[plugins]]\nname = "recompute"\nevery = 2\n' | cat "$recipes/none.toml" - >"$recipes/half.toml"
printf '\n[[plugins]]\nname = "recompute"\n' | cat "$recipes/none.toml" - >"$recipes/all.toml"
model=(--set model.layers=4 --set model.width=256 --set model.heads=8 --set data.seq_len=256)

echo "GPT 4 blocks x 256 wide, 8 heads, 256-token sequences (fortunes, padded documents), AdamW, $steps steps of one micro-batch"
bench_cpu python
echo "| micro-batch | blocks recomputed | step peak (MiB) | activations (MiB) | activations vs none | ms / step | vs none | Python checkpoint ms / step | vs none | Python forward share |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for m in "${sizes[@]}"; do
  rows=() py=()
  every=(0 2 1)
  for kind in none half all; do
    bench_tk "$kind-$m" "$steps" "$recipes/$kind.toml" --progress none --log-level warn "${model[@]}" \
      --set run.epochs=0 --set run.steps="$steps" --set run.validate_every=0 --set data.validation_fraction=0.0 \
      --set data.micro_batch="$m" --set plugins.grad_accum.steps=1 --set run.measure_memory=true
    rows+=("$tk_dir")
    bench_cmd "python-$kind-$m" ms_per_step "$bench_python" "$bench_root/bench/recompute_loop.py" 4 256 8 256 "$m" \
      "$steps" 1 "${every[${#py[@]}]}"
    py+=("$cmd_value:$(awk '/forward_ms/ {print $2}' "$cmd_out"):$(awk '/backward_ms/ {print $2}' "$cmd_out")")
  done
  "$bench_python" - "$m" "${rows[@]}" "${py[@]}" <<'PY' || bench_die "the runs at micro-batch $m disagree (see above)"
import json, sys, torch
m, dirs, py = sys.argv[1], sys.argv[2:5], [[float(v) for v in a.split(":")] for a in sys.argv[5:8]]
labels = ["none", "every other (2 of 4)", "all 4"]
params = sum(t.numel() for t in torch.load(f"{dirs[0]}/weights.pt").values())
state_mib = 16 * params / 2**20
runs = []
for d in dirs:
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    peak = max(r["step_peak_mib"] for r in rows[1:])
    ms = 1000 * (rows[-1]["wall_time"] - rows[0]["wall_time"]) / (len(rows) - 1)
    runs.append((peak, peak - state_mib, ms, [r["loss"] for r in rows]))
for label, (peak, act, ms, losses), (pms, pf, pb) in zip(labels, runs, py):
    print(f"| {m} | {label} | {peak:.0f} | {act:.0f} | {act / runs[0][1]:.2f}x | {ms:.0f} | {ms / runs[0][2]:.2f}x "
          f"| {pms:.0f} | {pms / py[0][0]:.2f}x | {pf / pms:.0%} |")
if any(r[3] != runs[0][3] for r in runs):
    print(f"bench: the losses differ with recomputation at micro-batch {m}: {[r[3] for r in runs]}", file=sys.stderr)
    sys.exit(1)
PY
done
echo "(parameters, gradients and AdamW's moments: 16 bytes x the model's parameters, subtracted from each peak)"
