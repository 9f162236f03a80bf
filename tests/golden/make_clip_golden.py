"""Writes clip_golden.pt: gradients before and after PyTorch's clip_grad_norm_ / clip_grad_value_.

Run with Debian's python3-torch:  /usr/bin/python3 tests/golden/make_clip_golden.py
The C++ test (tests/strategies/strategies_test.cpp) applies trainkit's clip plugin to the same
gradients and compares. Keys: "<case>.in.<i>", "<case>.out.<i>", "<case>.total_norm" (norm cases),
"<case>.max_norm", "<case>.norm_type", "<case>.max_value" (0-dim float64 tensors).
"""
import math
import pathlib

import torch

SHAPES = [(3, 4), (5,), (2, 2, 3)]
NORM_CASES = [  # name, max_norm, norm_type
    ("l2_clipped", 1.0, 2.0),
    ("l2_untouched", 1000.0, 2.0),
    ("l1_clipped", 0.5, 1.0),
    ("p3_clipped", 0.7, 3.0),
    ("inf_clipped", 0.1, math.inf),
]
VALUE_CASES = [("value", 0.3)]


def grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [2.0 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def params_with(gs):
    ps = [torch.zeros_like(g, requires_grad=True) for g in gs]
    for p, g in zip(ps, gs):
        p.grad = g.clone()
    return ps


def main():
    out = {}
    for seed, (name, max_norm, norm_type) in enumerate(NORM_CASES):
        gs = grads(seed)
        ps = params_with(gs)
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
        for i, (g, p) in enumerate(zip(gs, ps)):
            out[f"{name}.in.{i}"] = g
            out[f"{name}.out.{i}"] = p.grad
        out[f"{name}.total_norm"] = total.to(torch.float64)
        out[f"{name}.max_norm"] = torch.tensor(max_norm, dtype=torch.float64)
        out[f"{name}.norm_type"] = torch.tensor(norm_type, dtype=torch.float64)
    for seed, (name, max_value) in enumerate(VALUE_CASES, start=100):
        gs = grads(seed)
        ps = params_with(gs)
        torch.nn.utils.clip_grad_value_(ps, max_value)
        for i, (g, p) in enumerate(zip(gs, ps)):
            out[f"{name}.in.{i}"] = g
            out[f"{name}.out.{i}"] = p.grad
        out[f"{name}.max_value"] = torch.tensor(max_value, dtype=torch.float64)
    path = pathlib.Path(__file__).with_name("clip_golden.pt")
    torch.save(out, path)
    print(f"wrote {path} ({len(out)} tensors) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
