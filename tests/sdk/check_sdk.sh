#!/usr/bin/env bash
# The plugin SDK as an outside author meets it: trainkit installed into a temporary prefix, then
# everything built from that prefix alone (never the build tree):
#   1. the "Your first plugin" commands of docs/plugins.md, run as written;
#   2. every project in examples/: configure, build, ctest (contract + unit tests), train its recipe;
#   3. a plugin compiled with pkg-config's flags only, described by tk-plugin info.
# usage: check_sdk.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src="$1"; build="$2"; work="$3"
rm -rf "$work"; mkdir -p "$work"; : > "$work/leaks.txt"
prefix="$work/prefix"
log() { printf '\n== %s\n' "$*"; }

log "install trainkit, then move the installed tree to $prefix (it must be relocatable)"
cmake --install "$build" --prefix "$work/first-prefix" > "$work/install.log"
mv "$work/first-prefix" "$prefix"
export PATH="$prefix/bin:$PATH" TRAINKIT_PREFIX="$prefix"
# Nothing installed may point into the build tree or to where it was installed first: not the
# package files, not a run path.
for place in "$build" "$work/first-prefix"; do
  grep -rl "$place" "$prefix/lib/cmake" "$prefix/lib/pkgconfig" "$prefix/include" >> "$work/leaks.txt" || true
  while IFS= read -r -d '' elf; do
    if readelf -d "$elf" | grep -E 'R(UN)?PATH' | grep -q "$place"; then echo "$elf" >> "$work/leaks.txt"; fi
  done < <(find "$prefix" -type f \( -name '*.so*' -o -path '*/bin/*' \) -print0)
done
if [ -s "$work/leaks.txt" ]; then
  echo "installed files that name the build tree or their first install location:"; cat "$work/leaks.txt"; exit 1
fi
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix")
if command -v ccache > /dev/null; then cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

log "docs/plugins.md, 'Your first plugin', as written"
awk '/<!-- first-plugin:begin -->/{on=1; next} /<!-- first-plugin:end -->/{on=0} on && !/^```/' \
  "$src/docs/plugins.md" > "$work/first-plugin.sh"
test -s "$work/first-plugin.sh"
cat "$work/first-plugin.sh"
(cd "$work" && bash -euxo pipefail first-plugin.sh)

# The examples as the installed prefix ships them.
test -d "$prefix/share/trainkit/examples"
for dir in "$prefix"/share/trainkit/examples/*/; do
  name="$(basename "$dir")"
  log "examples/$name"
  cmake -S "$dir" -B "$work/build-$name" "${cmake_args[@]}" > "$work/configure-$name.log"
  cmake --build "$work/build-$name"
  ctest --test-dir "$work/build-$name" --output-on-failure
  (cd "$work" && tk-run "$dir/recipe.toml" --progress plain --report \
     --set "plugins.$name.path=$work/build-$name/tk_$name.so" --set "run.output=$work/run-$name") | tee "$work/tk-run-$name.log"
  grep -q '<script id="tk-data"' "$work/run-$name/report.html"
  if [ "$name" = ema ]; then  # its file, listed in the closing line and in files.json
    grep -q "^wrote $work/run-ema/{recipe.toml,metrics.jsonl,weights.pt,weights.safetensors,ema_weights.pt}" "$work/tk-run-ema.log"
    grep -q '"ema_weights.pt"' "$work/run-ema/files.json"
  fi
done

log "the installed tk-report: both example runs in one page"
tk-report "$work"/run-* -o "$work/examples.html"
test "$(grep -o '"status":"completed"' "$work/examples.html" | wc -l)" -eq "$(ls -d "$work"/run-* | wc -l)"

log "a plugin built with pkg-config only"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
cp "$src/plugins/clip/clip.cpp" "$work/pc_clip.cpp"
sed -i 's/TK_PLUGIN(Clip, "clip",/TK_PLUGIN(Clip, "pc_clip",/' "$work/pc_clip.cpp"
grep -q 'TK_PLUGIN(Clip, "pc_clip",' "$work/pc_clip.cpp"
# shellcheck disable=SC2046
g++ -O1 -shared -fPIC -fvisibility=hidden -o "$work/tk_pc_clip.so" "$work/pc_clip.cpp" $(pkg-config --cflags --libs trainkit)
tk-plugin info "$work/tk_pc_clip.so" | tee "$work/info.txt"
grep -q "plugin pc_clip" "$work/info.txt"
grep -q "provides   grads.clipped" "$work/info.txt"
log "tk_add_plugin_test with OWN_MAIN: tests that define doctest's main themselves"
own="$work/own-main"
mkdir -p "$own/tests"
cp "$src/plugins/clip/clip.cpp" "$own/own_clip.cpp"
sed -i 's/TK_PLUGIN(Clip, "clip",/TK_PLUGIN(Clip, "own_clip",/' "$own/own_clip.cpp"
printf '%s\n' 'cmake_minimum_required(VERSION 3.18)' 'project(own_main LANGUAGES CXX)' \
  'find_package(trainkit 0.4 REQUIRED)' 'tk_add_plugin(own_clip SOURCES own_clip.cpp)' 'enable_testing()' \
  'tk_add_plugin_test(own_clip NEUTRAL "max_norm = 1e30" TESTS tests/own_main_test.cpp OWN_MAIN)' > "$own/CMakeLists.txt"
printf '%s\n' '#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN' '#include <tk/doctest.h>' \
  'TEST_CASE("a test file with doctest'"'"'s main of its own builds and runs") {' \
  '  CHECK(tk::testing::load_plugin(TK_PLUGIN_FILE, "max_norm = 2.0")->name() == "own_clip");' '}' \
  > "$own/tests/own_main_test.cpp"
cmake -S "$own" -B "$own/build" "${cmake_args[@]}" > "$work/configure-own-main.log"
cmake --build "$own/build"
ctest --test-dir "$own/build" --output-on-failure

log "sdk: every step passed"
