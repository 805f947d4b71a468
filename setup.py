"""Builds ``hooks._observer``, the aten level's compiled observer (``hooks/native/observer.cpp``),
against the torch installed where the package is built: ``make venv`` installs with
``--no-build-isolation`` after torch, and a wheel built that way ships the module. Without torch or a
C++ compiler at build time the package installs without it, and capture uses its Python dispatch
mode (``hooks/observer.py`` says why at capture time). With a CUDA build of torch and nvcc (``CUDA_HOME``)
it also compiles ``hooks/native/stats_cuda.cu``: the observer then summarises CUDA outputs in C++
(``OPBAND_NO_CUDA=1`` builds the CPU-only module). Nothing is compiled at run time."""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup


def _observer() -> dict[str, Any]:
    if os.environ.get("OPBAND_NO_OBSERVER"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:  # an isolated build without torch: the Python dispatch mode only
        return {}
    macros = [("OPBAND_TORCH_VERSION", f'"{torch.__version__}"')]
    if torch.version.cuda and CUDA_HOME and not os.environ.get("OPBAND_NO_CUDA"):
        # a CUDA torch and nvcc: CUDA outputs are summarised in C++ too (hooks/native/stats_cuda.cu)
        ext = CUDAExtension("hooks._observer", ["hooks/native/observer.cpp", "hooks/native/stats_cuda.cu"],
                            extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3"]},
                            define_macros=[*macros, ("OPBAND_CUDA", "1")])
    else:
        ext = CppExtension("hooks._observer", ["hooks/native/observer.cpp"], extra_compile_args=["-O2"],
                           define_macros=macros)
    ext.optional = True  # a failed compile leaves the Python path, not a failed install
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}}


setup(**_observer())
