"""recipes/gpt-tiny.toml's model and step written by hand in Python (Debian's python3-torch): the
same GPT (pre-LayerNorm blocks, the causal attention of trainkit's GPT, tied head),
micro-batches of B sequences of T bytes accumulated K to a step with token normalization, AdamW.
Prints ms per optimizer step between steps WARMUP and STEPS.

usage: python3 gpt_loop.py LAYERS WIDTH HEADS T B K STEPS WARMUP [DEVICE] [modern]

On a CUDA DEVICE it also prints the peak of allocated GPU memory (peak_mib). With "modern" the GPT
has rotary positions and RMSNorm (model.position = "rotary", model.norm = "rmsnorm").
"""
import math
import sys
import time

import torch
import torch.nn.functional as F


class RmsNorm(torch.nn.Module):
    """x / sqrt(mean(x^2) + 1e-6) * weight (Python's torch 1.13 has no RMSNorm)."""

    def __init__(self, c: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x, base=10000.0):
    """Rotary positions on [B, H, T, D], feature i paired with i + D/2 (GPT-NeoX's form)."""
    t, half = x.shape[-2], x.shape[-1] // 2
    inv = base ** (torch.arange(half, dtype=torch.float64) * (-2.0 / (2 * half)))
    theta = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    cos, sin = theta.cos().to(x), theta.sin().to(x)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def causal_attention(q, k, v):
    """trainkit's GPT attention (tk/compat.h): PyTorch's fused kernel where torch has one (2.0+),
    else the scale and the causal mask folded into one baddbmm."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, h, t, d = q.shape
    future = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    s = torch.baddbmm(future.expand(b * h, t, t), q.reshape(b * h, t, d), k.reshape(b * h, t, d).transpose(1, 2),
                      alpha=1.0 / math.sqrt(d))
    return (s.softmax(-1) @ v.reshape(b * h, t, d)).view(b, h, t, d)


class Block(torch.nn.Module):
    def __init__(self, c: int, heads: int, rotary: bool = False, rms: bool = False):
        super().__init__()
        self.heads, self.rotary = heads, rotary
        norm = RmsNorm if rms else torch.nn.LayerNorm
        self.ln1, self.ln2 = norm(c), norm(c)
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.fc, self.out = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.rotary:
            q, k = rotate(q), rotate(k)
        x = x + self.proj(causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(torch.nn.Module):
    """Learned positions and LayerNorm, or (rotary, rms) rotary positions and RMSNorm."""

    def __init__(self, layers: int, c: int, heads: int, t: int, vocab: int = 256, rotary: bool = False,
                 rms: bool = False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, c)
        self.wpe = None if rotary else torch.nn.Embedding(t, c)
        self.blocks = torch.nn.ModuleList(Block(c, heads, rotary, rms) for _ in range(layers))
        self.ln_f = RmsNorm(c) if rms else torch.nn.LayerNorm(c)

    def forward(self, idx):
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


def main() -> None:
    layers, width, heads, t, b, k, steps, warmup = (int(a) for a in sys.argv[1:9])
    device = torch.device(sys.argv[9] if len(sys.argv) > 9 else "cpu")
    modern = len(sys.argv) > 10 and sys.argv[10] == "modern"
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(1)
    model = Gpt(layers, width, heads, t, rotary=modern, rms=modern).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, 256, (64, b, t + 1)).to(device)
    start = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
        tokens = 0
        for i in range(k):
            batch = data[(step * k + i) % 64]
            loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1), reduction="sum")
            loss.backward()
            tokens += batch[:, 1:].numel()
            loss.item()
        for p in model.parameters():
            p.grad /= tokens
        opt.step()
        opt.zero_grad()
    sync()
    print(f"ms_per_step {1000 * (time.perf_counter() - start) / (steps - warmup):.4f}")
    if cuda:
        print(f"peak_mib {torch.cuda.max_memory_allocated(device) / 2**20:.1f}")


if __name__ == "__main__":
    main()
