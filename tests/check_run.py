"""Checks a finished run's output folder from Python: the weights load with torch.load, the
metrics have one record per optimizer step, and the loss fell."""
import json
import pathlib
import sys

import torch

run = pathlib.Path(sys.argv[1])
# A plain torch.load, as safe as it gets: weights_only where this torch has it.
try:
    weights = torch.load(run / "weights.pt", weights_only=True)
except TypeError:  # torch < 1.13 has no weights_only
    weights = torch.load(run / "weights.pt")
assert isinstance(weights, dict) and weights, "weights.pt is not a non-empty dict"
for name, t in weights.items():
    assert isinstance(t, torch.Tensor), f"{name} is not a tensor"
    assert torch.isfinite(t).all(), f"{name} has non-finite values"
assert "head.weight" in weights, sorted(weights)

steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
train = [s for s in steps if "loss" in s]
assert [s["step"] for s in train] == list(range(1, len(train) + 1)), "steps are not 1..N"
for key in ("step", "epoch", "loss", "lr", "samples", "wall_time"):
    assert all(key in s for s in train), f"a record lacks {key}"
first = sum(s["loss"] for s in train[:10]) / 10
last = sum(s["loss"] for s in train[-10:]) / 10
assert last < 0.5 * first, f"loss did not fall enough: {first:.4f} -> {last:.4f}"
assert (run / "recipe.toml").read_text().startswith("# resolved"), "recipe.toml is not the resolved recipe"
print(f"python check: {len(weights)} tensors, {len(train)} steps, loss {first:.3f} -> {last:.3f}")
