"""``opband prescribe``: the smallest set of modules to keep at the reference precision so a low-precision
model's outputs pass their budgets.

1. The reference (the SPEC's model as built, usually fp32) runs once; its outputs are what the target's
   are judged against, with the budget of the variant's precision (or ``--budgets``, keyed as the root
   module's records are: ``/forward#0``, ``/forward#0:1`` ...).
2. Sensitivity, the error each candidate module *adds*: during that same reference run each candidate's
   target-precision module runs on the reference's own inputs to it, and its output is measured against
   the reference's (the module-level form of ``--replay``: no inherited error).
3. The most sensitive few are each kept alone in one run of the target model, and ranked by what the
   outputs' error becomes; the rest follow by sensitivity.
4. Greedy by that rank, with bisection: keep the first 1, 2, 4 ... until the outputs pass, then the
   shortest passing prefix between the last two sizes, then drop every kept module the outputs do not
   need (each drop is tried; the error it would bring back is what the module "removes").

The result passes (it was run), but it is not guaranteed to be the global minimum: the search tries
prefixes of one ranking and single drops, not every subset (see docs/prescribe.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from accuracy.budgets import BudgetPolicy, effective_dtype
from accuracy.metrics import Metrics, compare_arrays
from accuracy.verdicts import Verdict, judge_budget, worst_verdict
from hooks import gemm
from hooks import keep as keep_mod
from hooks.variants import QUANTIZED, apply_variant

#: sensitivities measured on one reference run; the most sensitive this many are also each kept alone
SINGLES = 8
#: modules inside a kept block tried in its place, per level
NARROW_TRIES = 3
#: metric names ``--metric`` accepts (attributes of :class:`accuracy.metrics.Metrics`)
METRICS = ("norm_l2", "max_abs", "max_rel", "mean_rel", "rmse", "ulp_max", "mean_abs")


class PrescribeError(ValueError):
    """The search cannot run or went past its budget; the message says what to change."""


@dataclass
class OutputCheck:
    """The model outputs of one run against the reference's: each output's verdict, metric and reason."""

    verdict: Verdict
    worst: float  # the ranking metric's largest value over the outputs (inf: non-finite)
    outputs: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": str(self.verdict), "worst": _json(self.worst), "outputs": self.outputs}


@dataclass
class Kept:
    """A module of the prescription: the outputs' error with the whole set, and without this module."""

    module: str
    error_without: float
    error_with: float

    def as_dict(self) -> dict[str, Any]:
        return {"module": self.module, "error_without": _json(self.error_without), "error_with": _json(self.error_with)}


@dataclass
class Prescription:
    """What ``opband prescribe`` found."""

    variant: str
    metric: str
    keep: list[Kept]
    before: OutputCheck
    after: OutputCheck | None  # None: nothing to keep (``before`` passes) or no set passed
    runs: int  # target runs (forward passes with a kept set), the reference's run not counted
    candidates: int
    sensitivity: list[tuple[str, float]]  # (module, error it adds), most sensitive first (the top 20)
    found: bool  # False: no set within --max-keep / --max-runs passed; ``keep`` is the best tried
    notes: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return [k.module for k in self.keep]

    def as_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "metric": self.metric, "found": self.found,
                "keep": [k.as_dict() for k in self.keep], "before": self.before.as_dict(),
                "after": self.after.as_dict() if self.after is not None else None, "runs": self.runs,
                "candidates": self.candidates,
                "sensitivity": [{"module": m, "error": _json(e)} for m, e in self.sensitivity],
                "notes": self.notes, "config": {"toml": self.toml(), "python": self.python()}}

    def toml(self) -> str:
        """What ``opband capture --variant V --keep FILE`` reads."""
        paths = ", ".join(f'"{p}"' for p in self.paths)
        return f'variant = "{self.variant}"\nkeep = [{paths}]\n'

    def python(self) -> str:
        return f"hooks.variants.apply(model, {self.variant!r}, keep={self.paths!r})"


def _json(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def _float_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _measure(ref: torch.Tensor, tgt: torch.Tensor) -> Metrics:
    r = ref.detach().to("cpu", torch.float64).reshape(-1).numpy()
    t = tgt.detach().to("cpu", torch.float64).reshape(-1).numpy()
    if r.shape != t.shape:
        raise PrescribeError(f"an output of shape {tuple(tgt.shape)} where the reference's is {tuple(ref.shape)}")
    return compare_arrays(np.ascontiguousarray(r), np.ascontiguousarray(t), "float64")


def _value(m: Metrics, metric: str) -> float:
    if not m.finite_outcome:
        return math.inf
    return m.get(metric)


def _call(model: nn.Module, inputs: Any) -> Any:
    with torch.no_grad():
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _size(module: nn.Module) -> int:
    """What keeping a module costs: its parameters (a parameter-free module: 1)."""
    return max(1, sum(p.numel() for p in module.parameters()))


def _callable(module: nn.Module) -> bool:
    """Modules that run a forward of their own (ModuleList/ModuleDict only hold others)."""
    return type(module).forward is not nn.Module.forward


def _cast_like(x: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


class Search:
    """One reference model and one target model (the variant applied to a copy, or a second SPEC)."""

    def __init__(self, reference: nn.Module, ref_inputs: Any, target: nn.Module, tgt_inputs: Any, variant: str,
                 candidates: Sequence[str], policy: BudgetPolicy, metric: str, max_runs: int,
                 progress: Callable[[int, str], None] | None = None) -> None:
        if metric not in METRICS:
            raise PrescribeError(f"--metric {metric!r}: one of {', '.join(METRICS)}")
        self.reference, self.target = reference, target
        self.ref_inputs, self.tgt_inputs = ref_inputs, tgt_inputs
        self.variant, self.policy, self.metric, self.max_runs = variant, policy, metric, max_runs
        self.candidates = list(candidates)
        self.progress = progress or (lambda runs, status: None)
        self.runs = 0
        self._originals: dict[str, nn.Module] = {}
        self._checked: dict[tuple[str, ...], OutputCheck] = {}
        self.ref_out = [t.detach().clone() for t in _float_leaves(_call(reference, ref_inputs))]
        if not self.ref_out:
            raise PrescribeError("the reference's outputs hold no floating tensor to judge")

    # -- runs --------------------------------------------------------------------------------------
    def check(self, keep: Sequence[str]) -> OutputCheck:
        """Run the target with ``keep`` at the reference precision; its outputs against the reference's."""
        key = tuple(sorted(keep_mod.normalize(keep)))
        if key in self._checked:
            return self._checked[key]
        if self.runs >= self.max_runs:
            raise _OutOfRuns()
        self.runs += 1
        self.progress(self.runs, f"keeping {len(key)} module(s)")
        kept = keep_mod.keep_modules(self.target, {p: self._original(p) for p in key}, list(key))
        try:
            out = _call(self.target, self.tgt_inputs)
        except Exception as e:
            raise PrescribeError(f"the target run keeping {list(key) or 'nothing'} at the reference precision "
                                 f"failed: {type(e).__name__}: {e}") from e
        finally:
            kept.restore()
        result = self._judge(_float_leaves(out))
        self._checked[key] = result
        return result

    def _original(self, path: str) -> nn.Module:
        if path not in self._originals:
            self._originals[path] = copy.deepcopy(self.reference.get_submodule(path))
        return self._originals[path]

    def _judge(self, outs: list[torch.Tensor]) -> OutputCheck:
        if len(outs) != len(self.ref_out):
            raise PrescribeError(f"the target returns {len(outs)} floating outputs, the reference {len(self.ref_out)}")
        rows, verdicts, worst = [], [], 0.0
        for i, (r, t) in enumerate(zip(self.ref_out, outs, strict=True)):
            key = "/forward#0" + (f":{i}" if i else "")
            dtype = effective_dtype(str(t.dtype).removeprefix("torch."), self.variant)
            budget = self.policy.budget(key, "forward", "module", dtype, "propagated")
            m = _measure(r, t)
            verdict, reason = judge_budget(m, budget)
            value = _value(m, self.metric)
            worst = max(worst, value)
            verdicts.append(verdict)
            rows.append({"output": key, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                         "verdict": str(verdict), self.metric: _json(value), "norm_l2": _json(_value(m, "norm_l2")),
                         "reason": reason})
        return OutputCheck(worst_verdict(verdicts), worst, rows)

    # -- sensitivity -------------------------------------------------------------------------------
    def sensitivity(self) -> dict[str, float]:
        """The error each candidate adds: its target module run on the reference's inputs to it."""
        added: dict[str, float] = {}
        handles = []
        ref_modules = dict(self.reference.named_modules())
        for path in self.candidates:
            own = self.target.get_submodule(path)
            dtype = _input_dtype(own, self.target)

            def hook(mod: nn.Module, args: Any, kwargs: dict[str, Any], out: Any, path: str = path,
                     own: nn.Module = own, dtype: torch.dtype = dtype) -> None:
                try:
                    args, kwargs = _private(args), {k: _private(v) for k, v in kwargs.items()}
                    got = own(*_cast_like(args, dtype), **_cast_like(kwargs, dtype))
                    pairs = list(zip(_float_leaves(out), _float_leaves(got), strict=True))
                    added[path] = max((_value(_measure(r, t), self.metric) for r, t in pairs), default=0.0)
                except Exception:  # noqa: BLE001 - a module that cannot run alone is ranked last, not fatal
                    added.setdefault(path, -1.0)

            handles.append(ref_modules[path].register_forward_hook(hook, with_kwargs=True))
        try:
            _call(self.reference, self.ref_inputs)
        finally:
            for h in handles:
                h.remove()
        return added

    # -- the search ----------------------------------------------------------------------------------
    def run(self, max_keep: int | None) -> Prescription:
        before = self.check([])
        if before.verdict == Verdict.PASS:
            return self._result([], before, None, True, {}, ["the target already passes: nothing to keep"])
        added = self.sensitivity()
        sizes = {p: _size(self.target.get_submodule(p)) for p in self.candidates}
        ranked = sorted(self.candidates, key=lambda p: (-added.get(p, -1.0), sizes[p]))
        notes: list[str] = []
        try:
            singles: dict[str, float] = {}
            for p in ranked[:SINGLES]:  # most sensitive first; the first that passes alone is the answer
                alone = self.check([p])
                if alone.verdict == Verdict.PASS:
                    return self._finish([p], before, added, notes)
                singles[p] = alone.worst
            order = sorted(singles, key=lambda p: (singles[p], sizes[p])) + ranked[SINGLES:]
            limit = min(len(order), max_keep or len(order))
            found = self._shortest_prefix(order, limit)
            if found is None:
                best = min(self._checked.items(), key=lambda kv: kv[1].worst)
                notes.append(f"no set of up to {limit} of the ranked modules passed")
                return self._result(list(best[0]), before, best[1], False, added, notes)
            return self._finish(found, before, added, notes)
        except _OutOfRuns:
            best_key, best = min(self._checked.items(), key=lambda kv: (kv[1].verdict != Verdict.PASS, kv[1].worst))
            notes.append(f"stopped after --max-runs {self.max_runs} runs: the set below is the best tried"
                         + ("" if best.verdict == Verdict.PASS else " and does not pass"))
            return self._result(list(best_key), before, best, best.verdict == Verdict.PASS, added, notes)

    def _shortest_prefix(self, order: list[str], limit: int) -> list[str] | None:
        """The shortest prefix of ``order`` (at most ``limit`` long) whose keeping passes: sizes 1, 2, 4 ...
        then bisection between the last failing and the first passing size."""
        low, size = 0, 1
        while True:
            size = min(size, limit)
            if self.check(order[:size]).verdict == Verdict.PASS:
                break
            if size == limit:
                return None
            low, size = size, size * 2
        high = size
        while high - low > 1:
            mid = (low + high) // 2
            if self.check(order[:mid]).verdict == Verdict.PASS:
                high = mid
            else:
                low = mid
        return keep_mod.normalize(order[:high])

    def _narrow(self, keep: list[str], added: dict[str, float]) -> list[str]:
        """Replace each kept block by one module inside it while the outputs still pass (most sensitive
        first, :data:`NARROW_TRIES` tries a level): keep the part of a block that loses the accuracy."""
        keep = list(keep)
        for i in range(len(keep)):
            while True:
                inner = sorted((p for p in self.candidates if p != keep[i] and keep_mod.inside(p, keep[i])),
                               key=lambda p: -added.get(p, -1.0))
                for p in inner[:NARROW_TRIES]:
                    if self.check([*keep[:i], p, *keep[i + 1:]]).verdict == Verdict.PASS:
                        keep[i] = p
                        break
                else:
                    break
        return keep

    def _finish(self, keep: list[str], before: OutputCheck, added: dict[str, float], notes: list[str]) -> Prescription:
        """Narrow each kept block, then drop each kept module the outputs do not need (latest ranked first);
        the set that passes."""
        keep = list(keep)
        try:
            keep = self._narrow(keep, added)
            for path in reversed(list(keep)):
                if len(keep) > 1 and self.check([p for p in keep if p != path]).verdict == Verdict.PASS:
                    keep.remove(path)
        except _OutOfRuns:
            notes.append(f"--max-runs {self.max_runs} reached while dropping unneeded modules: the set may hold more "
                         "than it needs")
        return self._result(keep, before, self.check(keep), True, added, notes)

    def _result(self, keep: list[str], before: OutputCheck, after: OutputCheck | None, found: bool,
                added: dict[str, float], notes: list[str]) -> Prescription:
        kept = []
        for path in keep:
            with_all = after.worst if after is not None else before.worst
            without = self._checked.get(tuple(sorted(p for p in keep if p != path)))
            if without is None and self.runs < self.max_runs:
                without = self.check([p for p in keep if p != path])
            kept.append(Kept(path, without.worst if without is not None else math.nan, with_all))
        top = sorted(added.items(), key=lambda kv: -kv[1])[:20]
        return Prescription(self.variant, self.metric, kept, before, after, self.runs, len(self.candidates), top,
                            found, notes)


class _OutOfRuns(Exception):
    """--max-runs reached."""


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def _private(x: Any) -> Any:
    """A copy of an argument that a module may change (a KV cache it appends to); tensors and scalars as is."""
    if isinstance(x, _PLAIN):
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_private(v) for v in x)
    return copy.deepcopy(x)


def _input_dtype(module: nn.Module, model: nn.Module) -> torch.dtype:
    """The dtype a target module computes in: its own (:func:`hooks.keep.compute_dtype`), else the model's."""
    return keep_mod.compute_dtype(module) or keep_mod.compute_dtype(model) or torch.float32


def candidates_for(reference: nn.Module, target: nn.Module, variant: str) -> list[str]:
    """The modules a prescription may keep: the GEMM-like modules a quantizing variant replaced, else every
    module with a forward of its own at the same path in both models (leaves and blocks)."""
    tgt = dict(target.named_modules())
    if variant in QUANTIZED:
        return [g.name for g in gemm.find_gemms(reference)[0] if g.name in tgt
                and type(tgt[g.name]) is not type(reference.get_submodule(g.name))]
    return [name for name, m in reference.named_modules() if name and _callable(m) and name in tgt]


def prescribe(spec: str, variant: str, *, target_spec: str | None = None, budgets: Any = None,
              metric: str = "norm_l2", max_keep: int | None = None, max_runs: int = 64, device: str = "cpu",
              seed: int = 0, progress: Callable[[int, str], None] | None = None) -> Prescription:
    """Find the modules to keep at the SPEC's own precision so the ``variant`` (or ``target_spec``'s model,
    matched by module path) passes on the SPEC's inputs; see the module docstring for the search."""
    from hooks.spec import load_training_spec

    torch.manual_seed(seed)
    reference, inputs, _ = load_training_spec(spec)
    target = tgt_inputs = None
    if target_spec is not None:
        torch.manual_seed(seed)
        target, tgt_inputs, _ = load_training_spec(target_spec)
    return prescribe_models(reference, inputs, variant, target=target, target_inputs=tgt_inputs, budgets=budgets,
                            metric=metric, max_keep=max_keep, max_runs=max_runs, device=device, progress=progress)


def prescribe_models(reference: nn.Module, inputs: Any, variant: str, *, target: nn.Module | None = None,
                     target_inputs: Any = None, budgets: Any = None, metric: str = "norm_l2",
                     max_keep: int | None = None, max_runs: int = 64, device: str = "cpu",
                     progress: Callable[[int, str], None] | None = None) -> Prescription:
    """:func:`prescribe` for models in hand: ``reference`` (left unchanged) and its ``inputs``; the target is
    ``variant`` applied to a copy, or ``target`` (with ``target_inputs``, default ``inputs``)."""
    reference = reference.eval().to(device)
    ref_inputs = _to(inputs, device)
    users = target is not None  # a user's own target: any module at a path both models have is a candidate
    if target is not None:
        target = target.eval().to(device)
        tgt_inputs = _to(target_inputs if target_inputs is not None else inputs, device)
    else:
        target, tgt_inputs, _ = apply_variant(copy.deepcopy(reference), ref_inputs, variant, device)
    policy = budgets if isinstance(budgets, BudgetPolicy) else BudgetPolicy.from_config(budgets)
    cands = candidates_for(reference, target, "fp32" if users else variant)
    if not cands:
        raise PrescribeError("no module of the target can be kept: " + (
            "no module path is in both models" if users else f"--variant {variant} replaced no module"))
    search = Search(reference, ref_inputs, target, tgt_inputs, variant, cands, policy, metric, max_runs, progress)
    return search.run(max_keep)


def _to(inputs: Any, device: str) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
