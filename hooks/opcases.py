"""The op sweep's database of cases: one record per op (what it calls, what its inputs are, default
shapes), the value regimes, and the input generator every sweep, the pytest plugin and tests share.

An :class:`OpCase` names the op it records (``aten.mm``; ``api`` kind for ``torch.*`` functions and
composite blocks such as RoPE), calls it through the ``torch`` namespace at call time (so a patched
kernel is what runs), and gives each tensor input a *role*: ``data`` inputs take the value regime,
``param`` inputs are weights drawn normally, ``index@I.D`` inputs are integers below dimension D of
input I. Ops not in the table are resolved by name (``aten.X`` or ``torch.a.b``) and called with
their tensors only, all of them ``data``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

#: Value regimes, in report order. ``normal`` N(0,1); the others are the boundary regimes.
REGIMES: dict[str, str] = {
    "normal": "N(0, 1)",
    "large": "N(0, 1) x 1e4 (fp16 overflows after one product)",
    "near_zero": "N(0, 1) x 1e-4 (fp16's subnormal range starts at 6.1e-5)",
    "subnormal": "N(0, 1) x 1e-40 (fp32 subnormals; fp16 flushes them to zero)",
    "nonfinite": "N(0, 1) with 2% of elements set to +inf, -inf or NaN",
    "ill_conditioned": "+-1e3 + N(0, 1): terms of opposite sign that cancel in sums and products",
}
BOUNDARY_REGIMES = tuple(r for r in REGIMES if r != "normal")


@dataclass(frozen=True)
class OpCase:
    """One op of the sweep: how to call it and what its tensor inputs are."""

    name: str  # sweep name, e.g. "softmax"
    op: str  # recorded op name, e.g. "aten._softmax"
    fn: Callable[..., Any]  # called with the tensor inputs (and kwargs)
    roles: tuple[str, ...]  # one per tensor input: data | param | index@I.D
    shapes: tuple[str, ...] = ()  # default shape signatures, e.g. "128x256,256x128"
    kind: str = "aten"
    outputs: tuple[int, ...] | None = None  # outputs to record (None: all); topk/sort indices tie-break freely
    aten: tuple[str, ...] = ()  # ATen op names a captured bundle may show for it
    kwargs: dict[str, Any] = field(default_factory=dict)
    recorded_call: dict[str, Any] | None = None  # an op call a capture recorded (``--inputs``), replayed with new tensors

    def call(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the op; the recorded output tensors, in order."""
        out = self.fn(*tensors, **self.kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        return outs if self.outputs is None else [outs[i] for i in self.outputs]


def _rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama): ``x * cos + rotate_half(x) * sin`` with cos/sin of ``angles``."""
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1)


def _case(name: str, op: str, fn: Callable[..., Any], roles: str, shapes: str, **kw: Any) -> OpCase:
    return OpCase(name, op, fn, tuple(roles.split()), tuple(shapes.split()), **kw)


#: The built-in LLM op list: what a decoder's forward pass runs, at shapes of a small one.
LLM_CASES: tuple[OpCase, ...] = (
    _case("mm", "aten.mm", lambda a, b: torch.mm(a, b), "data data", "64x256,256x128", aten=("aten.mm",)),
    _case("linear", "aten.linear", lambda x, w, b: F.linear(x, w, b), "data param param", "2x32x256,128x256,128",
          aten=("aten.linear",)),
    _case("bmm", "aten.bmm", lambda a, b: torch.bmm(a, b), "data data", "8x64x32,8x32x64", aten=("aten.bmm",)),
    _case("softmax", "aten._softmax", lambda x: torch.softmax(x, dim=-1), "data", "2x4x64x64",
          aten=("aten._softmax", "aten.softmax", "aten._safe_softmax")),
    _case("log_softmax", "aten._log_softmax", lambda x: torch.log_softmax(x, dim=-1), "data", "16x512",
          aten=("aten._log_softmax", "aten.log_softmax")),
    _case("layer_norm", "aten.layer_norm", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), "data param param",
          "2x32x256,256,256", aten=("aten.native_layer_norm", "aten.layer_norm")),
    _case("rms_norm", "aten.rms_norm", lambda x, w: F.rms_norm(x, x.shape[-1:], w, eps=1e-6), "data param",
          "2x32x256,256", aten=("aten.rms_norm", "aten._fused_rms_norm")),
    _case("silu", "aten.silu", lambda x: F.silu(x), "data", "2x32x344", aten=("aten.silu",)),
    _case("gelu", "aten.gelu", lambda x: F.gelu(x), "data", "2x32x344", aten=("aten.gelu",)),
    _case("gelu_tanh", "aten.gelu", lambda x: F.gelu(x, approximate="tanh"), "data", "2x32x344"),
    _case("rope", "rope.rotate_half", _rope, "data param", "2x4x32x32,32x16", kind="api"),
    _case("sdpa", "aten.scaled_dot_product_attention",
          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "data data data",
          "2x4x64x32,2x4x64x32,2x4x64x32",
          aten=("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention")),
    _case("embedding", "aten.embedding", lambda w, i: F.embedding(i, w), "data index@0.0", "512x128,2x32",
          aten=("aten.embedding",)),
    _case("topk", "aten.topk", lambda x: torch.topk(x, 8, dim=-1), "data", "16x512", outputs=(0,), aten=("aten.topk",)),
    _case("sort", "aten.sort", lambda x: torch.sort(x, dim=-1), "data", "16x512", outputs=(0,), aten=("aten.sort",)),
    _case("cumsum", "aten.cumsum", lambda x: torch.cumsum(x, dim=-1), "data", "16x512", aten=("aten.cumsum",)),
    _case("sum", "aten.sum", lambda x: torch.sum(x, dim=-1), "data", "16x512", aten=("aten.sum",)),
    _case("mean", "aten.mean", lambda x: torch.mean(x, dim=-1), "data", "16x512", aten=("aten.mean",)),
    _case("amax", "aten.amax", lambda x: torch.amax(x, dim=-1), "data", "16x512", aten=("aten.amax", "aten.max")),
    _case("logsumexp", "aten.logsumexp", lambda x: torch.logsumexp(x, dim=-1), "data", "16x512",
          aten=("aten.logsumexp",)),
    _case("add", "aten.add", lambda a, b: torch.add(a, b), "data data", "2x32x256,2x32x256", aten=("aten.add",)),
    _case("mul", "aten.mul", lambda a, b: torch.mul(a, b), "data data", "2x32x256,2x32x256", aten=("aten.mul",)),
    _case("div", "aten.div", lambda a, b: torch.div(a, b), "data data", "2x32x256,2x32x256", aten=("aten.div",)),
    _case("exp", "aten.exp", lambda x: torch.exp(x), "data", "2x32x256", aten=("aten.exp",)),
    _case("rsqrt", "aten.rsqrt", lambda x: torch.rsqrt(x), "data", "2x32x256", aten=("aten.rsqrt",)),
    _case("sigmoid", "aten.sigmoid", lambda x: torch.sigmoid(x), "data", "2x32x256", aten=("aten.sigmoid",)),
    _case("tanh", "aten.tanh", lambda x: torch.tanh(x), "data", "2x32x256", aten=("aten.tanh",)),
    _case("conv2d", "aten.conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), "data param param",
          "2x16x16x16,32x16x3x3,32", aten=("aten.conv2d", "aten.convolution")),
)
BUILTIN: dict[str, OpCase] = {c.name: c for c in LLM_CASES}
BY_ATEN: dict[str, OpCase] = {a: c for c in LLM_CASES for a in c.aten}


class CaseError(ValueError):
    """An op name, shape or role that the sweep cannot use; the message says what to write instead."""


def resolve_case(name: str, kwargs: dict[str, Any] | None = None) -> OpCase:
    """A built-in case (``softmax``), the built-in case of an ATen name a bundle shows
    (``aten._softmax``), or an op called by name with its tensors and ``kwargs`` (``aten.gelu``
    with ``approximate="tanh"``, ``torch.special.erf``)."""
    if not kwargs:
        if name in BUILTIN:
            return BUILTIN[name]
        if name in BY_ATEN:
            return BY_ATEN[name]
    fn = _lookup(name)
    if fn is None:
        raise CaseError(f"unknown op {name!r}: use a built-in name ({', '.join(BUILTIN)}; they take no kwargs), "
                        "an ATen op (aten.erf) or a torch function (torch.special.erf)")
    return OpCase(name, name, fn, (), (), kind="aten" if name.startswith("aten.") else "api", kwargs=dict(kwargs or {}))


def call_case(call: dict[str, Any], input_dtypes: Sequence[str | None]) -> OpCase:
    """A case that replays a call a capture recorded (its op overload and non-tensor arguments) on
    generated tensors: floating inputs take the regime, bool inputs are random masks, integer
    inputs are zeros."""
    from hooks.opcall import decode_call, resolve_target

    target = str(call.get("target", ""))
    try:
        fn = resolve_target(target)
    except (AttributeError, ValueError) as e:
        raise CaseError(f"recorded call {target!r} names no torch op: {e}") from None

    def run(*tensors: torch.Tensor) -> Any:
        args, kwargs = decode_call(call, tensors, str(tensors[0].device) if tensors else None)
        return fn(*args, **kwargs)

    roles = tuple("data" if (d or "").startswith(("float", "bfloat")) else "mask" if d == "bool" else "zeros"
                  for d in input_dtypes if d is not None)
    packet = ".".join(target.split(".")[:2])
    return OpCase(target, packet, run, roles, kind="aten", recorded_call=call)


def _lookup(name: str) -> Callable[..., Any] | None:
    parts = name.split(".")
    if parts[0] == "aten" and len(parts) in (2, 3):
        packet = getattr(torch.ops.aten, parts[1], None)
        return getattr(packet, parts[2], None) if packet is not None and len(parts) == 3 else packet
    if parts[0] == "torch" and len(parts) >= 2:
        obj: Any = torch
        for p in parts[1:]:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj if callable(obj) else None
    return None


def parse_shapes(signature: str) -> list[list[int]]:
    """``"64x256,256x128"`` -> ``[[64, 256], [256, 128]]`` (``scalar`` is a 0-d tensor)."""
    shapes = []
    for part in signature.split(","):
        part = part.strip()
        if part == "scalar":
            shapes.append([])
            continue
        try:
            dims = [int(d) for d in part.split("x")]
        except ValueError:
            raise CaseError(f"shape {signature!r}: write each input's dimensions joined by 'x', inputs separated "
                            "by ',' (e.g. 64x256,256x128)") from None
        if any(d < 0 for d in dims) or math.prod(dims) > 1 << 26:
            raise CaseError(f"shape {signature!r}: dimensions must be >= 0 and each input at most 2^26 elements")
        shapes.append(dims)
    return shapes


def roles_for(case: OpCase, n_inputs: int) -> tuple[str, ...]:
    """The case's roles, or ``data`` for every input of an op called by name."""
    if case.roles:
        if len(case.roles) != n_inputs:
            raise CaseError(f"op {case.name} takes {len(case.roles)} tensor input(s), the shape gives {n_inputs}")
        return case.roles
    return ("data",) * n_inputs


def regime_values(regime: str, shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """float32 values of ``shape`` in ``regime`` (see :data:`REGIMES`)."""
    x = torch.randn(tuple(shape), generator=gen)
    if regime == "normal":
        return x
    if regime == "large":
        return x * 1e4
    if regime == "near_zero":
        return x * 1e-4
    if regime == "subnormal":
        return (x.double() * 1e-40).float()
    if regime == "nonfinite":
        flat = x.reshape(-1)
        n = flat.numel()
        pick = torch.randperm(n, generator=gen)[: max(3, n // 50)] if n >= 3 else torch.arange(n)
        specials = torch.tensor([math.inf, -math.inf, math.nan])
        flat[pick] = specials[torch.arange(pick.numel()) % 3]
        return x
    if regime == "ill_conditioned":
        sign = torch.randint(0, 2, tuple(shape), generator=gen).float() * 2 - 1
        return sign * 1e3 + x
    raise CaseError(f"unknown value regime {regime!r}: choose from {', '.join(REGIMES)}")


def make_inputs(case: OpCase, shapes: list[list[int]], regime: str, seed: int,
                exact_in: Sequence[torch.dtype] = ()) -> list[torch.Tensor]:
    """The case's float32/int64 inputs for one regime, deterministic in ``seed``.

    ``exact_in``: round floating inputs to each of these dtypes wherever it holds them (finite and
    not flushed to zero), so a target's cast changes nothing but what the dtype cannot represent:
    the sweep then measures the target's kernel, not the rounding of its inputs.
    """
    gen = torch.Generator().manual_seed(seed)
    roles = roles_for(case, len(shapes))
    out: list[torch.Tensor] = []
    for role, shape in zip(roles, shapes, strict=True):
        if role == "data":
            t = regime_values(regime, shape, gen)
        elif role == "param":
            t = torch.randn(tuple(shape), generator=gen)
            t = 1.0 + 0.1 * t if len(shape) <= 1 else t / math.sqrt(max(shape[-1], 1))
        elif role == "mask":
            t = torch.rand(tuple(shape), generator=gen) < 0.5
        elif role == "zeros":  # integer inputs of a recorded call: index 0 is valid wherever an index is
            t = torch.zeros(tuple(shape), dtype=torch.int64)
        elif role.startswith("index@"):
            i, d = (int(v) for v in role[6:].split("."))
            bound = shapes[i][d] if i < len(shapes) and d < len(shapes[i]) else 0
            if bound <= 0:
                raise CaseError(f"op {case.name}: index input needs input {i} to have a dimension {d} > 0")
            t = torch.randint(0, bound, tuple(shape), generator=gen)
        else:
            raise CaseError(f"op {case.name}: unknown input role {role!r}")
        out.append(exact_values(t, exact_in))
    return out


def exact_values(t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``t`` rounded to each of ``dtypes`` (in order) wherever that dtype holds the value: finite,
    and not flushed to zero. Other elements (and non-float tensors) are left as they are."""
    if not t.is_floating_point():
        return t
    for dt in dtypes:
        r = t.to(dt).to(t.dtype)
        t = torch.where(torch.isfinite(r) & ((r != 0) | (t == 0)) | torch.isnan(t), r, t)
    return t
