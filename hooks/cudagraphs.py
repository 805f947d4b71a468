"""CUDA graphs under capture: refused with a sentence, never a silently empty bundle.

A replayed CUDA graph launches the kernels it recorded without the dispatcher, the module hooks or
any Python: a capture around ``graph.replay()`` would see none of its ops. Capturing a graph while
opband captures would record opband's own statistics kernels into the graph and leave the records
of a run that never computed anything. So while a capture is active, :class:`torch.cuda.CUDAGraph`'s
``replay`` and ``capture_begin`` and entering ``torch.cuda.graph`` raise :class:`CudaGraphRefused`
(``torch.cuda.make_graphed_callables`` and ``torch.compile(mode="reduce-overhead")`` go through
them too). The patch is on the classes, is installed once however many captures nest, and is
undone when the last one ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: what a user does instead
ADVICE = ("run the model eagerly for the capture (no torch.cuda.graph / make_graphed_callables; "
          "torch.compile without mode='reduce-overhead'), then compare that bundle")


class CudaGraphRefused(RuntimeError):
    """A CUDA graph was captured or replayed inside an opband capture."""


_lock = threading.Lock()
_depth = 0
_saved: list[tuple[type, str, Callable[..., Any]]] = []


def _refuse(what: str) -> Callable[..., Any]:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise CudaGraphRefused(f"a CUDA graph was {what} inside an opband capture: {_WHY[what]}; {ADVICE}")

    refused.__name__ = f"opband_refused_{what}"
    return refused


_WHY = {
    "replayed": "its kernels run without the dispatcher or the module hooks, so none of its ops would be "
                "recorded",
    "captured": "opband's own statistics kernels would be recorded into the graph, and the records would "
                "describe a run that computed nothing",
}
#: (class name in torch.cuda, method, what calling it does): ``graph.__enter__`` is refused before it
#: switches streams, so a refused ``with torch.cuda.graph(g)`` leaves the current stream as it was
_METHODS = (("CUDAGraph", "replay", "replayed"), ("CUDAGraph", "capture_begin", "captured"),
            ("graph", "__enter__", "captured"))


def _targets() -> list[tuple[type, str, str]]:
    cuda = getattr(torch, "cuda", None)
    out = []
    for cls_name, method, what in _METHODS:
        cls = getattr(cuda, cls_name, None)
        if isinstance(cls, type) and method in cls.__dict__:
            out.append((cls, method, what))
    return out


@contextmanager
def refuse_cuda_graphs() -> Iterator[None]:
    """While inside, ``torch.cuda.CUDAGraph.replay``, ``.capture_begin`` and ``torch.cuda.graph.__enter__``
    raise :class:`CudaGraphRefused`, in every thread of the process (the patch is on the classes)."""
    global _depth
    with _lock:
        if _depth == 0:
            for cls, method, what in _targets():
                _saved.append((cls, method, cls.__dict__[method]))
                setattr(cls, method, _refuse(what))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for cls, method, original in _saved:
                    setattr(cls, method, original)
                _saved.clear()
