"""What differs between two runs' setups: torch, driver/CUDA/CANN, op library, threads, flags, inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: run fields that change numerics; every environment field is compared as well
RUN_FIELDS = ("variant", "device", "level", "mode", "seed", "options")

#: the environment/run fields (and run tags) behind each category of "what changed" between two runs
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch", "python")),
    ("driver", ("cuda", "cann", "driver", "rocm", "hip", "nccl", "device_name", "firmware")),
    ("op library", ("cudnn", "cublas", "mkl", "onednn", "mkldnn", "quantized_engine", "triton", "aclnn", "op_library",
                    "kernel")),
    ("threads", ("threads", "omp", "interop")),
    ("flags", ("deterministic", "tf32", "float32_matmul_precision", "flags", "allow_", "benchmark")),
    ("inputs", ("seed", "inputs", "input", "options", "spec")),
    ("dtype", ("variant",)),
    ("device", ("device", "cpu", "platform", "gpu", "npu")),
    ("capture", ("level", "mode")),
    ("code", ("git_commit", "git_branch", "commit", "branch")),
)


def flatten(run: Mapping[str, Any] | None, environment: Mapping[str, Any] | None) -> dict[str, Any]:
    """``environment.<name>`` for every environment field, ``run.<name>`` for the numerics-changing run fields."""
    out = {f"environment.{k}": v for k, v in (environment or {}).items()}
    out.update({f"run.{k}": (run or {})[k] for k in RUN_FIELDS if k in (run or {})})
    return out


def changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[list[tuple[str, Any, Any]], int]:
    """``(field, a value, b value)`` for each field that differs between two flattened setups, sorted,
    and how many compared fields are equal."""
    fields = sorted(set(a) | set(b))
    changed = [(f, a.get(f), b.get(f)) for f in fields if a.get(f) != b.get(f)]
    return changed, len(fields) - len(changed)


def category_of(field: str) -> str:
    """``environment.tf32_matmul`` -> ``flags``; the first category whose words the field's name holds."""
    name = field.split(".", 1)[-1].lower().replace("-", "_")
    for category, words in CATEGORIES:
        if any(w == name or name.startswith(w) for w in words):
            return category
    return "other"
