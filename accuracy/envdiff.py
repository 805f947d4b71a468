"""What differs between two runs' setups: torch, driver/CUDA/CANN, op library, threads, flags, inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: run fields that change numerics; every environment field is compared as well
RUN_FIELDS = ("variant", "device", "level", "mode", "seed", "options")


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
