"""Writes a data set the way a user would prepare one in Python: torch.save of a dict of tensors.

usage: python3 make_tensor_data.py OUT.pt
"""
import pathlib
import sys

import torch

out = pathlib.Path(sys.argv[1])
out.parent.mkdir(parents=True, exist_ok=True)

g = torch.Generator().manual_seed(0)
inputs = torch.randn(1024, 6, generator=g)
teacher = torch.randn(6, 3, generator=g)
targets = (inputs @ teacher).argmax(1)
torch.save({"inputs": inputs, "targets": targets}, out)
print(f"wrote {sys.argv[1]}: inputs {tuple(inputs.shape)}, targets {tuple(targets.shape)}")
