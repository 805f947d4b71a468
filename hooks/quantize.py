"""Quantized replacements for GEMM-like modules, each calling one of torch's real quantized kernels.

- ``int8``: dynamic activations, per-channel int8 weights: torch.ao's dynamic ``Linear``
  (``quantized::linear_dynamic``, fbgemm/onednn on x86).
- ``w8a16``: weight-only int8, one scale per output channel, 16-bit activations:
  ``aten._weight_int8pack_mm``.
- ``w4a16``: weight-only asymmetric int4 in groups along the input dimension (GPTQ/AWQ layout:
  per group a scale and a zero point), 16-bit activations: ``aten._weight_int4pack_mm_for_cpu``.

Every replacement is built from a :class:`hooks.gemm.Gemm` (weight ``[out, in]``, bias) and keeps
the module path of what it replaces.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from hooks.gemm import Gemm

W4_GROUP_SIZES = (128, 64, 32)


class _WeightOnly(nn.Module):
    """Shared forward of the weight-only kernels: flatten to 2-D, matmul, add bias, restore shape."""

    opband_quantized = True

    def __init__(self, gemm: Gemm, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = gemm.weight.shape
        self.act_dtype = act_dtype
        self.register_buffer("bias", None if gemm.bias is None else gemm.bias.detach().to(act_dtype).clone())

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]).to(self.act_dtype).contiguous())  # the kernels want a dense A
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class W8A16Linear(_WeightOnly):
    """Weight-only int8 (symmetric, per output channel) through ``aten._weight_int8pack_mm``."""

    def __init__(self, gemm: Gemm, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(gemm, act_dtype)
        if self.in_features % 16:  # torch 2.13's CPU kernel reads past the row otherwise (a segfault, not an error)
            raise ValueError(f"in_features {self.in_features} is not a multiple of 16, which the kernel needs")
        w = gemm.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8).contiguous())
        self.register_buffer("scales", scale.to(act_dtype))

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)


class W4A16Linear(_WeightOnly):
    """Weight-only asymmetric int4, one (scale, zero) per ``group_size`` inputs of each output
    channel, through ``aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, gemm: Gemm, act_dtype: torch.dtype = torch.bfloat16, group_size: int | None = None) -> None:
        super().__init__(gemm, act_dtype)
        n, k = gemm.weight.shape
        g = group_size or next((s for s in W4_GROUP_SIZES if k % s == 0), None)
        if g is None or k % g:
            raise ValueError(f"in_features {k} is not a multiple of a group size {W4_GROUP_SIZES}")
        self.group_size = g
        w = gemm.weight.detach().float().reshape(n, k // g, g)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((w - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # the kernel computes (q - 8) * scale + zero: zero is the group minimum shifted by 8 steps
        zeros = lo + 8 * scale
        sz = torch.stack([scale.squeeze(-1).t(), zeros.squeeze(-1).t()], dim=-1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(act_dtype))

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)


def int8_dynamic(gemm: Gemm) -> nn.Module:
    """torch.ao's dynamic quantized Linear with per-channel int8 weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        out_f, in_f = gemm.weight.shape
        lin = nn.Linear(in_f, out_f, bias=gemm.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(gemm.weight.float())
            if gemm.bias is not None:
                lin.bias.copy_(gemm.bias.float())
        lin.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
        return DynamicLinear.from_float(lin)
