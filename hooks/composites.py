"""Composite ops that would take another path under capture's dispatch mode, run as they run without it.

Under any Python ``TorchDispatchMode`` ATen's ``isTensorSubclassLike`` is true, so
``linalg_svdvals`` asks ``_linalg_svd`` for singular vectors too and ``linalg_eigvalsh`` asks
``_linalg_eigh`` for eigenvectors (the differentiable path); LAPACK then returns values that differ
in the last bits, and ``linalg.cond`` / nuclear norms, which call them, inherit that. While an
``aten`` capture is active, :func:`faithful_composites` registers Python kernels for these two
composites at ``CompositeImplicitAutograd`` that make ATen's own decision
(``_may_require_fw_or_bw_grad``) from the tensor alone, not from the mode; the inner
``_linalg_svd``/``_linalg_eigh`` still reach the mode and are recorded. The registration is
process-wide (counted, so nested captures share it) and removed when the last capture exits.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_lock = threading.Lock()
_active = 0
_library: Any = None


def may_require_grad(a: torch.Tensor) -> bool:
    """ATen's ``_may_require_fw_or_bw_grad`` without the dispatch mode: grad mode and requires_grad,
    a forward-mode tangent, or a real tensor subclass (the Python dispatch key on the tensor)."""
    if torch.is_grad_enabled() and a.requires_grad:
        return True
    if torch._C._dispatch_keys(a).has(torch._C.DispatchKey.Python):
        return True
    try:
        return torch.autograd.forward_ad.unpack_dual(a).tangent is not None
    except RuntimeError:
        return False


def _svdvals(a: torch.Tensor, *, driver: str | None = None) -> torch.Tensor:
    return torch.ops.aten._linalg_svd.default(a, False, may_require_grad(a), driver=driver)[1]


def _eigvalsh(a: torch.Tensor, UPLO: str = "L") -> torch.Tensor:  # noqa: N803 - ATen's argument name
    return torch.ops.aten._linalg_eigh.default(a, UPLO, may_require_grad(a))[0]


@contextmanager
def faithful_composites() -> Iterator[None]:
    """While active, ``linalg_svdvals`` and ``linalg_eigvalsh`` take the path they take without capture."""
    global _active, _library
    with _lock:
        _active += 1
        if _active == 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
                lib = torch.library.Library("aten", "IMPL")
                lib.impl("linalg_svdvals", _svdvals, "CompositeImplicitAutograd")
                lib.impl("linalg_eigvalsh", _eigvalsh, "CompositeImplicitAutograd")
            _library = lib
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _library is not None:
                _library._destroy()
                _library = None
