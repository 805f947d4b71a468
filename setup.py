"""Builds ``hooks._observer``, the aten level's compiled observer (``hooks/native/observer.cpp``),
against the torch installed where the package is built: ``make venv`` installs with
``--no-build-isolation`` after torch, and a wheel built that way ships the module. Without torch or a
C++ compiler at build time the package installs without it, and capture uses its Python dispatch
mode (``hooks/observer.py`` says why at capture time). Nothing is compiled at run time."""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup


def _observer() -> dict[str, Any]:
    if os.environ.get("OPBAND_NO_OBSERVER"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # an isolated build without torch: the Python dispatch mode only
        return {}
    ext = CppExtension("hooks._observer", ["hooks/native/observer.cpp"], extra_compile_args=["-O2"],
                       define_macros=[("OPBAND_TORCH_VERSION", f'"{torch.__version__}"')])
    ext.optional = True  # a failed compile leaves the Python path, not a failed install
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}}


setup(**_observer())
