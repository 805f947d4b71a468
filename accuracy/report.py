"""One report module: the terminal table, JSON, Markdown and HTML all render one ComparisonReport."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from accuracy.bands import Band, BandCheck
from accuracy.budgets import Budget
from accuracy.compare import ComparisonReport, OpResult
from accuracy.metrics import Metrics
from accuracy.ranks import RankComparison
from accuracy.verdicts import Verdict

REPORT_SCHEMA = "opband.report/1"
TABLE_METRICS = ("norm_l2", "max_abs", "max_rel", "cosine", "snr_db")


def to_dict(report: ComparisonReport) -> dict[str, Any]:
    """The JSON report (schema ``opband.report/1``, documented in docs/report-format.md)."""
    return {
        "schema": REPORT_SCHEMA,
        "verdict": report.verdict,
        "mode": report.mode,
        "counts": report.counts,
        "passes_not_listed": report.passes_not_listed,
        "reference": report.reference,
        "target": report.target,
        "golden": report.golden,
        "history": report.history,
        "first_divergence": op_to_dict(report.first_divergence) if report.first_divergence else None,
        "generation": report.generation.as_dict() if report.generation is not None else None,
        "first_gradient_divergence": op_to_dict(report.first_gradient_divergence)
        if report.first_gradient_divergence else None,
        "ops": [op_to_dict(o) for o in report.worst_first()],
        "parameters": [{"name": d.name, "module": d.module, "how": d.how, "sentence": d.sentence}
                       for d in report.parameters],
        "notes": report.notes,
        "unmatched": [
            {"key": u.record.key, "output": u.record.output, "op": u.record.op, "module": u.record.module,
             "side": u.side, "reason": u.reason}
            for u in report.unmatched
        ],
    }


def op_to_dict(o: OpResult) -> dict[str, Any]:
    return {
        "key": o.key,
        "output": o.output,
        "op": o.op,
        "module": o.module,
        "kind": o.kind,
        "index": o.index,
        "input_shapes": o.input_shapes,
        "shape_signature": o.shape_signature,
        "step": o.step,
        "shape": o.shape,
        "dtype": o.dtype,
        "reference_dtype": o.reference_dtype,
        "metrics": o.metrics.as_dict() if o.metrics is not None else None,
        "verdict": o.verdict,
        "reason": o.reason,
        "budget": {"norm_l2": _num(o.budget.norm_l2), "cosine_min": o.budget.cosine_min, "source": o.budget.source,
                   **({"atol": o.budget.atol} if o.budget.atol else {}),  # atol only where one applies
                   **({"limits": {k: _num(v) for k, v in o.budget.limits}} if o.budget.limits else {}),
                   **({"rtol": o.budget.rtol, "close_share": o.budget.close_share} if o.budget.rtol is not None else {})}
        if o.budget
        else None,
        "bands": [_band_to_dict(c) for c in o.bands],
        "p_value": o.p_value,
        "golden_ratio": _num(o.golden_ratio),
        "reference_metrics": o.reference_metrics.as_dict() if o.reference_metrics is not None else None,
        "severity": _num(o.severity),
        "aligned_by": o.aligned_by,
        "inherited": o.inherited,
        "finding": o.finding,
        "auxiliary": o.auxiliary,
        "layouts": list(o.layouts) if o.layouts else None,
    }


def op_from_dict(d: dict[str, Any]) -> OpResult:
    """The exact inverse of :func:`op_to_dict`, also after a JSON round trip (derived fields such as
    ``severity`` and ``shape_signature`` are recomputed, not read): what a shard of a comparison stores
    of its judged ops, so that the merge concludes from the very same results."""
    budget = d["budget"]
    metrics, ref_metrics, layouts = d["metrics"], d["reference_metrics"], d["layouts"]
    return OpResult(
        key=d["key"], output=d["output"], op=d["op"], module=d["module"], kind=d["kind"], index=d["index"],
        input_shapes=d["input_shapes"], shape=d["shape"], dtype=d["dtype"], reference_dtype=d["reference_dtype"],
        metrics=Metrics.from_dict(metrics) if metrics is not None else None,
        verdict=Verdict(d["verdict"]), reason=d["reason"],
        budget=Budget(_float(budget["norm_l2"]), _float(budget["cosine_min"]), budget["source"],
                      _float(budget.get("atol", 0.0)),
                      tuple((k, _float(v)) for k, v in budget.get("limits", {}).items()),
                      budget.get("rtol"), budget.get("close_share", 0.0)) if budget is not None else None,
        aligned_by=d["aligned_by"], inherited=d["inherited"],
        bands=[_band_from_dict(b) for b in d["bands"]],
        p_value=_float(d["p_value"]),
        reference_metrics=Metrics.from_dict(ref_metrics) if ref_metrics is not None else None,
        golden_ratio=_float(d["golden_ratio"]), finding=d["finding"], auxiliary=d["auxiliary"],
        layouts=(layouts[0], layouts[1]) if layouts else None,
    )


def _float(v: float | str | None) -> Any:
    """A number as :func:`_num` wrote it (non-finite values as strings), back as a float."""
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[v]
    return v


def _band_from_dict(d: dict[str, Any]) -> BandCheck:
    band = Band(d["metric"], _float(d["upper"]), d["n"], _float(d["mean_log"]), _float(d["sd_log"]),
                _float(d["floor"]), d["level"], d["coverage"], d["confidence"], d.get("nonfinite", 0))
    return BandCheck(band, _float(d["value"]), _float(d["p_value"]))


def _num(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "inf" if v > 0 else "-inf" if v < 0 else "nan"


def _band_to_dict(c: BandCheck) -> dict[str, Any]:
    b = c.band
    return {"metric": b.metric, "value": _num(c.value), "upper": _num(b.upper), "p_value": c.p_value, "out": c.out,
            "n": b.n, "level": b.level, "coverage": b.coverage, "confidence": b.confidence,
            "mean_log": _num(b.mean_log), "sd_log": _num(b.sd_log), "floor": _num(b.floor), "nonfinite": b.nonfinite}


def limit_of(o: OpResult) -> float | None:
    """The number an op was held to: its tightest-violated band, else its budget."""
    if o.bands:
        return max(o.bands, key=lambda c: c.value / c.band.upper if c.band.upper > 0 else math.inf).band.upper
    return o.budget.norm_l2 if o.budget else None


def to_json(report: ComparisonReport) -> str:
    return json.dumps(to_dict(report), indent=2, allow_nan=False, default=str)


def fmt(value: float | None) -> str:
    """Numbers as a person reads them in a table: 3 significant digits, inf as 'inf'."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf" if value < 0 else "nan"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4g}"


def _metric(o: OpResult, name: str) -> float | None:
    return o.metrics.get(name) if o.metrics is not None else None


def headline(report: ComparisonReport) -> str:
    """``PASSED``/``FAILED`` line with counts and the first divergence: what CI logs grep for."""
    word = "FAILED" if report.verdict == Verdict.FAIL else "PASSED"
    counts = ", ".join(f"{n} {v}" for v, n in report.counts.items() if n)
    line = f"{word} | {report.verdict} | {report.total_ops} ops: {counts or 'none'}"
    fd = report.first_divergence
    if report.generation is not None:
        line += f"\nTOKENS | {report.generation.sentence()}"
    if fd is not None:
        step = _step_words(report, fd.step)
        line += f"\n{'FAILED' if fd.verdict == Verdict.FAIL else 'WARNING'} | first divergence: {fd.id} " \
                f"({op_words(fd.key, fd.op)}, module {fd.module or '<root>'}{step}, input shapes {fd.shape_signature}) " \
                f"| {fd.reason}"
        if fd.finding:
            line += f"\nFINDING | {fd.finding}"
        grad = report.first_gradient_divergence
        if grad is not None and grad is not fd:
            line += f"\n{'FAILED' if grad.verdict == 'fail' else 'WARNING'} | first diverging gradient: {grad.id} " \
                    f"(module {grad.module or '<root>'}, shape {'x'.join(map(str, grad.shape))}) | {grad.reason}"
        run = report.target.get("run") or {}
        if report.mode == "propagated":
            line += "\nNote: later failures marked 'inherited' carry this op's error downstream; " \
                    "re-run with `opband capture --replay` to measure each op on its own inputs."
        elif run.get("replay_of") or run.get("replay"):
            line += "\nNote: each op ran on the reference's inputs, so every failure listed is local."
        else:
            line += "\nNote: every failure is judged as local, but the target is an end-to-end run, so an op's " \
                    "error includes what reached it from upstream; `opband capture --replay REF` measures each " \
                    "op on the reference's inputs."
    others = [d for d in report.parameters if fd is None or d.sentence not in (fd.finding or "")]
    for d in others[:5]:
        line += f"\nFINDING | {d.sentence}"
    if len(others) > 5:
        line += f"\nFINDING | ... and {len(others) - 5} more parameters differ"
    for note in report.notes:
        line += f"\nNote: {note}"
    relaid = [o for o in report.ops if o.layouts]
    if relaid:
        pairs = sorted({f"{a} -> {b}" for a, b in (o.layouts for o in relaid if o.layouts)})
        line += f"\nNote: {len(relaid)} ops had different memory layouts ({', '.join(pairs[:3])}); values were " \
                "compared by logical index."
    return line


def _step_words(report: ComparisonReport, step: int) -> str:
    """``, step N`` (a generation's: prefill or decode, with the token position it computes)."""
    gen = report.generation
    if gen is None:
        return f", step {step}" if step else ""
    st = gen.steps[step] if step < len(gen.steps) else None
    where = f", token position {st.position}" if st is not None and st.position is not None else ""
    return f", step {step} ({'prefill' if step == 0 else 'decode'}{where})"


#: the per-step columns of a generation's token table (Markdown and HTML)
GENERATION_COLUMNS = ("step", "position", "argmax agreement", "top-k overlap", "log-prob drop", "KL (nats)",
                      "reference tokens", "target tokens")


def generation_rows(report: ComparisonReport) -> list[list[str]]:
    """The generation's steps as table cells (:data:`GENERATION_COLUMNS`); empty without a generation."""
    gen = report.generation
    if gen is None:
        return []
    return [[str(s.step), "-" if s.position is None else str(s.position), f"{s.argmax_agreement:.0%}",
             f"{s.topk_overlap:.0%}", fmt(s.logprob_drop), fmt(s.kl), " ".join(map(str, s.reference_tokens)),
             " ".join(map(str, s.target_tokens))] for s in gen.steps]


def op_words(key: str, op: str) -> str:
    """``op aten.mm``, or ``target op aten.mul`` when the target ran another op at that key (a
    module-level alignment: e.g. a fast-sigmoid SiLU where the reference ran ``aten.silu``)."""
    named = key.rsplit("/", 1)[-1].split("#", 1)[0]
    return f"op {op}" if named == op else f"target op {op}"


def local_failures(report: ComparisonReport, limit: int = 10) -> list[str]:
    """One ``FAILED``/``WARNING`` line per out-of-band op that is not inherited, worst first."""
    rows = [o for o in report.worst_first() if o.verdict in (Verdict.FAIL, Verdict.WARN) and not o.inherited]
    lines = [f"{'FAILED' if o.verdict == 'fail' else 'WARNING'} | {o.id} | {o.reason}" for o in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more")
    return lines


#: colours of the verdict cells on a colour terminal (plain consoles drop them)
VERDICT_STYLE = {Verdict.FAIL: "bold red", Verdict.WARN: "yellow", Verdict.PASS: "green", Verdict.NEW: "cyan",
                 Verdict.MISSING: "magenta"}
#: one word for the number an op is held to, in every table and report (and the API's ``budget``):
#: its budget, or the upper bound of a band learned from history where one applies
THRESHOLD = "budget"


def run_title(side: dict[str, Any]) -> str:
    """How a report names one run: ``label (target name, variant@device)``, leaving out what it lacks."""
    run = side.get("run") or {}
    where = str(run.get("variant", "?")) + (f"@{run['device']}" if run.get("device") else "")
    target = run.get("target") if run.get("target") != where else None
    inner = ", ".join(x for x in (target, where) if x)
    return f"{run['label']} ({inner})" if run.get("label") else (f"{target} ({where})" if target else where)


#: the metric columns a narrow terminal (under ``WIDE`` columns) keeps
NARROW_METRICS = ("norm_l2",)
WIDE = 150


def table_metrics(width: int | None) -> tuple[str, ...]:
    """The metric columns for a console ``width`` wide (None: not a terminal, every column)."""
    return NARROW_METRICS if width is not None and width < WIDE else TABLE_METRICS


def text_renderables(report: ComparisonReport, limit: int | None = 20,
                     metrics: tuple[str, ...] = TABLE_METRICS) -> list[Any]:
    """The terminal report as rich renderables: the table worst first (with ``metrics`` columns),
    then the PASSED/FAILED lines (never wrapped). Print them on a console that knows the terminal."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"opband compare ({report.mode}): {run_title(report.target)} vs {run_title(report.reference)}",
                  show_lines=False)
    table.add_column("verdict", no_wrap=True)
    table.add_column("op key", overflow="fold")
    table.add_column("input shapes", overflow="fold")
    table.add_column("dtype", no_wrap=True)
    for name in metrics:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column(THRESHOLD, justify="right", no_wrap=True)
    rows = report.worst_first()
    for o in rows[:limit] if limit else rows:
        verdict = Text(o.verdict.upper() + (" (inherited)" if o.inherited else ""),
                       style="" if o.inherited else VERDICT_STYLE.get(o.verdict, ""))
        cells = [fmt(_metric(o, m)) for m in metrics]
        if o.metrics is not None and not o.metrics.finite_outcome and metrics[0] == "norm_l2":
            cells[0] = "NaN/Inf"  # the metrics cover the finite part only
        table.add_row(verdict, o.id, o.shape_signature, o.dtype, *cells, fmt(limit_of(o)))
    lines = [f"... {len(rows) - limit} more ops (use --json or --html for all)"] if limit and len(rows) > limit else []
    lines += local_failures(report) + headline(report).splitlines()
    return [table, *(Text(line, no_wrap=True, overflow="ignore") for line in lines)]


def print_renderables(console: Any, items: list[Any]) -> None:
    """Print a report's renderables: tables to the console's width, text lines unwrapped."""
    from rich.text import Text

    for item in items:
        console.print(item, soft_wrap=isinstance(item, Text), highlight=False)


def to_text(report: ComparisonReport, limit: int | None = 20, width: int = 160) -> str:
    """The terminal report as plain text (no colour) for a console ``width`` columns wide."""
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    print_renderables(Console(file=buf, width=width, force_terminal=False, no_color=True),
                      text_renderables(report, limit))
    return buf.getvalue()


def to_markdown(report: ComparisonReport, limit: int | None = 50) -> str:
    lines = [f"## opband: {report.verdict.upper()}", "",
             f"target **{run_title(report.target)}** vs reference **{run_title(report.reference)}**", "",
             "```", headline(report), "```", ""]
    lines.append("| verdict | op key | input shapes | dtype | " + " | ".join(TABLE_METRICS) + f" | {THRESHOLD} | reason |")
    lines.append("|---" * (6 + len(TABLE_METRICS)) + "|")
    rows = report.worst_first()
    for o in rows[:limit] if limit else rows:
        cells = [o.verdict + (" (inherited)" if o.inherited else ""), f"`{o.id}`", o.shape_signature, o.dtype]
        cells += [fmt(_metric(o, m)) for m in TABLE_METRICS] + [fmt(limit_of(o)), o.reason.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    if limit and len(rows) > limit:
        lines += ["", f"... {len(rows) - limit} more ops: the JSON and HTML reports list every op."]
    steps = generation_rows(report)
    if steps:
        lines += ["", "### generation, step by step", "", "| " + " | ".join(GENERATION_COLUMNS) + " |",
                  "|---" * len(GENERATION_COLUMNS) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in steps]
    if report.unmatched:
        lines += ["", f"{len(report.unmatched)} unmatched record(s):", ""]
        lines += [f"- `{u.record.id}` ({u.side}): {u.reason}" for u in report.unmatched[:limit]]
    return "\n".join(lines) + "\n"


def _histogram_svg(counts: list[int], width: int = 240, height: int = 40) -> str:
    if not counts or not sum(counts):
        return ""
    peak = max(counts)
    bar = width / len(counts)
    bars = "".join(
        f'<rect x="{i * bar:.1f}" y="{height - height * c / peak:.1f}" width="{bar:.1f}" height="{height * c / peak:.1f}"/>'
        for i, c in enumerate(counts) if c
    )
    return f'<svg width="{width}" height="{height}" class="hist" role="img" aria-label="abs error histogram">{bars}</svg>'




#: HTML report: ops per page (every op is in the file; with scripts on, one page shows at a time)
HTML_PAGE = 200

_HTML_STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem;color:#222} table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left} tr.fail td:first-child{color:#b00020;font-weight:bold}
tr.warn td:first-child{color:#b36b00} tr.pass td:first-child{color:#2e7d32} .hist rect{fill:#5470c6}
pre{background:#f6f6f6;padding:1rem} table.runs,table.diff{margin-bottom:1rem} #pager button{margin:0 .5rem}
"""

_HTML_PAGER = """
(function () {
  var size = %d, rows = document.querySelectorAll("#ops tbody tr"), page = 0;
  var pages = Math.ceil(rows.length / size);
  if (pages < 2) return;
  function show() {
    rows.forEach(function (r, i) { r.hidden = Math.floor(i / size) !== page; });
    document.getElementById("page").textContent = "ops " + (page * size + 1) + "-" +
      Math.min(rows.length, (page + 1) * size) + " of " + rows.length;
  }
  document.getElementById("pager").hidden = false;
  document.getElementById("prev").onclick = function () { if (page > 0) { page--; show(); } };
  document.getElementById("next").onclick = function () { if (page < pages - 1) { page++; show(); } };
  show();
})();
"""


def _runs_html(report: ComparisonReport) -> str:
    """Both runs side by side (label, target, variant, device, tags, file), then what changed between them."""
    from accuracy import envdiff

    esc = html.escape
    sides = (report.reference, report.target)

    def cell(side: dict[str, Any], name: str) -> str:
        run = side.get("run") or {}
        if name == "tags":
            return ", ".join(f"{k}={v}" for k, v in (run.get("tags") or {}).items()) or "-"
        if name == "target":
            return str(run.get("target") or f"{run.get('variant', '?')}@{run.get('device', '?')}")
        if name == "file":
            return str(side.get("path", "-"))
        return str(run.get(name, "-"))

    rows = "".join(f"<tr><th>{f}</th>" + "".join(f"<td>{esc(cell(side, f))}</td>" for side in sides) + "</tr>"
                   for f in ("label", "target", "variant", "device", "tags", "file"))
    runs = ('<table class="runs"><thead><tr><th></th><th>reference</th><th>target</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")
    changed, same = envdiff.changes(*(envdiff.flatten(side.get("run"), side.get("environment")) for side in sides))
    if not changed:
        return runs + f"<h2>environment diff: none</h2><p>the {same} compared fields are the same.</p>"
    items = "".join(f"<tr><td><code>{esc(f)}</code></td><td>{esc(json.dumps(a, default=str))}</td>"
                    f"<td>{esc(json.dumps(b, default=str))}</td></tr>" for f, a, b in changed)
    return (runs + f"<h2>environment diff: {len(changed)} changed, {same} the same</h2>"
            '<table class="diff"><thead><tr><th>field</th><th>reference</th><th>target</th></tr></thead>'
            f"<tbody>{items}</tbody></table>")


def to_html(report: ComparisonReport, limit: int | None = None) -> str:
    """A standalone HTML report (no external resources): both runs and their environment diff, then
    every op worst first (``limit``: only that many, said in the heading) with a histogram each,
    paged ``HTML_PAGE`` at a time when scripts run (all rows show without them)."""
    esc = html.escape
    ops = report.worst_first()
    shown = ops[:limit] if limit else ops
    rows = []
    for o in shown:
        hist = _histogram_svg(o.metrics.histogram) if o.metrics is not None else ""
        metrics = "".join(f"<td>{esc(fmt(_metric(o, m)))}</td>" for m in TABLE_METRICS)
        rows.append(
            f'<tr class="{esc(o.verdict)}"><td>{esc(o.verdict)}{" (inherited)" if o.inherited else ""}</td>'
            f"<td><code>{esc(o.id)}</code></td><td>{esc(o.shape_signature)}</td><td>{esc(o.dtype)}</td>"
            f"{metrics}<td>{esc(fmt(limit_of(o)))}</td><td>{hist}</td><td>{esc(o.reason)}</td></tr>"
        )
    head = "".join(f"<th>{m}</th>" for m in TABLE_METRICS)
    steps = generation_rows(report)
    generation = ("<h2>generation, step by step</h2><table id=\"generation\"><thead><tr>"
                  + "".join(f"<th>{c}</th>" for c in GENERATION_COLUMNS) + "</tr></thead><tbody>"
                  + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in steps)
                  + "</tbody></table>") if steps else ""
    cut = f" (the worst {len(shown)} of {len(ops)})" if len(shown) < len(ops) else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>opband report: {esc(report.verdict)}</title>
<style>{_HTML_STYLE}</style></head><body>
<h1>opband: {esc(report.verdict.upper())}</h1>
<p>target <b>{esc(run_title(report.target))}</b> vs reference <b>{esc(run_title(report.reference))}</b>, {esc(report.mode)} mode</p>
{_runs_html(report)}
<pre>{esc(headline(report))}</pre>
{generation}
<h2>ops, worst first: {len(shown)}{cut}</h2>
<div id="pager" hidden><button id="prev">previous</button><span id="page"></span><button id="next">next</button></div>
<table id="ops"><thead><tr><th>verdict</th><th>op key</th><th>input shapes</th><th>dtype</th>{head}<th>{THRESHOLD}</th><th>|error| histogram</th><th>reason</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<script>{_HTML_PAGER % HTML_PAGE}</script>
</body></html>
"""


# -- multi-rank runs (accuracy.ranks) --------------------------------------------------------------
RANKS_SCHEMA = "opband.report.ranks/1"


def ranks_to_dict(rc: RankComparison) -> dict[str, Any]:
    """The JSON report of a multi-rank comparison: the per-rank reports and the run's first divergence."""
    fd = rc.first_divergence
    return {
        "schema": RANKS_SCHEMA, "verdict": rc.verdict, "world_size": rc.world_size,
        "first_divergence": {"rank": fd[0], **op_to_dict(fd[1])} if fd else None,
        "ranks": {str(r): to_dict(rep) for r, rep in rc.reports.items()},
    }


def ranks_headline(rc: RankComparison) -> str:
    """``PASSED``/``FAILED`` line naming the rank, op and input shapes of the first divergence."""
    word = "FAILED" if rc.verdict == Verdict.FAIL else "PASSED"
    bad = [r for r, rep in rc.reports.items() if rep.verdict == Verdict.FAIL]
    line = f"{word} | {rc.verdict} | {rc.world_size} ranks" + (f", failing on rank(s) {bad}" if bad else "")
    if rc.first_divergence is not None:
        rank, o = rc.first_divergence
        line += f"\n{'FAILED' if o.verdict == 'fail' else 'WARNING'} | first divergence: rank {rank}, {o.id} " \
                f"({op_words(o.key, o.op)}, module {o.module or '<root>'}, input shapes {o.shape_signature}) " \
                f"| {o.reason}\nNote: other ranks diverge later, through the collectives that carry rank {rank}'s " \
                "error; its own table follows."
    return line


def ranks_to_text(rc: RankComparison, limit: int | None = 20, width: int = 160) -> str:
    """One row per rank, then the table of the rank that diverged first, then the headline."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"opband compare: {rc.world_size} ranks")
    for col in ("rank", "verdict", "ops", "fail", "warn", "first divergence", "input shapes"):
        table.add_column(col, overflow="fold")
    for r, rep in rc.reports.items():
        fd = rep.first_divergence
        table.add_row(str(r), rep.verdict.upper(), str(rep.total_ops), str(rep.counts.get(Verdict.FAIL, 0)),
                      str(rep.counts.get(Verdict.WARN, 0)), fd.id if fd else "-", fd.shape_signature if fd else "-")
    buf = StringIO()
    console = Console(file=buf, width=width, force_terminal=False, no_color=True)
    console.print(table)
    if rc.first_divergence is not None:
        rank = rc.first_divergence[0]
        console.print(f"rank {rank}:\n" + to_text(rc.reports[rank], limit=limit, width=width),
                      highlight=False, markup=False, soft_wrap=True)
    console.print(ranks_headline(rc), highlight=False, markup=False, soft_wrap=True)
    return buf.getvalue()
