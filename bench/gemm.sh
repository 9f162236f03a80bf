#!/usr/bin/env bash
# This machine's matrix-product peak, the figure MFU is measured against (run.peak_gflops):
# square float32 and bfloat16 products of n = 512, 1024, 2048 through the same LibTorch tk-run
# links (Debian's python3-torch runs on libtorch_cpu, the same kernels and BLAS), at the default
# thread count and at THREADS if given; the best of REPS timings of 8 products each. Prints a table
# and the run.peak_gflops to set: the largest fp32 figure (bf16's where a recipe trains in bf16).
#   bash bench/gemm.sh [REPS] [THREADS]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
[ $# -le 2 ] || bench_usage "gemm.sh takes at most two arguments: REPS and THREADS"
reps=${1:-5}
bench_int REPS "$reps" 1
threads=${2:-0}
bench_int THREADS "$threads" 0
bench_cpu python
bench_cmd gemm peak_fp32 "$bench_python" - "$reps" "$threads" <<'PY'
import sys, time
import torch
reps, threads = int(sys.argv[1]), int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
print(f"threads: {torch.get_num_threads()}")
print("| n | dtype | GFLOP/s (best of %d) |" % reps)
print("|---|---|---|")
best = {}
for dtype in (torch.float32, torch.bfloat16):
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(8):
                torch.mm(a, b)
            times.append((time.perf_counter() - t0) / 8)
        g = 2 * n ** 3 / min(times) / 1e9
        best[dtype] = max(best.get(dtype, 0.0), g)
        print(f"| {n} | {str(dtype).replace('torch.', '')} | {g:.1f} |")
print(f"peak_fp32 {best[torch.float32]:.1f}")
print(f"peak_bf16 {best[torch.bfloat16]:.1f}")
PY
cat "$cmd_out"
echo "set: --set run.peak_gflops=$cmd_value   (fp32; $(sed -n 's/^peak_bf16 //p' "$cmd_out") for bf16 autocast)"
