"""Published checkpoints read by `[model] pretrained`, against forwards written here from each
layout's own definition, in float64: a Hugging Face GPT-2 folder (Conv1D weights [in, out], GELU in
its tanh form, tied head), a Hugging Face Llama folder in two shards with grouped-query attention,
RoPE at theta 500000, RMSNorm and an untied head, and llm.c's GPT-2 .bin with a padded vocabulary.
Random float32 weights are written in each layout; `tk-sample RECIPE --ids ... --logits FILE`
gives trainkit's logits, which must agree with the reference's to 1e-10. Then the refusals: a
checkpoint that lacks a tensor, holds one more, holds one of another shape or dtype, a
configuration field trainkit cannot honour, a recipe that sets a shape option too.

With NANOGPT_MODEL_PY (nanoGPT's model.py) set, the GPT-2 folder (with exact GELU, as nanoGPT has)
is also checked against nanoGPT's GPT, its weights loaded as nanoGPT's from_pretrained maps them.
With LLMC_TRAIN_LLAMA3 (llm.c's train_llama3.py) set, the Llama folder is checked against its LLaMA
(Meta's interleaved RoPE, the weights un-permuted from Hugging Face's layout by its own code); its
RoPE and RMSNorm compute in float32 by design, so there the logits agree to float32's precision.

Out the same way: `tk-export RECIPE --format huggingface|llmc` writes each model back; the files
hold the checkpoint's tensors exactly (llm.c's .bin byte for byte), a Llama exported past
--max-shard-size is sharded with an index, and each exported checkpoint, read back, gives the
same logits.

usage: python3 check_pretrained.py TK_SAMPLE TK_EXPORT WORK"""
import collections
import importlib.util
import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import torch
import torch.nn.functional as F

TK_SAMPLE, TK_EXPORT, WORK = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir(parents=True)
torch.manual_seed(0)

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.int64: "I64"}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.contiguous().numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        dtype = {"F64": torch.float64, "F32": torch.float32}[e["dtype"]]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=dtype).reshape(e["shape"])
    return out


def write_shard(path, vocab, count):
    """An llm.c-format token shard (magic 20240520, version 1: uint16 ids)."""
    ids = torch.randint(0, vocab, (count,), dtype=torch.int32)
    header = [20240520, 1, count] + [0] * 253
    path.write_bytes(struct.pack("<256i", *header) + ids.to(torch.int16).numpy().tobytes())


def recipe(folder, pretrained, vocab, seq_len, extra=""):
    folder.mkdir(exist_ok=True)
    shard = folder / "train_000.bin"
    write_shard(shard, vocab, 4 * (seq_len + 1))
    text = f"""[run]
name = "pretrained"
steps = 1
dtype = "float64"

[model]
pretrained = "{pretrained}"
{extra}
[data]
name = "tokens"
train = "{shard}"
vocab = {vocab}
seq_len = {seq_len}

[batch]
micro_batch = 2

[optimizer]
name = "adamw"
lr = 1e-4
"""
    path = folder / "recipe.toml"
    path.write_text(text)
    return path


def tk_logits(recipe_path, ids):
    out = recipe_path.parent / "logits.safetensors"
    r = subprocess.run([TK_SAMPLE, str(recipe_path), "--ids", " ".join(map(str, ids)), "--logits", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"tk-sample failed:\n{r.stdout}\n{r.stderr}"
    return read_safetensors(out)["logits"]


def tk_refuses(recipe_path, *expected):
    r = subprocess.run([TK_SAMPLE, str(recipe_path), "--ids", "1 2", "--logits", str(recipe_path.parent / "x")],
                       capture_output=True, text=True, timeout=120)  # a pipe read as a checkpoint would wait forever
    said = r.stdout + r.stderr
    assert r.returncode != 0, f"accepted {recipe_path}:\n{said}"
    for e in expected:
        assert e in said, f"expected {e!r} in:\n{said}"
    print(f"refused, as it should be: {said.strip().splitlines()[0][:160]} ...")


def tk_export(recipe_path, fmt, out, *args):
    r = subprocess.run([TK_EXPORT, str(recipe_path), "--format", fmt, "--out", str(out), *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"tk-export failed:\n{r.stdout}\n{r.stderr}"
    return out


def same_tensors(name, got, want):
    assert sorted(got) == sorted(want), f"{name}: names {sorted(set(got) ^ set(want))} differ"
    for k in want:
        assert got[k].shape == want[k].shape and torch.equal(got[k], want[k].to(got[k].dtype)), f"{name}: '{k}' differs"
    print(f"{name}: {len(want)} tensors, each equal to the checkpoint's")


def read_folder(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= read_safetensors(f)
    return out


def agree(name, tk, ref):
    ref = ref.to(torch.float64)
    assert tk.dtype == torch.float64, tk.dtype
    assert tk.shape == ref.shape, f"{name}: logits {list(tk.shape)}, the reference's {list(ref.shape)}"
    diff = (tk - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    print(f"{name}: logits {list(tk.shape)}, largest difference {diff:.3g} (largest logit {ref.abs().max().item():.3g})")
    assert diff <= 1e-10 * scale, f"{name}: trainkit's logits differ from the reference's by {diff}"


def causal(q, k, v):
    t, d = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


# ---------------------------------------------------------------- GPT-2 (Hugging Face, llm.c)

def gpt2_weights(L, C, V, T, inner):
    w = lambda *s: (torch.randn(*s) * 0.2).float()  # noqa: E731
    sd = {"wte.weight": w(V, C), "wpe.weight": w(T, C), "ln_f.weight": 1 + w(C), "ln_f.bias": w(C)}
    for i in range(L):
        p = f"h.{i}."
        sd |= {p + "ln_1.weight": 1 + w(C), p + "ln_1.bias": w(C), p + "attn.c_attn.weight": w(C, 3 * C),
               p + "attn.c_attn.bias": w(3 * C), p + "attn.c_proj.weight": w(C, C), p + "attn.c_proj.bias": w(C),
               p + "ln_2.weight": 1 + w(C), p + "ln_2.bias": w(C), p + "mlp.c_fc.weight": w(C, inner),
               p + "mlp.c_fc.bias": w(inner), p + "mlp.c_proj.weight": w(inner, C), p + "mlp.c_proj.bias": w(C)}
    return sd


def gpt2_reference(sd, ids, L, H, eps, tanh, vocab):
    """GPT-2 as published: Conv1D (x @ W + b), pre-LayerNorm blocks, tied head; a bias the weights
    lack is none (nanoGPT's bias = False)."""
    sd = {k: v.double() for k, v in sd.items()}
    b = lambda name: sd.get(name, 0.0)  # noqa: E731
    x = sd["wte.weight"][ids] + sd["wpe.weight"][: len(ids)]
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd.get(p + ".bias"), eps)  # noqa: E731
    for i in range(L):
        p = f"h.{i}."
        t, c = x.shape
        q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"] + b(p + "attn.c_attn.bias")).split(c, -1)
        q, k, v = (z.view(t, H, c // H).transpose(0, 1) for z in (q, k, v))
        y = causal(q, k, v).transpose(0, 1).reshape(t, c)
        x = x + y @ sd[p + "attn.c_proj.weight"] + b(p + "attn.c_proj.bias")
        h = ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"] + b(p + "mlp.c_fc.bias")
        h = F.gelu(h, approximate="tanh") if tanh else F.gelu(h)
        x = x + h @ sd[p + "mlp.c_proj.weight"] + b(p + "mlp.c_proj.bias")
    return ln(x, "ln_f") @ sd["wte.weight"][:vocab].T


L, C, H, V, T = 2, 32, 4, 300, 16
ids = torch.randint(0, V, (T,)).tolist()

gpt2 = WORK / "gpt2"
gpt2.mkdir()
sd = gpt2_weights(L, C, V, T, 4 * C)
config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_positions": T, "n_embd": C,
          "n_layer": L, "n_head": H, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
          "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "scale_attn_weights": True}
(gpt2 / "config.json").write_text(json.dumps(config))
# As GPT2LMHeadModel.save_pretrained writes it: "transformer." names, the causal-mask buffers.
saved = {"transformer." + k: v for k, v in sd.items()} | {f"transformer.h.{i}.attn.bias": torch.ones(1, 1, T, T).tril()
                                                          for i in range(L)}
write_safetensors(gpt2 / "model.safetensors", saved)
gpt2_logits = tk_logits(recipe(gpt2, gpt2, V, T), ids)
agree("Hugging Face GPT-2", gpt2_logits, gpt2_reference(sd, ids, L, H, 1e-5, True, V))
out = tk_export(gpt2 / "recipe.toml", "huggingface", WORK / "gpt2-out")
same_tensors("GPT-2 exported as a Hugging Face folder", read_folder(out), sd)
exported = json.loads((out / "config.json").read_text())
assert exported["model_type"] == "gpt2" and exported["activation_function"] == "gelu_new" and exported["n_layer"] == L
assert torch.equal(tk_logits(recipe(WORK / "gpt2-again", out, V, T), ids), gpt2_logits)

# llm.c's .bin of the same weights: Linear layout ([out, in]), the table padded to 320 rows.
Vp = 320
llmc = WORK / "llmc"
llmc.mkdir()
lin = {k: (v.T.contiguous() if k.endswith("weight") and ("c_attn" in k or "c_proj" in k or "c_fc" in k) else v)
       for k, v in sd.items()}
padded = torch.cat([lin["wte.weight"], torch.randn(Vp - V, C)])  # padding rows that must never reach a logit
order = [["wte.weight"], ["wpe.weight"]] + [[f"h.{i}.{n}" for i in range(L)] for n in (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")] + [
    ["ln_f.weight"], ["ln_f.bias"]]
blob = b"".join((padded if n == "wte.weight" else lin[n]).float().numpy().tobytes() for group in order for n in group)
header = [20240326, 3, T, V, L, H, C, Vp] + [0] * 248
(llmc / "gpt2.bin").write_bytes(struct.pack("<256i", *header) + blob)
agree("llm.c GPT-2 (padded vocabulary)", tk_logits(recipe(llmc, llmc / "gpt2.bin", V, T), ids),
      gpt2_reference(sd, ids, L, H, 1e-5, True, V))
out = tk_export(llmc / "recipe.toml", "llmc", WORK / "llmc-out" / "gpt2.bin")
assert out.read_bytes() == (llmc / "gpt2.bin").read_bytes(), "the exported .bin differs from the one read"
print("llm.c GPT-2 exported: the same bytes as the .bin it was read from")

# ---------------------------------------------------------------- Llama (Hugging Face)

KV, I, theta, eps = 2, 96, 500000.0, 1e-5  # I: what llm.c's MLP sizing gives for width 32, multiple_of 16
w = lambda *s: (torch.randn(*s) * 0.2).float()  # noqa: E731
D = C // H
llama_sd = {"model.embed_tokens.weight": w(V, C), "model.norm.weight": 1 + w(C), "lm_head.weight": w(V, C)}
for i in range(L):
    p = f"model.layers.{i}."
    llama_sd |= {p + "input_layernorm.weight": 1 + w(C), p + "self_attn.q_proj.weight": w(H * D, C),
                 p + "self_attn.k_proj.weight": w(KV * D, C), p + "self_attn.v_proj.weight": w(KV * D, C),
                 p + "self_attn.o_proj.weight": w(C, H * D), p + "post_attention_layernorm.weight": 1 + w(C),
                 p + "mlp.gate_proj.weight": w(I, C), p + "mlp.up_proj.weight": w(I, C), p + "mlp.down_proj.weight": w(C, I)}


def llama_reference(sd, ids):
    """Llama as Hugging Face's modeling_llama computes it: RMSNorm, RoPE by rotate_half with
    cos/sin of the angles repeated over both halves, keys and values repeated for their groups,
    SwiGLU, an untied head."""
    sd = {k: v.double() for k, v in sd.items()}
    t = len(ids)
    rms = lambda x, wt: wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    emb = torch.cat([torch.outer(torch.arange(t, dtype=torch.float64), inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    rotate_half = lambda x: torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1)  # noqa: E731
    rope = lambda x: x * cos + rotate_half(x) * sin  # noqa: E731
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(t, H, D).transpose(0, 1)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(t, KV, D).transpose(0, 1)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(t, KV, D).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k[:, None].expand(KV, H // KV, t, D).reshape(H, t, D)
        v = v[:, None].expand(KV, H // KV, t, D).reshape(H, t, D)
        x = x + causal(q, k, v).transpose(0, 1).reshape(t, H * D) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) @ \
            sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


llama = WORK / "llama"
llama.mkdir()
llama_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": C,
                "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                "max_position_embeddings": 64, "rms_norm_eps": eps, "rope_theta": theta, "hidden_act": "silu",
                "tie_word_embeddings": False, "attention_bias": False, "rope_scaling": None, "torch_dtype": "float32"}
(llama / "config.json").write_text(json.dumps(llama_config))
names = sorted(llama_sd)
shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
          "model-00002-of-00002.safetensors": names[len(names) // 2:]}
for file, part in shards.items():
    write_safetensors(llama / file, {n: llama_sd[n] for n in part})
(llama / "model.safetensors.index.json").write_text(json.dumps(
    {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
llama_logits = tk_logits(recipe(llama, llama, V, T), ids)
agree("Hugging Face Llama (2 shards, 4 heads on 2 key/value heads)", llama_logits, llama_reference(llama_sd, ids))
out = tk_export(llama / "recipe.toml", "huggingface", WORK / "llama-out", "--max-shard-size", "40KB")
index = json.loads((out / "model.safetensors.index.json").read_text())
assert len(set(index["weight_map"].values())) > 2, "expected shards past --max-shard-size"
for f in out.glob("*.safetensors"):  # a file holds 40 KB at most, or one tensor larger than that
    assert f.stat().st_size <= 40 * 1024 + 4096 or len(read_safetensors(f)) == 1, f
same_tensors(f"Llama exported in {len(set(index['weight_map'].values()))} shards", read_folder(out), llama_sd)
exported = json.loads((out / "config.json").read_text())
for key in ("num_key_value_heads", "num_attention_heads", "intermediate_size", "rope_theta", "rms_norm_eps",
            "tie_word_embeddings", "vocab_size", "hidden_size", "num_hidden_layers"):
    assert exported[key] == llama_config[key], (key, exported[key], llama_config[key])
assert torch.equal(tk_logits(recipe(WORK / "llama-again", out, V, T), ids), llama_logits)

# ---------------------------------------------------------------- nanoGPT's GPT, when given

if os.environ.get("NANOGPT_MODEL_PY"):
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.environ["NANOGPT_MODEL_PY"])
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    exact = WORK / "gpt2-exact-gelu"
    exact.mkdir()
    (exact / "config.json").write_text(json.dumps(config | {"activation_function": "gelu"}))
    write_safetensors(exact / "model.safetensors", sd)
    model = nano.GPT(nano.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, dropout=0.0, bias=True))
    # nanoGPT's from_pretrained: "transformer." names, Conv1D weights transposed into its Linears.
    state = {"transformer." + k: (v.T if any(k.endswith(s) for s in (
        "c_attn.weight", "c_proj.weight", "c_fc.weight")) else v) for k, v in sd.items()}
    state["lm_head.weight"] = sd["wte.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(".attn.bias") for k in missing), (missing, unexpected)
    model.double().eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref, _ = model(x, targets=x)  # with targets, the logits of every position
    agree("Hugging Face GPT-2 (exact GELU) against nanoGPT's model.py", tk_logits(recipe(exact, exact, V, T), ids), ref[0])
    # nanoGPT's own state_dict(), saved as its train.py saves it.
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    model.float()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": dict(n_layer=L, n_head=H, n_embd=C, block_size=T, bias=True, vocab_size=V, dropout=0.0),
                "iter_num": 0, "best_val_loss": 1e9, "config": {}}, WORK / "nano-own.pt")
    agree("nanoGPT's model.py, its state_dict() saved as train.py saves it", tk_logits(
        recipe(WORK / "nano-own", WORK / "nano-own.pt", V, T), ids), ref[0])

# ---------------------------------------------------------------- nanoGPT's ckpt.pt

def nanogpt_checkpoint(path, weights, args, compiled=False):
    """What nanoGPT's train.py saves: the model's state_dict() (an OrderedDict with _metadata, the
    tied head listed as well, the causal-mask buffers), AdamW's state, model_args, the loop's
    counters and its config."""
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    state = collections.OrderedDict()
    for k, v in weights.items():
        name = "transformer." + k
        state[("_orig_mod." if compiled else "") + name] = v.T.contiguous() if k.endswith(conv1d) else v
        if k.endswith("ln_2.weight"):
            state[("_orig_mod." if compiled else "") + name.replace("ln_2.weight", "attn.bias")] = \
                torch.ones(1, 1, T, T).tril()
    state[("_orig_mod." if compiled else "") + "lm_head.weight"] = state[("_orig_mod." if compiled else "") + "transformer.wte.weight"]
    state._metadata = collections.OrderedDict({"": {"version": 1}})
    params = [torch.nn.Parameter(v.clone()) for v in list(weights.values())[:3]]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    opt.step()
    torch.save({"model": state, "optimizer": opt.state_dict(), "model_args": args, "iter_num": 250,
                "best_val_loss": torch.tensor(1.4697), "config": {"out_dir": "out", "compile": compiled, "lr": 6e-4}}, path)


nano = WORK / "nanogpt"
nano.mkdir()
args = dict(n_layer=L, n_head=H, n_embd=C, block_size=T, bias=True, vocab_size=V, dropout=0.0)
nanogpt_checkpoint(nano / "ckpt.pt", sd, args, compiled=True)
agree("nanoGPT's ckpt.pt (compiled: _orig_mod. names)", tk_logits(recipe(nano, nano / "ckpt.pt", V, T), ids),
      gpt2_reference(sd, ids, L, H, 1e-5, False, V))
unbiased = {k: v for k, v in sd.items() if not k.endswith("bias")}
nano = WORK / "nanogpt-bias-false"
nano.mkdir()
nanogpt_checkpoint(nano / "ckpt.pt", unbiased, args | {"bias": False})
agree("nanoGPT's ckpt.pt (bias = False)", tk_logits(recipe(nano, nano / "ckpt.pt", V, T), ids),
      gpt2_reference(unbiased, ids, L, H, 1e-5, False, V))
torch.save({"wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"]}, WORK / "plain.pt")
tk_refuses(recipe(WORK / "plain", WORK / "plain.pt", V, T), "not nanoGPT's checkpoint", "[model] init")
torch.save({"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]}, WORK / "bare.pt")
tk_refuses(recipe(WORK / "bare", WORK / "bare.pt", V, T), "it holds nanoGPT's names without the model_args")

# ---------------------------------------------------------------- a few accumulated steps

def train_reference(weights, seqs, steps, per_step, forward):
    """AdamW on a published layout's own forward in float64: each step the mean next-token loss of
    `per_step` sequences, as trainkit's window of micro-batches takes it."""
    params = {k: v.double().clone().requires_grad_(True) for k, v in weights.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(steps):
        batch = seqs[step * per_step:(step + 1) * per_step]
        loss = sum(F.cross_entropy(forward(params, b[:-1].tolist()), b[1:], reduction="sum")
                   for b in batch) / (per_step * T)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


train = WORK / "steps-data"
train.mkdir()
count = 12 * T + 1
write_shard(train / "train_000.bin", V, count)
raw = (train / "train_000.bin").read_bytes()
tokens = torch.frombuffer(bytearray(raw[1024:1024 + 2 * count]), dtype=torch.int16).to(torch.int64) & 0xFFFF
seqs = tokens[torch.arange(12).unsqueeze(1) * T + torch.arange(T + 1)]


def train_steps(name, pretrained, forward, weights):
    """3 steps of trainkit from `pretrained` (float64, 2 micro-batches of 2 accumulated, AdamW), its
    weights exported, against train_reference's."""
    folder = WORK / name
    folder.mkdir()
    (folder / "recipe.toml").write_text(f"""[run]
name = "{name}"
output = "{folder / 'run'}"
steps = 3
dtype = "float64"
validate_every = 0

[model]
pretrained = "{pretrained}"

[data]
name = "tokens"
train = "{train / 'train_000.bin'}"
vocab = {V}
seq_len = {T}
shuffle = false

[batch]
micro_batch = 2
accumulation = 2

[optimizer]
name = "adamw"
lr = 0.001
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.1

[[plugins]]
name = "grad_accum"
""")
    r = subprocess.run([str(pathlib.Path(TK_SAMPLE).parent / "tk-run"), str(folder / "recipe.toml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    trained = read_folder(tk_export(folder / "run", "huggingface", folder / "exported"))
    want = train_reference(weights, seqs, 3, 4, forward)
    worst = max((trained[k] - want[k]).abs().max().item() for k in want)
    print(f"{name}: 3 AdamW steps of 2 micro-batches x 2 sequences, float64: weights within {worst:.3g} of the reference's")
    assert sorted(trained) == sorted(want) and worst <= 1e-10, worst


train_steps("gpt2-steps", gpt2, lambda p, ids: gpt2_reference(p, ids, L, H, 1e-5, True, V), sd)
train_steps("llama-steps", llama, llama_reference, llama_sd)

# ---------------------------------------------------------------- llm.c's LLaMA, when given

if os.environ.get("LLMC_TRAIN_LLAMA3"):
    # Its model's definitions alone (the file also imports tiktoken and torch 2's inductor).
    source = pathlib.Path(os.environ["LLMC_TRAIN_LLAMA3"]).read_text()
    start, end = source.index("def repeat_kv"), source.index("class Tokenizer")
    import dataclasses
    import typing
    space = {"math": math, "torch": torch, "nn": torch.nn, "F": F, "dataclass": dataclasses.dataclass,
             "Tuple": typing.Tuple, "Optional": typing.Optional, "List": typing.List, "Path": pathlib.Path}
    exec(compile(source[start:end], os.environ["LLMC_TRAIN_LLAMA3"], "exec"), space)
    cfg = space["LlamaConfig"](block_size=T, vocab_size=V, n_layer=L, n_head=H, n_kv_head=KV, n_embd=C,
                               ffn_dim_multiplier=None, multiple_of=16, norm_eps=eps, rope_theta=theta,
                               use_scaled_rope=False, use_kv=False, flash=False)
    model = space["LLaMA"](cfg)
    state = space["LLaMA"].adapt_llama_state_dict_keys_hf(dict(llama_sd), cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.double().eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref, _ = model(x, targets=x)
    ref, tk = ref[0].double(), llama_logits
    diff = (tk - ref).abs().max().item()
    print(f"Hugging Face Llama against llm.c's train_llama3.py: largest difference {diff:.3g} (its RoPE and RMSNorm in float32)")
    assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), "llm.c's LLaMA disagrees with trainkit's"

# ---------------------------------------------------------------- other shapes of the same layouts

# GPT-2 with an MLP of n_inner, exact GELU and another epsilon.
inner = gpt2_weights(L, C, V, T, 48)
folder = WORK / "gpt2-inner"
folder.mkdir()
(folder / "config.json").write_text(json.dumps(config | {"n_inner": 48, "activation_function": "gelu",
                                                         "layer_norm_epsilon": 1e-6}))
write_safetensors(folder / "model.safetensors", inner)
agree("Hugging Face GPT-2 (n_inner 48, exact GELU, epsilon 1e-6)", tk_logits(recipe(folder, folder, V, T), ids),
      gpt2_reference(inner, ids, L, H, 1e-6, False, V))

# llm.c's bfloat16 checkpoint (version 5): the reference computes with the bfloat16 values.
rounded = {k: v.to(torch.bfloat16) for k, v in sd.items()}
lin16 = {k: (v.T.contiguous() if k.endswith("weight") and ("c_attn" in k or "c_proj" in k or "c_fc" in k) else v)
         for k, v in rounded.items()}
table16 = torch.cat([lin16["wte.weight"], torch.zeros(Vp - V, C, dtype=torch.bfloat16)])
blob = b"".join((table16 if n == "wte.weight" else lin16[n]).contiguous().view(torch.int16).numpy().tobytes()
                for group in order for n in group)
folder = WORK / "llmc-bf16"
folder.mkdir()
(folder / "gpt2.bin").write_bytes(struct.pack("<256i", *([20240326, 5, T, V, L, H, C, Vp] + [0] * 248)) + blob)
agree("llm.c GPT-2 in bfloat16 (version 5)", tk_logits(recipe(folder, folder / "gpt2.bin", V, T), ids),
      gpt2_reference({k: v.double() for k, v in rounded.items()}, ids, L, H, 1e-5, True, V))

# Llama with its head tied to the table (no lm_head.weight saved).
tied = {k: v for k, v in llama_sd.items() if k != "lm_head.weight"}
folder = WORK / "llama-tied"
folder.mkdir()
(folder / "config.json").write_text(json.dumps(llama_config | {"tie_word_embeddings": True}))
write_safetensors(folder / "model.safetensors", tied)
agree("Hugging Face Llama (tied head)", tk_logits(recipe(folder, folder, V, T), ids),
      llama_reference(tied | {"lm_head.weight": tied["model.embed_tokens.weight"]}, ids))

# ---------------------------------------------------------------- refusals


def variant(name, tensors, cfg=config, extra=""):
    folder = WORK / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    write_safetensors(folder / "model.safetensors", tensors)
    return recipe(folder, folder, V, T, extra)


without = dict(sd)
del without["h.1.mlp.c_fc.bias"]
tk_refuses(variant("lacks", without), "'blocks.1.fc.bias': the checkpoint lacks it")
tk_refuses(variant("extra", sd | {"h.0.attn.c_attn.scale": w(3)}), "model.safetensors 'h.0.attn.c_attn.scale'")
tk_refuses(variant("misshapen", sd | {"h.0.mlp.c_fc.weight": w(4 * C, C)}),
           "'blocks.0.fc.weight' (from model.safetensors 'h.0.mlp.c_fc.weight' (transposed)): shape [32, 128]")
tk_refuses(variant("integers", sd | {"ln_f.bias": torch.zeros(C, dtype=torch.int64)}), "'ln_f.bias'", "not floating point")
tk_refuses(variant("unhonoured", sd, config | {"scale_attn_by_inverse_layer_idx": True}),
           "config.json", "'scale_attn_by_inverse_layer_idx' = true")
tk_refuses(variant("shape-set", sd, extra="layers = 3\n"), "model.layers", "is set by the checkpoint")
tk_refuses(variant("untied-head", sd | {"lm_head.weight": w(V, C)}), "ties the head to the token table")
swapped = dict(llama_sd)
swapped["model.layers.0.self_attn.q_proj.weight"] = w(KV * D, C)  # a query projection with the keys' rows
swapped["model.layers.0.self_attn.k_proj.weight"] = w(H * D, C)
folder = WORK / "llama-swapped"
folder.mkdir()
(folder / "config.json").write_text(json.dumps(llama_config))
write_safetensors(folder / "model.safetensors", swapped)
tk_refuses(recipe(folder, folder, V, T), "'model.layers.0.self_attn.q_proj.weight': shape [16, 32]",
           "a piece of 'blocks.0.attn.qkv.weight' is [32, 32]")
tk_refuses(variant("heads-5", sd, config | {"n_head": 5}), "config.json: width 32 is not divisible by 5 heads")
tk_refuses(variant("nan", sd | {"ln_f.bias": torch.full((C,), float("nan"))}),
           "holds values that are not finite", "'ln_f.bias' (from model.safetensors 'ln_f.bias'): 32 of its 32 values")
# The data against the shape the configuration states (before any tensor is read), which the tensors are held to.
tk_refuses(variant("config-vocab", sd, config | {"vocab_size": 512}),
           f"predicts a vocabulary of 512 tokens by its configuration, the data's is {V}", "or mend its configuration")
tk_refuses(recipe(WORK / "data-vocab", gpt2, V + 1, T), f"predicts a vocabulary of {V} tokens by its configuration, the data's is {V + 1}")
# Files of another kind, or that are no file, given as the checkpoint: said as such, at once.
os.mkfifo(WORK / "pipe.bin")
tk_refuses(recipe(WORK / "pipe", WORK / "pipe.bin", V, T), "pipe.bin: not a regular file (a pipe or a device?)")
folder = WORK / "config-folder"
(folder / "config.json").mkdir(parents=True)
write_safetensors(folder / "model.safetensors", sd)
tk_refuses(recipe(folder, folder, V, T), "config.json: not a regular file (a folder, a pipe or a device)")
tk_refuses(recipe(WORK / "one-file", gpt2 / "model.safetensors", V, T),
           "model.safetensors: a safetensors file: give the folder that holds it with its config.json")
tk_refuses(recipe(WORK / "json-file", gpt2 / "config.json", V, T), "config.json: a JSON file: give the folder that holds it")
torch.save(sd, WORK / "legacy.pt", _use_new_zipfile_serialization=False)
tk_refuses(recipe(WORK / "legacy", WORK / "legacy.pt", V, T), "a torch.save file in the legacy format (a pickle, not a zip)")
short = WORK / "short.bin"
short.write_bytes((llmc / "gpt2.bin").read_bytes()[:-4])
tk_refuses(recipe(WORK / "short-bin", short, V, T), "bytes, but a 2-layer GPT-2")
r = subprocess.run([TK_EXPORT, str(llama / "recipe.toml"), "--format", "llmc", "--out", str(WORK / "x.bin")],
                   capture_output=True, text=True)
assert r.returncode == 1 and "llm.c's .bin holds GPT-2, and this GPT has rotary positions" in r.stderr, r.stderr
r = subprocess.run([TK_EXPORT, str(gpt2 / "recipe.toml"), "--format", "huggingface", "--out", str(WORK / "gpt2-out")],
                   capture_output=True, text=True)
assert r.returncode == 1 and "exists and is not an empty folder" in r.stderr, r.stderr
# llm.c's one file, never over one that is there (the run's own pretrained .bin here) or a folder.
before = (llmc / "gpt2.bin").read_bytes()
for out, said in ((llmc / "gpt2.bin", "gpt2.bin exists: export into a new file"), (WORK, "is a folder: llm.c's format is one file")):
    r = subprocess.run([TK_EXPORT, str(llmc / "recipe.toml"), "--format", "llmc", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 1 and said in r.stderr, r.stderr
assert (llmc / "gpt2.bin").read_bytes() == before, "tk-export wrote over the .bin the run was read from"
print("published checkpoints: all agree, all refusals name what is wrong, every export reads back the same")
