#!/usr/bin/env bash
# recipes/speedrun.toml on the fortunes tokenized as tools/speedrun.sh tokenizes them: 3 steps,
# validated, its validation loss recomputed from its weights by the same GPT written in Python,
# then a sample from the run, and the same sample from its last checkpoint's weights.
#   speedrun_short.sh TK_TOKENIZE TK_RUN TK_SAMPLE SOURCE_DIR WORK
set -euo pipefail
tokenize=$1 run=$2 sample=$3 src=$4 work=$5
rm -rf "$work"
mapfile -t texts < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
"$tokenize" "${texts[@]}" --vocab 4096 --separator '\n%\n' --out "$work/data" > "$work.tokenize.log" 2>&1 ||
  { cat "$work.tokenize.log"; exit 1; }
grep -q "^tokenized [0-9]* documents" "$work.tokenize.log"
"$run" "$src/recipes/speedrun.toml" --progress plain --set data.train="\"$work/data/train_*.bin\"" \
  --set data.validation="\"$work/data/val_*.bin\"" --set run.steps=3 --set run.validate_every=3 --set run.checkpoint_every=3 \
  --set run.output="\"$work/run\"" > "$work.run.log" 2>&1 || { cat "$work.run.log"; exit 1; }
grep -q "unigram baseline" "$work.run.log" || { cat "$work.run.log"; echo "no validation against the unigram baseline"; exit 1; }
/usr/bin/python3 "$src/tests/cli/check_gpt_python.py" "$work/run" "$work/data/val_000.bin" "$src"
text=$("$sample" "$work/run" --prompt "The" --tokens 10 --seed 1)
[ "${text:0:3}" = "The" ] || { echo "tk-sample wrote: $text"; exit 1; }
# The checkpoint at the last step holds the weights the run ended with: its folder, its model.pt,
# the checkpoints folder (its latest) and the run's weights.pt sample the same text.
for w in "$work/run/checkpoints/step-00000003" "$work/run/checkpoints/step-00000003/model.pt" "$work/run/checkpoints" \
         "$work/run/weights.pt"; do
  again=$("$sample" "$work/run" --weights "$w" --prompt "The" --tokens 10 --seed 1)
  [ "$again" = "$text" ] || { echo "tk-sample --weights $w wrote: $again (from weights.safetensors: $text)"; exit 1; }
done
if "$sample" "$work/run" --weights "$work/run" --prompt "The" --tokens 2 > "$work.folder.log" 2>&1; then
  echo "tk-sample took a folder without model.pt as weights"; exit 1
fi
grep -q "holds no complete checkpoint" "$work.folder.log" || { cat "$work.folder.log"; exit 1; }
echo "speedrun recipe: 3 steps validated; sample: $text"
