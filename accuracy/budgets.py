"""Default error budgets for ops with no history: one table keyed by dtype and op class.

A budget bounds the normalized L2 error ``||t - r|| / ||r||`` of an op's output (and puts a floor
under the cosine), in units of ``u``, the unit roundoff of the dtype whose rounding the target
carries (``machine_eps``: 2^-24 fp32, 2^-11 tf32/fp16, 2^-8 bf16, 2^-4 e4m3, 2^-3 e5m2, 1/254 int8).

- ``replay``/``golden`` (each op on the reference's inputs):
  ``max(CLASS_U[class] x u + ACC_U x sqrt(K) x u_acc, FLOOR[dtype])`` where ``K`` is the number of
  terms an output element sums (matmul/conv inner dimension, reduction length, normalized
  dimension, softmax length; 1 for other ops) and ``u_acc`` the unit roundoff of the accumulator
  (fp32, fp64 for fp64 ops). Rounding the operands costs a few ``u`` whatever ``K``; the rounding
  errors of a K-term sum grow like ``sqrt(K) u_acc`` (Higham, *Accuracy and Stability*, ch. 3), and
  a different kernel (blocking, split-K, thread count) changes exactly that part.
- ``propagated`` (two end-to-end runs): every upstream op's error arrives too and dominates, so
  one multiple of ``u`` per dtype (``PROPAGATED_U``) holds for every op.

The table and the measurements behind it are in ``docs/budgets.md``. Overrides come from a config
mapping or a TOML/YAML file ``{"ops": {"<op key or op name glob>": {"norm_l2": x, "cosine_min": y}}}``;
an override must give every field of the budget it replaces, or it is refused with the reason.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accuracy.errors import ConfigError
from accuracy.metrics import FLOAT_FORMATS, machine_eps

#: Op classes and the op names (ATen overload packets, without ``aten.``) that belong to them.
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "exact": (
        "embedding", "index_select", "gather", "cat", "stack", "clone", "copy", "copy_", "slice",
        "select", "index", "where", "masked_fill", "masked_fill_", "constant_pad_nd", "max_pool2d",
        "argmax", "argmin", "eq", "ne", "lt", "gt", "le", "ge", "fill_", "zeros_like", "ones_like",
        "_to_copy", "to", "neg", "abs", "relu", "scatter", "index_put", "index_put_", "tril", "triu",
        "arange", "full", "ones", "zeros", "max", "min", "amax", "amin", "maximum", "minimum",
    ),
    "matmul": (
        "mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "conv1d", "conv2d", "conv3d",
        "convolution", "_convolution", "linear_dynamic", "einsum", "addmv", "mv", "dot",
    ),
    "normalization": (
        "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_batch_norm",
        "batch_norm", "group_norm", "native_group_norm",
    ),
    "attention": (
        "_softmax", "softmax", "_log_softmax", "log_softmax", "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_safe_softmax",
    ),
    "reduction": ("sum", "mean", "var", "std", "norm", "linalg_vector_norm", "cumsum", "prod", "logsumexp",
                  "var_mean", "std_mean"),
}
_CLASS_OF = {name: cls for cls, names in OP_CLASSES.items() for name in names}

#: Replay/golden: the multiple of ``u`` one op may add by rounding its operands and result.
#: Elementwise ops are correctly rounded or within a few ulps (libm transcendental functions).
CLASS_U: dict[str, float] = {
    "exact": 1.0,
    "elementwise": 8.0,
    "reduction": 4.0,
    "matmul": 4.0,
    "normalization": 8.0,
    "attention": 8.0,
    "module": 64.0,
}
SUMMING_CLASSES = frozenset({"reduction", "matmul", "normalization", "attention"})
#: Replay/golden: the multiple of ``sqrt(K) u_acc`` a K-term sum may add (summation order).
ACC_U = 4.0

#: Replay/golden: absolute floor per dtype (below it differences are noise for any op).
FLOOR: dict[str, float] = {
    "float64": 1e-13,
    "float32": 1e-6,
    "tfloat32": 1e-4,
    "float16": 1e-3,
    "bfloat16": 8e-3,
    "float8_e4m3fn": 6e-2,
    "float8_e5m2": 1.2e-1,
    "int8": 2e-2,
    "int4": 1.7e-1,
}

#: Propagated mode: errors from every upstream op arrive too, so one budget per dtype, in units
#: of u, holds for every op class (the measurements behind each value: docs/budgets.md).
PROPAGATED_U: dict[str, float] = {
    "float64": 512.0,
    "float32": 512.0,
    "tfloat32": 32.0,
    "float16": 40.0,  # above the largest honest port measured (docs/budgets.md)
    "bfloat16": 32.0,
    "float8_e4m3fn": 4.0,
    "float8_e5m2": 4.0,
    "int8": 64.0,
    "int4": 8.0,  # u = 1/30: weight-only int4 (w4a16), random-weight GPT-2 logits 0.12 (= 3.5u)
}

#: Absolute floor of an op's RMS error, in units of ``tiny x u`` (half the subnormal spacing) of the
#: target dtype: values that an honest port rounds into or below the subnormal range (a layer scale of
#: 1e-6 times activations of 1e-2 in fp16) carry that absolute error whatever their size, so their
#: normalized error says nothing (``torch.testing``'s atol + rtol |ref|, with atol from the dtype).
ABS_FLOOR_TINY_U = 4.0

#: The largest finite value per dtype: references beyond a target's range are compared clipped to it
#: (``torch.finfo(float32).min`` as a mask value is ``finfo(float16).min`` in an honest fp16 port).
DTYPE_MAX: dict[str, float] = {
    "float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0,
}

#: An excess of at most this factor over the budget is a warning, beyond it a failure.
WARN_FACTOR = 2.0

#: Golden mode: a target may carry this many times the reference's own error against the fp64
#: golden (so a TF32 GPU reference's rounding is not blamed on the target).
GOLDEN_RATIO = 4.0


#: Metrics a budget override may bound from above, besides ``norm_l2`` (``accuracy.metrics.Metrics``'s names)
LIMIT_METRICS = ("max_abs", "max_rel", "mean_rel", "rmse", "ulp_max")


@dataclass(frozen=True)
class Budget:
    """The accepted error of one op: normalized L2 error and a cosine floor, and (from an override) upper
    limits on any other metric and torch.testing's ``|t - r| <= atol + rtol * |r|``."""

    norm_l2: float
    cosine_min: float
    source: str
    #: without ``rtol``: RMS error at or below this passes whatever the norm (values near the dtype's
    #: underflow); with ``rtol``: torch.testing's absolute tolerance
    atol: float = 0.0
    #: ``(metric, limit)``: ``max_abs`` … as in :data:`LIMIT_METRICS`, ``share_rel_over_1e-03`` …
    limits: tuple[tuple[str, float], ...] = ()
    rtol: float | None = None  # torch.testing's relative tolerance: set, the elements outside are counted
    close_share: float = 0.0  # with ``rtol``: the share of elements allowed outside ``atol + rtol * |r|``

    def describe(self) -> str:
        return f"norm_l2 <= {self.norm_l2:.2e} ({self.source})"


def op_class(op: str, kind: str = "aten") -> str:
    """The budget class of an op name such as ``aten.mm`` or ``quantized.linear_dynamic``."""
    if kind == "module":
        return "module"
    base = op.split(".")[1] if op.count(".") >= 1 else op
    return _CLASS_OF.get(base, "elementwise")


def reduction_length(op: str, input_shapes: Sequence[Sequence[int] | None], shape: Sequence[int]) -> int:
    """How many terms one output element of ``op`` sums (1 when it sums none or it is unknown)."""
    cls = op_class(op)
    shapes = [list(s) for s in input_shapes if s]
    if cls not in SUMMING_CLASSES or not shapes:
        return 1
    base = op.split(".")[-1]
    if cls == "matmul":
        if base in ("addmm", "baddbmm", "addmv") and len(shapes) >= 2:
            return max(shapes[1][-1], 1)
        if base.startswith("conv") or "convolution" in base:
            w = shapes[1] if len(shapes) > 1 else shapes[0]
            return max(math.prod(w[1:]), 1)
        return max(shapes[0][-1], 1)
    if cls == "reduction":
        n_out = max(math.prod(shape), 1)
        return max(math.prod(shapes[0]) // n_out, 1)
    if base.startswith("_scaled_dot") or base == "scaled_dot_product_attention":
        return max(shapes[0][-1] + (shapes[1][-2] if len(shapes) > 1 and len(shapes[1]) > 1 else 0), 1)
    return max(shapes[0][-1], 1)


_VARIANT_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8", "w8a16": "int8", "w4a16": "int4",
                  "fp8-e4m3": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2", "tf32": "tfloat32"}


def effective_dtype(target_dtype: str, variant: str, mode: str = "propagated") -> str:
    """The dtype whose rounding the target's values carry.

    int8/fp8 variants always carry their quantization error. In propagated mode an op that
    computes in fp32 inside a bf16 run (an upcast RMSNorm, a float softmax) still receives
    bf16-rounded inputs, so the run's lowest precision is the one that bounds its error.
    """
    low = _VARIANT_DTYPE.get(variant.removesuffix("-rowwise"))
    if low is None:
        return target_dtype
    if variant in ("int8", "w8a16", "w4a16", "tf32") or variant.startswith("fp8") or mode == "propagated":
        return low
    return target_dtype


def declared_dtype(variant: str) -> str:
    """The precision a run declares with its variant (``fp32`` -> ``float32``, ``bf16`` -> ``bfloat16``)."""
    return _VARIANT_DTYPE.get(variant, "float32")


@functools.lru_cache(maxsize=8192)  # pure, asked once per judged pair
def precision_trap(reference_dtype: str, target_dtype: str, variant: str) -> str | None:
    """Words for an op that computed in a lower precision than both the reference and the run's declared
    precision (casts around a GEMM in an fp32 run, an fp16 kernel in a bf16 port), else None.

    Such an op is judged at the declared precision: judged at its own dtype it would pass and the
    lost precision would be blamed on the next op.
    """
    declared = declared_dtype(variant)
    u_t, u_r, u_d = machine_eps(target_dtype), machine_eps(reference_dtype), machine_eps(declared)
    if u_t > 0 and u_r > 0 and u_t > u_r and u_t > u_d:
        return f"computed in {target_dtype}, reference {reference_dtype}, run declared {variant}"
    return None


@functools.lru_cache(maxsize=8192)  # pure, asked once per judged pair
def judged_dtype(reference_dtype: str, target_dtype: str, variant: str, mode: str) -> str:
    """The dtype whose budget an op is held to: :func:`effective_dtype`, except that a precision trap
    is held to the run's declared precision."""
    if precision_trap(reference_dtype, target_dtype, variant):
        return effective_dtype(declared_dtype(variant), variant, mode)
    return effective_dtype(target_dtype, variant, mode)


#: Outputs of multi-output ops that are by-products (saved statistics for backward, indices,
#: scratch): reported, never failing a run alone. Their main output carries the numbers that matter,
#: and e.g. a saved mean is ~0 by construction, so its normalized error says nothing.
AUXILIARY_OUTPUTS: dict[str, dict[int, str]] = {
    "native_layer_norm": {1: "saved mean", 2: "saved rstd"},
    "native_group_norm": {1: "saved mean", 2: "saved rstd"},
    "native_batch_norm": {1: "saved mean", 2: "saved invstd"},
    "_native_batch_norm_legit": {1: "saved mean", 2: "saved invstd"},
    "_native_batch_norm_legit_no_training": {1: "saved mean", 2: "saved invstd"},
    "_batch_norm_with_update": {1: "saved mean", 2: "saved invstd", 3: "reserve"},
    "_fused_rms_norm": {1: "saved rstd"},
    "max_pool2d_with_indices": {1: "indices"},
    "max_pool3d_with_indices": {1: "indices"},
    "adaptive_max_pool2d": {1: "indices"},
    "max": {1: "indices"},
    "min": {1: "indices"},
    "sort": {1: "indices"},
    "topk": {1: "indices"},
    "kthvalue": {1: "indices"},
    "mode": {1: "indices"},
    "median": {1: "indices"},
    "nanmedian": {1: "indices"},
    "cummax": {1: "indices"},
    "cummin": {1: "indices"},
    "_embedding_bag": {1: "offset2bag", 2: "bag size", 3: "max indices"},
    "_ctc_loss": {1: "log_alpha scratch"},
    "native_dropout": {1: "mask"},
    "_scaled_dot_product_flash_attention_for_cpu": {1: "logsumexp"},
    "_scaled_dot_product_flash_attention": {1: "logsumexp", 6: "philox seed", 7: "philox offset", 8: "debug mask"},
    "_scaled_dot_product_efficient_attention": {1: "logsumexp", 2: "philox seed", 3: "philox offset"},
    "_scaled_dot_product_cudnn_attention": {1: "logsumexp"},
}


def auxiliary_output(op: str, output: int) -> str | None:
    """What output ``output`` of ``op`` (``aten.native_layer_norm``) is when it is auxiliary, else None."""
    if output == 0:
        return None
    base = op.split(".")[1] if op.count(".") >= 1 else op
    return AUXILIARY_OUTPUTS.get(base, {}).get(output)


@functools.lru_cache(maxsize=8192)  # pure, asked once per judged pair
def default_budget(op: str, kind: str, dtype: str, mode: str = "propagated", reduction: int = 1) -> Budget:
    """The default budget of one op for a target ``dtype`` (see the module docstring)."""
    u = machine_eps(dtype) or machine_eps("float32")
    dtype = dtype if dtype in PROPAGATED_U else "float32"
    if mode == "propagated":
        limit = PROPAGATED_U[dtype] * u
        source = f"default {dtype}/propagated"
    else:
        cls = op_class(op, kind)
        summing = cls in SUMMING_CLASSES and reduction > 1
        u_acc = machine_eps("float64") if dtype == "float64" else machine_eps("float32")
        limit = max(CLASS_U[cls] * u + (ACC_U * math.sqrt(reduction) * u_acc if summing else 0.0), FLOOR[dtype])
        source = f"default {dtype}/{cls}" + (f" K={reduction}" if summing else "")
    limit = min(limit, 1.0)
    cosine_min = 1.0 - 2.0 * limit**2  # cos ~ 1 - nl2^2 / 2, with 2x slack on nl2
    tiny = FLOAT_FORMATS[dtype][1] if dtype in FLOAT_FORMATS else 0.0
    return Budget(norm_l2=limit, cosine_min=cosine_min, source=source, atol=ABS_FLOOR_TINY_U * tiny * u)


class BudgetPolicy:
    """Resolves the budget of each op: per-op overrides first (in file order), then the default table."""

    def __init__(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._overrides: list[tuple[str, Budget]] = []
        for pattern, spec in (overrides or {}).items():
            if not isinstance(spec, Mapping):
                raise ConfigError(f"budget override {pattern!r} must be a table of fields, not {type(spec).__name__}")
            self._overrides.append((pattern, _parse_override(pattern, spec)))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | os.PathLike[str] | None) -> BudgetPolicy:
        """From a mapping, or a ``.toml``/``.yaml``/``.yml``/``.json`` file path."""
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config)
        if not config:
            return cls()
        if not isinstance(config, Mapping):
            raise ConfigError("a budget config must be a mapping with an 'ops' section")
        unknown = set(config) - {"ops"}
        if unknown:
            raise ConfigError(f"unknown budget config section(s) {sorted(unknown)}; only 'ops' is read")
        return cls(config.get("ops") or {})

    @property
    def overrides(self) -> list[tuple[str, Budget]]:
        return list(self._overrides)

    def budget(self, key: str, op: str, kind: str, dtype: str, mode: str, reduction: int = 1) -> Budget:
        for pattern, budget in self._overrides:
            if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(op, pattern):
                return budget
        return default_budget(op, kind, dtype, mode, reduction)


def load_config(path: str | os.PathLike[str], what: str = "budget config") -> Mapping[str, Any]:
    """Read a config file (``what`` names it in errors); the suffix picks the parser."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror}") from e
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        if suffix == ".json":
            import json

            return json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parser error is the user's file, said once
        raise ConfigError(f"{what} {p} is not valid {suffix[1:].upper()}: {e}") from e
    raise ConfigError(f"{what} {p}: unknown suffix {suffix!r}; use .toml, .yaml, .yml or .json")


def _number(pattern: str, name: str, value: Any, low: float = 0.0, high: float = math.inf) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"budget override {pattern!r}: fields must be numbers ({name}: {e})") from e
    if not (low <= x <= high and math.isfinite(x)):
        raise ConfigError(f"budget override {pattern!r}: {name} must lie in [{low:g}, {high:g}] (finite), not {x!r}")
    return x


def _parse_override(pattern: str, spec: Mapping[str, Any]) -> Budget:
    """One override: ``norm_l2`` with ``cosine_min`` (both or neither), and/or upper limits on other metrics
    (:data:`LIMIT_METRICS`, ``share_rel_over``: ``{"1e-03": share}``), and/or ``atol`` + ``rtol``."""
    from accuracy.metrics import REL_THRESHOLDS

    allowed = {"norm_l2", "cosine_min", "atol", "rtol", "close_share", "share_rel_over", *LIMIT_METRICS}
    unknown = set(spec) - allowed
    if unknown:
        raise ConfigError(f"budget override {pattern!r}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    pair = {"norm_l2", "cosine_min"} & set(spec)
    if len(pair) == 1:
        missing = sorted({"norm_l2", "cosine_min"} - pair)
        raise ConfigError(
            f"budget override {pattern!r} sets {sorted(pair)} but not {missing}: a half-specified "
            "budget would silently mix your limit with a default you did not choose; give every field"
        )
    limits = [(name, _number(pattern, name, spec[name])) for name in LIMIT_METRICS if name in spec]
    shares = spec.get("share_rel_over", {})
    if not isinstance(shares, Mapping):
        raise ConfigError(f"budget override {pattern!r}: share_rel_over must map a relative-error threshold to "
                          f"the share of elements allowed over it, e.g. {{\"1e-03\" = 0.01}}")
    known = {f"{t:.0e}": t for t in REL_THRESHOLDS}
    for threshold, share in shares.items():
        name = next((k for k, t in known.items() if _same_threshold(threshold, t)), None)
        if name is None:
            raise ConfigError(f"budget override {pattern!r}: share_rel_over threshold {threshold!r} is not one opband "
                              f"measures; use one of {sorted(known)}")
        limits.append((f"share_rel_over_{name}", _number(pattern, f"share_rel_over {threshold}", share, 0.0, 1.0)))
    rtol = _number(pattern, "rtol", spec["rtol"]) if "rtol" in spec else None
    if "close_share" in spec and rtol is None:
        raise ConfigError(f"budget override {pattern!r}: close_share bounds the elements outside atol + rtol * |r|: "
                          "give rtol (and atol) with it")
    atol = _number(pattern, "atol", spec.get("atol", 0.0))
    if not pair and not limits and rtol is None:
        raise ConfigError(f"budget override {pattern!r} bounds nothing: give norm_l2 and cosine_min, a limit on one "
                          f"of {sorted([*LIMIT_METRICS, 'share_rel_over'])}, or atol and rtol")
    norm_l2 = _number(pattern, "norm_l2", spec["norm_l2"]) if pair else math.inf
    cosine_min = _number(pattern, "cosine_min", spec["cosine_min"], -1.0, 1.0) if pair else -1.0
    return Budget(norm_l2=norm_l2, cosine_min=cosine_min, source=f"override {pattern}", atol=atol,
                  limits=tuple(limits), rtol=rtol, close_share=_number(pattern, "close_share",
                                                                       spec.get("close_share", 0.0), 0.0, 1.0))


def _same_threshold(given: Any, threshold: float) -> bool:
    try:
        return math.isclose(float(given), threshold, rel_tol=1e-9)
    except (TypeError, ValueError):
        return False