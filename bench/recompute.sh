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
# The peaks come from one run of each with every allocation counted (run.measure_memory); the times
# from REPS more, interleaved, without the counting (median and best).
#   bash bench/recompute.sh [STEPS] [REPS] [MICRO_BATCH...]   (after tools/build.sh; default 6 steps, 3 runs, 8 16 32)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
steps="${1:-6}"
bench_int steps "$steps" 3  # the time per step is taken over steps 2..steps
reps="${2:-3}"
bench_int REPS "$reps" 1
shift $(($# > 2 ? 2 : $#))
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
echo "| micro-batch | blocks recomputed | step peak (MiB) | activations (MiB) | activations vs none | ms / step (median, best) | vs none (median, best) | Python checkpoint ms / step (median) | vs none | Python forward share |"
echo "|---|---|---|---|---|---|---|---|---|---|"
run_tk() {  # KIND MICRO_BATCH NAME ARG...
  local kind=$1 m=$2 name=$3
  shift 3
  bench_tk "$name" "$steps" "$recipes/$kind.toml" --progress none --log-level warn "${model[@]}" \
    --set run.epochs=0 --set run.steps="$steps" --set run.validate_every=0 --set data.validation_fraction=0.0 \
    --set batch.micro_batch="$m" --set batch.accumulation=1 "$@"
}
for m in "${sizes[@]}"; do
  memory=() times="$bench_work/times-$m"
  every=(0 2 1)
  for kind in none half all; do
    run_tk "$kind" "$m" "memory-$kind-$m" --set run.measure_memory=true
    memory+=("$tk_dir")
  done
  for r in $(seq "$reps"); do
    for i in 0 1 2; do
      kind=$(echo none half all | cut -d' ' -f$((i + 1)))
      run_tk "$kind" "$m" "time-$kind-$m-$r"
      ms=$(/usr/bin/python3 "$bench_root/bench/step_ms.py" "$tk_dir/metrics.jsonl" 1 "$steps")
      echo "tk $i $ms" >>"$times"
      bench_cmd "python-$kind-$m" ms_per_step "$bench_python" "$bench_root/bench/recompute_loop.py" 4 256 8 256 "$m" \
        "$steps" 1 "${every[$i]}"
      forward=$(awk '/forward_ms/ {print $2}' "$cmd_out")
      [ -n "$forward" ] || bench_die "recompute_loop.py printed no forward_ms; its stdout:" "$cmd_out"
      echo "py $i $cmd_value $forward" >>"$times"
    done
  done
  "$bench_python" - "$m" "$times" "${memory[@]}" <<'PY' || bench_die "the runs at micro-batch $m disagree (see above)"
import json, statistics, sys, torch
m, times, dirs = sys.argv[1], sys.argv[2], sys.argv[3:6]
labels = ["none", "every other (2 of 4)", "all 4"]
params = sum(t.numel() for t in torch.load(f"{dirs[0]}/weights.pt").values())
state_mib = 16 * params / 2**20
tk, py, fwd = [[], [], []], [[], [], []], [[], [], []]
for line in open(times):
    words = line.split()
    i = int(words[1])
    (tk if words[0] == "tk" else py)[i].append(float(words[2]))
    if words[0] == "py":
        fwd[i].append(float(words[3]) / float(words[2]))
peaks, losses = [], []
for d in dirs:
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    peaks.append(max(r["step_peak_mib"] for r in rows[1:]))
    losses.append([r["loss"] for r in rows])
med = [statistics.median(v) for v in tk]
best = [min(v) for v in tk]
pmed = [statistics.median(v) for v in py]
for i, label in enumerate(labels):
    act, act0 = peaks[i] - state_mib, peaks[0] - state_mib
    print(f"| {m} | {label} | {peaks[i]:.0f} | {act:.0f} | {act / act0:.2f}x | {med[i]:.0f}, {best[i]:.0f} | "
          f"{med[i] / med[0]:.2f}x, {best[i] / best[0]:.2f}x | {pmed[i]:.0f} | {pmed[i] / pmed[0]:.2f}x | "
          f"{statistics.median(fwd[i]):.0%} |")
if any(l != losses[0] for l in losses):
    print(f"bench: the losses differ with recomputation at micro-batch {m}: {losses}", file=sys.stderr)
    sys.exit(1)
PY
done
echo "(parameters, gradients and AdamW's moments: 16 bytes x the model's parameters, subtracted from each peak)"
