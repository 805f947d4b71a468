"""SPECs for ``--backward`` tests: an MLP with a loss function, the same MLP whose activation has a
wrong backward kernel (gradient 1% too large; forward exact), and GPT-2 returning its own loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class _SiLUBadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s)) * 1.01


class Act(nn.Module):
    def __init__(self, bad_grad: bool = False) -> None:
        super().__init__()
        self.bad_grad = bad_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SiLUBadGrad.apply(x) if self.bad_grad else F.silu(x)


class MLP(nn.Module):
    def __init__(self, bad_grad: bool = False) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), Act(bad_grad), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _mlp(bad_grad: bool) -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return MLP(bad_grad), (x,), lambda out: F.mse_loss(out, y)


def mlp() -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    return _mlp(False)


def mlp_bad_grad() -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    return _mlp(True)


def gpt2_own_loss() -> tuple[Any, dict[str, torch.Tensor]]:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_gpt2_spec", Path(__file__).with_name("transformers_specs.py"))
    assert spec is not None and spec.loader is not None
    specs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(specs)
    model, inputs = specs.gpt2()
    return model, {**inputs, "labels": inputs["input_ids"]}
