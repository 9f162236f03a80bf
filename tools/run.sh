#!/usr/bin/env bash
# Installs what is needed, builds what a run needs (tk-run and the plugins, not the tests), and
# trains a recipe (default: recipes/fashion-mnist.toml).
#   bash tools/run.sh [recipe.toml] [tk-run options...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
TK_BUILD_TARGETS="tk-run tk_plugins" bash "$root/tools/build.sh"
# The default demo starts over each time; a run of your own is never overwritten unless you say so.
[ $# -gt 0 ] || set -- "$root/recipes/fashion-mnist.toml" --overwrite
exec "$build/bin/tk-run" "$@"
