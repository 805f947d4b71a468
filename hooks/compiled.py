"""Compiled targets: run a model's blocks through ``torch.compile`` and keep their boundaries observable.

Each block (by default every child of an ``nn.ModuleList``: the repeated layers of a decoder,
else the whole model) gets a compiled ``forward``; the module itself stays at its path, so
capture's forward hooks record its output as in eager mode and a comparison pairs it with the
eager reference's ``path/forward#N`` by key. Inside a block capture steps aside while the compiled
code runs (no hooks, no dispatch mode: Inductor's fused kernels are not ATen ops, and tracing the
recorder would break the graph), so a block's inner modules and ops are not recorded; the
manifest's ``run["compile"]`` lists the blocks, and :func:`accuracy.compare` leaves the
reference's records inside them out of the pairing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from hooks import observer

_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")


def default_blocks(model: nn.Module) -> list[str]:
    """The paths of the repeated layers (children of every outermost ``nn.ModuleList``), else ``[""]``."""
    blocks: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(b + ".") or name == b for b in blocks):
            blocks += [f"{name}.{child}" if name else child for child, _ in m.named_children()]
    return blocks or [""]


@contextmanager
def capture_paused() -> Iterator[None]:
    """No global module hooks and no Python dispatch modes while the block runs (restored after)."""
    seen = observer.active()  # the compiled observer (aten summary captures) is no dispatch mode
    for mode in [*_get_current_dispatch_mode_stack(), *([seen] if seen is not None else [])]:
        settle = getattr(mode, "before_unseen_ops", None)  # a capture's background readers (tensor writes,
        if settle is not None:  # weight fingerprints) finish before ops it cannot see write into memory they read
            settle()
    mm = torch.nn.modules.module
    saved = {name: getattr(mm, name).copy() for name in _GLOBAL_HOOKS if hasattr(mm, name)}
    for name in saved:
        getattr(mm, name).clear()
    try:
        with _disable_current_modes(), seen.paused() if seen is not None else nullcontext():
            yield
    finally:
        for name, hooks in saved.items():
            d: OrderedDict[Any, Any] = getattr(mm, name)
            d.clear()
            d.update(hooks)


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with capture_paused():
            return fn(*args, **kwargs)

    return run


def compile_blocks(model: nn.Module, blocks: list[str] | None = None, backend: str = "inductor",
                   mode: str | None = None, dynamic: bool | None = False) -> tuple[nn.Module, dict[str, Any]]:
    """Compile each block's ``forward`` in place; returns the model and ``run["compile"]`` notes."""
    names = default_blocks(model) if blocks is None else blocks
    for name in names:
        block = model.get_submodule(name) if name else model
        block.forward = _opaque(torch.compile(block.forward, backend=backend, mode=mode, dynamic=dynamic))
    notes = {"backend": backend, "mode": mode, "dynamic": dynamic, "blocks": names,
             "torch": torch.__version__, "inductor_cpp": backend == "inductor",
             "observable": "each block's output (module record); not the modules and ops inside a block"}
    if backend == "inductor":
        from torch._inductor import config as inductor_config

        notes["inductor"] = {k: getattr(inductor_config, k) for k in ("max_autotune", "freezing", "cpp_wrapper")
                             if hasattr(inductor_config, k)}
        notes["inductor"]["cpp_simdlen"] = getattr(inductor_config.cpp, "simdlen", None)
    return model, notes
