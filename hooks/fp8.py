"""FP8 emulation for ``nn.Linear``: weights and activations are quantized to float8 with one
per-tensor scale and dequantized before an ordinary matmul (no FP8 kernels are called).

``FP8Linear`` subclasses ``nn.Linear`` and replaces it at the same attribute, so module paths
(``model.layers.0.mlp.down_proj``) and parameter names stay those of the fp32 model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


def quantize_dequantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` through ``dtype`` with a per-tensor scale ``amax / finfo.max`` (stays on device)."""
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return (q.float() * scale).to(x.dtype)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose weight (once) and input (every call) go through FP8."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> FP8Linear:
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)  # same parameters, buffers, hooks and flags
        new.fp8_dtype = dtype
        with torch.no_grad():
            new.register_buffer("weight_fp8", quantize_dequantize(linear.weight, dtype), persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(quantize_dequantize(x, self.fp8_dtype), self.weight_fp8, self.bias)


def convert(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) with an :class:`FP8Linear`; returns it."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, FP8Linear.from_linear(child, dtype))
    if type(model) is nn.Linear:
        return FP8Linear.from_linear(model, dtype)
    return model
