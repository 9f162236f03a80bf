#!/usr/bin/env bash
# GPT-2 124M (recipes/gpt2-124m.toml: 12 x 768, 12 heads, vocabulary 50304, 4 sequences of 64
# tokens a step, AdamW) side by side, ROUNDS times, the programs interleaved in each round:
#   tk-run as shipped (run.allocator = "caching"), tk-run with run.allocator = "system",
#   the same GPT-2 in PyTorch eager (bench/gpt2_loop.py, Debian's python3-torch) with glibc's
#   malloc and with jemalloc preloaded (MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1),
#   tk-run and PyTorch eager (jemalloc) with bf16 autocast,
#   and, when LLMC_DIR names a checkout of karpathy/llm.c, its train_gpt2.c (gcc -Ofast
#   -march=native -fopenmp) on the same shapes, started from this model's initial weights.
# Each program takes STEPS steps; the mean time of those after the first WARMUP is its figure.
# Prints seconds per step, the model's GFLOP/s (6N-style count of the recipe's GPT: matrix
# products and attention, forward and backward) and its fraction of this machine's matrix-product
# peak, measured in the same run (bench/gemm.sh); each program's best round.
#   bash bench/gpt2.sh [STEPS] [ROUNDS] [WARMUP]     (defaults 8, 1, 3; after tools/build.sh)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 3 ] || bench_usage "gpt2.sh takes at most three arguments: STEPS, ROUNDS and WARMUP"
steps=${1:-8} rounds=${2:-1} warmup=${3:-3}
bench_int STEPS "$steps" 2
bench_int ROUNDS "$rounds" 1
bench_int WARMUP "$warmup" 1
[ "$warmup" -lt "$steps" ] || bench_usage "WARMUP ($warmup) must be below STEPS ($steps)"
jemalloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
[ -f "$jemalloc" ] || bench_cannot "find $jemalloc (Debian's libjemalloc2; tools/setup.sh installs it)"
if [ -n "${LLMC_DIR:-}" ] && [ ! -f "$LLMC_DIR/train_gpt2.c" ]; then
  bench_usage "LLMC_DIR=$LLMC_DIR holds no train_gpt2.c (a checkout of karpathy/llm.c)"
fi

data="$bench_root/data/fortunes"
if [ ! -f "$data/train_000.bin" ]; then
  mapfile -t texts < <(ls /usr/share/games/fortunes/* | grep -v '\.dat$\|\.u8$')
  bench_checked tokenize "$bench_work/tokenize.log" "$bench_bin/tk-tokenize" "${texts[@]}" --vocab 4096 \
    --separator '\n%\n' --out "$data"
fi
recipe="$bench_root/recipes/gpt2-124m.toml"
bf16_recipe="$bench_work/gpt2-124m-bf16.toml"
{ cat "$recipe"; printf '\n[[plugins]]\nname = "mixed_precision"\ndtype = "bf16"\n'; } >"$bf16_recipe"
tk_args=(--progress none --set run.steps="$steps" --set data.train="\"$data/train_000.bin\""
  --set data.validation='""')
py_loop=("$bench_python" "$bench_root/bench/gpt2_loop.py" train "$data/train_000.bin" 4 64 "$steps" "$warmup")
with_jemalloc=(env LD_PRELOAD="$jemalloc" MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1)

if [ -n "${LLMC_DIR:-}" ]; then  # built and fed in bench_work: the checkout is not written to
  llmc="$bench_work/llmc"
  mkdir -p "$llmc/dev/data/tinyshakespeare"
  bench_checked "llm.c build" "$bench_work/llmc-build.log" gcc -Ofast -march=native -fopenmp -DOMP \
    -I"$LLMC_DIR" "$LLMC_DIR/train_gpt2.c" -lm -o "$llmc/train_gpt2"
  bench_checked "llm.c weights" "$bench_work/llmc-weights.log" "$bench_python" "$bench_root/bench/gpt2_loop.py" \
    llmc-weights "$llmc/gpt2_124M.bin"
  ln -s "$data/train_000.bin" "$llmc/dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
  ln -s "$data/val_000.bin" "$llmc/dev/data/tinyshakespeare/tiny_shakespeare_val.bin"
fi

# llm.c's own loop trains 41 steps of 4 x 64 with validations and samples between: it is stopped
# once it has printed STEPS step lines; its figure is the mean "took" of those after WARMUP.
llmc_steps() {  # -> "s_per_step S"
  (cd "$llmc" && exec "$bench_python" - "$steps" "$warmup" ./train_gpt2) <<'PY'
import re, subprocess, sys
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
p = subprocess.Popen([sys.argv[3]], stdout=subprocess.PIPE, text=True)
took = []
for line in p.stdout:
    m = re.match(r"step (\d+): train loss \S+ \(took ([0-9.]+) ms\)", line)
    if m:
        took.append(float(m.group(2)) / 1000)
        if len(took) == steps:
            break
p.kill()
p.wait()
if len(took) < steps:
    sys.exit(f"llm.c printed {len(took)} step lines, the benchmark needs {steps}")
print(f"s_per_step {sum(took[warmup:]) / (steps - warmup):.4f}")
PY
}

declare -A best
note() {  # NAME SECONDS
  if [ -z "${best[$1]:-}" ] || awk -v a="$2" -v b="${best[$1]}" 'BEGIN { exit !(a < b) }'; then best[$1]=$2; fi
}
tk_seconds() { bench_step_ms "$tk_dir/metrics.jsonl" "$warmup" "$steps" | awk '{ printf "%.4f", $1 / 1000 }'; }

bench_cpu python
echo "GPT-2 124M, 4 x 64 tokens a step, AdamW; $steps steps per program, the first $warmup not timed; $rounds round(s)"
order=("tk-run" "tk-run, run.allocator = system" "PyTorch eager" "PyTorch eager, jemalloc"
  "tk-run, bf16 autocast" "PyTorch eager, jemalloc, bf16 autocast")
[ -z "${LLMC_DIR:-}" ] || order+=("llm.c train_gpt2.c")
for round in $(seq "$rounds"); do
  echo "round $round" >&2
  bench_tk tk "$steps" "$recipe" "${tk_args[@]}"
  note "tk-run" "$(tk_seconds)"
  bench_cmd eager s_per_step "${py_loop[@]}"
  note "PyTorch eager" "$cmd_value"
  bench_cmd eager-jemalloc s_per_step "${with_jemalloc[@]}" "${py_loop[@]}"
  note "PyTorch eager, jemalloc" "$cmd_value"
  bench_tk tk-system "$steps" "$recipe" "${tk_args[@]}" --set run.allocator=system
  note "tk-run, run.allocator = system" "$(tk_seconds)"
  bench_tk tk-bf16 "$steps" "$bf16_recipe" "${tk_args[@]}"
  note "tk-run, bf16 autocast" "$(tk_seconds)"
  bench_cmd eager-jemalloc-bf16 s_per_step "${with_jemalloc[@]}" "${py_loop[@]}" bf16
  note "PyTorch eager, jemalloc, bf16 autocast" "$cmd_value"
  if [ -n "${LLMC_DIR:-}" ]; then
    bench_cmd llm.c s_per_step llmc_steps
    note "llm.c train_gpt2.c" "$cmd_value"
  fi
done

bench_cmd gemm peak_fp32 bash "$bench_root/bench/gemm.sh" 3
peak_fp32=$cmd_value
peak_bf16=$(sed -n 's/^peak_bf16 //p' "$cmd_out")
gflop=$(grep -m1 -o '"model_gflop": [0-9.e+-]*' "$tk_dir/metrics.jsonl" | awk '{ print $2 }')
echo "matrix-product peak (bench/gemm.sh, best of 3): fp32 $peak_fp32 GFLOP/s, bf16 $peak_bf16 GFLOP/s; $gflop GFLOP a step"
echo "| program | s / step | model GFLOP/s | of the GEMM peak | tk-run is faster by |"
echo "|---|---|---|---|---|"
for name in "${order[@]}"; do
  s=${best[$name]}
  if [[ $name == *bf16* ]]; then peak=$peak_bf16 ref=${best["tk-run, bf16 autocast"]}; else peak=$peak_fp32 ref=${best["tk-run"]}; fi
  awk -v n="$name" -v s="$s" -v g="$gflop" -v p="$peak" -v r="$ref" -v pk="$( [[ $name == *bf16* ]] && echo bf16 || echo fp32)" \
    'BEGIN { printf "| %s | %.3f | %.0f | %.2f of %s | %.2fx |\n", n, s, g / s, g / s / p, pk, s / r }'
done
