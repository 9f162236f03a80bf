"""recipes/speedrun.toml's training written by hand in Python (Debian's python3-torch), for a
side-by-side race: the same GPT as bench/gpt_loop.py (4 layers x 128, 4 heads, tied head, rotary
positions, RMSNorm, GPT-2's initialization) over the vocabulary of the shards, the same llm.c-format shards read by hand, sequences of 128, 4
micro-batches of 16 (mean loss, each scaled by 1/4) per AdamW step (lr 3e-3, betas 0.9/0.95,
weight decay 0.1) on the recipe's warmup-cosine schedule, a seeded shuffle per epoch; it stops at
STEPS steps or once SECONDS have passed at a step's end, then validates on every validation
sequence. Prints "step N loss L seconds S" every 100 steps, then steps, tokens_per_s and val_loss.

usage: python3 speedrun_loop.py TRAIN_SHARD VAL_SHARD SECONDS STEPS
"""
import math
import pathlib
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpt_loop import Gpt  # noqa: E402

T, B, K, WARMUP, BASE, MIN_LR = 128, 16, 4, 50, 3e-3, 3e-4


def shard(path):
    raw = pathlib.Path(path).read_bytes()
    magic, version, count = struct.unpack("<3i", raw[:12])
    assert magic == 20240520 and version == 1 and len(raw) == 1024 + 2 * count, path
    return torch.frombuffer(bytearray(raw[1024:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def sequences(tokens):
    n = (tokens.numel() - 1) // T
    idx = torch.arange(n).unsqueeze(1) * T + torch.arange(T + 1)
    return tokens[idx]  # [n, T + 1]


def init_gpt2(model, layers):
    """GPT-2's initialization, as trainkit's GPT has it: N(0, 0.02) weights and embeddings, zero
    biases, the residual projections at 0.02 / sqrt(2 * layers)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.Embedding):
                m.weight.normal_(0.0, 0.02)
        for b in model.blocks:
            for w in (b.proj.weight, b.out.weight):
                w.normal_(0.0, 0.02 / math.sqrt(2 * layers))


def lr_at(step, total):
    if step < WARMUP:
        return BASE * (step + 1) / WARMUP
    t = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return MIN_LR + 0.5 * (BASE - MIN_LR) * (1 + math.cos(math.pi * t))


def main() -> None:
    train_path, val_path, seconds, steps = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    train, val = shard(train_path), shard(val_path)
    vocab = int(max(train.max(), val.max())) + 1
    xs, vs = sequences(train), sequences(val)
    torch.manual_seed(1)
    model = Gpt(4, 128, 4, T, vocab, rotary=True, rms=True)
    init_gpt2(model, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=BASE, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    order, at, step, tokens = torch.randperm(xs.shape[0], generator=gen), 0, 0, 0
    start = time.perf_counter()
    while step < steps and time.perf_counter() - start < seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        total = 0.0
        for _ in range(K):
            if at + B > order.numel():
                order, at = torch.randperm(xs.shape[0], generator=gen), 0
            batch = xs[order[at:at + B]]
            at += B
            loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
            (loss / K).backward()
            total += loss.item() / K
            tokens += batch[:, 1:].numel()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss {total:.4f} seconds {time.perf_counter() - start:.1f}", flush=True)
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1), reduction="sum").item()
                  for b in vs.split(64)]
    print(f"steps {step}")
    print(f"tokens_per_s {tokens / elapsed:.1f}")
    print(f"val_loss {sum(losses) / (vs.shape[0] * T):.4f}")


if __name__ == "__main__":
    main()
