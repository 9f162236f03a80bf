#!/usr/bin/env bash
# The optimizer state, the gradients and the parameters under data parallel, whole on every rank
# (ddp) and sharded (the shard plugin at stages 1, 2 and 3): the GPT of bench/gpt-memory.sh (4
# layers x 256) with AdamW on 1, 2 and 4 ranks (Gloo, loopback). Per configuration: the optimizer
# state, the gradients and the parameters rank 0 holds at the step (optimizer_state_mib, grad_mib,
# param_mib), their bytes per parameter of the model next to ZeRO's figures for float32 AdamW (16,
# 8 + 8/N, 4 + 12/N, 16/N; each share is within one largest tensor of 1/N), at stage 3 the time
# rank 0 spends starting and waiting for parameter gathers, with prefetch and without it
# (3-late), the bytes it received, also with the parameters gathered in bf16 (3-bf16:
# gather_dtype, rounded weights on every rank), and the most parameter memory it held at once in a
# step (shard_param_peak_mib: its share and the blocks gathered), the largest share any rank updates
# (from each rank's log), rank 0's peak of tensor memory in a step (step_peak_mib: 2 micro-batches
# a step, stage 2 summing after each backward) and its peak resident memory, time per step, and
# whether the sharded
# run's losses equal the unsharded one's (stage 1: bit for bit; stages 2 and 3 sum in another
# order: to 1e-5, float32; 3-bf16 computes with rounded weights: to 1e-2).
#   bash bench/zero.sh [STEPS]      (after tools/build.sh; STEPS default 6, at least 3)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 1 ] || bench_usage "zero.sh takes at most one argument, the number of steps"
steps=${1:-6}
bench_int STEPS "$steps" 3
model=(--set model.layers=4 --set model.width=256 --set model.heads=8 --set data.seq_len=128
       --set run.epochs=0 --set run.steps="$steps" --set run.validate_every=0 --set data.validation_fraction=0.0
       --set batch.micro_batch=4 --set batch.accumulation=2 --set run.checkpoint_every=0 --set run.measure_memory=true)
sed '/^\[\[plugins\]\]/,$d' "$bench_root/recipes/gpt-tiny.toml" >"$bench_work/gpt.toml"
printf '[[plugins]]\nname = "grad_accum"\nnormalize = "tokens"\n[[plugins]]\nname = "ddp"\n[[plugins]]\nname = "shard"\n' >>"$bench_work/gpt.toml"

summary() {  # metrics.jsonl, the run's stdout+stderr, ranks, zero stage -> a table row's figures
  /usr/bin/python3 - "$@" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
log = open(sys.argv[2]).read()
ranks, stage = int(sys.argv[3]), int(sys.argv[4])
ms = 1000 * (rows[-1]["wall_time"] - rows[1]["wall_time"]) / (len(rows) - 2)
state = rows[-1].get("optimizer_state_mib")
grads = rows[-1].get("grad_mib")
params = rows[-1].get("param_mib")
if state is None or grads is None or params is None:
    sys.exit("no optimizer_state_mib, grad_mib or param_mib in the records")
shares = [int(m) / 2**20 for m in re.findall(r"this rank updates \d+ of \d+ tensors \((\d+) of", log)]
if stage >= 1 and len(shares) != ranks:
    sys.exit(f"expected {ranks} sharding lines in the log, found {len(shares)}")
largest = f"{2 * max(shares):.2f}" if shares else f"{state:.2f}"
losses = ",".join(f"{r['loss']:.10f}" for r in rows)
gathers = [r["shard_param_gather_ms"] for r in rows[1:] if "shard_param_gather_ms" in r]
gather_ms = f"{sum(gathers) / len(gathers):.1f}" if gathers else "-"
received = [r["shard_param_gather_mib"] for r in rows[1:] if "shard_param_gather_mib" in r]
gather_mib = f"{sum(received) / len(received):.2f}" if received else "-"
held = [r["shard_param_peak_mib"] for r in rows[1:] if "shard_param_peak_mib" in r]
held_mib = f"{max(held):.2f}" if held else "-"
print(f"{state:.2f} {grads:.2f} {params:.2f} {largest} {max(r['step_peak_mib'] for r in rows[1:]):.1f} {rows[-1]['peak_rss_mib']:.0f} {ms:.0f} {gather_ms} {gather_mib} {held_mib} {losses}")
PY
}

losses_close() {  # losses A, losses B (comma-separated), relative tolerance -> whether each pair is within it
  /usr/bin/python3 -c "import sys; a, b = ([float(x) for x in s.split(',')] for s in sys.argv[1:3]); sys.exit(any(abs(x - y) > float(sys.argv[3]) * max(1, abs(y)) for x, y in zip(a, b)))" "$@"
}

echo "GPT 4 layers x 256, 8 heads, 128-token sequences (fortunes, bytes), AdamW (float32 state), micro-batch 4 x 2 per rank, $steps steps"
bench_cpu
echo "| ranks | stage | optimizer state, rank 0 (MiB) | gradients at the step, rank 0 (MiB) | parameters at the step, rank 0 (MiB) | bytes / parameter, rank 0 (ZeRO's) | largest rank's state (MiB) | total / ranks (MiB) | step's tensor peak, rank 0 (MiB) | peak RSS, rank 0 (MiB) | ms / step | gathers' ms / step (rank 0) | gathered MiB / step (rank 0) | parameters held at most, rank 0 (MiB) | losses equal |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
declare -A whole
model_mib=""
for ranks in 1 2 4; do
  for config in 0 1 2 3 3-late 3-bf16; do  # 3-late: stage 3 without prefetch; 3-bf16: gathered in bf16
    stage=${config%%-*}
    args=("$bench_work/gpt.toml" --progress none --log-level info "${model[@]}" --set plugins.shard.stage="$stage")
    if [ "$config" = 3-late ]; then args+=(--set plugins.shard.prefetch=false); fi
    if [ "$config" = 3-bf16 ]; then args+=(--set 'plugins.shard.gather_dtype="bf16"'); fi
    if [ "$ranks" -gt 1 ]; then args+=(--nproc "$ranks"); fi
    bench_tk "r$ranks-z$config" "$steps" "${args[@]}"
    cat "$tk_out" "$tk_err" >"$bench_work/log-$ranks-$config"
    read -r state grads params largest peak rss ms gather_ms gather_mib held_mib losses <<<"$(summary "$tk_dir/metrics.jsonl" "$bench_work/log-$ranks-$config" "$ranks" "$stage")"
    [ -n "$model_mib" ] || model_mib=$params  # float32: 4 bytes a parameter
    tol=1e-5  # stages 2 and 3 sum in another order; 3-bf16 computes with weights rounded to bf16
    if [ "$config" = 3-bf16 ]; then tol=1e-2; fi
    if [ "$stage" = 0 ]; then
      whole[$ranks]=$state
      whole_losses=$losses
      equal="-"
    elif [ "$losses" = "$whole_losses" ]; then
      equal="yes"
    elif [ "$stage" -ge 2 ] && losses_close "$losses" "$whole_losses" "$tol"; then
      equal="to $tol"
    else
      bench_die "ranks $ranks: the sharded run's losses differ from the unsharded run's: $losses vs $whole_losses"
    fi
    per=$(/usr/bin/python3 -c "print(f'{${whole[$ranks]} / $ranks:.2f}')")
    bytes=$(/usr/bin/python3 -c "
n, s, N = $model_mib / 4, $stage, $ranks
theory = [16, 8 + 8 / N, 4 + 12 / N, 16 / N][s]
print(f'{($state + $grads + $params) / n:.2f} ({theory:.2f})')")
    echo "| $ranks | $config | $state | $grads | $params | $bytes | $largest | $per | $peak | $rss | $ms | $gather_ms | $gather_mib | $held_mib | $equal |"
  done
done
