"""Operator-level accuracy checks of a user's function (the pytest plugin's ``opband.check``).

The function is one case of an op sweep: its inputs (as given, plus any generated value regimes)
are stored in a reference bundle, it runs on the reference device in float32 and on the target
device in each dtype, and the bundles are compared op by op like any sweep.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from accuracy.manifest import shape_signature
from hooks.opcases import REGIMES, CaseError, OpCase, regime_values
from hooks.opsweep import PlannedCase, SweepConfig, SweepResult, run_sweep


def _label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "check"


def check_function(
    fn: Callable[..., Any],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    op: str | None = None,
    dtypes: Sequence[str] = ("bf16",),
    regimes: Sequence[str] = (),
    reference_device: str | None = None,
    target_device: str = "cpu",
    budgets: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> SweepResult:
    """Run ``fn(*inputs)`` on the reference (float32) and on ``target_device`` in each of ``dtypes``.

    ``inputs`` run as given (regime ``given``); each of ``regimes`` (``large``, ``subnormal`` …) adds
    a run on generated float inputs of the same shapes (integer inputs stay as given). ``op`` names
    the op for its default budget class (``aten.rms_norm``); ``budgets`` overrides budgets as
    ``opband compare --budgets`` does.
    """
    tensors = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise CaseError("opband.check needs its inputs as a tensor or a tuple of tensors")
    bad = [r for r in regimes if r not in REGIMES]
    if bad:
        raise CaseError(f"regime(s) {bad}: choose from {', '.join(REGIMES)}")
    label = _label(name or getattr(fn, "__name__", "check"))
    recorded = op or f"check.{label}"
    case = OpCase(label, recorded, fn, ("data",) * len(tensors), kind="aten" if recorded.startswith("aten.") else "api")
    sig = shape_signature([list(t.shape) for t in tensors])
    cpu = tuple(t.detach().to("cpu") for t in tensors)
    cpu = tuple(t.float() if t.is_floating_point() else t for t in cpu)
    planned = [PlannedCase(f"pytest.{label}.given.{sig.replace(',', '_')}/{recorded}#0", case, label, "given", sig, seed, cpu)]
    gen = torch.Generator().manual_seed(seed)
    for regime in regimes:
        made = tuple(regime_values(regime, t.shape, gen) if t.is_floating_point() else t for t in cpu)
        planned.append(PlannedCase(f"pytest.{label}.{regime}.{sig.replace(',', '_')}/{recorded}#0", case, label,
                                   regime, sig, seed, made))
    cfg = SweepConfig(dtypes=list(dtypes), regimes=["normal"], reference_device=reference_device,
                      target_device=target_device, seed=seed)
    return run_sweep(cfg, out_dir, progress=False, planned=planned, budgets=budgets)
