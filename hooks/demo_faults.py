"""Demo targets with a realistic porting bug, so ``opband demo`` shows a failure being localized."""

from __future__ import annotations

import torch
from torch import nn

from hooks.demo_model import build


class FastSigmoidSiLU(nn.Module):
    """SiLU with the cheap sigmoid approximation ``0.5 + 0.5 x / (1 + |x|)``: a plausible kernel bug."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (0.5 + 0.5 * x / (1 + x.abs()))


def build_fast_sigmoid_bug(layer: int = 2) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The demo decoder with layer ``layer``'s MLP activation replaced by :class:`FastSigmoidSiLU`."""
    model, inputs = build()
    model.model.layers[layer].mlp.act = FastSigmoidSiLU()  # same module path as the healthy model
    return model, inputs
