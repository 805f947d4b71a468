"""Guarded device helpers: the only place that knows about cuda, npu or other backends."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


class SideCopies:
    """Device-to-host copies of one CUDA device's outputs into pinned memory on a side stream, so the
    model's stream goes on while they run. Each copy first waits (on the device) for the work queued on
    the current stream, and the output's memory is kept from reuse until the copy is done
    (``record_stream``). :meth:`ready` gives a callable that returns once the copies queued so far have
    arrived (a CUDA event: the bundle writer thread calls it, the model's thread never does).
    :meth:`fence` makes the current stream wait for them (on the device, not the host): before an op
    writes in place into memory a copy may still be reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.fenced: set[int] = set()  # streams that waited for every copy queued so far

    @staticmethod
    def serves(t: torch.Tensor) -> bool:
        """Whether ``t`` is a plain CUDA tensor these copies take."""
        return t.is_cuda and type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_sparse

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor that will hold ``t``'s values once :meth:`ready`'s callable returns."""
        t = t.detach()
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        self.fenced.clear()
        return host

    def ready(self) -> Callable[[], object]:
        """A callable that returns once every copy queued so far has arrived."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.synchronize

    def fence(self) -> None:
        """The current stream waits (on the device) for the copies queued so far (once per stream and copy)."""
        current = torch.cuda.current_stream(self.device)
        if current.stream_id not in self.fenced:
            current.wait_stream(self.stream)
            self.fenced.add(current.stream_id)


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
