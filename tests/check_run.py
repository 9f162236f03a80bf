"""Checks a finished run's output folder from Python: the weights load with torch.load, the
same weights read from weights.safetensors with struct, json and torch.frombuffer (no safetensors
package), the metrics have one record per optimizer step, and the loss fell."""
import json
import pathlib
import struct
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

# weights.safetensors, read by the format's definition: u64 little-endian header length, a JSON
# header of name -> {dtype, shape, data_offsets}, then the raw little-endian data.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
raw = (run / "weights.safetensors").read_bytes()
(n,) = struct.unpack("<Q", raw[:8])
assert n % 8 == 0, f"header length {n} is not a multiple of 8"
header = json.loads(raw[8:8 + n])
data = bytearray(raw[8 + n:])
names = [k for k in header if k != "__metadata__"]
assert sorted(names) == sorted(weights), (sorted(names), sorted(weights))
end = 0
for name in names:
    e = header[name]
    begin, stop = e["data_offsets"]
    assert begin == end, f"{name}: data not packed in order ({begin} after {end})"
    end = stop
    dtype = DTYPES[e["dtype"]]
    size = torch.empty(0, dtype=dtype).element_size()  # torch 1.13's dtypes have no itemsize
    t = (torch.frombuffer(data, dtype=dtype, count=(stop - begin) // size, offset=begin).reshape(e["shape"])
         if stop > begin else torch.empty(e["shape"], dtype=dtype))
    assert torch.equal(t, weights[name]), f"{name} differs between weights.safetensors and weights.pt"
assert end == len(data), f"{len(data) - end} bytes after the last tensor"

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
