"""Builds ``hooks._observer``, the aten level's compiled observer (``hooks/native/observer.cpp``),
against the torch installed where the package is built: ``make venv`` installs with
``--no-build-isolation`` after torch, and a wheel built that way ships the module. Without torch or a
C++ compiler at build time the package installs without it, and capture uses its Python dispatch
mode (``hooks/observer.py`` says why at capture time). With a CUDA build of torch and nvcc (``CUDA_HOME``)
it also compiles ``hooks/native/stats_cuda.cu``: the observer then summarises CUDA outputs in C++
(``OPBAND_NO_CUDA=1`` builds the CPU-only module). Nothing is compiled at run time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

from setuptools import setup


def _cuda_problem(torch: Any, cuda_home: str) -> str | None:
    """Why the CUDA path cannot be built here (nvcc missing or of another major version than torch's
    CUDA), or None. With no GPU visible and no ``TORCH_CUDA_ARCH_LIST``, the architectures torch itself
    was built for are targeted (torch's own detection needs a visible GPU)."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} --version failed ({e})"
    found = re.search(r"release (\d+)\.(\d+)", out)
    if found is None:
        return f"{nvcc} --version printed no release number"
    if found.group(1) != str(torch.version.cuda).split(".")[0]:
        return f"nvcc is CUDA {found.group(1)}.{found.group(2)}, torch was built with CUDA {torch.version.cuda}"
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.device_count():
        # torch's own list (get_arch_list is empty without a GPU on some torch versions), of what nvcc compiles
        flags = getattr(torch._C, "_cuda_getArchFlags", None)
        names = flags().split() if flags is not None else torch.cuda.get_arch_list()
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout.split()
        archs = [f"{m.group(1)}.{m.group(2)}" for a in names
                 if (m := re.fullmatch(r"sm_(\d+)(\d)", a)) and f"compute_{m.group(1)}{m.group(2)}" in listed]
        if not archs:
            return ("no GPU is visible and torch names no CUDA architecture that nvcc compiles: set "
                    "TORCH_CUDA_ARCH_LIST (e.g. 9.0)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs) + "+PTX"  # PTX of the newest: later GPUs JIT it
    return None


def _observer() -> dict[str, Any]:
    if os.environ.get("OPBAND_NO_OBSERVER"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:  # an isolated build without torch: the Python dispatch mode only
        return {}
    macros = [("OPBAND_TORCH_VERSION", f'"{torch.__version__}"')]
    cuda = bool(torch.version.cuda and CUDA_HOME and not os.environ.get("OPBAND_NO_CUDA"))
    if cuda and (problem := _cuda_problem(torch, CUDA_HOME)):
        print(f"hooks._observer: building without its CUDA path: {problem}", file=sys.stderr)
        cuda = False
    if cuda:
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
