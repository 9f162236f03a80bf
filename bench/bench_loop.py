"""The same hand-written loop as bench_loop.cpp, in Python with Debian's python3-torch.

usage: python3 bench_loop.py FEATURES HIDDEN LAYERS CLASSES SAMPLES MICRO_BATCH K STEPS WARMUP THREADS
"""
import math
import sys
import time

import torch


def main() -> None:
    f, h, layers, c, n, m, k, steps, warmup, threads = (int(a) for a in sys.argv[1:11])
    if threads > 0:  # 0: torch's default
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = torch.randn(n, f)
    y = torch.tanh(x @ (torch.randn(f, 4 * c) / math.sqrt(f))) @ torch.randn(4 * c, c)
    y = y.argmax(1)
    mods, width = [], f
    for _ in range(layers):
        mods += [torch.nn.Linear(width, h), torch.nn.GELU()]
        width = h
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, c))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    per_epoch = n // m
    order = torch.randperm(n)
    b = 0
    start = time.perf_counter()
    loss_value = 0.0
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        window = 0.0
        for _ in range(k):
            if b == per_epoch:
                b = 0
                order = torch.randperm(n)
            idx = order[b * m:(b + 1) * m]
            b += 1
            loss = torch.nn.functional.cross_entropy(model(x.index_select(0, idx)), y.index_select(0, idx))
            (loss / k).backward()
            window += loss.item() / k
        opt.step()
        opt.zero_grad()
        loss_value = window
    elapsed = time.perf_counter() - start
    print(f"ms_per_step {1000 * elapsed / (steps - warmup):.4f} loss {loss_value:.4f}")


if __name__ == "__main__":
    main()
