"""The comparison pipeline: align two bundles, measure each pair, judge it, find the first divergence.

Modes: ``propagated`` (two end-to-end runs: errors flow downstream), ``replay`` (the target ran
each op on the reference's inputs: every failure is local) and ``golden`` (a third bundle of fp64
recomputations with the reference's record keys; both sides are measured against it and the
verdict uses target error / reference error). With ``history`` the per-op bands learned from
accepted runs replace the default budgets wherever there is enough history.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from accuracy.align import Pair, PairList, Unmatched, align_bundles
from accuracy.bands import BandConfig, History
from accuracy.budgets import BudgetPolicy
from accuracy.bundle import Bundle
from accuracy.errors import BundleError, OpbandError
from accuracy.divergence import BundleDataflow, mark_first_divergence
from accuracy.gcpause import paused_gc
from accuracy.fingerprints import ParameterDifference, input_difference, parameter_differences
from accuracy.generation import GenerationComparison, compare_generations
from accuracy.manifest import Record
from accuracy.records import KINDS, RecordIndex
from accuracy.results import ComparisonReport, OpResult
from accuracy.judging import MEASURE_BATCH, JudgeContext, apply_fdr, RecentMetrics, shared_key, unmatched_result
from accuracy.verdicts import VERDICT_ORDER, Verdict, worst_verdict

MODES = ("propagated", "replay", "golden")
__all__ = ["MODES", "VERDICT_ORDER", "ComparisonPlan", "ComparisonReport", "OpResult", "Tally", "compare", "conclude",
           "judge_range", "judge_streamed", "plan_comparison", "repeated_measurements", "target_name",
           "worst_verdict"]

#: Comparisons of more aligned pairs than this keep passing results as counts only (see :class:`Tally`).
KEEP_ALL_RESULTS = 100_000
#: Pairs judged per batch by :func:`judge_streamed`.
JUDGE_BATCH = 4096


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
    context: JudgeContext


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
    judge_ctx = JudgeContext(ref, tgt, gold if mode == "golden" else None, policy, mode, tgt.manifest.variant, hist, cfg, tname)
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
    apply_fdr(results, cfg)
    results += [unmatched_result(u) for u in unmatched]
    local_everywhere = mode == "replay" or (mode == "golden" and replayed)
    generation = compare_generations(ref.manifest.run, tgt.manifest.run, (_tensor_source(ref), _tensor_source(tgt)))
    judged_ops = _after_token_divergence(results, generation)
    first = mark_first_divergence(judged_ops, local_everywhere, _dataflow(plan),
                                  _paired_reference_ids(plan) if passes else None)
    diffs, note = _parameter_diffs(plan)
    first = _changed_parent(first, results, unmatched) if first is not None and not local_everywhere else first
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


def _tensor_source(bundle: Bundle) -> Callable[[str], np.ndarray | None]:
    """Read a tensor of ``bundle`` by name, None when it holds none of that name."""
    return lambda name: bundle.values(name) if name in bundle.tensors else None


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


def _changed_parent(first: OpResult, results: list[OpResult], unmatched: list[Unmatched]) -> OpResult:
    """The module whose own implementation differs, when the first divergence lies inside it: an op of
    a module (or of a child of it) that runs after ops of that module that could not be paired (other
    quantities) only inherits their error, so the module's own failing output is the first divergence."""
    changed = {u.record.module for u in unmatched
               if u.implementation_differs and u.side == "target" and u.record.module and u.record.step == first.step
               and u.record.index < first.index and _inside(first.module, u.record.module)}
    for module in sorted(changed, key=lambda m: -m.count(".")):  # the innermost changed module around it first
        own = [r for r in results if r.kind == "module" and r.module == module and r.step == first.step
               and r.index > first.index and r.verdict in (Verdict.FAIL, Verdict.WARN)]
        if own:
            chosen = min(own, key=lambda r: r.index)
            first.inherited, chosen.inherited = True, False
            chosen.finding = ((chosen.finding + "; ") if chosen.finding else "") + \
                f"the implementation of module {module!r} differs (its own ops are unpaired): {first.id} inside it " \
                "only inherits its error"
            return chosen
    return first


def _inside(module: str, parent: str) -> bool:
    return module == parent or module.startswith(parent + ".")


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


def _after_token_divergence(results: list[OpResult], generation: GenerationComparison | None) -> list[OpResult]:
    """The results the first divergence is looked for in: without teacher forcing, the steps after the
    target chose another token compute on other inputs, so their out-of-budget ops are warnings
    marked inherited (``inputs differ``), not op faults."""
    after = generation.inputs_differ_after if generation is not None else None
    if after is None:
        return results
    kept = []
    for r in results:
        # the generation loop's own ops (outside the model) from that step on pick and append the tokens
        loop = r.module == "" and r.kind == "aten" and r.step == after
        if r.step < after or (r.step == after and not loop):
            kept.append(r)
        elif r.verdict in (Verdict.FAIL, Verdict.WARN):
            r.verdict, r.inherited = Verdict.WARN, True  # reported, never an op fault of the target's
            r.reason = (f"the token choice that differs at step {after} (see the generation's tokens): {r.reason}"
                        if loop else f"inputs differ (the target chose other tokens at step {after}): {r.reason}")
    return kept


def repeated_measurements(plan: ComparisonPlan) -> Iterator[tuple[Pair, bool]]:
    """Each pair of ``plan`` in order (read once), with whether judging it reuses the measurement of an
    earlier pair (the same stored tensors within the last :data:`SHARED_METRICS` pairs, as
    :meth:`JudgeContext._measure_shared` keeps them; in golden mode, by the reference's tensors), so that its
    metric kernel does not run again. For sizing work, e.g. shards."""
    window = RecentMetrics()
    for pair in plan.pairs:
        key = shared_key(plan.ref, plan.tgt, pair.reference, pair.target)
        repeat = key is not None and key in window
        if key is not None and not repeat:
            window.put(key, None)
        yield pair, repeat


