#!/usr/bin/env bash
# The recipe.toml a run writes into its output folder runs as it is and trains the same weights,
# for a plugin loaded by path whose option is set with --set plugins.<name>.<key>.
# usage: resolved_recipe.sh TK_RUN SOURCE_DIR PLUGIN_DIR WORK_DIR
set -euo pipefail
tk_run="$1"; src="$2"; plugins="$3"; work="$4"
rm -rf "$work"; mkdir -p "$work"
cat > "$work/recipe.toml" <<TOML
[run]
seed = 4
steps = 40
[model]
name = "mlp"
hidden = [32]
[data]
name = "synthetic-classification"
samples = 512
[batch]
micro_batch = 16
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[[plugins]]
path = "$plugins/tk_grad_accum.so"
steps = 2
TOML
"$tk_run" "$work/recipe.toml" --progress none --set plugins.grad_accum.steps=4 --set run.output="$work/first"
grep -q "^path = \"$plugins/tk_grad_accum.so\"" "$work/first/recipe.toml"
grep -q "^steps = 4" "$work/first/recipe.toml"
"$tk_run" "$work/first/recipe.toml" --progress none --set run.output="$work/second"
cmp "$work/first/weights.pt" "$work/second/weights.pt"
echo "the resolved recipe reran to bit-identical weights"
