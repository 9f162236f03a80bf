#!/usr/bin/env bash
# The speedrun race: recipes/speedrun.toml with tk-run, and the same model, data, batch and
# schedule written by hand in Python (bench/speedrun_loop.py, Debian's python3-torch), each for
# SECONDS (default 600, the recipe's 10 minutes), one after the other on this machine. Prints the
# steps each took, tokens per second, the last step's loss, the validation loss at the end (on every
# validation sequence) against the unigram baseline, and tk-run's validation curve.
#   bash bench/speedrun.sh [SECONDS]      (after tools/build.sh; the fortunes are tokenized into
#                                          data/fortunes first, as tools/speedrun.sh does)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 1 ] || bench_usage "speedrun.sh takes at most one argument, the seconds each program trains"
seconds=${1:-600}
bench_int SECONDS "$seconds" 10
data="$bench_root/data/fortunes"
if [ ! -f "$data/train_000.bin" ]; then
  mapfile -t texts < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
  bench_checked tokenize "$bench_work/tokenize.log" "$bench_bin/tk-tokenize" "${texts[@]}" --vocab 4096 \
    --separator '\n%\n' --out "$data"
fi
steps=$(sed -n 's/^steps = \([0-9]*\).*/\1/p' "$bench_root/recipes/speedrun.toml" | head -1)
bench_int "the recipe's run.steps" "$steps" 1
echo "recipes/speedrun.toml (GPT 4 x 128, rotary, RMSNorm, BPE 4096, 128-token sequences, 4 x 16 per step, $steps steps), $seconds s each"
bench_cpu python
out=$(bench_fresh tk)
bench_checked tk-run "$bench_work/tk.log" "$bench_bin/tk-run" "$bench_root/recipes/speedrun.toml" --progress plain \
  --set run.output="\"$out\"" --set run.max_time="\"${seconds}s\"" --set data.train="\"$data/train_*.bin\"" \
  --set data.validation="\"$data/val_*.bin\"" "${bench_extra[@]}"
bench_cmd python val_loss "$bench_python" "$bench_root/bench/speedrun_loop.py" "$data/train_000.bin" \
  "$data/val_000.bin" "$seconds" "$steps"
/usr/bin/python3 - "$out/metrics.jsonl" "$bench_work/tk.log" "$cmd_out" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if "wall_time" in r]
vals = [(r["step"], r["validation_loss"]) for r in rows if "validation_loss" in r]
if not train or not vals:
    sys.exit("tk-run wrote no step or no validation record")
log = open(sys.argv[2]).read()
m = re.search(r"unigram baseline loss ([0-9.]+)", log)
baseline = float(m.group(1)) if m else float("nan")
py = dict(l.split()[:2] for l in open(sys.argv[3]) if l.split() and l.split()[0] in ("steps", "tokens_per_s", "val_loss"))
py_last = [l for l in open(sys.argv[3]) if l.startswith("step ")]
tk_tps = train[-1]["tokens"] / train[-1]["wall_time"]
print("| program | steps | tokens / s | last logged loss | validation loss at the end | unigram baseline |")
print("|---|---|---|---|---|---|")
print(f"| tk-run | {train[-1]['step']} | {tk_tps:.0f} | {train[-1]['loss']:.4f} | {vals[-1][1]:.4f} | {baseline:.4f} |")
print(f"| Python by hand | {py['steps']} | {float(py['tokens_per_s']):.0f} | "
      f"{py_last[-1].split()[3] if py_last else '-'} | {float(py['val_loss']):.4f} | {baseline:.4f} |")
print("\ntk-run's validation curve: " + ", ".join(f"step {s}: {v:.4f}" for s, v in vals))
print(f"tokens per second, tk-run / Python: {tk_tps / float(py['tokens_per_s']):.3f}")
cut = re.search(r"run.max_time stopped the run at step \d+ of run.steps = \d+.*", log)
print("tk-run: " + (cut.group(0) if cut else "its schedule ended within the time"))
PY
