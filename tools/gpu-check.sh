#!/usr/bin/env bash
# trainkit on an NVIDIA GPU: one prepared script that builds trainkit against the machine's PyTorch
# (its bundled LibTorch) and checks the CUDA path, for a machine with a GPU, CUDA's compiler, CMake,
# ninja and a PyTorch wheel, but none of trainkit's other build dependencies and no network.
#
#   bash tools/gpu-check.sh --prepare [DEPS]   on Debian 12: the headers trainkit builds with, from
#                                              Debian's packages (apt-get download + dpkg -x), into
#                                              DEPS (default .gpu-deps/, a few MiB); carry it along
#   bash tools/gpu-check.sh [DEPS]             on the GPU machine: configure, build (all cores),
#                                              run the CUDA checks, time the GPT against Python,
#                                              print one summary; exit 1 when a check failed
#   bash tools/gpu-check.sh --cpu-dry-run      here: prepare, then configure and build the same
#                                              targets against DEPS and the system's LibTorch, check
#                                              that no header came from outside DEPS, and train a
#                                              few CPU steps; no GPU needed
#
# The checks on CUDA: accumulation exact in float64 (the verifier), the run's weights files read by
# PyTorch, fp16 with the dynamic loss scaler and a forced overflow, bf16 autocast with clipping,
# resume bit-identical, prefetch on and off bit-identical, the plugin contract suite, DDP over NCCL
# on two GPUs (skipped with one), the sharded optimizer on the GPT (a world of one; over NCCL with
# two GPUs), recomputation on the GPT (against the run without it and that run's own run-to-run
# difference; its memory and time), the optimizers' foreach and fused forms against the per-tensor
# one (their time and drift, with phase times), the speedrun recipe's model (rotary, RMSNorm) with
# its phase times, and the GPT recipe's throughput and peak memory next to the same training
# written by hand in PyTorch. docs/gpu.md has what it measured on an H200.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode=check
case "${1:-}" in
  --prepare) mode=prepare; shift ;;
  --cpu-dry-run) mode=dry; shift ;;
  -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
esac
deps="$(realpath -m "${1:-$root/.gpu-deps}")"
build="${BUILD_DIR:-$root/build-gpu}"
[ "$mode" = dry ] && build="${BUILD_DIR:-$root/build-gpu-dry}"
# The headers trainkit builds with, and the text the GPT recipe learns (fortunes).
packages=(libtomlplusplus-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev doctest-dev libgloo-dev
          zlib1g-dev libboost1.74-dev fortunes)
# What the checks run. The dry run also builds the test suites: every use of the headers compiles.
targets=(tk-run tk-plugin tk_plugins tk_plugin_probe)
[ "$mode" = dry ] && targets+=(tk_strategy_tests tk_accum_tests tk_core_tests)
t_start=$(date +%s)
say() { printf '[gpu-check %4ds] %s\n' $(( $(date +%s) - t_start )) "$*"; }

prepare() {
  command -v apt-get >/dev/null || { echo "--prepare needs Debian's apt-get" >&2; exit 2; }
  local dl
  dl="$(mktemp -d)"
  rm -rf "$deps" && mkdir -p "$deps"
  (cd "$dl" && apt-get download "${packages[@]}" >/dev/null 2>&1) ||
    { echo "apt-get download ${packages[*]} failed" >&2; exit 2; }
  for f in "$dl"/*.deb; do dpkg -x "$f" "$deps"; done
  for f in "$dl"/*.deb; do dpkg-deb -f "$f" Package Version | paste -sd' '; done > "$deps/PACKAGES"
  # Boost: only what Boost.DLL includes (found by the preprocessor), and Boost's configuration.
  local inc="$deps/usr/include" keep
  keep="$(mktemp)"
  printf '#include <boost/dll/shared_library.hpp>\n#include <boost/dll/runtime_symbol_info.hpp>\n' |
    g++ -std=c++17 -DBOOST_DLL_USE_STD_FS -isystem "$inc" -M -x c++ - | tr ' \\' '\n\n' |
    grep -o "$inc/boost/.*" | sort -u > "$keep"
  (cd "$inc" && find boost/config -type f | sed "s|^|$inc/|") >> "$keep"
  mv "$inc/boost" "$inc/boost.all"
  while read -r f; do
    mkdir -p "$(dirname "$f")"
    cp "${f/$inc\/boost\//$inc/boost.all/}" "$f"
  done < "$keep"
  rm -rf "$inc/boost.all" "$deps/usr/share/doc" "$deps/usr/share/man" "$dl" "$keep"
  # Headers only: the libraries of the -dev packages (zlib's static, non-PIC libz.a among them) stay
  # out; the build links the machine's own libz.so.1.
  find "$deps/usr/lib" \( -name '*.a' -o -name '*.so' -o -name '*.so.*' \) -delete 2>/dev/null || true
  say "prepared $deps ($(du -sh "$deps" | cut -f1), $(wc -l < "$deps/PACKAGES") packages; carry this folder)"
}

# configure TORCH_PREFIX [cmake args...]
configure() {
  local prefix="$1"; shift
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTK_HEADER_ONLY_DEPS="$deps" \
    -DTK_BUILD_BENCH=OFF -DTK_WITH_TOKENIZER=OFF ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"} "$@" > "$build/gpu-check.configure.log" 2>&1 ||
    { tail -40 "$build/gpu-check.configure.log"; say "configure failed (log: $build/gpu-check.configure.log)"; exit 1; }
  if grep -q -- '^#define TK_WITH_CUDA 1$' "$build/core/include/tk/version.h"; then say "configured $build (CUDA)"
  else say "configured $build (CPU only: this LibTorch has no c10_cuda)"; fi
}

# Builds every target it can (ninja -k 0: one file that fails does not stop the others), so that one
# run shows every error. Where tk-run itself was built the checks still run, and the build's
# failure is the first FAIL of the summary (build_failed names the targets that did not build).
build_failed=""
build_targets() {
  local args=()
  for t in "${targets[@]}"; do args+=(--target "$t"); done
  if cmake --build "$build" --parallel "$(nproc)" "${args[@]}" -- -k 0 > "$build/gpu-check.build.log" 2>&1; then
    say "built ${targets[*]}"
    return
  fi
  grep -E -A12 '^FAILED:' "$build/gpu-check.build.log" | grep -E '^FAILED:|error' | head -60 || tail -40 "$build/gpu-check.build.log"
  build_failed="$(grep -oE '^FAILED: (\[code=[0-9]+\] )?[^ ]+' "$build/gpu-check.build.log" | sed -E 's/^FAILED: (\[code=[0-9]+\] )?//' | paste -sd' ')"
  say "build failed: $build_failed"
  [ "$mode" != dry ] && [ -x "$build/bin/tk-run" ] || exit 1
  say "tk-run was built: the checks run without what failed"
}

# Every header the build read from trainkit's dependencies came from DEPS, none from the system.
check_headers_from_deps() {
  local leaks
  local seen
  seen="$(ninja -C "$build" -t deps | tr -d ' ' | grep -c '^/' || true)"
  [ "$seen" -gt 0 ] || { echo "ninja recorded no header dependencies in $build"; return 1; }
  leaks="$(ninja -C "$build" -t deps | tr -d ' ' |
    grep -E '^/usr/include/(boost|spdlog|fmt|toml\+\+|CLI|nlohmann|doctest|gloo|zlib\.h|zconf\.h)' | sort -u | head -5 || true)"
  if [ -n "$leaks" ]; then
    echo "headers read from the system, not from $deps:"; echo "$leaks"
    return 1
  fi
}

if [ "$mode" = prepare ]; then prepare; exit 0; fi

if [ "$mode" = dry ]; then
  [ -f "$deps/usr/include/toml++/toml.h" ] || prepare
  configure ""
  build_targets
  check_headers_from_deps || { say "FAIL: the carried folder misses headers"; exit 1; }
  say "every dependency header came from $deps"
  out="$(mktemp -d)"
  "$build/bin/tk-run" "$root/recipes/quickstart.toml" --progress none --log-level warn --set run.device=cpu \
    --set run.epochs=0 --set run.steps=5 --set run.output="$out/run" >/dev/null
  [ "$(wc -l < "$out/run/metrics.jsonl")" -ge 5 ] || { say "FAIL: the CPU smoke run recorded no steps"; exit 1; }
  rm -rf "$out"
  say "cpu dry run: configured and built against $deps, trained 5 CPU steps: OK"
  exit 0
fi

# ---- on the GPU machine ---------------------------------------------------------------------
[ -f "$deps/usr/include/toml++/toml.h" ] ||
  { echo "no headers folder at $deps: make it on Debian 12 with: bash tools/gpu-check.sh --prepare" >&2; exit 2; }
py="${PYTHON:-python3}"
torch_prefix="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
versions="$("$py" -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
say "$versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu] /' || true
configure "$torch_prefix"
build_targets

bin="$build/bin"
work="$(mktemp -d)"
export TK_PLUGIN_PATH="$build/test-plugins"
results=()
[ -n "$build_failed" ] && results+=("FAIL  the build: $build_failed (see $build/gpu-check.build.log)")
pass() { results+=("PASS  $1"); say "PASS $1"; }
fail() { results+=("FAIL  $1"); say "FAIL $1"; }
skip() { results+=("SKIP  $1"); say "SKIP $1"; }
cuda=(--set run.device=cuda --progress none --log-level warn)
# Every training run is stopped after TK_GPU_CHECK_RUN_S seconds (default 180): a hang (a collective
# that waits, a kernel that never returns) fails its check and the others still run.
run_s="${TK_GPU_CHECK_RUN_S:-180}"
# run NAME RECIPE [tk-run args...]: trains into $work/NAME; its output in $work/NAME.log
run() {
  local name="$1" recipe="$2"; shift 2
  timeout "$run_s" "$bin/tk-run" "$recipe" "${cuda[@]}" --set run.output="$work/$name" "$@" > "$work/$name.log" 2>&1
}
# same A B: the weights of runs A and B bit-identical (weights.safetensors, read by Python's safetensors)
same() { "$py" - "$work/$1/weights.safetensors" "$work/$2/weights.safetensors" <<'PY'
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(f) for f in sys.argv[1:3])
sys.exit(0 if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else 1)
PY
}
close() {  # close A B TOL: the weights of runs A and B agree to TOL (relative to the largest weight)
  "$py" - "$work/$1/weights.safetensors" "$work/$2/weights.safetensors" "$3" <<'PY'
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(f) for f in sys.argv[1:3])
tol = float(sys.argv[3])
ok = a.keys() == b.keys() and all(
    (a[k].double() - b[k].double()).abs().max() <= tol * max(1.0, b[k].double().abs().max().item()) for k in a)
sys.exit(0 if ok else 1)
PY
}
recipe_with() {  # recipe_with NAME BASE EXTRA_TOML: a recipe file of BASE with EXTRA_TOML appended
  cat "$2" > "$work/$1.toml"; printf '%b' "$3" >> "$work/$1.toml"; echo "$work/$1.toml"
}
quick=(--set run.epochs=0 --set run.steps=60)

# 1. Accumulation exact in float64 on CUDA.
timeout "$run_s" "$bin/tk-run" "$root/recipes/quickstart.toml" --verify-accumulation --set run.device=cuda > "$work/verify.log" 2>&1 &&
  pass "accumulation exact in float64 on CUDA ($(grep -o 'largest difference [^,]*' "$work/verify.log" | head -1))" ||
  fail "accumulation exact in float64 on CUDA (see $work/verify.log)"

# 1b. The files a run writes read in PyTorch: weights.pt by torch.load (weights_only) and
# weights.safetensors by safetensors, the same tensors; a checkpoint's model state by torch.load.
if run files "$root/recipes/quickstart.toml" --set run.epochs=0 --set run.steps=10 --set run.checkpoint_every=10 &&
   line=$("$py" - "$work/files" <<'PY'
import glob, os, sys, torch
from safetensors.torch import load_file
d = sys.argv[1]
pt = torch.load(os.path.join(d, "weights.pt"), weights_only=True)
st = load_file(os.path.join(d, "weights.safetensors"))
assert pt.keys() == st.keys() and all(torch.equal(pt[k].cpu(), st[k]) for k in pt), "weights.pt and weights.safetensors differ"
print(f"{len(pt)} tensors, {sum(t.numel() for t in pt.values())} numbers, equal in both files")
PY
)
then pass "weights.pt (torch.load) and weights.safetensors (safetensors) read in PyTorch $("$py" -c 'import torch; print(torch.__version__)'): $line"
else fail "the run's weights files read in PyTorch (see $work/files.log)"; fi

# 2. fp16 with the dynamic loss scaler, a gradient made inf at step 10: that step skipped, scale halved.
r=$(recipe_with fp16 "$root/recipes/quickstart.toml" '\n[[plugins]]\nname = "mixed_precision"\ndtype = "fp16"\n\n[[plugins]]\nname = "probe"\ninf_grad_at_step = 10\n')
if run fp16 "$r" "${quick[@]}" && "$py" - "$work/fp16/metrics.jsonl" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
skipped = [x["step"] for x in r if "skipped" in x]
scale = {x["step"]: x.get("loss_scale") for x in r}
ok = skipped == [11] and scale[12] == scale[10] / 2 and r[-1]["loss"] < r[0]["loss"]
print("skipped", skipped, "scale", scale[10], "->", scale[12])
sys.exit(0 if ok else 1)
PY
then pass "fp16 + dynamic loss scaler: the forced overflow skipped its step and halved the scale"
else fail "fp16 + dynamic loss scaler with a forced overflow (see $work/fp16.log)"; fi

# 3. bf16 autocast with accumulation and clipping trains.
if run bf16 "$root/recipes/accum-bf16-clip.toml" "${quick[@]}" &&
   "$py" -c "import json,sys; r=[json.loads(l) for l in open('$work/bf16/metrics.jsonl') if '\"loss\"' in l]; sys.exit(0 if r[-1]['loss'] < r[0]['loss'] else 1)"
then pass "bf16 autocast + accumulation + clipping trains"
else fail "bf16 autocast (see $work/bf16.log)"; fi

# 4. Resume on CUDA: killed at step 25 (0-based 24), resumed from the checkpoint at 20: bit-identical.
r=$(recipe_with killed "$root/recipes/quickstart.toml" '\n[[plugins]]\nname = "probe"\nkill_at_step = 24\n')
run whole "$root/recipes/quickstart.toml" "${quick[@]}" --set run.checkpoint_every=20 || true
timeout "$run_s" "$bin/tk-run" "$r" "${cuda[@]}" "${quick[@]}" --set run.checkpoint_every=20 --set run.output="$work/resumed" > "$work/resumed.log" 2>&1 || true
r2=$(recipe_with resume "$root/recipes/quickstart.toml" '\n[[plugins]]\nname = "probe"\n')
if timeout "$run_s" "$bin/tk-run" "$r2" "${cuda[@]}" "${quick[@]}" --set run.checkpoint_every=20 --set run.output="$work/resumed" \
     --resume latest --allow-change plugins.probe >> "$work/resumed.log" 2>&1 && same whole resumed
then pass "resume on CUDA is bit-identical"
else fail "resume on CUDA (see $work/resumed.log)"; fi

# 5. Prefetch (pinned memory, side stream) on and off: bit-identical.
if run pf_on "$root/recipes/quickstart.toml" "${quick[@]}" --set run.prefetch=on &&
   run pf_off "$root/recipes/quickstart.toml" "${quick[@]}" --set run.prefetch=off && same pf_on pf_off
then pass "prefetch on CUDA (pinned, side stream) is bit-identical to none"
else fail "prefetch on CUDA (see $work/pf_on.log)"; fi

# 6. The plugin contract suite.
if ctest --test-dir "$build" -R '^contract\.' --output-on-failure > "$work/contract.log" 2>&1
then pass "plugin contract suite ($(grep -o '[0-9]*% tests passed.*' "$work/contract.log"))"
else fail "plugin contract suite (see $work/contract.log)"; fi

# 7. DDP over NCCL: two ranks, each on a GPU of its own (NCCL refuses two ranks on one device). A
# world of one would prove nothing: the plugin makes no process group there.
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
  skip "ddp over NCCL: needs 2 GPUs, $gpus visible"
elif run ddp "$root/recipes/ddp.toml" "${quick[@]}" --set world.backend=nccl --nproc 2 &&
     grep -q 'rank 1 of 2 (RANK/WORLD_SIZE, nccl' "$work/ddp.log"
then pass "ddp over NCCL, two ranks on two GPUs"
else fail "ddp over NCCL, two ranks (see $work/ddp.log)"; fi

# 7b. The sharded optimizer (the shard plugin at stage 1), the sharded gradients (stage 2) and the
# sharded parameters (stage 3) on the
# GPT: a world of one on CUDA, and 2 ranks over NCCL where 2 GPUs are visible; the weights equal
# those of stage 0, bit for bit (stage 2 over NCCL: to float32's rounding).
gpt_quick=(--set run.epochs=0 --set run.steps=20 --set run.validate_every=0 --set data.validation_fraction=0.0
           --set data.path="$deps/usr/share/games/fortunes/cookie")
r=$(recipe_with gpt_ddp "$root/recipes/gpt-tiny.toml" '\n[[plugins]]\nname = "ddp"\n[[plugins]]\nname = "shard"\n')
if run zero1 "$r" "${gpt_quick[@]}" --set plugins.shard.stage=1 && run zero0 "$r" "${gpt_quick[@]}" && same zero1 zero0 &&
   grep -q '"optimizer_state_mib"' "$work/zero1/metrics.jsonl"
then pass "GPT with the sharded optimizer on CUDA (a world of one) equals the unsharded one"
else fail "GPT with the sharded optimizer on CUDA (see $work/zero1.log, $work/zero0.log)"; fi
if [ "${gpus:-0}" -lt 2 ]; then
  skip "sharded optimizer over NCCL: needs 2 GPUs, $gpus visible"
elif run zero1n "$r" "${gpt_quick[@]}" --set plugins.shard.stage=1 --set world.backend=nccl --nproc 2 &&
     run zero0n "$r" "${gpt_quick[@]}" --set world.backend=nccl --nproc 2 && same zero1n zero0n
then pass "GPT with the sharded optimizer over NCCL, two ranks, equals ddp alone"
else fail "GPT with the sharded optimizer over NCCL (see $work/zero1n.log)"; fi
# Stage 2 (the gradients summed onto their owners during backward) and stage 3 (the parameters too
# freed on the ranks that do not update them, gathered around each block, the next block's gather
# started early): a world of one equals stage 0 bit for bit; over NCCL their sums come in another
# order, so to float32's rounding after 20 steps.
for stage in 2 3; do
  if [ "$stage" = 2 ]; then what="the gradients sharded (stage 2)" key=grad_mib
  else what="the parameters sharded (stage 3)" key=param_mib; fi
  if run "zero$stage" "$r" "${gpt_quick[@]}" --set plugins.shard.stage="$stage" && same "zero$stage" zero0 &&
     grep -q "\"$key\"" "$work/zero$stage/metrics.jsonl"
  then pass "GPT with $what on CUDA (a world of one) equals the unsharded one"
  else fail "GPT with $what on CUDA (see $work/zero$stage.log)"; fi
  if [ "${gpus:-0}" -lt 2 ]; then
    skip "$what over NCCL: needs 2 GPUs, $gpus visible"
  elif run "zero${stage}n" "$r" "${gpt_quick[@]}" --set plugins.shard.stage="$stage" --set world.backend=nccl --nproc 2 &&
       close "zero${stage}n" zero0n 1e-4
  then pass "GPT with $what over NCCL, two ranks, equals ddp alone to 1e-4"
  else fail "GPT with $what over NCCL (see $work/zero${stage}n.log)"; fi
done
# Stage 3 gathering in bf16 (gather_dtype): every rank computes with the weights rounded to bf16,
# so the weights stay near stage 0's (to 5e-2 after 20 steps); over NCCL each gather moves half
# the bytes of zero3n's.
half_bytes() {  # half_bytes A B: every record's shard_param_gather_mib of run A is half of run B's
  "$py" - "$work/$1/metrics.jsonl" "$work/$2/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l).get("shard_param_gather_mib") for l in open(f)] for f in sys.argv[1:3])
sys.exit(0 if len(a) == len(b) and any(a) and all(x is not None and abs(2 * x - y) <= 1e-9 * y for x, y in zip(a, b)) else 1)
PY
}
if run zero3b "$r" "${gpt_quick[@]}" --set plugins.shard.stage=3 --set 'plugins.shard.gather_dtype="bf16"' &&
   grep -q "parameters gathered in bf16" "$work/zero3b.log" && close zero3b zero0 5e-2
then pass "GPT at stage 3 gathering in bf16 on CUDA (a world of one) stays near the unsharded one"
else fail "GPT at stage 3 gathering in bf16 on CUDA (see $work/zero3b.log)"; fi
if [ "${gpus:-0}" -lt 2 ]; then
  skip "stage 3 gathering in bf16 over NCCL: needs 2 GPUs, $gpus visible"
elif run zero3bn "$r" "${gpt_quick[@]}" --set plugins.shard.stage=3 --set 'plugins.shard.gather_dtype="bf16"' \
       --set world.backend=nccl --nproc 2 && half_bytes zero3bn zero3n && close zero3bn zero0n 5e-2
then pass "GPT at stage 3 gathering in bf16 over NCCL, two ranks: half the bytes, near ddp alone"
else fail "GPT at stage 3 gathering in bf16 over NCCL (see $work/zero3bn.log)"; fi

# 7c. Recomputation on CUDA: the GPT of bench/recompute.sh (4 x 256, 256-token sequences, dropout)
# with every block recomputed, against the run without it (the CUDA generator replayed), and its GPU
# peak and time per step next to those without it. On CUDA the run without recomputation is itself
# not bit-reproducible at this size (measured on an H200 with PyTorch 2.11: two identical runs end
# up to 2.2e-4 apart; attention's and the embedding's backward kernels add with atomics), so the
# check runs it twice: the recomputed run must be as close to it as it is to itself (within 2x),
# or equal.
rc_model=(--set model.layers=4 --set model.width=256 --set model.heads=8 --set model.dropout=0.1 --set data.seq_len=256
          --set batch.micro_batch=16 --set batch.accumulation=1)
r=$(recipe_with gpt_rc "$root/recipes/gpt-tiny.toml" '\n[[plugins]]\nname = "recompute"\n')
if run rc_on "$r" "${gpt_quick[@]}" "${rc_model[@]}" && run rc_off "$root/recipes/gpt-tiny.toml" "${gpt_quick[@]}" "${rc_model[@]}" &&
   run rc_off2 "$root/recipes/gpt-tiny.toml" "${gpt_quick[@]}" "${rc_model[@]}" &&
   line=$("$py" - "$work" <<'PY'
import json, sys, torch
from safetensors.torch import load_file
w = sys.argv[1]
def stats(f):
    r = [json.loads(l) for l in open(f) if '"loss"' in l]
    return max(x["step_peak_mib"] for x in r), 1000 * (r[-1]["wall_time"] - r[4]["wall_time"]) / (len(r) - 5)
def diff(a, b):
    x, y = (load_file(f"{w}/{n}/weights.safetensors") for n in (a, b))
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)
(p0, t0), (p1, t1) = stats(f"{w}/rc_off/metrics.jsonl"), stats(f"{w}/rc_on/metrics.jsonl")
on, base = diff("rc_on", "rc_off"), diff("rc_off2", "rc_off")
print(f"weights {on:.1e} from the run without it, which is {base:.1e} from itself; GPT 4x256, 16 x 256 tokens: "
      f"every block recomputed {p1:.0f} MiB peak vs {p0:.0f} MiB ({p1 / p0:.2f}x), {t1:.1f} vs {t0:.1f} ms/step ({t1 / t0:.2f}x)")
sys.exit(0 if on == 0.0 or on <= 2 * base else 1)
PY
); then pass "recomputation on CUDA: $line"
else fail "recomputation on CUDA ${line:-} (see $work/rc_on.log, $work/rc_off.log)"; fi

# 7d. The optimizers' step forms on CUDA: foreach (and fused AdamW) against per_tensor on the GPT,
# with each step's phase times: the optimizer's milliseconds and how far the weights drift apart
# (foreach is bit-identical on the CPU; CUDA's foreach kernels round a few products differently).
forms_ok=1 forms_line=""
for form in per_tensor foreach fused; do
  run "opt_$form" "$root/recipes/gpt-tiny.toml" "${gpt_quick[@]}" --set run.phase_times=true \
    --set optimizer.implementation="\"$form\"" || { forms_ok=0; break; }
  forms_line+="$form $("$py" - "$work/opt_$form/metrics.jsonl" "$work/opt_per_tensor/weights.pt" "$work/opt_$form/weights.pt" <<'PY'
import json, statistics, sys, torch
r = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l][5:]
a, b = (torch.load(f, weights_only=True) for f in sys.argv[2:4])
drift = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
print(f"optimizer {statistics.median(x['optimizer_ms'] for x in r):.2f} ms, step {statistics.median(x['forward_ms'] + x['backward_ms'] + x['boundary_ms'] + x['optimizer_ms'] for x in r):.2f} ms, largest weight difference {drift:.1e};")
PY
) "
done
[ $forms_ok = 1 ] && pass "optimizer step forms on CUDA (GPT 2x128, medians): $forms_line" ||
  fail "optimizer step forms on CUDA (see $work/opt_*.log)"

# 8. The GPT recipe on CUDA against the same training in PyTorch by hand.
steps=300 warmup=50
if run gpt "$root/recipes/gpt-tiny.toml" --set run.epochs=0 --set run.steps=$steps --set run.validate_every=0 \
     --set data.validation_fraction=0.0 --set data.path="$deps/usr/share/games/fortunes/cookie"; then
  tk_ms=$("$py" "$root/bench/step_ms.py" "$work/gpt/metrics.jsonl" $warmup $steps || echo nan)
  tk_peak=$("$py" -c "import json; print(max(json.loads(l).get('step_peak_mib', 0) for l in open('$work/gpt/metrics.jsonl')))" || echo '?')
  "$py" "$root/bench/gpt_loop.py" 2 128 4 128 8 4 $steps $warmup cuda > "$work/gpt_py.log" 2>&1 || true
  py_ms=$(awk '/ms_per_step/ {print $2}' "$work/gpt_py.log")
  py_peak=$(awk '/peak_mib/ {print $2}' "$work/gpt_py.log")
  tokens=$((8 * 4 * 128))
  line=$("$py" -c "t=float('$tk_ms'); p=float('${py_ms:-nan}'); n=$tokens; print(f'GPT 2x128, 8x4 sequences of 128 per step: trainkit {t:.2f} ms/step ({n/t*1000:.0f} tokens/s), PyTorch by hand {p:.2f} ms/step ({n/p*1000:.0f} tokens/s), trainkit/PyTorch time {t/p:.2f}; peak GPU memory trainkit $tk_peak MiB, PyTorch ${py_peak:-?} MiB')" || echo "GPT timing: trainkit $tk_ms ms/step, PyTorch ${py_ms:-?} ms/step")
  pass "$line"
else fail "GPT recipe on CUDA (see $work/gpt.log)"; fi

# 8b. The speedrun recipe's model (4 x 128, 4 heads, rotary positions, RMSNorm, 4 x 16 sequences of
# 128 a step) on CUDA against the same model in PyTorch by hand, on bytes (vocabulary 256, not the
# recipe's 4096 BPE pieces: no tokenizer is built here), with trainkit's phase times and MFU's FLOPs.
speed_model=(--set model.layers=4 --set model.width=128 --set model.heads=4 --set model.position='"rotary"'
             --set model.norm='"rmsnorm"' --set data.seq_len=128 --set batch.micro_batch=16 --set batch.accumulation=4)
if run speed "$root/recipes/gpt-tiny.toml" --set run.epochs=0 --set run.steps=$steps --set run.validate_every=0 \
     --set data.validation_fraction=0.0 --set data.path="$deps/usr/share/games/fortunes/cookie" --set run.phase_times=true \
     "${speed_model[@]}"; then
  tk_ms=$("$py" "$root/bench/step_ms.py" "$work/speed/metrics.jsonl" $warmup $steps || echo nan)
  phases=$("$py" - "$work/speed/metrics.jsonl" <<'PY' || echo "phases unreadable"
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l][50:]
print(", ".join(f"{k[:-3]} {statistics.median(x[k] for x in r):.2f} ms" for k in
                ("data_ms", "forward_ms", "backward_ms", "boundary_ms", "optimizer_ms"))
      + f"; {statistics.median(x['gflops'] for x in r):.0f} GFLOP/s of the model's counted FLOPs")
PY
)
  "$py" "$root/bench/gpt_loop.py" 4 128 4 128 16 4 $steps $warmup cuda modern > "$work/speed_py.log" 2>&1 || true
  py_ms=$(awk '/ms_per_step/ {print $2}' "$work/speed_py.log")
  line=$("$py" -c "t=float('$tk_ms'); p=float('${py_ms:-nan}'); n=16*4*128; print(f'speedrun model 4x128 (rotary, RMSNorm), 16x4 sequences of 128: trainkit {t:.2f} ms/step ({n/t*1000:.0f} tokens/s), PyTorch by hand {p:.2f} ms/step ({n/p*1000:.0f} tokens/s), ratio {t/p:.2f}')" ||
         echo "speedrun model: trainkit $tk_ms ms/step, PyTorch ${py_ms:-?} ms/step")
  pass "$line; trainkit's phases: $phases"
else fail "speedrun model on CUDA (see $work/speed.log)"; fi

echo
echo "== trainkit GPU check: $versions, $(( $(date +%s) - t_start )) s =="
printf '%s\n' "${results[@]}"
echo "(logs in $work)"
! printf '%s\n' "${results[@]}" | grep -q '^FAIL'
