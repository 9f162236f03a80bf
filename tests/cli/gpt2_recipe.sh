#!/usr/bin/env bash
# recipes/gpt2-124m.toml on the fortunes as bench/gpt2.sh tokenizes them: its plan (--dry-run) is
# GPT-2 small's, 124475904 parameters with the 50304-row tied embedding; and a short run's
# progress lines show mfu, against the machine's measured peak.
#   gpt2_recipe.sh TK_TOKENIZE TK_RUN SOURCE_DIR WORK
set -euo pipefail
tokenize=$1 run=$2 src=$3 work=$4
rm -rf "$work" "$work".*.log
mkdir -p "$work"
mapfile -t texts < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
"$tokenize" "${texts[@]}" --vocab 4096 --separator '\n%\n' --out "$work/data" > "$work.tokenize.log" 2>&1 ||
  { cat "$work.tokenize.log"; exit 1; }
"$run" "$src/recipes/gpt2-124m.toml" --dry-run --set data.train="\"$work/data/train_*.bin\"" \
  --set data.validation="\"$work/data/val_*.bin\"" > "$work.plan.log" 2>&1 || { cat "$work.plan.log"; exit 1; }
grep -q "gpt (124475904 parameters" "$work.plan.log" || { cat "$work.plan.log"; echo "the plan does not count GPT-2 small's 124,475,904 parameters"; exit 1; }
"$run" "$src/recipes/quickstart.toml" --progress plain --set run.epochs=0 --set run.steps=3 --set run.output="\"$work/quick\"" \
  > "$work.quick.log" 2>&1 || { cat "$work.quick.log"; exit 1; }
grep -q "^step 3/3 .* mfu [0-9.]* " "$work.quick.log" || { cat "$work.quick.log"; echo "no mfu on the progress line"; exit 1; }
echo "gpt2-124m: 124,475,904 parameters planned; the progress line shows mfu"
