#!/usr/bin/env bash
# The speedrun recipe from scratch: the packages (tools/setup.sh), tk-run, tk-tokenize and
# tk-sample built, the fortunes tokenized into data/fortunes (once), recipes/speedrun.toml trained
# for at most 10 minutes into runs/speedrun (started over each time), and a sample of its text.
#   bash tools/speedrun.sh [tk-run options]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
TK_BUILD_TARGETS="tk-run tk-tokenize tk-sample tk_plugins" bash "$root/tools/build.sh"
bin="${BUILD_DIR:-$root/build}/bin"
if [ ! -f "$root/data/fortunes/train_000.bin" ]; then
  mapfile -t texts < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
  "$bin/tk-tokenize" "${texts[@]}" --vocab 4096 --separator '\n%\n' --out "$root/data/fortunes"
fi
"$bin/tk-run" "$root/recipes/speedrun.toml" --overwrite --set run.output=\""$root/runs/speedrun"\" "$@"
echo "--- a sample (tk-sample runs/speedrun --prompt \"The\" --tokens 100 --top-k 40 --seed 1):"
"$bin/tk-sample" "$root/runs/speedrun" --prompt "The" --tokens 100 --top-k 40 --seed 1
