"""Op coverage: which ops, overloads, dtypes, input-shape classes and value regimes a set of runs
exercised, per model, with each op's verdicts and band state, and the share of an op list covered.

The unit is an :class:`Exercise`: one op call seen in one run, with the verdict a comparison gave
it when there is one. The CLI builds exercises from bundle files (comparing each target with its
reference offline); the service builds them from its index (op records, comparison results). Both
then call :func:`coverage`, so the numbers agree.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accuracy.errors import ConfigError, OpbandError
from accuracy.manifest import Manifest, shape_signature
from accuracy.verdicts import Verdict

COUNTED_KINDS = ("aten", "api")  # module outputs and gradients are not operators


@dataclass(frozen=True)
class Exercise:
    """One op call of one run."""

    model: str
    op: str
    dtype: str
    shape_signature: str
    regime: str = "model"  # a sweep's value regime; "model" for captured runs
    overload: str | None = None  # e.g. aten.add.Tensor, when the run recorded its calls
    key: str = ""
    verdict: str | None = None  # from a comparison against a reference; "inherited" for a failure carried from upstream
    band: str | None = None  # "band" (judged against history) or "budget" (default budget)


def model_name(run: Mapping[str, Any], fallback: str) -> str:
    """What a run is of: its label, SPEC, ``sweep``, the tool it was imported from, else ``fallback``."""
    for key in ("label", "spec"):
        if run.get(key):
            return str(run[key])
    if "sweep" in run:
        return "sweep"
    imported = run.get("imported_from")
    if isinstance(imported, Mapping) and imported.get("tool"):
        return f"{imported['tool']} import"
    return fallback


def exercises_of(manifest: Manifest, fallback_model: str, cases: Mapping[str, Any] | None = None,
                 verdicts: Mapping[int, tuple[str, str]] | None = None) -> list[Exercise]:
    """The op calls of one bundle. ``cases``: a sweep reference's ``run.sweep.cases`` (regimes);
    ``verdicts``: record index -> (verdict, band state) from a comparison with this bundle as target."""
    run = manifest.run
    model = model_name(run, fallback_model)
    cases = cases if cases is not None else (run.get("sweep") or {}).get("cases") or {}
    calls = run.get("calls") or {}
    out = []
    for r in manifest.records:
        if r.kind not in COUNTED_KINDS:
            continue
        call = calls.get(r.key) if isinstance(calls, Mapping) else None
        regime = str(cases[r.key].get("regime")) if r.key in cases and isinstance(cases[r.key], Mapping) else "model"
        verdict, band = (verdicts or {}).get(r.index, (None, None))
        out.append(Exercise(model, r.op, compute_dtype(r.input_dtypes, r.dtype, manifest.variant),
                            shape_signature(r.input_shapes),
                            regime, str(call["target"]) if isinstance(call, Mapping) and "target" in call else None,
                            r.key, verdict, band))
    return out


#: Variants whose float tensors carry another format's rounding (quantized or emulated): the
#: dtype an op was exercised in is the variant's, not float32.
QUANTIZED_VARIANTS = ("int8", "fp8-e4m3", "fp8-e5m2")


def compute_dtype(input_dtypes: Sequence[str | None], output_dtype: str, variant: str = "fp32") -> str:
    """The dtype an op computed in: its first floating input's, else its output's; a float op of an
    int8/FP8 run is counted as that variant (``int8``)."""
    dtype = output_dtype
    for d in input_dtypes:
        if d and (d.startswith("float") or d.startswith("bfloat") or d.startswith("q")):
            dtype = d
            break
    if variant in QUANTIZED_VARIANTS and dtype.startswith(("float", "q")):
        return variant
    return dtype


def shape_class(signature: str) -> str:
    """Input shapes by rank and size decade: ``64x256,256x128`` -> ``2d:1e4,2d:1e4``."""
    if not signature:
        return "no tensor inputs"
    parts = []
    for s in signature.split(","):
        if s == "-":
            continue
        if s == "scalar":
            parts.append("0d")
            continue
        dims = [int(d) for d in s.split("x") if d.isdigit()]
        n = math.prod(dims)
        size = "empty" if n == 0 else f"1e{max(0, math.ceil(math.log10(n)))}"
        parts.append(f"{len(dims)}d:{size}")
    return ",".join(parts) or "no tensor inputs"


@dataclass
class Cell:
    """One op in one model: what was exercised and how it was judged."""

    calls: int = 0
    dtypes: set[str] = field(default_factory=set)
    shape_classes: set[str] = field(default_factory=set)
    regimes: set[str] = field(default_factory=set)
    verdicts: Counter[str] = field(default_factory=Counter)
    bands: Counter[str] = field(default_factory=Counter)

    def add(self, e: Exercise) -> None:
        self.calls += 1
        self.dtypes.add(e.dtype)
        self.shape_classes.add(shape_class(e.shape_signature))
        self.regimes.add(e.regime)
        if e.verdict:
            self.verdicts[e.verdict] += 1
        if e.band:
            self.bands[e.band] += 1

    def state(self) -> str:
        """``pass 12``, ``FAIL 2/12``, ``WARN 1/12`` or ``seen`` (exercised, never compared); failures
        carried in from an upstream op (``inherited``) are counted apart: ``pass 9 (+3 inherited)``."""
        inherited = self.verdicts["inherited"]
        judged = sum(self.verdicts.values()) - inherited
        tail = f" (+{inherited} inherited)" if inherited else ""
        if not judged:
            return "seen" + tail if not inherited else f"inherited {inherited}"
        for v in (Verdict.FAIL, Verdict.WARN, Verdict.MISSING):
            if self.verdicts[v]:
                return f"{v.upper()} {self.verdicts[v]}/{judged}{tail}"
        return f"pass {judged}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "dtypes": sorted(self.dtypes), "shape_classes": sorted(self.shape_classes),
                "regimes": sorted(self.regimes), "verdicts": dict(self.verdicts), "bands": dict(self.bands),
                "state": self.state()}


@dataclass
class OpCoverage:
    op: str
    overloads: set[str] = field(default_factory=set)
    total: Cell = field(default_factory=Cell)
    by_model: dict[str, Cell] = field(default_factory=dict)


@dataclass
class CoverageReport:
    """The op x model matrix and, with an op list, its covered share."""

    ops: dict[str, OpCoverage]
    models: list[str]
    op_list: list[str] | None = None
    covered: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)

    @property
    def share(self) -> float | None:
        return len(self.covered) / len(self.op_list) if self.op_list else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "opband.coverage/1", "models": self.models,
            "ops": [{"op": o.op, "overloads": sorted(o.overloads), **o.total.to_dict(),
                     "models": {m: c.to_dict() for m, c in o.by_model.items()}} for o in self.ops.values()],
            "op_list": None if self.op_list is None else {
                "size": len(self.op_list), "covered": self.covered, "uncovered": self.uncovered, "share": self.share},
        }

    def to_text(self, width: int = 160) -> str:
        """The op table (what was exercised), the op x model matrix (state per cell) and the share."""
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        buf = StringIO()
        console = Console(file=buf, width=width, force_terminal=False, no_color=True)
        ops = Table(title=f"opband coverage: {len(self.ops)} ops over {len(self.models)} model(s)")
        for col in ("op", "calls", "overloads", "dtypes", "shape classes", "regimes", "state", "judged by"):
            ops.add_column(col, overflow="fold", justify="right" if col == "calls" else "left")
        for o in self.ops.values():
            t = o.total
            ops.add_row(o.op, str(t.calls), ", ".join(sorted(o.overloads)) or "-", ", ".join(sorted(t.dtypes)),
                        str(len(t.shape_classes)), ", ".join(sorted(t.regimes)), t.state(),
                        ", ".join(f"{k} {n}" for k, n in sorted(t.bands.items())) or "-")
        console.print(ops)
        matrix = Table(title="op x model (verdicts of compared runs; 'seen' = exercised, not compared)")
        matrix.add_column("op")
        for m in self.models:
            matrix.add_column(m, overflow="fold")
        for o in self.ops.values():
            matrix.add_row(o.op, *(o.by_model[m].state() if m in o.by_model else "" for m in self.models))
        console.print(matrix)
        if self.op_list is not None:
            share = self.share or 0.0
            console.print(f"{'PASSED' if not self.uncovered else 'NOTE'} | op list | {len(self.covered)}/{len(self.op_list)} "
                          f"ops covered ({100 * share:.1f}%)", highlight=False, markup=False)
            if self.uncovered:
                console.print("uncovered: " + ", ".join(self.uncovered), highlight=False, markup=False, soft_wrap=True)
                console.print("Note: sweep them with `opband sweep --op-list FILE` (--shape for ops without a built-in "
                              "case), or add a model that runs them.",
                              highlight=False, markup=False)
        return buf.getvalue()


def normalize_op(name: str) -> str:
    """``mm`` -> ``aten.mm``; ``aten.add.Tensor`` and ``torch.*`` names unchanged."""
    name = name.strip()
    return name if "." in name else f"aten.{name}"


def load_op_list(path: str | os.PathLike[str]) -> list[str]:
    """An op list file: one op per line (``aten.mm``, ``aten.add.Tensor``, ``mm``); ``#`` comments."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read op list {path}: {e}; write one op name per line (aten.mm)") from e
    ops = [normalize_op(line.split("#", 1)[0]) for line in text.splitlines() if line.split("#", 1)[0].strip()]
    if not ops:
        raise ConfigError(f"op list {path} names no ops; write one op name per line (aten.mm)")
    return list(dict.fromkeys(ops))


def coverage(exercises: Iterable[Exercise], op_list: Sequence[str] | None = None) -> CoverageReport:
    """Group exercises per op and model; with ``op_list``, which of its ops were exercised (an
    ``aten.X.overload`` entry needs that overload recorded, an ``aten.X`` entry any call of X)."""
    ops: dict[str, OpCoverage] = {}
    models: list[str] = []
    for e in exercises:
        oc = ops.setdefault(e.op, OpCoverage(e.op))
        if e.overload:
            oc.overloads.add(e.overload)
        oc.total.add(e)
        oc.by_model.setdefault(e.model, Cell()).add(e)
        if e.model not in models:
            models.append(e.model)
    ordered = dict(sorted(ops.items()))
    report = CoverageReport(ordered, models)
    if op_list is not None:
        names = [normalize_op(o) for o in op_list]
        seen_ops = set(ordered)
        seen_overloads = {ov for o in ordered.values() for ov in o.overloads}
        report.op_list = names
        report.covered = [n for n in names if n in seen_ops or n in seen_overloads]
        report.uncovered = [n for n in names if n not in report.covered]
    return report


def coverage_of_bundles(paths: Sequence[str | os.PathLike[str]], op_list: Sequence[str] | None = None,
                        judge: bool = True, reference: str | os.PathLike[str] | None = None) -> CoverageReport:
    """Coverage of bundle files. With ``judge``, each target is compared with its reference: a sweep
    or replay target with the bundle its ``run.replay_of`` names (mode replay), any other run with
    ``reference`` if given, else the first float32 capture of the same model among ``paths``."""
    from accuracy.bundle import Bundle
    from accuracy.compare import compare

    bundles = [Bundle.open(p) for p in paths]
    fixed = Bundle.open(reference) if reference is not None else None
    by_path = {Path(b.path).resolve(): b for b in bundles}
    refs: dict[str, Bundle] = {}
    for b in bundles:
        run = b.manifest.run
        if not run.get("replay_of") and b.manifest.variant == "fp32" and not run.get("golden"):
            refs.setdefault(model_name(run, Path(b.path).stem), b)
    out: list[Exercise] = []
    for b in bundles:
        run = b.manifest.run
        fallback = Path(b.path).stem
        ref, mode = None, "propagated"
        if run.get("replay_of"):
            ref, mode = by_path.get(Path(str(run["replay_of"])).resolve()), "replay"
        else:
            ref = fixed if fixed is not None else refs.get(model_name(run, fallback))
        cases = ((ref.manifest.run.get("sweep") or {}).get("cases") if ref is not None else None)
        verdicts: dict[int, tuple[str, str]] = {}
        if judge and ref is not None and ref is not b and Path(ref.path).resolve() != Path(b.path).resolve():
            try:
                report = compare(ref, b, mode=mode)  # results carry the target's record index
                verdicts = {o.index: ("inherited" if o.inherited else o.verdict, "band" if o.bands else "budget")
                            for o in report.ops if o.verdict != Verdict.MISSING}
            except OpbandError:
                verdicts = {}
        model = model_name(ref.manifest.run, fallback) if ref is not None and run.get("replay_of") else None
        out += exercises_of(b.manifest, model or fallback, cases, verdicts)
    return coverage(out, op_list)
