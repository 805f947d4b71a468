"""FP8 GEMMs through torch's real float8 dtypes and its scaled matmul kernel ``torch._scaled_mm``.

The weight is quantized once and the input on every call to ``float8_e4m3fn`` / ``float8_e5m2``
with a scale ``amax / finfo.max``, either one per tensor or one per row (per output channel of
the weight, per token of the input: "rowwise", as in FP8 LLM serving). ``_scaled_mm`` multiplies
the float8 operands, applies both scales and the bias, and returns the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from hooks.gemm import Gemm

FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
SCALINGS = ("tensor", "row")


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``x ~= q.float() * scale``: ``scale`` is ``[]`` per tensor or ``[rows, 1]``
    per row, ``amax / finfo(dtype).max`` (1 where the amax is 0)."""
    fmax = torch.finfo(dtype).max
    xf = x.detach().float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def quantize_dequantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = False) -> torch.Tensor:
    """``x`` rounded through ``dtype`` (:func:`quantize`, then back to ``x``'s dtype; stays on device)."""
    q, scale = quantize(x, dtype, rowwise)
    return (q.float() * scale).to(x.dtype)


class FP8Linear(nn.Module):
    """A GEMM-like module run as ``torch._scaled_mm`` on float8 weight and input."""

    opband_quantized = True

    def __init__(self, gemm: Gemm, dtype: torch.dtype, scaling: str = "tensor") -> None:
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, not {scaling!r}")
        self.fp8_dtype, self.rowwise = dtype, scaling == "row"
        self.out_features, self.in_features = gemm.weight.shape
        q, scale = quantize(gemm.weight, dtype, self.rowwise)
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scale.t() if self.rowwise else scale)  # [1, out] per row
        self.register_buffer("bias", None if gemm.bias is None else gemm.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q, scale = quantize(x.reshape(-1, shape[-1]), self.fp8_dtype, self.rowwise)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale, bias=bias,
                               out_dtype=x.dtype)
        return out.reshape(*shape[:-1], self.out_features)
