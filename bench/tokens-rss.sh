#!/usr/bin/env bash
# Resident memory while training on token shards (the `tokens` data set, memory-mapped): the same
# small GPT on a corpus of a few MiB and on one of GIB GiB (default 2), written as llm.c-format
# shards of random uint16 tokens. The shards are read through the page cache, never resident
# whole: the peak RSS of the two runs may differ by the epoch's shuffled order of sequences (8
# bytes each, the core's) and by at most 2% of the corpus besides, or the script fails.
#   bash bench/tokens-rss.sh [GIB] [STEPS]      (after tools/build.sh; default 2 GiB, 30 steps)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 2 ] || bench_usage "tokens-rss.sh takes at most two arguments: GiB of tokens, steps"
gib=${1:-2}
steps=${2:-30}
bench_int GIB "$gib" 1
bench_int STEPS "$steps" 2

write_shards() {  # folder, shards, tokens per shard
  mkdir -p "$1"
  bench_checked "shards-$2x$3" "$bench_work/shards.log" /usr/bin/python3 - "$@" <<'PY'
import struct, sys, torch
folder, shards, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
for s in range(shards):
    with open(f"{folder}/train_{s:03d}.bin", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        left = n
        while left:  # 64M tokens at a time: this writer stays small too
            k = min(left, 64 << 20)
            f.write(torch.randint(0, 256, (k,), generator=g, dtype=torch.int32).to(torch.int16).numpy().tobytes())
            left -= k
PY
}

per_shard=$(( gib * (1 << 29) / 4 ))  # 4 shards of 2-byte tokens make GIB GiB
write_shards "$bench_work/small" 4 $(( 1 << 20 ))
write_shards "$bench_work/large" 4 "$per_shard"
printf '[run]\nseed = 0\nsteps = %d\n[model]\nname = "gpt"\nlayers = 2\nheads = 4\nwidth = 64\n[data]\nname = "tokens"\nseq_len = 1024\n[batch]\nmicro_batch = 4\n[optimizer]\nname = "adamw"\nlr = 0.001\n' \
  "$steps" >"$bench_work/gpt.toml"

echo "GPT 2 x 64 on llm.c token shards (vocabulary 256, 1024-token sequences, micro-batch 4), $steps steps"
bench_cpu
echo "| corpus | tokens | peak RSS (MiB) | RSS at step 1 / at the last step (MiB) | ms / step |"
echo "|---|---|---|---|---|"
declare -A peak
for size in small large; do
  bench_tk "$size" "$steps" "$bench_work/gpt.toml" --progress none --log-level warn \
    --set data.train=\""$bench_work/$size/train_*.bin"\"
  read -r p first last ms <<<"$(/usr/bin/python3 - "$tk_dir/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * (rows[-1]["wall_time"] - rows[0]["wall_time"]) / (len(rows) - 1)
print(f"{max(r['peak_rss_mib'] for r in rows):.0f} {rows[0]['peak_rss_mib']:.0f} {rows[-1]['peak_rss_mib']:.0f} {ms:.0f}")
PY
)"
  peak[$size]=$p
  tokens=$([ $size = small ] && echo $(( 4 << 20 )) || echo $(( 4 * per_shard )))
  echo "| $size ($(( tokens * 2 / 1048576 )) MiB) | $tokens | $p | $first / $last | $ms |"
done
/usr/bin/python3 - "${peak[small]}" "${peak[large]}" "$gib" "$per_shard" "$(( 1 << 20 ))" <<'PY'
import sys
small, large, gib = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
# 4 shards each: (n - 1) // 1024 sequences a shard, 8 bytes each in the epoch's order.
order = 8 * 4 * ((int(sys.argv[4]) - 1) // 1024 - (int(sys.argv[5]) - 1) // 1024) / 2**20
rest = large - small - order
print(f"\npeak RSS, {gib:g} GiB corpus - 8 MiB corpus: {large - small:+.0f} MiB, of which the epoch order of its "
      f"sequences {order:.0f} MiB; the rest {rest:+.0f} MiB ({rest / (gib * 1024) * 100:+.1f}% of the corpus)")
if rest > 0.02 * gib * 1024:
    sys.exit("the large corpus raised the peak RSS by more than 2% of its size: it is being held in memory")
PY
