"""The run's environment, written into every manifest: what could explain a numeric difference."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from typing import Any

import torch

from hooks import devices


@cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str | None = None) -> dict[str, Any]:
    """torch/driver versions, device, CPU, threads, determinism and TF32 flags, git commit."""
    device = device or "cpu"
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "device": device,
        "device_name": devices.device_name(device),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "quantized_engine": torch.backends.quantized.engine,
    }
    if torch.version.cuda:
        env["cuda"] = torch.version.cuda
    if torch.backends.cudnn.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
    npu = devices.backend_module("npu")
    if npu is not None:
        env["cann"] = getattr(getattr(torch, "version", None), "cann", None) or os.environ.get("ASCEND_TOOLKIT_HOME")
    commit = _git("rev-parse", "HEAD")
    if commit:
        env["git_commit"] = commit
        env["git_branch"] = _git("rev-parse", "--abbrev-ref", "HEAD")
    return env
