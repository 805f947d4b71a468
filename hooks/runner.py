"""One capture run from a SPEC: load, apply the variant, run under capture, write the bundle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hooks import devices
from hooks.capture import capture
from hooks.spec import load_spec
from hooks.variants import apply_variant


def run_capture(
    spec: str,
    out: str | os.PathLike[str],
    *,
    device: str | None = None,
    variant: str = "fp32",
    level: str = "aten",
    mode: str = "full",
    seed: int = 0,
    replay: str | os.PathLike[str] | None = None,
    golden: bool = False,
    **options: Any,
) -> Path:
    """Capture one forward pass of the SPEC's model and return the bundle path.

    With ``replay=REF_BUNDLE`` the model is not run: each ATen op of REF (captured with
    ``inputs=True``) is re-run alone on ``device``/``variant`` (``golden``: float64 on CPU).
    """
    device = device or ("cpu" if variant == "int8" else devices.default_device())
    if replay is not None:
        from hooks.replay import replay as replay_ops

        return replay_ops(replay, spec, out, device=device, variant=variant, golden=golden, mode=mode)
    torch.manual_seed(seed)
    model, inputs = load_spec(spec)
    model, inputs, notes = apply_variant(model.eval(), inputs, variant, device)
    run = {"spec": spec, "device": device, "seed": seed, **notes}
    with torch.no_grad(), capture(model, out, level=level, mode=mode, run=run, **options) as cap:
        if isinstance(inputs, dict):
            model(**inputs)
        else:
            model(*inputs)
    assert cap.bundle_path is not None
    return cap.bundle_path
