"""Default error budgets for ops with no history: one table keyed by dtype and op class.

A budget bounds the normalized L2 error ``||t - r|| / ||r||`` of an op's output, in units of
``u``, the unit roundoff of the dtype whose rounding the target carries. In ``propagated`` mode
(two end-to-end runs) one multiple of ``u`` per dtype holds for every op, since upstream error
dominates; in ``replay``/``golden`` mode (each op on the reference's inputs) the multiple depends
on the op class. The constants and their measurements are below and in ``docs/budgets.md``.

Overrides come from a config mapping ``{"ops": {"<op key or op name glob>": {"norm_l2": x}}}``;
an override must give every field of the budget it replaces, or it is refused.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from accuracy.errors import ConfigError
from accuracy.metrics import machine_eps

#: Op classes and the op names (ATen overload packets, without ``aten.``) that belong to them.
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "exact": (
        "embedding", "index_select", "gather", "cat", "stack", "clone", "copy", "copy_", "slice",
        "select", "index", "where", "masked_fill", "masked_fill_", "constant_pad_nd", "max_pool2d",
        "argmax", "argmin", "eq", "ne", "lt", "gt", "le", "ge", "fill_", "zeros_like", "ones_like",
        "_to_copy", "to", "neg", "abs", "relu", "scatter", "index_put", "index_put_", "tril", "triu",
    ),
    "matmul": (
        "mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "conv1d", "conv2d", "conv3d",
        "convolution", "_convolution", "linear_dynamic", "einsum", "addmv", "mv", "dot",
    ),
    "normalization": (
        "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_batch_norm",
        "batch_norm", "group_norm", "native_group_norm", "rsqrt",
    ),
    "attention": (
        "_softmax", "softmax", "_log_softmax", "log_softmax", "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_safe_softmax",
    ),
    "reduction": ("sum", "mean", "var", "std", "norm", "linalg_vector_norm", "cumsum", "prod", "logsumexp"),
}
_CLASS_OF = {name: cls for cls, names in OP_CLASSES.items() for name in names}

#: Budget multipliers on the unit roundoff, per op class (elementwise is the default class).
CLASS_MULTIPLIER: dict[str, float] = {
    "exact": 2.0,
    "elementwise": 4.0,
    "reduction": 8.0,
    "matmul": 8.0,
    "normalization": 8.0,
    "attention": 8.0,
    "module": 16.0,
}

#: Replay/golden mode: per target dtype, (scale on u, absolute floor). An op's own error is
#: ``class multiplier x scale x u``: fp32 re-executions differ by reordering, a few u per op.
REPLAY_SCALE: dict[str, tuple[float, float]] = {
    "float64": (16.0, 1e-13),
    "float32": (16.0, 1e-7),
    "tfloat32": (4.0, 1e-5),
    "float16": (4.0, 1e-4),
    "bfloat16": (4.0, 1e-3),
    "float8_e4m3fn": (2.0, 1e-2),
    "float8_e5m2": (2.0, 1e-2),
    "int8": (4.0, 1e-2),
}

#: Propagated mode: errors from every upstream op arrive too, so one budget per dtype, in units
#: of u, holds for every op class. Measured on the demo decoder (4 layers, propagated): fp32 with
#: another thread count differs by 0; bf16 reaches 0.022 (= 5.6u), fp16 0.0027 (= 5.5u), int8
#: dynamic quantization 0.17 (= 43u); a wrong activation in fp32 gives > 1e-4 (= 1700u).
PROPAGATED_U: dict[str, float] = {
    "float64": 512.0,
    "float32": 512.0,
    "tfloat32": 32.0,
    "float16": 24.0,
    "bfloat16": 24.0,
    "float8_e4m3fn": 4.0,
    "float8_e5m2": 4.0,
    "int8": 64.0,
}

#: An excess of at most this factor over the budget is a warning, beyond it a failure.
WARN_FACTOR = 2.0


@dataclass(frozen=True)
class Budget:
    """The accepted error of one op: normalized L2 error and a cosine floor."""

    norm_l2: float
    cosine_min: float
    source: str

    def describe(self) -> str:
        return f"norm_l2 <= {self.norm_l2:.2e} ({self.source})"


def op_class(op: str, kind: str = "aten") -> str:
    """The budget class of an op name such as ``aten.mm`` or ``quantized.linear_dynamic``."""
    if kind == "module":
        return "module"
    base = op.split(".")[1] if op.count(".") >= 1 else op
    return _CLASS_OF.get(base, "elementwise")


_VARIANT_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                  "fp8-e4m3": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}


def effective_dtype(target_dtype: str, variant: str, mode: str = "propagated") -> str:
    """The dtype whose rounding the target's values carry.

    int8/fp8 variants always carry their quantization error. In propagated mode an op that
    computes in fp32 inside a bf16 run (an upcast RMSNorm, a float softmax) still receives
    bf16-rounded inputs, so the run's lowest precision is the one that bounds its error.
    """
    low = _VARIANT_DTYPE.get(variant)
    if low is None:
        return target_dtype
    if variant in ("int8",) or variant.startswith("fp8") or mode == "propagated":
        return low
    return target_dtype


def default_budget(op: str, kind: str, dtype: str, mode: str = "propagated") -> Budget:
    """The default budget of one op for a target ``dtype`` (see the module docstring)."""
    u = machine_eps(dtype) or machine_eps("float32")
    if mode == "propagated":
        limit = PROPAGATED_U.get(dtype, PROPAGATED_U["float32"]) * u
        source = f"default {dtype}/propagated"
    else:
        cls = op_class(op, kind)
        scale, floor = REPLAY_SCALE.get(dtype, REPLAY_SCALE["float32"])
        limit = max(CLASS_MULTIPLIER[cls] * scale * u, floor)
        source = f"default {dtype}/{cls}"
    cosine_min = 1.0 - 2.0 * min(limit, 1.0) ** 2  # cos ~ 1 - nl2^2 / 2, with 2x slack on nl2
    return Budget(norm_l2=limit, cosine_min=cosine_min, source=source)


class BudgetPolicy:
    """Resolves the budget of each op: per-op overrides first, then the default table."""

    def __init__(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._overrides: list[tuple[str, Budget]] = []
        for pattern, spec in (overrides or {}).items():
            self._overrides.append((pattern, _parse_override(pattern, spec)))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> BudgetPolicy:
        if not config:
            return cls()
        unknown = set(config) - {"ops"}
        if unknown:
            raise ConfigError(f"unknown budget config section(s) {sorted(unknown)}; only 'ops' is read")
        return cls(config.get("ops") or {})

    def budget(self, key: str, op: str, kind: str, dtype: str, mode: str) -> Budget:
        for pattern, budget in self._overrides:
            if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(op, pattern):
                return budget
        return default_budget(op, kind, dtype, mode)


def _parse_override(pattern: str, spec: Mapping[str, Any]) -> Budget:
    names = {f.name for f in fields(Budget)} - {"source"}
    given = set(spec)
    unknown = given - names
    if unknown:
        raise ConfigError(f"budget override {pattern!r}: unknown field(s) {sorted(unknown)}; allowed: {sorted(names)}")
    missing = names - given
    if missing:
        raise ConfigError(
            f"budget override {pattern!r} sets {sorted(given)} but not {sorted(missing)}: a half-specified "
            "budget would silently mix your limit with a default you did not choose; give every field"
        )
    values = {k: float(spec[k]) for k in names}
    if not (values["norm_l2"] >= 0 and math.isfinite(values["norm_l2"])):
        raise ConfigError(f"budget override {pattern!r}: norm_l2 must be a finite number >= 0")
    if not -1.0 <= values["cosine_min"] <= 1.0:
        raise ConfigError(f"budget override {pattern!r}: cosine_min must lie in [-1, 1]")
    return Budget(norm_l2=values["norm_l2"], cosine_min=values["cosine_min"], source=f"override {pattern}")
