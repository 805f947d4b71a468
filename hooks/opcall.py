"""JSON-safe record of one ATen call (op + non-tensor arguments), so replay can call it again.

Tensors become ``{"$t": i}`` placeholders (``i`` indexes ``Record.input_tensors``); dtypes,
devices, layouts, memory formats and non-finite floats get small tagged objects. A call with any
other argument (a generator, a tensor subclass, an opaque object) is not replayable and says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


class NotReplayable(ValueError):
    """The call has an argument that cannot be written as JSON."""


_ENUMS: dict[str, dict[str, Any]] = {
    "$dtype": {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)},
    "$layout": {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)},
    "$memory_format": {str(v).removeprefix("torch."): v for v in vars(torch).values()
                       if isinstance(v, torch.memory_format)},
}


def op_target(func: Any) -> str:
    """``aten.add.Tensor``: namespace, op and overload of an OpOverload."""
    ns, _, name = func._schema.name.partition("::")
    return f"{ns}.{name}.{func._overloadname}"


def resolve_target(target: str) -> Any:
    """The ``torch.ops`` OpOverload named by :func:`op_target`."""
    ns, name, overload = target.split(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def encode_call(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``({"args": [...], "kwargs": {...}}, tensors)``; raises :class:`NotReplayable`."""
    tensors: list[torch.Tensor] = []
    enc_args = [_encode(a, tensors) for a in args]
    enc_kwargs = {k: _encode(v, tensors) for k, v in kwargs.items()}
    return {"args": enc_args, "kwargs": enc_kwargs}, tensors


def layouts_of(tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """``{"strides": [...]}`` when an input is laid out otherwise than contiguously without
    overlapping itself (a transposed weight ``w.t()``, a ``chunk`` of a wider tensor): kernels pick
    their path by layout (``addmm`` on ``w.t()``, or ``sigmoid_`` on a strided chunk, round
    differently from the same op on a contiguous copy), so replay rebuilds it. Overlapping inputs
    (``expand``) replay contiguous; ``{}`` when every input is contiguous."""
    strides: list[list[int] | None] = []
    for t in tensors:
        try:
            keep = not t.is_contiguous() and not overlaps(tuple(t.shape), tuple(t.stride()))
        except RuntimeError:  # sparse and other layouts without strides
            keep = False
        strides.append(list(t.stride()) if keep else None)
    return {"strides": strides} if any(s is not None for s in strides) else {}


def draws_random_numbers(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers: ops tagged ``nondeterministic_seeded`` do, unless their
    dropout is off (fused attention with ``dropout_p=0``, ``native_dropout`` with ``train=False``)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
              for i, a in enumerate(func._schema.arguments)}
    if "dropout_p" in values:
        return bool(values["dropout_p"])
    if values.get("train") is False or values.get("p") == 0:
        return False
    return True


def layout_of(t: torch.Tensor) -> tuple[list[int] | None, str | None]:
    """``(strides, memory format)`` of a non-contiguous strided tensor, ``(None, None)`` otherwise."""
    try:
        if t.layout != torch.strided or t.is_contiguous():
            return None, None
        strides = list(t.stride())
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
            return strides, "channels_last"
        if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
            return strides, "channels_last_3d"
    except (RuntimeError, NotImplementedError):  # tensors without strides
        return None, None
    return strides, "strided"


def overlaps(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether two index tuples of this strided layout can reach one memory slot."""
    reach = 0  # the largest offset the dimensions so far can add
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz > 1):
        if st <= reach:
            return True
        reach += st * (sz - 1)
    return False


def span_of(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Storage elements a strided layout reaches (0 when it holds no element)."""
    if any(sz == 0 for sz in shape):
        return 0
    return 1 + sum((sz - 1) * st for sz, st in zip(shape, stride, strict=True))


def strided_like(t: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """``t``'s values in a tensor with ``stride`` (non-overlapping; gaps zero-filled)."""
    buf = torch.zeros(span_of(t.shape, stride), dtype=t.dtype, device=t.device)
    return buf.as_strided(tuple(t.shape), tuple(stride)).copy_(t)


def decode_call(call: dict[str, Any], tensors: Sequence[torch.Tensor],
                device: str | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Inverse of :func:`encode_call` with the loaded input tensors; ``device`` replaces recorded devices."""
    args = [_decode(a, tensors, device) for a in call["args"]]
    kwargs = {k: _decode(v, tensors, device) for k, v in call["kwargs"].items()}
    return args, kwargs


def _encode(v: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return {"$t": len(tensors) - 1}
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$f": repr(v)}
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise NotReplayable("symbolic sizes are not replayable")
    if isinstance(v, complex):
        return {"$c": [_encode(v.real, tensors), _encode(v.imag, tensors)]}
    if isinstance(v, (list, tuple)):
        return [_encode(x, tensors) for x in v]
    if isinstance(v, torch.dtype):
        return {"$dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"$device": v.type}  # replay runs on its own device
    if isinstance(v, torch.layout):
        return {"$layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"$memory_format": str(v).removeprefix("torch.")}
    raise NotReplayable(f"argument of type {type(v).__name__} cannot be recorded")


def _decode(v: Any, tensors: Sequence[torch.Tensor], device: str | None = None) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, device) for x in v]
    if not isinstance(v, dict):
        return v
    (tag, val), = v.items()
    if tag == "$t":
        return tensors[val]
    if tag == "$f":
        return float(val)
    if tag == "$c":
        return complex(_decode(val[0], tensors), _decode(val[1], tensors))
    if tag == "$device":
        return torch.device(device or val)
    return _ENUMS[tag][val]
