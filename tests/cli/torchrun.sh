#!/usr/bin/env bash
# recipes/ddp.toml under torchrun as docs/distributed.md gives it for Debian 12 (torch 1.13 on Python
# 3.11: the module form, underscore options, --redirects 1 --tee 1), on one node: 2 workers join
# one world over Gloo, train, and rank 0 writes the run; the unused-parameter search's note is said
# once, in trainkit's words.
#   torchrun.sh TK_RUN SOURCE_DIR WORK
set -euo pipefail
tk_run=$1 src=$2 work=$3
/usr/bin/python3 -c 'import torch.distributed.run' 2>/dev/null || { echo "SKIPPED: no python3-torch (torchrun)"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
port=$(( 20000 + RANDOM % 20000 ))
set +e
timeout 300 /usr/bin/python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 2 --node_rank 0 \
  --master_addr 127.0.0.1 --master_port "$port" --redirects 1 --tee 1 --no_python \
  "$tk_run" "$src/recipes/ddp.toml" --set run.epochs=0 --set run.steps=4 --set run.output="\"$work/out\"" \
  --progress plain > "$work/log" 2>&1
rc=$?
set -e
fail() { cat "$work/log"; echo "torchrun: $*"; exit 1; }
# Debian 13's PyTorch 2.6 is built without libuv, which its torchrun's own store asks for: torchrun
# cannot start there, whatever it launches.
if [ $rc != 0 ] && grep -q 'use_libuv was requested but PyTorch was build without libuv support' "$work/log"; then
  echo "SKIPPED: this PyTorch's torchrun cannot start its own store (built without libuv)"
  exit 77
fi
[ $rc = 0 ] || fail "exit code $rc"
grep -q 'rank 1 of 2 (RANK/WORLD_SIZE, gloo' "$work/log" || fail "rank 1 did not join a world of 2"
[ "$(grep -c '"step"' "$work/out/metrics.jsonl")" -ge 4 ] || fail "rank 0 recorded fewer than 4 steps"
! grep -q 'did not find any unused parameters' "$work/log" || fail "LibTorch's note on the search was not replaced"
[ "$(grep -c 'every rank used every parameter in step 1' "$work/log")" = 1 ] || fail "the search's note is not said once"
echo "torchrun: 2 workers trained recipes/ddp.toml for 4 steps"
