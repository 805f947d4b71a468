"""Replay: re-run each ATen op of a reference bundle alone, on the reference's recorded inputs.

The reference must be captured with ``inputs=True`` (level ``aten``): each replayable record
then has ``input_tensors`` and an entry in ``run["calls"]`` (the ``torch.ops`` target and its
non-tensor arguments). Replay writes a new bundle whose records have the same keys, so
``accuracy.compare(reference, replayed, mode="replay")`` measures each op's own error, with no
error carried in from earlier ops. ``golden=True`` recomputes every op in float64 on the CPU into
a separate bundle with the same keys: ``compare(reference, replayed, mode="golden", golden=it)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accuracy.bundle import Bundle
from accuracy.manifest import Record
from hooks.options import CaptureOptions
from hooks.environment import environment
from hooks.opcall import decode_call, overlaps, resolve_target, span_of, strided_like
from hooks.recorder import Recorder
from hooks.tensors import RAW_TAG_DTYPES
from hooks.variants import _CASTS



def replay(
    reference: str | os.PathLike[str],
    spec: str | None,
    out: str | os.PathLike[str],
    *,
    device: str = "cpu",
    variant: str = "fp32",
    golden: bool = False,
    mode: str = "full",
    run: dict[str, Any] | None = None,
) -> Path:
    """Re-run every replayable op of ``reference`` and write the outputs to ``out``.

    ``variant`` casts floating inputs to fp16/bf16 (fp32 keeps the reference dtypes); int8 and
    fp8 change which ops a model runs, so they cannot be replayed op by op: capture them instead.
    ``spec`` is only noted in the run metadata (the ops need no model). Ops that cannot be
    replayed (no call recorded, an input over the byte budget, a failure) become diagnostics.
    ``run`` adds fields to the manifest's run metadata (a label, target name and tags).
    """
    if variant not in ("fp32", *_CASTS):
        raise ValueError(f"replay supports fp32, fp16 and bf16, not {variant!r}: int8/fp8 replace whole modules, "
                         "so capture the variant with `opband capture --variant` instead")
    ref = Bundle.open(reference)
    calls: dict[str, dict[str, Any]] = ref.manifest.run.get("calls", {})
    if not calls:
        raise ValueError(f"{reference} records no ATen calls: capture the reference with inputs=True (level aten)")
    target_device = "cpu" if golden else device
    cast = torch.float64 if golden else _CASTS.get(variant)
    run = {**(run or {}), "replay_of": str(reference), "spec": spec, "device": target_device,
           "variant": "fp64-golden" if golden else variant, "golden": golden,
           "reference_run": {k: v for k, v in ref.manifest.run.items() if k != "calls"}}
    rec = Recorder(Path(out), CaptureOptions(level="aten", mode=mode, progress=False))
    ref_reasons = {d.key: d.message.removeprefix("not replayable: ") for d in ref.manifest.diagnostics if d.key}
    for record in ref.records:
        if record.output != 0 or record.kind != "aten":
            continue
        call = calls.get(record.key)
        if call is None:  # say why the reference could not record it, when it said so
            why = ref_reasons.get(record.key, "the reference recorded no call for this op")
            rec.diagnose(record.key, f"not replayed: {why}")
            continue
        _replay_one(rec, ref, record, call, target_device, cast)
    return rec.finish({**run, "level": "aten", "mode": mode}, environment(target_device))


def not_replayed(diagnostics: Any, limit: int = 3) -> list[str]:
    """Terminal lines for the ops a replay could not run, grouped by reason, e.g.
    ``not replayed: 2 ops: the op draws random numbers (drop/aten.native_dropout#0, ...)``."""
    by_reason: dict[str, list[str]] = {}
    for d in diagnostics:
        msg = d.message.removeprefix("not replayed: ").removeprefix("not replayable: ")
        by_reason.setdefault(msg, []).append(d.key or "(run)")
    lines = []
    for reason, keys in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(keys[:limit]) + (", ..." if len(keys) > limit else "")
        lines.append(f"not replayed: {len(keys)} op{'s' if len(keys) != 1 else ''}: {reason} ({shown})")
    return lines


def _replay_one(rec: Recorder, ref: Bundle, record: Record, call: dict[str, Any], device: str,
                cast: torch.dtype | None) -> None:
    names = record.input_tensors or []
    if any(n is None for n in names):
        rec.diagnose(record.key, "not replayed: an input was not stored (byte budget or unsupported tensor)")
        return
    strides = call.get("strides") or [None] * len(names)
    try:
        tensors = [_load(ref, n, device, cast, st) for n, st in zip(names, strides, strict=True)]
        args, kwargs = decode_call(call, tensors, device)
        with torch.set_grad_enabled(bool(call.get("grad", False))):  # as captured: some kernels differ
            out = resolve_target(call["target"])(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - one op failing must not stop the others
        rec.diagnose(record.key, f"replay failed: {type(e).__name__}: {e}")
        return
    rec.ops_seen += 1
    rec.step = record.step
    rec.record("aten", record.module, record.op, record.key, record.ordinal, out, tensors)


def _load(ref: Bundle, name: str, device: str, cast: torch.dtype | None,
          stride: list[int] | None = None) -> torch.Tensor:
    """The stored input as a torch tensor in its recorded dtype, then cast for the target, laid
    out with the recorded ``stride`` when the capture noted one (non-overlapping, and spanning at
    most 64x its elements: a hostile stride must not allocate the machine away)."""
    tag = ref.tensors[name].dtype
    raw = np.array(ref.raw(name))  # copy out of the memory map: ops may write into their inputs
    t = torch.from_numpy(raw)
    if tag in RAW_TAG_DTYPES:
        t = t.view(RAW_TAG_DTYPES[tag])
    t = t.to(device)
    if cast is not None and t.is_floating_point():
        t = t.to(cast)
    if (stride is not None and len(stride) == t.dim() and all(type(x) is int and x >= 0 for x in stride)
            and not overlaps(tuple(t.shape), tuple(stride))
            and span_of(t.shape, stride) < 64 * t.numel() + 4096):
        t = strided_like(t, stride)
    return t
