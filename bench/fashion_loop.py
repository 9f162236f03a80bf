"""recipes/fashion-mnist.toml's training written by hand in Python (Debian's python3-torch): the
same CNN, data scaling, micro-batches of 32 accumulated 4 to a step, AdamW. Prints ms per optimizer
step between steps WARMUP and STEPS.

usage: python3 fashion_loop.py STEPS WARMUP [DIR]
"""
import gzip
import pathlib
import sys
import time

import torch


def idx(path: pathlib.Path) -> torch.Tensor:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return torch.frombuffer(bytearray(raw[4 + 4 * rank:]), dtype=torch.uint8).view(*dims)


def main() -> None:
    steps, warmup = int(sys.argv[1]), int(sys.argv[2])
    folder = pathlib.Path(sys.argv[3] if len(sys.argv) > 3 else "/usr/share/datasets/fashion-mnist")
    images = idx(folder / "train-images-idx3-ubyte.gz").unsqueeze(1)
    labels = idx(folder / "train-labels-idx1-ubyte.gz").long()
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
    m, k, n = 32, 4, images.shape[0]
    order, pos = torch.randperm(n), 0
    start = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        for _ in range(k):
            if pos + m > n:
                order, pos = torch.randperm(n), 0
            idx_ = order[pos:pos + m]
            pos += m
            x = (images.index_select(0, idx_).float() / 255.0 - 0.2860) / 0.3530
            loss = torch.nn.functional.cross_entropy(model(x), labels.index_select(0, idx_))
            (loss / k).backward()
            loss.item()  # the loop logs its loss, as tk-run does
        opt.step()
        opt.zero_grad()
    print(f"ms_per_step {1000 * (time.perf_counter() - start) / (steps - warmup):.4f}")


if __name__ == "__main__":
    main()
