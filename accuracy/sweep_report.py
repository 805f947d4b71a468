"""The op sweep's report: one row per op x dtype x shape x regime, from ordinary comparison reports.

Rows come from :func:`rows_from_comparison` (a replay comparison of a sweep target against its
reference, plus the reference manifest's ``run.sweep.cases``); :class:`SweepReport` renders them
as rich tables (one per dtype: ops and shapes down, regimes across), JSON and ``FAILED`` lines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from accuracy.compare import ComparisonReport
from accuracy.report import fmt, limit_of, op_words
from accuracy.verdicts import VERDICT_ORDER, Verdict

_VERDICT_RANK = {v: i for i, v in enumerate(VERDICT_ORDER)}


@dataclass(frozen=True)
class SweepRow:
    """The verdict of one op on one dtype, shape and value regime."""

    op: str
    dtype: str
    shape: str
    regime: str
    verdict: Verdict
    key: str
    recorded_op: str
    norm_l2: float | None
    max_rel: float | None
    limit: float | None
    reason: str


def rows_from_comparison(cases: Mapping[str, Mapping[str, Any]], report: ComparisonReport, dtype: str) -> list[SweepRow]:
    """One row per sweep case (output 0; other outputs fold into it, worst verdict wins)."""
    by_key: dict[str, SweepRow] = {}
    for o in report.ops:
        meta = cases.get(o.key)
        if meta is None:
            continue
        row = SweepRow(op=str(meta.get("label") or meta.get("op")), dtype=dtype, shape=str(meta.get("shape")),
                       regime=str(meta.get("regime")), verdict=o.verdict, key=o.key, recorded_op=o.op,
                       norm_l2=o.metrics.norm_l2 if o.metrics is not None else None,
                       max_rel=o.metrics.max_rel if o.metrics is not None else None,
                       limit=limit_of(o), reason=o.reason)
        prior = by_key.get(o.key)
        if prior is None or _VERDICT_RANK.get(row.verdict, 0) > _VERDICT_RANK.get(prior.verdict, 0):
            by_key[o.key] = row
    return list(by_key.values())


def missing_rows(cases: Mapping[str, Mapping[str, Any]], dtype: str, reason: str) -> list[SweepRow]:
    """Rows for a target that ran none of the cases (compare has nothing to align)."""
    return [SweepRow(op=str(m.get("label") or m.get("op")), dtype=dtype, shape=str(m.get("shape")),
                     regime=str(m.get("regime")), verdict=Verdict.MISSING, key=key, recorded_op=key.rsplit("/", 1)[-1].split("#")[0],
                     norm_l2=None, max_rel=None, limit=None, reason=reason) for key, m in cases.items()]


@dataclass
class SweepReport:
    """Every row of a sweep and the ops it could not run. Truthy when no row failed."""

    rows: list[SweepRow]
    skipped: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not any(r.verdict == Verdict.FAIL for r in self.rows)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.verdict] = out.get(r.verdict, 0) + 1
        return out

    def failures(self) -> list[SweepRow]:
        bad = [r for r in self.rows if r.verdict in (Verdict.FAIL, Verdict.WARN, Verdict.MISSING)]
        return sorted(bad, key=lambda r: (-_VERDICT_RANK.get(r.verdict, 0), r.op, r.dtype, r.regime, r.shape))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "opband.sweep/1", "counts": self.counts(),
                "rows": [{k: _num(v) for k, v in asdict(r).items()} for r in self.rows], "skipped": self.skipped}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def failure_lines(self, limit: int = 30) -> list[str]:
        """Three-part lines: what failed, by how much, and (once) what to do next."""
        lines = []
        rows = self.failures()
        for r in rows[:limit]:
            word = "FAILED" if r.verdict == Verdict.FAIL else "WARNING" if r.verdict == Verdict.WARN else "MISSING"
            lines.append(f"{word} | {r.op} {r.dtype} shape {r.shape} regime {r.regime} "
                         f"({op_words(r.key, r.recorded_op)}, key {r.key}) | {r.reason}")
        if len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more (use --json for all)")
        if rows:
            lines.append("Note: each op ran alone on the reference's stored inputs, so every failure is the op's own; "
                         "re-run one with `opband compare REF TARGET --mode replay` for its full error distribution.")
        return lines

    def to_text(self, width: int = 160) -> str:
        """One rich table per dtype (op and shape down, regimes across), then the failure lines."""
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        buf = StringIO()
        console = Console(file=buf, width=width, force_terminal=False, no_color=True)
        regimes = list(dict.fromkeys(r.regime for r in self.rows))
        for dtype in dict.fromkeys(r.dtype for r in self.rows):
            table = Table(title=f"opband sweep: {dtype} vs fp32 reference (norm L2 error; verdict)")
            table.add_column("op")
            table.add_column("input shapes", overflow="fold")
            for regime in regimes:
                table.add_column(regime, justify="right")
            cells: dict[tuple[str, str], dict[str, SweepRow]] = {}
            for r in self.rows:
                if r.dtype == dtype:
                    cells.setdefault((r.op, r.shape), {})[r.regime] = r
            for (op, shape), by_regime in cells.items():
                table.add_row(op, shape, *(_cell(by_regime.get(g)) for g in regimes))
            console.print(table)
        counts = ", ".join(f"{n} {v}" for v, n in sorted(self.counts().items(), key=lambda kv: _VERDICT_RANK.get(kv[0], 0)))
        for line in self.failure_lines():
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        for s in self.skipped[:20]:
            console.print(f"SKIPPED | {s}", highlight=False, markup=False, soft_wrap=True)
        word = "PASSED" if self else "FAILED"
        console.print(f"{word} | sweep | {len(self.rows)} cases: {counts or 'none'}", highlight=False, markup=False)
        return buf.getvalue()


def _cell(r: SweepRow | None) -> str:
    if r is None:
        return ""
    if r.verdict == Verdict.PASS:
        return fmt(r.norm_l2)
    if r.norm_l2 is None or (isinstance(r.norm_l2, float) and not math.isfinite(r.norm_l2)):
        return r.verdict.upper()
    return f"{r.verdict.upper()} {fmt(r.norm_l2)}"


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else "-inf" if v < 0 else "nan"
    return v
