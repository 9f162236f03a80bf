#!/usr/bin/env python3
"""TorchScript models that do not fit 8-feature data of 10 classes, for bad_input.py.

    make_bad_models.py DIR
"""
import sys

import torch


class TwoArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)

    def forward(self, x, y):
        return self.l(x) + y


class Flat(torch.nn.Module):  # one value per example: [N]
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.l(x).sum(1)


class FiveOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.l(x)


class Wide(torch.nn.Module):  # expects 64 features
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.l(x)


class Ints(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.l(x).long()


class Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)
        for p in self.l.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.l(x)


class NanOut(torch.nn.Module):  # finite parameters and inputs, a NaN output
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.l(x) * float("nan")


class Detached(torch.nn.Module):  # its output does not depend on its parameters for autograd
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.l(x).detach()


for name, model in [("two_args", TwoArgs()), ("flat", Flat()), ("five_out", FiveOut()), ("wide", Wide()),
                    ("ints", Ints()), ("frozen", Frozen()), ("nan_out", NanOut()), ("detached", Detached())]:
    torch.jit.save(torch.jit.script(model), "%s/%s.ts" % (sys.argv[1], name))
