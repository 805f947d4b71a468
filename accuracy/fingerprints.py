"""Compare the fingerprints of two runs: their model inputs and each module's parameters.

Different inputs make two runs incomparable (every op would differ alike): :func:`input_difference`
says how, and compare stops with that sentence. Different parameters are a finding: a bad weight
conversion or cast on the target is a real port bug, named per parameter by
:func:`parameter_differences`. A fingerprint holds a digest of the bytes and float64 sum, L2 norm
and absmax; across an honest dtype cast (the bf16 port of an fp32 model) the digests differ, so
the statistics are compared within what rounding to the lower precision can move them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accuracy.manifest import Fingerprints, TensorPrint
from accuracy.metrics import FLOAT_FORMATS, is_float_dtype, machine_eps

#: Variants whose weights differ from the reference by design (quantized): parameters not judged
#: (also their ``-rowwise`` forms).
WEIGHT_CHANGING_VARIANTS = ("int8", "w8a16", "w4a16", "fp8-e4m3", "fp8-e5m2")
#: Allowed drift of the statistics across a cast, in units of the lower precision's u.
CAST_SLACK_U = 2.0
#: Allowed drift of the same values' sum and L2 summed in another order, in units of float32's u
#: for float32/bf16/fp16: a CPU run's prints (the statistics kernel sums blocks of 4096 in float32)
#: against an accelerator run's (torch's float64 reductions on the device, no digest). Measured on
#: normal, 1 + noise, 100 + noise and tiny weights of 7 to 3M elements: at most 0.6 u on the L2 and
#: 2.1 u x sqrt(n) x L2 on the sum; ``tests/test_hooks_fingerprints.py`` measures it again. float64
#: values (summed in float64 on both sides) drifted at most 96 float64 u, and are allowed
#: REORDER_SLACK_U_F64 of them, as are integers and bools (one token id changed by 1 among 1M still
#: shows). A changed float32 weight
#: still shows unless the change spares its largest element (absmax must match exactly) and stays
#: under ~4e-6 of its L2; no statistic sees a permutation of the same values (a transposed square
#: weight), which only a digest would.
REORDER_SLACK_U = 32.0
REORDER_SLACK_U_F64 = 4096.0


@dataclass(frozen=True)
class ParameterDifference:
    """One parameter or buffer that differs between the runs."""

    name: str  # e.g. ``layers.5.mlp.up_proj.weight``
    module: str  # e.g. ``layers.5.mlp.up_proj``
    how: str  # in words

    @property
    def sentence(self) -> str:
        leaf = self.name.rpartition(".")[2]
        return f"{leaf} of `{self.module or '<root>'}` differs: {self.how}"


def _shape(s: list[int]) -> str:
    return "x".join(map(str, s)) or "scalar"


def print_difference(a: TensorPrint, b: TensorPrint) -> str | None:
    """None when ``b`` holds what ``a`` holds (bitwise, or within an honest cast's rounding), else how not."""
    if a.shape != b.shape:
        return f"shape {_shape(a.shape)} vs {_shape(b.shape)}"
    if is_float_dtype(a.dtype) != is_float_dtype(b.dtype):
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.dtype == b.dtype:
        if a.digest and b.digest:
            if a.digest == b.digest:
                return None
            if _reordered(a, b):  # equal statistics up to summation order: the bytes moved, not the values
                return ("the same values in another order or layout (a transposed or permuted weight?): sum, L2 "
                        "and max abs agree, the bytes do not")
            return _stats_words(a, b) or "same statistics, different bytes"
        # one side has no digest (statistics computed on an accelerator): the same values summed in
        # another order; absmax and the NaN/Inf count do not depend on the order
        return None if _reordered(a, b) else _stats_words(a, b) or "values differ beyond summation order"
    u = max(machine_eps(a.dtype), machine_eps(b.dtype))
    n = max(math.prod(a.shape), 1)
    slack = CAST_SLACK_U * u
    # below the lower dtype's normal range (a layer scale of 1e-6 in fp16) rounding is absolute: tiny x u
    atol = CAST_SLACK_U * max(_tiny(a.dtype), _tiny(b.dtype)) * u
    close = (a.nonfinite == b.nonfinite
             and abs(a.l2 - b.l2) <= slack * a.l2 + atol * math.sqrt(n)
             and abs(a.absmax - b.absmax) <= slack * a.absmax + atol
             and abs(a.sum - b.sum) <= slack * math.sqrt(n) * a.l2 + atol * n)
    return None if close else _stats_words(a, b) or f"values beyond {b.dtype} rounding"


def _reorder_slack(dtype: str) -> float:
    """Relative drift of the same values' sum and L2 in another summation order: REORDER_SLACK_U float32
    u for float32 and narrower floats, REORDER_SLACK_U_F64 float64 u for float64, integers and bool (their
    float64 sums are exact below 2^53, and a sum of squares past it rounds by order: 1M token ids)."""
    if is_float_dtype(dtype) and dtype not in ("float64", "complex128"):
        return REORDER_SLACK_U * machine_eps("float32")
    return REORDER_SLACK_U_F64 * machine_eps("float64")


def _tiny(dtype: str) -> float:
    return FLOAT_FORMATS[dtype][1] if dtype in FLOAT_FORMATS else 0.0


def _reordered(a: TensorPrint, b: TensorPrint) -> bool:
    """The statistics of ``a`` and ``b`` (same dtype) agree up to the order their values were summed in."""
    u = _reorder_slack(a.dtype)
    n = max(math.prod(a.shape), 1)
    return (a.nonfinite == b.nonfinite and a.absmax == b.absmax
            and (a.l2 == b.l2 or abs(a.l2 - b.l2) <= u * a.l2)
            and (a.sum == b.sum or abs(a.sum - b.sum) <= u * math.sqrt(n) * a.l2))


def _stats_words(a: TensorPrint, b: TensorPrint) -> str:
    parts = []
    if a.nonfinite != b.nonfinite:
        parts.append(f"{a.nonfinite} vs {b.nonfinite} NaN/Inf")
    for name in ("sum", "l2", "absmax"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            parts.append(f"{'max abs' if name == 'absmax' else name} {x:.4g} vs {y:.4g}")
    return ", ".join(parts[:3])


def input_difference(reference: Fingerprints | None, target: Fingerprints | None) -> str | None:
    """Words for how two runs' model inputs differ (``input_ids 2x12 vs 2x16``), or None when they agree
    or either run has no input fingerprints (older bundles, replays)."""
    if reference is None or target is None or not reference.inputs or not target.inputs:
        return None
    problems = []
    for name in sorted(set(reference.inputs) | set(target.inputs)):
        a, b = reference.inputs.get(name), target.inputs.get(name)
        if a is None or b is None:
            side = "target" if a is None else "reference"
            problems.append(f"{name} only in the {side}")
            continue
        how = print_difference(a, b)
        if how is not None:
            problems.append(f"{name} {how}" if how.startswith("shape") else f"{name} ({_shape(a.shape)}) {how}")
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "") or None


def parameter_differences(reference: Fingerprints | None, target: Fingerprints | None,
                          variant: str) -> tuple[list[ParameterDifference], str | None]:
    """The parameters that differ, and a note when they were not judged (quantized variants, no fingerprints)."""
    if reference is None or target is None or not reference.parameters or not target.parameters:
        return [], None
    if variant.removesuffix("-rowwise") in WEIGHT_CHANGING_VARIANTS:
        return [], (f"the target's variant {variant} changes weights by design (quantization): its parameters "
                    "were not compared with the reference's")
    out = []
    for name, a in reference.parameters.items():
        b = target.parameters.get(name)
        if b is None:
            continue  # a parameter the target keeps elsewhere (e.g. a fused layout): the ops still compare
        how = print_difference(a, b)
        if how is not None:
            out.append(ParameterDifference(name, name.rpartition(".")[0], how))
    return out, None
