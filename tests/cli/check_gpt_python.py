"""A run of recipes/speedrun.toml (rotary positions, RMSNorm, tied head) checked against the same
GPT written independently in Python (bench/gpt_loop.py): trainkit's final weights, loaded by name
into the Python model, give the validation loss trainkit recorded at its last step, over every
validation sequence of the shard.

usage: python3 check_gpt_python.py RUN_DIR VAL_SHARD SOURCE_DIR"""
import json
import pathlib
import re
import struct
import sys

import torch
import torch.nn.functional as F

run, val_path, src = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
sys.path.insert(0, str(src / "bench"))
from gpt_loop import Gpt  # noqa: E402

recipe = (run / "recipe.toml").read_text()
T = int(re.search(r"^seq_len = (\d+)", recipe, re.M).group(1))
try:
    weights = torch.load(run / "weights.pt", weights_only=True)
except TypeError:
    weights = torch.load(run / "weights.pt")
layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks."))
vocab, width = weights["wte.weight"].shape
assert "wpe.weight" not in weights and "ln_f.bias" not in weights, "expected rotary positions and RMSNorm"

# trainkit's names -> the Python model's: attn.qkv -> qkv, attn.proj -> proj, the MLP's proj -> out.
def python_name(name: str) -> str:
    name = re.sub(r"^(blocks\.\d+\.)proj\.", r"\1out.", name)
    return re.sub(r"^(blocks\.\d+\.)attn\.", r"\1", name)


model = Gpt(layers, width, 4, T, vocab, rotary=True, rms=True)
state = {python_name(k): v for k, v in weights.items()}
missing, unexpected = model.load_state_dict(state, strict=False)
assert not missing and not unexpected, (missing, unexpected)

raw = pathlib.Path(val_path).read_bytes()
magic, version, count = struct.unpack("<3i", raw[:12])
assert magic == 20240520 and version == 1, val_path
tokens = torch.frombuffer(bytearray(raw[1024:1024 + 2 * count]), dtype=torch.int16).to(torch.int64) & 0xFFFF
n = (count - 1) // T
seqs = tokens[torch.arange(n).unsqueeze(1) * T + torch.arange(T + 1)]
model.eval()
with torch.no_grad():
    total = sum(F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1), reduction="sum").item()
                for b in seqs.split(64))
python_loss = total / (n * T)
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
tk_loss = [r["validation_loss"] for r in records if "validation_loss" in r][-1]
print(f"validation loss: trainkit {tk_loss:.6f}, Python with trainkit's weights {python_loss:.6f}")
assert abs(python_loss - tk_loss) <= 1e-4 * abs(tk_loss), "the Python GPT disagrees with trainkit's"
