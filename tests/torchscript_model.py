"""A TorchScript model trained by tk-run, checked against the same training in Python.

usage: python3 torchscript_model.py make DIR    writes DIR/model.pt (torch.jit.script), DIR/data.pt and
                                                DIR/model_bn.pt (the same with BatchNorm, for the
                                                accumulation verifier)
       python3 torchscript_model.py check RUN   RUN = DIR/run, the tk-run output folder
       python3 torchscript_model.py check-mix RUN   the same for a run that trains only mix.*
                                                (model.trainable = ["mix.*"]): the tied weight
                                                trains under its second name, the rest stays

`check` loads RUN/weights.pt, requires exactly the module's state_dict names (a tied weight under
both of its names) and loads it back with load_state_dict, and replays the recipe
(tests/fixtures/torchscript.toml: SGD with momentum, batches of 16 in file order made of 2
micro-batches of 8, or of 8 on each of 2 ranks) with torch.optim on the scripted module: the
parameters must agree to float32 precision. The module ties one weight to another (one tensor
under two names), which must be stepped once.
"""
import pathlib
import sys

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.mix = torch.nn.Linear(16, 16)
        self.mix.weight = self.body[2].weight  # tied: one parameter, two names
        self.head = torch.nn.Linear(16, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(torch.relu(self.body(x)))) * self.scale)


class NormNet(torch.nn.Module):
    """Net with BatchNorm1d inside its body: accumulation is not exact for it in training mode."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make(out: pathlib.Path):
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(Net()), str(out / "model.pt"))
    torch.jit.save(torch.jit.script(NormNet()), str(out / "model_bn.pt"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    torch.save({"inputs": x, "targets": y}, out / "data.pt")
    print(f"wrote {out}/model.pt and {out}/data.pt")


def check(run: pathlib.Path, only: str = ""):
    folder = run.parent
    try:
        weights = torch.load(run / "weights.pt", weights_only=True)
    except TypeError:
        weights = torch.load(run / "weights.pt")
    model = torch.jit.load(str(folder / "model.pt"))
    expected = list(model.state_dict())
    assert sorted(weights) == sorted(expected), f"names {sorted(weights)} != module's {sorted(expected)}"
    torch.jit.load(str(folder / "model.pt")).load_state_dict(weights)

    data = torch.load(folder / "data.pt")
    # By every name a parameter has (state_dict lists a tied one under both): chosen by either.
    named = model.state_dict(keep_vars=True)
    trained = [p for p in model.parameters() if any(q is p and n.startswith(only) for n, q in named.items())]
    opt = torch.optim.SGD(trained, lr=0.1, momentum=0.9)
    # Unoptimized execution, as tk-run runs it: no fuser JIT-compiling the graph.
    with torch.jit.optimized_execution(False):
        for _epoch in range(3):
            for start in range(0, 96, 16):
                opt.zero_grad()
                out = model(data["inputs"][start:start + 16])
                torch.nn.functional.cross_entropy(out, data["targets"][start:start + 16]).backward()
                opt.step()
    worst = 0.0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        worst = max(worst, (weights[name] - p.detach()).abs().max().item())
    initial = dict(torch.jit.load(str(folder / "model.pt")).named_parameters())
    moved = max((weights[n] - p.detach()).abs().max().item() for n, p in initial.items())
    assert moved > 1e-2, f"tk-run barely changed the parameters (max change {moved})"
    # What the recipe froze stayed as it was; the tied weight (body.2.weight is mix.weight) moved.
    for n, p in initial.items():
        kept = any(named[n] is q for q in trained)
        assert kept or torch.equal(weights[n], p.detach()), f"{n} was frozen but changed"
        assert not kept or not torch.equal(weights[n], p.detach()), f"{n} trains but did not change"
    assert worst < 1e-5, f"tk-run's parameters differ from torch.optim's by up to {worst}"
    print(f"python check: {len(weights)} tensors named as in the module; max |tk - torch.optim| = {worst:.2e} "
          f"after training moved them by up to {moved:.3f}")


if __name__ == "__main__":
    mode, path = sys.argv[1], pathlib.Path(sys.argv[2])
    {"make": make, "check": check, "check-mix": lambda run: check(run, "mix.")}[mode](path)
