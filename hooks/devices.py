"""Guarded device helpers: the only place that knows about cuda, npu or other backends."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def backend_module(device_type: str) -> object | None:
    """``torch.cuda``, ``torch.npu`` (torch_npu) or another PrivateUse1 module, if present."""
    return getattr(torch, device_type, None)


def default_device() -> str:
    """``cuda`` when a CUDA device is usable, ``npu`` when torch_npu is, else ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    npu = backend_module("npu")
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return "npu"
    return "cpu"


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy that later in-place ops on ``t`` cannot change; non-blocking off the CPU."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    try:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    except RuntimeError:  # no pinned memory on this backend
        return t.to("cpu")
    host.copy_(t, non_blocking=True)
    return host


def synchronize_copies(hosts: Iterable[torch.Tensor]) -> None:
    """Wait for pending non-blocking copies into pinned ``hosts`` buffers."""
    if any(h.is_pinned() for h in hosts):
        synchronize_all()


def synchronize_all() -> None:
    for name in ("cuda", "npu", "xpu", "mps"):
        mod = backend_module(name)
        if mod is not None and getattr(mod, "is_available", lambda: False)():
            try:
                mod.synchronize()  # type: ignore[attr-defined]
            except RuntimeError:
                pass


def device_name(device: str) -> str:
    """Human-readable name of the device a run used."""
    dev = torch.device(device)
    mod = backend_module(dev.type)
    if dev.type != "cpu" and mod is not None and hasattr(mod, "get_device_name"):
        try:
            return str(mod.get_device_name(dev.index or 0))  # type: ignore[attr-defined]
        except (RuntimeError, AssertionError):
            pass
    return dev.type
