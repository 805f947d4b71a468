"""What capture stores for one tensor: its payload bytes, its dtype name, its on-device statistics."""

from __future__ import annotations

from typing import Any

import torch

#: Ops that move no numbers: views, reshapes, aliasing, metadata. Skipped and counted by default.
NO_NUMBER_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.detach", "aten.alias",
    "aten.as_strided", "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.chunk",
    "aten.unbind", "aten.flatten", "aten.unflatten", "aten.view_as", "aten.expand_as", "aten.lift_fresh",
    "aten.clone", "aten.contiguous", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_same_size", "aten._local_scalar_dense",
    "aten.item", "aten.new_empty", "aten.new_empty_strided", "aten.set_", "aten.resize_", "aten.narrow",
    "aten.movedim", "aten.diagonal", "aten.unfold", "aten.real", "aten.imag", "aten.view_as_real",
    "aten.view_as_complex", "aten._has_compatible_shallow_copy_type", "aten.lift_fresh_copy",
})

_TAGS = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
SAMPLE_SIZE = 16
_STAT_FIELDS = ("numel", "min", "max", "mean", "std", "l2", "absmax", "nan", "inf", "zeros")


def tensor_dtype_name(t: torch.Tensor) -> str:
    """``float32``, ``bfloat16``, ``qint8`` …: the dtype name without the ``torch.`` prefix."""
    return str(t.dtype).removeprefix("torch.")


def unsupported_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be captured (sparse, nested, meta, complex …), or None when it can."""
    if t.is_sparse or t.layout not in (torch.strided,):
        return f"layout {t.layout} is not captured"
    if getattr(t, "is_nested", False):
        return "nested tensors are not captured"
    if t.device.type == "meta":
        return "meta tensors have no values"
    if t.is_complex():
        return "complex tensors are not captured yet"
    if not t.is_quantized and t.dtype not in _TAGS:
        return f"dtype {t.dtype} has no bundle encoding"
    return None


def stored_payload(t: torch.Tensor) -> tuple[torch.Tensor, str, dict[str, Any] | None]:
    """(tensor whose bytes are stored, safetensors tag, quantization params or None)."""
    t = t.detach()
    if t.is_quantized:
        qparams: dict[str, Any] = {"qscheme": str(t.qscheme()).removeprefix("torch."), "dtype": tensor_dtype_name(t)}
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            qparams.update(scale=float(t.q_scale()), zero_point=int(t.q_zero_point()))
        else:
            qparams.update(axis=int(t.q_per_channel_axis()))
        return t.dequantize(), "F32", qparams
    raw = _RAW_VIEW.get(t.dtype)
    if raw is not None:
        return t.contiguous().view(raw), _TAGS[t.dtype], None
    return t, _TAGS[t.dtype], None


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The numeric values of a captured tensor (dequantized), on its device."""
    t = t.detach()
    return t.dequantize() if t.is_quantized else t


class StatsBatch:
    """Per-tensor statistics kept on the device and moved to the host once, at the end."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []

    def add(self, payload: torch.Tensor, original: torch.Tensor) -> int | None:
        values = values_of(original)
        if values.numel() == 0:
            return None
        self._rows.append(device_stats(values))
        return len(self._rows) - 1

    def to_host(self) -> list[dict[str, Any]]:
        if not self._rows:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, row in enumerate(self._rows):
            by_device.setdefault(row.device, []).append(i)
        host: list[torch.Tensor | None] = [None] * len(self._rows)
        for idxs in by_device.values():
            stacked = torch.stack([self._rows[i] for i in idxs]).to("cpu", torch.float64)
            for i, row in zip(idxs, stacked, strict=True):
                host[i] = row
        out = []
        for row in host:
            assert row is not None
            vals = row.tolist()
            d: dict[str, Any] = dict(zip(_STAT_FIELDS, vals[: len(_STAT_FIELDS)], strict=True))
            for k in ("numel", "nan", "inf", "zeros"):
                d[k] = int(d[k])
            d["sample"] = vals[len(_STAT_FIELDS):][: min(SAMPLE_SIZE, d["numel"])]
            out.append(d)
        return out


def device_stats(values: torch.Tensor) -> torch.Tensor:
    """One float row on the device: numel, min, max, mean, std, l2, absmax, nan, inf, zeros, sample."""
    acc = torch.float64 if values.device.type == "cpu" else torch.float32
    x = values.reshape(-1)
    x = x.to(acc) if x.dtype != torch.bool else x.to(acc)
    n = x.numel()
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros((), dtype=acc, device=x.device))
    count = finite.sum().to(acc)
    lo = torch.where(finite, x, torch.full((), float("inf"), dtype=acc, device=x.device)).min()
    hi = torch.where(finite, x, torch.full((), float("-inf"), dtype=acc, device=x.device)).max()
    mean = xf.sum() / count.clamp_min(1)
    var = ((xf - mean) * finite).pow(2).sum() / count.clamp_min(1)
    l2 = xf.pow(2).sum().sqrt()
    absmax = xf.abs().max()
    nan = torch.isnan(x).sum().to(acc)
    inf = torch.isinf(x).sum().to(acc)
    zeros = (x == 0).sum().to(acc)
    idx = torch.linspace(0, n - 1, min(SAMPLE_SIZE, n), device=x.device).round().long()
    sample = x.index_select(0, idx)
    if sample.numel() < SAMPLE_SIZE:  # rows are stacked later: pad, the numel field says how many are real
        sample = torch.cat([sample, torch.zeros(SAMPLE_SIZE - sample.numel(), dtype=acc, device=x.device)])
    head = torch.stack([torch.tensor(float(n), dtype=acc, device=x.device), lo, hi, mean, var.sqrt(), l2, absmax, nan, inf, zeros])
    return torch.cat([head, sample])
