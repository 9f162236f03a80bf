"""GPT-2 124M (recipes/gpt2-124m.toml's model) written for the bench in Python with Debian's
python3-torch, the way nanoGPT's model.py writes it: learned positions, pre-LayerNorm blocks with
GELU MLPs, causal attention (PyTorch's fused scaled_dot_product_attention where it has one, the
masked softmax otherwise), the head tied to the token embedding, a vocabulary of 50304. Steps of
B sequences of T tokens from an llm.c-format shard with AdamW, as tk-run takes them.

usage: python3 gpt2_loop.py train SHARD B T STEPS WARMUP [bf16]
         prints "s_per_step S" (the median of the steps after WARMUP) and "loss L" (the last step's)
       python3 gpt2_loop.py llmc-weights FILE
         writes the model's initial weights as llm.c's gpt2_124M.bin (version 3, padded vocabulary)
"""
import ctypes
import math
import statistics
import struct
import sys
import time

import torch
import torch.nn.functional as F

LAYERS, HEADS, WIDTH, CONTEXT, VOCAB, PADDED = 12, 12, 768, 1024, 50257, 50304


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(WIDTH)
        self.c_attn = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln_2 = torch.nn.LayerNorm(WIDTH)
        self.c_fc = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp_proj = torch.nn.Linear(4 * WIDTH, WIDTH)

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(PADDED, WIDTH)
        self.wpe = torch.nn.Embedding(CONTEXT, WIDTH)
        self.h = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(WIDTH)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def shard_tokens(path):
    data = open(path, "rb").read()
    magic, _, count = struct.unpack_from("<3i", data)
    if magic != 20240520:
        sys.exit(f"{path}: not an llm.c token shard")
    ids = torch.frombuffer(bytearray(data[1024:1024 + 2 * count]), dtype=torch.int16)
    return ids.to(torch.int64) & 0xFFFF  # uint16 ids


def train(shard, b, t, steps, warmup, bf16):
    torch.manual_seed(1)
    tokens = shard_tokens(shard)
    model = Gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)  # as the recipe
    times, loss = [], None
    for step in range(steps):
        start = step * b * t % (tokens.numel() - b * t - 1)
        chunk = tokens[start:start + b * t + 1]
        x, y = chunk[:-1].view(b, t), chunk[1:].view(b, t)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, PADDED), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        print(f"step {step + 1} {times[-1]:.3f}s loss {loss.item():.4f}", file=sys.stderr, flush=True)
    print(f"s_per_step {statistics.median(times[warmup:]):.4f}")
    print(f"loss {loss.item():.4f}")


def llmc_weights(path):
    """llm.c's layout: a 256-int header, then each kind of tensor for all layers together."""
    torch.manual_seed(1)
    m = Gpt2()
    h = m.h
    stack = lambda f: torch.cat([f(blk).reshape(-1) for blk in h])  # noqa: E731
    tensors = [m.wte.weight, m.wpe.weight, stack(lambda k: k.ln_1.weight), stack(lambda k: k.ln_1.bias),
               stack(lambda k: k.c_attn.weight), stack(lambda k: k.c_attn.bias), stack(lambda k: k.c_proj.weight),
               stack(lambda k: k.c_proj.bias), stack(lambda k: k.ln_2.weight), stack(lambda k: k.ln_2.bias),
               stack(lambda k: k.c_fc.weight), stack(lambda k: k.c_fc.bias), stack(lambda k: k.mlp_proj.weight),
               stack(lambda k: k.mlp_proj.bias), m.ln_f.weight, m.ln_f.bias]
    header = [20240326, 3, CONTEXT, VOCAB, LAYERS, HEADS, WIDTH, PADDED] + [0] * 248
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        for x in tensors:
            x = x.detach().float().contiguous()
            f.write(ctypes.string_at(x.data_ptr(), 4 * x.numel()))


if __name__ == "__main__":
    if len(sys.argv) >= 7 and sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
              len(sys.argv) > 7 and sys.argv[7] == "bf16")
    elif len(sys.argv) == 3 and sys.argv[1] == "llmc-weights":
        llmc_weights(sys.argv[2])
    else:
        sys.exit(__doc__)
