"""bench/recompute.sh's GPT step written by hand in Python (Debian's python3-torch), with chosen
blocks recomputed by PyTorch's own torch.utils.checkpoint: the same model as bench/gpt_loop.py, one
micro-batch of B sequences of T bytes per step, token-normalized, AdamW. Prints the time of a step,
and of its forward and its backward, averaged over the steps after WARMUP.

usage: python3 recompute_loop.py LAYERS WIDTH HEADS T B STEPS WARMUP EVERY
       EVERY: 0 recomputes no block, 1 every block, 2 every other block
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_loop import Gpt  # noqa: E402


def main() -> None:
    layers, width, heads, t, b, steps, warmup, every = (int(a) for a in sys.argv[1:9])
    torch.manual_seed(1)
    model = Gpt(layers, width, heads, t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, 256, (16, b, t + 1))

    def forward(idx):
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(model.blocks):
            x = torch.utils.checkpoint.checkpoint(block, x) if every and i % every == 0 else block(x)
        return model.ln_f(x) @ model.wte.weight.t()

    fwd = bwd = total = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        batch = data[step % 16]
        loss = F.cross_entropy(forward(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1), reduction="sum")
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for p in model.parameters():
            p.grad /= batch[:, 1:].numel()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= warmup:
            fwd, bwd, total = fwd + t1 - t0, bwd + t2 - t1, total + t3 - t0
    n = steps - warmup
    print(f"ms_per_step {1000 * total / n:.1f}")
    print(f"forward_ms {1000 * fwd / n:.1f}")
    print(f"backward_ms {1000 * bwd / n:.1f}")


if __name__ == "__main__":
    main()
