"""``hooks._observer``, the compiled part of capture (``hooks/native/observer.cpp``, and its CUDA
statistics kernel where built with CUDA), loaded in one place: the observer engine
(:mod:`hooks.observer`) and the dispatch mode's on-device statistics (:mod:`hooks.tensors`) both take
it from here. Built at install time (``setup.py``), never at run time."""

from __future__ import annotations

import importlib
from typing import Any

import torch

try:  # by its full name (``from hooks import`` would tie this module to the package's __init__)
    compiled: Any = importlib.import_module("hooks._observer")
except ImportError as e:  # not built (no compiler at install time, or an isolated build without torch)
    compiled = None
    MISSING = f"hooks._observer is not built ({e}); reinstall with `pip install --no-build-isolation` after torch"
else:
    MISSING = ""


def unusable() -> str | None:
    """Why the compiled module cannot run here (not built, or built for another torch), or None."""
    if compiled is None:
        return MISSING
    if compiled.TORCH_VERSION != torch.__version__:
        return f"hooks._observer was built for torch {compiled.TORCH_VERSION}, this is {torch.__version__}: reinstall opband"
    return None


def with_cuda() -> Any:
    """The compiled module when it runs here and has its CUDA path, else None."""
    return compiled if unusable() is None and getattr(compiled, "CUDA", False) else None
