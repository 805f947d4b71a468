"""The comparison pipeline: align two bundles, measure each pair, judge it, find the first divergence.

Modes: ``propagated`` (two end-to-end runs: errors flow downstream), ``replay`` (the target ran
each op on the reference's inputs: every failure is local) and ``golden`` (a third bundle of fp64
recomputations with the reference's record keys; both sides are measured against it and the
verdict uses target error / reference error). With ``history`` the per-op bands learned from
accepted runs replace the default budgets wherever there is enough history.
"""

from __future__ import annotations

import math
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from accuracy.align import Pair, PairList, Unmatched, align_bundles, same_elements
from accuracy.bands import BandCheck, BandConfig, History, bands_for, benjamini_hochberg
from accuracy.budgets import DTYPE_MAX, Budget, BudgetPolicy, auxiliary_output, judged_dtype, precision_trap, reduction_length
from accuracy.bundle import Bundle
from accuracy.errors import BundleError, OpbandError
from accuracy.divergence import BundleDataflow, mark_first_divergence
from accuracy.gcpause import paused_gc
from accuracy.fingerprints import ParameterDifference, input_difference, parameter_differences
from accuracy.capture_format import step_of_key
from accuracy.generation import GenerationComparison, compare_generations
from accuracy.manifest import Record, shape_signature
from accuracy.records import KINDS, RecordIndex
from accuracy.metrics import Metrics, PairBatch, compare_arrays, compare_discrete, compare_stats, is_float_dtype
from accuracy.verdicts import (
    TABLE_ORDER, VERDICT_ORDER, Verdict, judge_bands, judge_budget, judge_golden, judge_nonfinite_history, worst_verdict,
)

MODES = ("propagated", "replay", "golden")
__all__ = ["MODES", "VERDICT_ORDER", "ComparisonPlan", "ComparisonReport", "OpResult", "Tally", "compare", "conclude",
           "judge", "judge_range", "judge_streamed", "plan_comparison", "repeated_measurements", "target_name",
           "worst_verdict"]

#: Comparisons of more aligned pairs than this keep passing results as counts only (see :class:`Tally`).
KEEP_ALL_RESULTS = 100_000
#: Pairs judged per batch by :func:`judge_streamed`.
JUDGE_BATCH = 4096
#: Metrics of this many recent (reference tensor, target tensor) pairs are kept for records that share them.
SHARED_METRICS = 1024
#: Pairs whose small tensors are measured together (one :class:`~accuracy.metrics.PairBatch`) before judging.
MEASURE_BATCH = 256


@dataclass
class OpResult:
    """The judged comparison of one aligned op output."""

    key: str
    output: int
    op: str
    module: str
    kind: str
    index: int
    input_shapes: list[list[int] | None]
    shape: list[int]
    dtype: str
    reference_dtype: str
    metrics: Metrics | None
    verdict: Verdict
    reason: str
    budget: Budget | None = None
    aligned_by: str = "key"
    inherited: bool = False
    bands: list[BandCheck] = field(default_factory=list)  # non-empty when judged against history
    p_value: float | None = None  # band mode: Bonferroni over the op's metrics, before FDR control
    reference_metrics: Metrics | None = None  # golden mode: the reference against the golden
    golden_ratio: float | None = None  # golden mode: target error / reference error
    finding: str | None = None  # e.g. a precision trap: "computed in bfloat16, reference float32, run declared fp32"
    auxiliary: str | None = None  # what a by-product output is ("saved mean", "indices"): reported, never failing alone
    layouts: tuple[str, str] | None = None  # (reference, target) memory layouts when they differ

    @property
    def id(self) -> str:
        return self.key if self.output == 0 else f"{self.key}:{self.output}"

    @property
    def shape_signature(self) -> str:
        return shape_signature(self.input_shapes)

    @property
    def step(self) -> int:
        """The step of a capture whose calls of the model are steps (a generation: 0 the prefill, then
        one per decode step); 0 otherwise."""
        return step_of_key(self.key)

    @property
    def error(self) -> float:
        """The op's normalized L2 error (inf when it has no metrics but failed)."""
        if self.metrics is None:
            return math.inf if self.verdict == Verdict.FAIL else 0.0
        return self.metrics.norm_l2

    @property
    def severity(self) -> float:
        """How far out of its band or budget this op is (value / limit); orders tables worst first."""
        if self.metrics is None:
            return math.inf if self.verdict == Verdict.FAIL else 0.0
        if not self.metrics.finite_outcome:
            return math.inf
        if self.bands:
            return max(c.value / c.band.upper if c.band.upper > 0 else math.inf for c in self.bands)
        if self.budget is None:
            return 0.0
        if self.budget.norm_l2 == 0:
            return math.inf if self.metrics.norm_l2 > 0 or self.metrics.mismatches else 0.0
        return self.metrics.norm_l2 / self.budget.norm_l2


@dataclass
class ComparisonReport:
    """Everything one comparison found. Truthy when no op failed."""

    reference: dict[str, Any]
    target: dict[str, Any]
    mode: str
    ops: list[OpResult]
    unmatched: list[Unmatched]
    first_divergence: OpResult | None
    verdict: Verdict
    counts: dict[str, int] = field(default_factory=dict)
    golden: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    parameters: list[ParameterDifference] = field(default_factory=list)  # parameters that differ: findings
    notes: list[str] = field(default_factory=list)  # what was not judged, and why
    passes_not_listed: int = 0  # a large comparison lists its passing ops only in ``counts``
    generation: GenerationComparison | None = None  # both runs generated: their tokens step by step

    @property
    def total_ops(self) -> int:
        """Every judged op and unmatched record, listed in ``ops`` or not."""
        return len(self.ops) + self.passes_not_listed

    def __bool__(self) -> bool:
        return self.verdict != Verdict.FAIL

    @property
    def first_gradient_divergence(self) -> OpResult | None:
        """The earliest out-of-budget gradient or parameter update (training captures), in backward order."""
        bad = [o for o in self.ops if o.kind == "grad" and o.verdict in (Verdict.FAIL, Verdict.WARN) and o.aligned_by != "none"]
        return min(bad, key=lambda o: o.index) if bad else None

    def worst_first(self) -> list[OpResult]:
        return sorted(self.ops, key=lambda o: (-TABLE_ORDER.index(o.verdict), o.inherited, -o.severity, o.index))


def target_name(b: Bundle) -> str:
    """The target a history is kept for: ``run.target`` if set, else ``device/variant``."""
    run = b.manifest.run
    return str(run.get("target") or f"{b.manifest.device}/{b.manifest.variant}")


@paused_gc()
def compare(
    reference: str | os.PathLike[str] | Bundle,
    target: str | os.PathLike[str] | Bundle,
    *,
    mode: str = "propagated",
    budgets: Mapping[str, Any] | BudgetPolicy | str | os.PathLike[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    golden: str | os.PathLike[str] | Bundle | None = None,
    history: History | Mapping[Any, Any] | Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    band_config: BandConfig | None = None,
    target_id: str | None = None,
    on_pass: Callable[[list[OpResult]], None] | None = None,
) -> ComparisonReport:
    """Compare two bundles op by op and return the report the CLI, API and gate all render.

    ``golden``: the fp64 recomputation bundle (required in golden mode). ``history``: accepted
    past results (see docs/bands.md); ``target_id`` names the target they were kept for.
    A comparison of more than ``KEEP_ALL_RESULTS`` pairs keeps memory flat: its plain passing results
    are counted (``report.passes_not_listed``), not listed in ``report.ops``, and handed in batches to
    ``on_pass`` when given (they are final: e.g. to store every op's row as it comes).
    """
    plan = plan_comparison(reference, target, mode=mode, budgets=budgets, golden=golden, history=history,
                           band_config=band_config, target_id=target_id)
    if len(plan.pairs) > KEEP_ALL_RESULTS and not _parameter_diffs(plan)[0]:
        return conclude(plan, judge_streamed(plan, progress, on_pass))
    return conclude(plan, judge_range(plan, 0, len(plan.pairs), progress))


@dataclass
class ComparisonPlan:
    """Two opened, aligned runs and how to judge them: what :func:`judge_range` needs for any range of
    pairs and :func:`conclude` for the whole. A comparison can be split into ranges (shards) that run
    apart, even in other processes (each re-plans the same bundles: planning is deterministic)."""

    ref: Bundle
    tgt: Bundle
    gold: Bundle | None
    mode: str
    replayed: bool
    pairs: Sequence[Pair]  # a PairList: positions into both bundles, each Pair read when asked for
    unmatched: list[Unmatched]
    context: _Context


@paused_gc()
def plan_comparison(
    reference: str | os.PathLike[str] | Bundle,
    target: str | os.PathLike[str] | Bundle,
    *,
    mode: str = "propagated",
    budgets: Mapping[str, Any] | BudgetPolicy | str | os.PathLike[str] | None = None,
    golden: str | os.PathLike[str] | Bundle | None = None,
    history: History | Mapping[Any, Any] | Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    band_config: BandConfig | None = None,
    target_id: str | None = None,
) -> ComparisonPlan:
    """Open, check and align two bundles (see :func:`compare` for the arguments); measures nothing."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ref = _open(reference)
    tgt = _open(target)
    gold = _open(golden) if golden is not None else None
    if mode == "golden" and gold is None:
        if not is_golden(ref):
            raise OpbandError(
                f"golden mode needs a float64 recomputation of the reference: the reference ({ref.path.name}, "
                f"variant {ref.manifest.variant}) is not one. Make it with `opband capture --replay REF "
                "--golden -o GOLD.bundle` and compare GOLD.bundle against the target (Python: golden=GOLD.bundle)")
        gold, ref = ref, _original_reference(ref)
    policy = budgets if isinstance(budgets, BudgetPolicy) else BudgetPolicy.from_config(budgets)
    hist = History.load(history) if history is not None else None
    cfg = band_config or BandConfig()
    tname = target_id or target_name(tgt)
    replayed = bool(tgt.manifest.run.get("replay_of") or tgt.manifest.run.get("replay"))
    blocks = (tgt.manifest.run.get("compile") or {}).get("blocks")
    _check_same_model(ref, tgt, replayed, blocks)
    different = input_difference(ref.manifest.fingerprints, tgt.manifest.fingerprints)
    if different:
        raise OpbandError(
            f"the two runs had different inputs: {different}. Every op would differ alike; capture both runs "
            "on the same inputs (same SPEC, seed and data) and compare again")
    ref_sel = np.arange(ref.index.count)
    if replayed:  # a replay re-runs the reference's ops only: records of kinds it never produces (module
        # outputs) have no counterpart; an op sweep's targets re-run its aten and api (torch.*) cases
        kinds = {KINDS[k] for k in np.unique(tgt.index.kind)} - {"module", "grad"} or {"aten"}
        ref_sel = ref_sel[np.isin(ref.index.kind, [KINDS.index(k) for k in kinds])]
    if blocks:  # a compiled target records its blocks' outputs, not what runs inside them
        ref_sel = ref_sel[~_inside_compiled_mask(ref.index, blocks)[ref_sel]]
    pairs, unmatched = align_bundles(ref, ref_sel, tgt, np.arange(tgt.index.count), by_key=replayed)
    if not len(pairs):
        raise OpbandError(
            f"nothing to compare: the reference holds {len(ref.records)} records and the target "
            f"{len(tgt.records)}, and none of them align. Capture both runs from the same model code "
            "(same SPEC) and check the manifests' diagnostics and module/op filters"
        )
    judge_ctx = _Context(ref, tgt, gold if mode == "golden" else None, policy, mode, tgt.manifest.variant, hist, cfg, tname)
    return ComparisonPlan(ref, tgt, gold, mode, replayed, pairs, unmatched, judge_ctx)


@paused_gc()
def judge_range(plan: ComparisonPlan, start: int, stop: int,
                progress: Callable[[int, int], None] | None = None) -> list[OpResult]:
    """Measure and judge ``plan.pairs[start:stop]`` (before FDR control over bands, which
    :func:`conclude` applies to the whole); ``progress(done, total)`` after each pair."""
    results: list[OpResult] = []
    total = stop - start
    ctx = plan.context
    for lo in range(start, stop, MEASURE_BATCH):
        pairs = [plan.pairs[k] for k in range(lo, min(stop, lo + MEASURE_BATCH))]
        ctx.measure_ahead(pairs)
        try:
            for pair in pairs:
                results.append(ctx.judge_pair(pair))
                if progress:
                    progress(len(results), total)
        finally:
            ctx.forget_ahead()
    return results


@dataclass
class Tally:
    """Judged results of a large comparison, kept in flat memory: every result that is not a plain pass
    (failing, warning, new, banded — FDR needs those —, with a finding or a layout note, or an auxiliary
    output out of budget) in full, and the plain passes as counts. :func:`conclude` takes it in place
    of the result list; the report then lists the plain passes in ``counts`` only."""

    kept: list[OpResult] = field(default_factory=list)
    judged: int = 0
    passes: int = 0  # plain passes, not kept
    on_pass: Callable[[list[OpResult]], None] | None = None  # gets each batch's plain passes (final results)

    def add(self, results: Iterable[OpResult]) -> None:
        passed: list[OpResult] = []
        for r in results:
            self.judged += 1
            if r.verdict == Verdict.PASS and not (r.bands or r.finding or r.layouts or (r.auxiliary and r.reason.startswith("auxiliary"))):
                passed.append(r)
            else:
                self.kept.append(r)
        self.passes += len(passed)
        if self.on_pass is not None and passed:
            self.on_pass(passed)


@paused_gc()
def judge_streamed(plan: ComparisonPlan, progress: Callable[[int, int], None] | None = None,
                   on_pass: Callable[[list[OpResult]], None] | None = None) -> Tally:
    """:func:`judge_range` over every pair, in batches, into a :class:`Tally` (memory flat in the number
    of passing ops); ``progress(done, total)`` after each batch."""
    tally = Tally(on_pass=on_pass)
    total = len(plan.pairs)
    for start in range(0, total, JUDGE_BATCH):
        tally.add(judge_range(plan, start, min(total, start + JUDGE_BATCH)))
        if start // JUDGE_BATCH % 4 == 3:  # every ~16k pairs: the bundles' pages read so far leave the resident set
            for b in (plan.ref, plan.tgt, plan.gold):
                if b is not None:
                    b.release_pages()
        if progress:
            progress(tally.judged, total)
    return tally


@paused_gc()
def conclude(plan: ComparisonPlan, results: list[OpResult] | Tally) -> ComparisonReport:
    """The report from the judged results of all of ``plan.pairs``, in order (or their :class:`Tally`):
    FDR control over the banded ops, the unmatched records, the first divergence, parameter findings
    and the counts."""
    judged = results.judged if isinstance(results, Tally) else len(results)
    if judged != len(plan.pairs):
        raise ValueError(f"{judged} results for {len(plan.pairs)} aligned pairs: judge every range first")
    ref, tgt, gold, mode, replayed = plan.ref, plan.tgt, plan.gold, plan.mode, plan.replayed
    unmatched, cfg, hist = plan.unmatched, plan.context.config, plan.context.history
    tname = plan.context.target
    passes = results.passes if isinstance(results, Tally) else 0
    results = list(results.kept if isinstance(results, Tally) else results)
    _apply_fdr(results, cfg)
    results += [_unmatched_result(u) for u in unmatched]
    local_everywhere = mode == "replay" or (mode == "golden" and replayed)
    generation = compare_generations(ref.manifest.run, tgt.manifest.run)
    judged_ops = _after_token_divergence(results, generation)
    first = mark_first_divergence(judged_ops, local_everywhere, _dataflow(plan),
                                  _paired_reference_ids(plan) if passes else None)
    diffs, note = _parameter_diffs(plan)
    first = _parameter_divergence(results, diffs) or first
    counts = Counter(r.verdict for r in results)
    counts[Verdict.PASS] += passes
    notes = [note] if note else []
    if passes:
        notes.append(f"{passes:,} of {judged:,} ops passed and are counted, not listed one by one (a comparison of "
                     f"more than {KEEP_ALL_RESULTS:,} ops lists the others)")
    return ComparisonReport(
        reference=_side(ref), target=_side(tgt), mode=mode, ops=results, unmatched=unmatched,
        first_divergence=first, verdict=worst_verdict([v for v in VERDICT_ORDER if counts[v]]),
        counts={v: counts[v] for v in VERDICT_ORDER},
        golden=_side(gold) if gold is not None else None,
        history={"target": tname, "ops_with_bands": sum(1 for r in results if r.bands)} if hist is not None else None,
        parameters=diffs, notes=notes, passes_not_listed=passes, generation=generation,
    )


def _parameter_diffs(plan: ComparisonPlan) -> tuple[list[ParameterDifference], str | None]:
    if plan.replayed:
        return [], None
    return parameter_differences(plan.ref.manifest.fingerprints, plan.tgt.manifest.fingerprints,
                                 plan.tgt.manifest.variant)


def _dataflow(plan: ComparisonPlan) -> BundleDataflow:
    """The target's dataflow graph keyed like the results (by the reference's record ids: a
    sequence-aligned pair has another id in the target, so the target's ids are translated)."""
    pairs = plan.pairs
    aligned = pairs.sequence_aligned() if isinstance(pairs, PairList) else iter(pairs)
    alias = {p.target.id: p.reference.id for p in aligned if p.target.id != p.reference.id}
    return BundleDataflow(plan.tgt, alias)


def _paired_reference_ids(plan: ComparisonPlan) -> Callable[[str], bool]:
    """Whether an id is a paired reference record's (so it was measured) — for results not kept."""
    pairs = plan.pairs
    if not isinstance(pairs, PairList):
        ids = {p.reference.id for p in pairs}
        return ids.__contains__
    paired = np.zeros(plan.ref.index.count, dtype=bool)
    paired[pairs.ref_pos] = True

    def measured(rid: str) -> bool:
        p = plan.ref.position(rid)
        return p is not None and bool(paired[p])

    return measured


#: Below this share of the reference's modules found in the target, two runs are not the same model.
SAME_MODEL_SHARE = 0.5


def _check_same_model(ref: Bundle, tgt: Bundle, replayed: bool, blocks: list[str] | None = None) -> None:
    """Refuse (exit 2) two runs whose module structures do not align: a comparison would only list failures.
    Modules inside a compiled target's blocks are not observable there, so they are not counted."""
    if replayed:
        return
    ri, ti, mk = ref.index, tgt.index, KINDS.index("module")
    seen_r = (ri.kind == mk) & ~_inside_compiled_mask(ri, blocks) if blocks else ri.kind == mk
    mods_r = {ri.modules[c] for c in np.unique(ri.module[seen_r])}
    mods_t = {ti.modules[c] for c in np.unique(ti.module[ti.kind == mk])}
    if len(mods_r) < 2 or not mods_t:
        return
    shared = mods_r & mods_t
    if len(shared) >= SAME_MODEL_SHARE * len(mods_r):
        return
    only_r = sorted(mods_r - mods_t)[:3]
    only_t = sorted(mods_t - mods_r)[:3]
    raise OpbandError(
        f"the two runs are not the same model: only {len(shared)} of the reference's {len(mods_r)} modules exist in "
        f"the target (reference-only: {', '.join(only_r)}; target-only: {', '.join(only_t) or 'none'}). "
        "Compare captures of the same model code (same SPEC), with the same module names")


def _parameter_divergence(results: list[OpResult], diffs: list[ParameterDifference]) -> OpResult | None:
    """The first divergence when parameters differ: inside the earliest-running module whose parameters
    differ, its earliest local out-of-band op, else its own output record, marked failing with the finding."""
    def inside(r: OpResult, module: str) -> bool:
        return r.aligned_by != "none" and (r.module == module or r.module.startswith(module + ".") or not module)

    best: tuple[int, str, list[ParameterDifference]] | None = None
    for module in {d.module for d in diffs}:
        idx = [r.index for r in results if inside(r, module)]
        if idx and (best is None or min(idx) < best[0]):
            best = (min(idx), module, [d for d in diffs if d.module == module])
    if best is None:
        return None
    _, module, own = best
    words = "; ".join(d.sentence for d in own)
    members = [r for r in results if inside(r, module)]
    bad = [r for r in members if r.verdict in (Verdict.FAIL, Verdict.WARN) and not r.inherited and r.kind != "module"]
    own_record = [r for r in members if r.kind == "module" and r.module == module]
    chosen = min(bad, key=lambda r: r.index) if bad else (own_record or sorted(members, key=lambda r: r.index))[0]
    if chosen.verdict not in (Verdict.FAIL, Verdict.WARN):
        chosen.reason = f"parameters differ ({chosen.reason})"
    chosen.verdict, chosen.inherited = Verdict.FAIL, False
    chosen.finding = f"{chosen.finding}; {words}" if chosen.finding else words
    return chosen
def inside_compiled(r: Record, blocks: Iterable[str]) -> bool:
    """Whether a record lies inside a compiled block (``hooks.compiled``): an op of the block or of a
    module under it, or a module under it. The block's own output is observable."""
    for b in blocks:
        if not b:
            return r.kind != "module" or r.module != ""
        if r.module.startswith(b + ".") or (r.module == b and r.kind != "module"):
            return True
    return False


def _inside_compiled_mask(index: RecordIndex, blocks: Iterable[str]) -> np.ndarray:
    """:func:`inside_compiled` for every record of an index (decided once per module and kind)."""
    blocks = list(blocks)
    as_module = np.array([inside_compiled(SimpleNamespace(kind="module", module=m), blocks)  # type: ignore[arg-type]
                          for m in index.modules], dtype=bool).reshape(-1)
    as_op = np.array([inside_compiled(SimpleNamespace(kind="aten", module=m), blocks)  # type: ignore[arg-type]
                      for m in index.modules], dtype=bool).reshape(-1)
    if not index.count:
        return np.zeros(0, dtype=bool)
    return np.where(index.kind == KINDS.index("module"), as_module[index.module], as_op[index.module])


def is_golden(b: Bundle) -> bool:
    """True for an fp64 recomputation bundle (``hooks.replay(..., golden=True)`` marks ``run.golden``)."""
    return is_golden_run(b.manifest.run)


def is_golden_run(run: Mapping[str, Any]) -> bool:
    """:func:`is_golden` from a manifest's ``run`` alone (what the service keeps per bundle)."""
    return bool(run.get("golden")) or str(run.get("variant", "")).endswith("golden")


def _original_reference(gold: Bundle) -> Bundle:
    """The reference a golden was recomputed from (``run.replay_of``), or the golden itself if gone."""
    path = gold.manifest.run.get("replay_of")
    if path and Path(str(path)).is_file():
        try:
            return Bundle.open(str(path))
        except BundleError:
            return gold
    return gold


def _open(x: str | os.PathLike[str] | Bundle) -> Bundle:
    return x if isinstance(x, Bundle) else Bundle.open(x)


def _side(b: Bundle) -> dict[str, Any]:
    return {"path": str(b.path), "run": b.manifest.run, "environment": b.manifest.environment, "records": len(b.records)}


@dataclass
class _Context:
    ref: Bundle
    tgt: Bundle
    golden: Bundle | None
    policy: BudgetPolicy
    mode: str
    variant: str
    history: History | None
    config: BandConfig
    target: str
    #: metrics by the stored tensor pair they were measured on (see :meth:`_measure_shared`)
    _shared: _Recent = field(default_factory=lambda: _Recent())
    #: metrics measured ahead of judging (:meth:`measure_ahead`), by the same keys, until a record takes them
    _ahead: dict[tuple[Any, ...], Metrics] = field(default_factory=dict)

    def measure_ahead(self, pairs: Sequence[Pair]) -> None:
        """Measure the pairs of small stored float tensors among ``pairs`` together (one
        :class:`~accuracy.metrics.PairBatch`: one compiled call per dtype combination instead of one per
        pair), before they are judged one by one; :meth:`_measure_shared` then takes each pair's metrics
        from here. The same numbers as measuring each alone. Golden comparisons measure one by one."""
        if self.golden is not None or len(pairs) < 2:
            return
        try:
            self._ahead.update(self._measured_together(pairs))
        except Exception:  # noqa: BLE001 - each pair is then measured alone, and any error reported with it
            return

    def _measured_together(self, pairs: Sequence[Pair]) -> list[tuple[tuple[Any, ...], Metrics]]:
        """(key, metrics) of the pairs :meth:`measure_ahead` batches (see there)."""
        batch: PairBatch | None = None
        keys: list[tuple[Any, ...]] = []
        queued: set[tuple[Any, ...]] = set()
        for pair in pairs:
            r, t = pair.reference, pair.target
            key = _shared_key(self.ref, self.tgt, r, t)
            if (key is None or key in queued or key in self._shared or not same_elements(r, t)
                    or not is_float_dtype(r.dtype) or not is_float_dtype(t.dtype)):
                continue
            absmax, clip = _absmax_and_clip(r, t)
            if clip is not None:  # compared clipped: one by one
                continue
            assert r.tensor is not None and t.tensor is not None  # a shared key names both
            if batch is None:
                batch = PairBatch(self.ref.buffer(), self.tgt.buffer())
            if batch.add(self.ref.span(r.tensor), self.tgt.span(t.tensor), t.dtype, absmax):
                keys.append(key)
                queued.add(key)
        if batch is None or not keys:
            return []
        return list(zip(keys, batch.measure(), strict=True))

    def forget_ahead(self) -> None:
        """Drop metrics measured ahead that no judged record took (pairs judged without measuring)."""
        self._ahead.clear()

    def judge_pair(self, pair: Pair) -> OpResult:
        result = self._judge_values(pair)
        r, t = pair.reference, pair.target
        if r.layout != t.layout:  # values are stored in logical order: the comparison is by logical index
            result.layouts = (r.layout, t.layout)
            result.reason += f" (layouts differed: reference {r.layout}, target {t.layout}; compared by logical index)"
        aux = auxiliary_output(result.op, result.output)
        if aux is not None:
            result.auxiliary = aux
            if result.verdict in (Verdict.FAIL, Verdict.WARN):
                result.reason = f"auxiliary output ({aux}), reported, not judged alone: {result.reason}"
                result.verdict = Verdict.PASS
        return result

    def _judge_values(self, pair: Pair) -> OpResult:
        r, t = pair.reference, pair.target
        base = _base(pair)
        if not same_elements(r, t):
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL, reason=f"shape differs: reference {r.shape}, target {t.shape}")
        if is_float_dtype(r.dtype) != is_float_dtype(t.dtype):
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL,
                            reason=f"dtype kind differs: reference {r.dtype}, target {t.dtype}")
        gold = self._golden_record(r)
        try:
            metrics = self._measure_shared(self.golden if gold else self.ref, self.tgt, gold or r, t)
            ref_metrics = (self._measure_shared(self.golden, self.ref, gold, r)
                           if gold and self.golden is not None and self.golden is not self.ref else None)
        except Exception as e:  # noqa: BLE001 - our bug, reported with the pair, never the user's crash
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL,
                            reason=f"internal error comparing {r.id}: {type(e).__name__}: {e} (please report)")
        if metrics is None:
            return OpResult(**base, metrics=None, verdict=Verdict.NEW, reason="no tensor or statistics to compare on one side")
        if metrics.mismatches is not None:
            verdict = Verdict.FAIL if metrics.mismatches else Verdict.PASS
            reason = f"{metrics.mismatches} of {metrics.numel} elements differ" if metrics.mismatches else "all elements equal"
            return OpResult(**base, metrics=metrics, verdict=verdict, reason=reason, budget=Budget(0.0, 1.0, "exact"))
        dtype = judged_dtype(r.dtype, t.dtype, self.variant, self.mode)
        k = reduction_length(t.op, t.input_shapes, t.shape)
        budget = self.policy.budget(r.key, t.op, t.kind, dtype, "replay" if self.mode == "golden" else self.mode, k)
        result = OpResult(**base, metrics=metrics, verdict=Verdict.PASS, reason="", budget=budget, reference_metrics=ref_metrics,
                          finding=precision_trap(r.dtype, t.dtype, self.variant))
        if self.history is not None and self._judge_history(result, dtype):
            return result
        if ref_metrics is not None:
            result.verdict, result.reason, result.golden_ratio = judge_golden(metrics, ref_metrics, budget)
        else:
            result.verdict, result.reason = judge_budget(metrics, budget)
            if self.golden is not None and gold is None:
                result.reason += " (no golden record: judged against the reference)"
            elif gold is not None:
                result.reason += " (vs fp64 golden; no reference outputs to compare its error with)"
        if result.finding:
            result.reason += f"; {result.finding}"
        return result

    def _measure_shared(self, ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> Metrics | None:
        """:func:`_measure`, once per stored tensor pair: records that name the same stored tensors (a
        module's output and the op output it aliases, e.g. ``q_proj/forward#0`` and its ``aten.mm#0``;
        bundle format 1.1 on) share their metrics, which depend on nothing else the key leaves out.
        Each record gets its own object (later ones a shallow copy). The last :data:`SHARED_METRICS` pairs are kept.
        A pair measured ahead (:meth:`measure_ahead`) is taken from there, as if measured now."""
        key = _shared_key(ref, tgt, r, t)
        if key is None:
            return _measure(ref, tgt, r, t)
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._shared.put(key, ahead)
            return ahead
        if key in self._shared:
            return _copied(self._shared[key])
        metrics = _measure(ref, tgt, r, t)
        self._shared.put(key, metrics)  # the first record keeps it; later ones get copies
        return metrics

    def _golden_record(self, r: Record) -> Record | None:
        if self.golden is None:
            return None
        try:
            return self.golden.record(r.id)
        except KeyError:
            return None

    def _judge_history(self, result: OpResult, dtype: str) -> bool:
        """Judge against bands when there is enough history; False to fall back to the budget."""
        assert self.history is not None and result.metrics is not None
        op_id = result.op if result.output == 0 else f"{result.op}:{result.output}"  # bands per output
        bands, runs, nonfinite = bands_for(self.history, result.id, op_id, result.shape_signature,
                                           result.dtype, self.target, self.config)
        categorical = judge_nonfinite_history(result.metrics, runs, nonfinite) if runs >= self.config.min_history else None
        if categorical is not None:
            result.verdict, result.reason = categorical
            return True
        if not bands:
            return False
        m = result.metrics
        result.bands = [BandCheck(b, m.get(b.metric), b.p_value(m.get(b.metric))) for b in bands]
        out = [c.p_value for c in result.bands if c.out]
        result.p_value = min(1.0, min(out) * len(result.bands)) if out else 1.0
        return True


def _after_token_divergence(results: list[OpResult], generation: GenerationComparison | None) -> list[OpResult]:
    """The results the first divergence is looked for in: without teacher forcing, the steps after the
    target chose another token compute on other inputs, so their out-of-budget ops are warnings
    marked inherited (``inputs differ``), not op faults."""
    after = generation.inputs_differ_after if generation is not None else None
    if after is None:
        return results
    kept = []
    for r in results:
        if r.step <= after:
            kept.append(r)
        elif r.verdict in (Verdict.FAIL, Verdict.WARN):
            r.verdict, r.inherited = Verdict.WARN, True  # reported, never an op fault of the target's
            r.reason = f"inputs differ (the target chose other tokens at step {after}): {r.reason}"
    return kept


def _apply_fdr(results: list[OpResult], cfg: BandConfig) -> None:
    """Benjamini-Hochberg across the banded ops of this comparison, then their verdicts."""
    banded = [r for r in results if r.bands and r.p_value is not None]
    reject = benjamini_hochberg([r.p_value for r in banded], cfg.fdr)  # type: ignore[misc]
    for r, significant in zip(banded, reject, strict=True):
        r.verdict, r.reason = judge_bands(r.bands, significant, len(banded))


def judge(metrics: Metrics, budget: Budget) -> tuple[str, str]:
    """Verdict and reason in words for one op's metrics against a budget (kept for callers)."""
    return judge_budget(metrics, budget)


def _base(pair: Pair) -> dict[str, Any]:
    t = pair.target
    return dict(
        key=pair.reference.key, output=pair.reference.output, op=t.op, module=t.module, kind=t.kind, index=t.index,
        input_shapes=t.input_shapes, shape=t.shape, dtype=t.dtype, reference_dtype=pair.reference.dtype,
        aligned_by=pair.how,
    )


def _measure(ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> Metrics | None:
    if ref is None or r is None:
        return None
    if r.tensor is not None and t.tensor is not None:
        if not is_float_dtype(r.dtype) or not is_float_dtype(t.dtype):
            return compare_discrete(ref.iter_chunks(r.tensor), tgt.iter_chunks(t.tensor))
        absmax, top = _absmax_and_clip(r, t)
        (rv, rtag), (tv, ttag) = ref.stored(r.tensor), tgt.stored(t.tensor)
        if top is not None:
            return compare_arrays(rv, tv, t.dtype, top, reference_dtype=rtag, stored_dtype=ttag, clip=top)
        return compare_arrays(rv, tv, t.dtype, absmax, reference_dtype=rtag, stored_dtype=ttag)
    if r.stats and t.stats:
        return compare_stats(r.stats, t.stats, t.dtype)
    return None


def _absmax_and_clip(r: Record, t: Record) -> tuple[float | None, float | None]:
    """The reference's recorded absmax, and the target dtype's largest value when the reference goes beyond
    it (the pair is then compared clipped to it), else None."""
    absmax = r.stats.absmax if r.stats else None
    top = DTYPE_MAX.get(t.dtype)
    return absmax, (top if top is not None and absmax is not None and absmax > top else None)


class _Recent(OrderedDict[tuple[Any, ...], Any]):
    """The last :data:`SHARED_METRICS` entries put, the oldest dropped first (records that share a stored
    tensor pair are near each other in execution order)."""

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        self[key] = value
        if len(self) > SHARED_METRICS:
            self.popitem(last=False)


def _shared_key(ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> tuple[Any, ...] | None:
    """What a measurement of ``r`` (in ``ref``) against ``t`` (in ``tgt``) depends on, for records that name
    stored tensors (None otherwise): records with equal keys get equal metrics."""
    if ref is None or r is None or r.tensor is None or t.tensor is None:
        return None
    return (id(ref), r.tensor, r.dtype, id(tgt), t.tensor, t.dtype, r.stats.absmax if r.stats else None)


def repeated_measurements(plan: ComparisonPlan) -> Iterator[tuple[Pair, bool]]:
    """Each pair of ``plan`` in order (read once), with whether judging it reuses the measurement of an
    earlier pair (the same stored tensors within the last :data:`SHARED_METRICS` pairs, as
    :meth:`_Context._measure_shared` keeps them; in golden mode, by the reference's tensors), so that its
    metric kernel does not run again. For sizing work, e.g. shards."""
    window = _Recent()
    for pair in plan.pairs:
        key = _shared_key(plan.ref, plan.tgt, pair.reference, pair.target)
        repeat = key is not None and key in window
        if key is not None and not repeat:
            window.put(key, None)
        yield pair, repeat


def _copied(m: Metrics | None) -> Metrics | None:
    """A shallow copy of a metrics object (~10x cheaper than ``copy.copy`` of a dataclass)."""
    if m is None:
        return None
    out = Metrics.__new__(Metrics)
    out.__dict__.update(m.__dict__)
    return out


def _unmatched_result(u: Unmatched) -> OpResult:
    rec = u.record
    return OpResult(
        key=rec.key, output=rec.output, op=rec.op, module=rec.module, kind=rec.kind, index=rec.index,
        input_shapes=rec.input_shapes, shape=rec.shape, dtype=rec.dtype, reference_dtype=rec.dtype, metrics=None,
        verdict=Verdict.MISSING if u.side == "reference" else Verdict.NEW,
        reason=("only in the reference: " if u.side == "reference" else "only in the target: ") + u.reason,
        aligned_by="none",
    )
