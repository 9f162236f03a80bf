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

log "what the prefix ships: binaries without their debug info, the guides"
while IFS= read -r -d '' elf; do
  if [ -L "$elf" ] || ! head -c 4 "$elf" | grep -q ELF; then continue; fi
  if readelf -S "$elf" | grep -q '\.debug_info'; then echo "installed with its debug info: $elf"; exit 1; fi
done < <(find "$prefix" -type f \( -name '*.so*' -o -path '*/bin/*' \) -print0)
du -sh "$prefix" "$prefix"/lib/libtrainkit.so.*.*
# The headers installed are the SDK's, the embedding ones and the test library's (core/include/<audience>/),
# and nothing else: not the private ones (LibTorch's version shims), not the core's own planning or
# checkpoint declarations (they live in core/src's layers). No installed header includes a private one.
expected="$( (cd "$src/core/include" && ls sdk/tk embed/tk testing/tk | grep '\.h' | sed 's/\.in$//') | sort)"
installed="$(ls "$prefix/include/tk" | sort)"
if [ "$expected" != "$installed" ]; then
  echo "the installed headers are not the audiences' (core/include/{sdk,embed,testing}/tk):"
  diff <(echo "$expected") <(echo "$installed") || true; exit 1
fi
for private in $(ls "$src/core/private/tk"); do
  if grep -l "tk/$private" "$prefix"/include/tk/*.h; then echo "an installed header includes tk/$private"; exit 1; fi
done
guide="$(realpath "$prefix")/share/doc/trainkit/plugins.md"
test -f "$guide"
grep -q '^## Porting a plugin to API 4' "$guide"
# Every relative link of the installed guides and examples' READMEs leads to an installed file.
python3 - "$prefix" <<'PY'
import os, re, sys
bad = []
for root, _, files in os.walk(sys.argv[1] + "/share"):
    for f in files:
        if not f.endswith(".md"):
            continue
        path = os.path.join(root, f)
        text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            target = target.split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(root, target))):
                bad.append(f"{path}: ({target})")
if bad:
    sys.exit("installed links that lead nowhere:\n" + "\n".join(bad))
PY
tk-plugin --help | tee "$work/tk-plugin-help.txt"
grep -qF "plugin guide (writing, building, testing and porting plugins): $guide" "$work/tk-plugin-help.txt"
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix")
if command -v ccache > /dev/null; then cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

log "docs/plugins.md, 'Your first plugin', as written"
awk '/<!-- first-plugin:begin -->/{on=1; next} /<!-- first-plugin:end -->/{on=0} on && !/^```/' \
  "$src/docs/plugins.md" > "$work/first-plugin.sh"
test -s "$work/first-plugin.sh"
cat "$work/first-plugin.sh"
(cd "$work" && bash -euxo pipefail first-plugin.sh) 2>&1 | tee "$work/first-plugin.log"
if grep -E "warning\]? +plugin .*deprecated" "$work/first-plugin.log"; then  # tk-run's word, not a compiler's
  echo "the scaffold's recipe uses a deprecated option" >&2
  exit 1
fi
grep -qF "$guide" "$work/my_plugin/README.md"  # the scaffold says where the guide is
grep -q 'tk_plugin_my_plugin' "$work/my_plugin/CMakeLists.txt"

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

log "ema: a file name from an option is refused by --dry-run, at its recipe line"
ema_dir="$prefix/share/trainkit/examples/ema"
if (cd "$work" && tk-run "$ema_dir/recipe.toml" --dry-run --set "plugins.ema.path=$work/build-ema/tk_ema.so" \
      --set 'plugins.ema.file="sub/x.pt"') > "$work/ema-bad-file.log" 2>&1; then
  echo "a dry run accepted plugins.ema.file = sub/x.pt"; exit 1
fi
cat "$work/ema-bad-file.log"
grep -q "plugins.ema.file" "$work/ema-bad-file.log"
grep -q "not a plain file name" "$work/ema-bad-file.log"

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
log "the guide's plugin with files of its own, built from the installed guide"
awk '/<!-- files-plugin:begin -->/{on=1; next} /<!-- files-plugin:end -->/{on=0} on && !/^```/' "$guide" > "$work/last_weights.cpp"
grep -q 'TK_PLUGIN(LastWeights' "$work/last_weights.cpp"
# shellcheck disable=SC2046
g++ -O1 -shared -fPIC -fvisibility=hidden -o "$work/tk_last_weights.so" "$work/last_weights.cpp" $(pkg-config --cflags --libs trainkit)
tk-plugin check "$work/tk_last_weights.so"
printf '%s\n' '[run]' 'steps = 3' '[model]' 'name = "mlp"' 'hidden = [8]' '[data]' 'name = "synthetic-classification"' \
  'samples = 64' 'features = 4' 'classes = 3' '[batch]' 'micro_batch = 16' '[optimizer]' 'name = "sgd"' 'lr = 0.1' \
  '[[plugins]]' "path = \"$work/tk_last_weights.so\"" > "$work/last_weights.toml"
if tk-run "$work/last_weights.toml" --dry-run --set 'plugins.last_weights.file="../x.pt"' > "$work/lw-bad.log" 2>&1; then
  echo "a dry run accepted plugins.last_weights.file = ../x.pt"; exit 1
fi
grep -q "plugins.last_weights.file" "$work/lw-bad.log"
tk-run "$work/last_weights.toml" --progress plain --set "run.output=$work/run-lw" > "$work/lw.log"
# torch.save's format: a zip with the pickled dict and one record per tensor.
python3 -c "import zipfile,sys; n = zipfile.ZipFile(sys.argv[1]).namelist(); assert any(x.endswith('data.pkl') for x in n) and sum('/data/' in x for x in n) == 4, n" "$work/run-lw/last_weights.pt"
grep -qx 'steps 3' "$work/run-lw/last_weights.txt"
grep -q '"last_weights.pt"' "$work/run-lw/files.json"

log "a source written for plugin API 1: the compiler points to the porting tables"
# shellcheck disable=SC2046
if g++ -fsyntax-only -std=c++17 "$src/tests/sdk/api1_plugin.cpp" $(pkg-config --cflags trainkit) > "$work/api1.log" 2>&1; then
  echo "an API 1 plugin compiled"; exit 1
fi
grep -E "error|warning" "$work/api1.log" | cut -c1-240
for what in "tk::EventSet is plugin API 1" "this plugin is written for plugin API 1" \
            "TK_PLUGIN(Api1, name, version) is the form of plugin APIs 1 to 3"; do
  grep -qF "$what" "$work/api1.log" || { echo "no message: $what"; exit 1; }
done
test "$(grep -c "Porting a plugin to API 4', '... to API 5', '... to API 6' and '... to API 7' in trainkit's plugin guide: <prefix>/share/doc/trainkit/plugins.md" "$work/api1.log")" -ge 3

log "tk_add_plugin_test with OWN_MAIN: tests that define doctest's main themselves"
own="$work/own-main"
mkdir -p "$own/tests"
cp "$src/plugins/clip/clip.cpp" "$own/own_clip.cpp"
sed -i 's/TK_PLUGIN(Clip, "clip",/TK_PLUGIN(Clip, "own_clip",/' "$own/own_clip.cpp"
printf '%s\n' 'cmake_minimum_required(VERSION 3.18)' 'project(own_main LANGUAGES CXX)' \
  'find_package(trainkit 0.7 REQUIRED)' 'tk_add_plugin(own_clip SOURCES own_clip.cpp)' 'enable_testing()' \
  'tk_add_plugin_test(own_clip NEUTRAL "max_norm = 1e30" TESTS tests/own_main_test.cpp OWN_MAIN)' \
  '# the targets the guide names, given flags of their own' \
  'target_compile_definitions(tk_plugin_own_clip PRIVATE OWN_PLUGIN_FLAG=1)' \
  'target_compile_definitions(own_clip_tests PRIVATE OWN_TEST_FLAG=1)' > "$own/CMakeLists.txt"
printf '%s\n' '#ifndef OWN_PLUGIN_FLAG' '#error tk_plugin_own_clip is not the plugin target' '#endif' >> "$own/own_clip.cpp"
printf '%s\n' '#ifndef OWN_TEST_FLAG' '#error own_clip_tests is not the tests target' '#endif' \
  '#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN' '#include <tk/doctest.h>' \
  'TEST_CASE("a test file with doctest'"'"'s main of its own builds and runs") {' \
  '  CHECK(tk::testing::load_plugin(TK_PLUGIN_FILE, "max_norm = 2.0")->name() == "own_clip");' '}' \
  > "$own/tests/own_main_test.cpp"
cmake -S "$own" -B "$own/build" "${cmake_args[@]}" > "$work/configure-own-main.log"
cmake --build "$own/build"
ctest --test-dir "$own/build" --output-on-failure

log "sdk: every step passed"
