"""``opband gate``: upload reference and target, wait for the comparison, print, exit 0/1/2."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accuracy.manifest import RunNames
from accuracy.report import THRESHOLD, VERDICT_STYLE, fmt, op_words, print_renderables
from accuracy.verdicts import Verdict
from opband.client import Client
from opband.terminal import progress

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def run_name(run: dict[str, Any] | None, variant: str | None = None, device: str | None = None) -> str:
    """A comparison side as a person names it: ``label (target name)``, else the target name."""
    run = run or {}
    target = run.get("target") or f"{variant or run.get('variant', '?')}@{device or run.get('device', '?')}"
    return f"{run['label']} ({target})" if run.get("label") else str(target)


def gate_title(c: dict[str, Any]) -> str:
    return (f"opband gate: {run_name(c.get('target_run'), c.get('target_variant'), c.get('target_device'))}"
            + (f" vs {run_name(c['reference_run'])}" if c.get("reference_run") else ""))


GATE_METRICS = ("norm_l2", "max_abs", "cosine")


def gate_renderables(comparison: dict[str, Any], ops: list[dict[str, Any]], limit: int = 20,
                     metrics: tuple[str, ...] = GATE_METRICS) -> list[Any]:
    """Worst ops as a table (with ``metrics`` columns), then PASSED/FAILED lines CI logs can grep
    (never wrapped)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=gate_title(comparison))
    numeric = (*metrics, THRESHOLD)
    for col in ("verdict", "op key", "input shapes", "dtype", *numeric):
        table.add_column(col, overflow="fold", no_wrap=col in ("verdict", "dtype", *numeric),
                         justify="right" if col in numeric else "left")
    for o in ops[:limit]:
        budget = (o.get("budget") or {}).get("norm_l2")
        verdict = Text(o["verdict"].upper() + (" (inherited)" if o["inherited"] else ""),
                       style="" if o["inherited"] else VERDICT_STYLE.get(o["verdict"], ""))
        values = ["NaN/Inf" if m == "norm_l2" and o.get("nonfinite") else fmt(o.get(m)) for m in metrics]
        table.add_row(verdict, o["key"], o["shape_signature"], o["dtype"], *values, fmt(budget))
    return [table, *(Text(line, no_wrap=True, overflow="ignore") for line in gate_headline(comparison).splitlines())]


def gate_table(comparison: dict[str, Any], ops: list[dict[str, Any]], limit: int = 20, width: int = 160) -> str:
    """:func:`gate_renderables` as plain text ``width`` columns wide."""
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    print_renderables(Console(file=buf, width=width, no_color=True), gate_renderables(comparison, ops, limit))
    return buf.getvalue()


def gate_headline(c: dict[str, Any]) -> str:
    verdict = c.get("verdict") or c["status"]
    word = "FAILED" if verdict == Verdict.FAIL or c["status"] == "failed" else "PASSED"
    counts = ", ".join(f"{n} {v}" for v, n in (c.get("counts") or {}).items() if n)
    line = f"{word} | comparison {c['id']} | {verdict} | {counts}"
    fd = c.get("first_divergence")
    if fd:
        line += (f"\nFAILED | first divergence: {fd['key']} ({op_words(fd['key'], fd['op'])}, input shapes "
                 f"{fd['shape_signature']}) | {fd['reason']}")
    return line


def dashboard_link(server: str, comparison_id: str) -> str:
    """The comparison's permalink on the dashboard."""
    return f"{server.rstrip('/')}/#/comparison/{comparison_id}"


def group_by_root(ops: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each op that is not an inherited failure, in execution order, with the inherited failures it
    carries downstream: those after it, up to the next local failure or warning."""
    groups: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    root: list[dict[str, Any]] | None = None
    for o in sorted(ops, key=lambda o: o["index"]):
        if o["inherited"] and o["verdict"] in (Verdict.FAIL, Verdict.WARN) and root is not None:
            root.append(o)
            continue
        groups.append((o, []))
        if o["verdict"] in (Verdict.FAIL, Verdict.WARN):
            root = groups[-1][1]
    return groups


def junit_xml(c: dict[str, Any], ops: list[dict[str, Any]]) -> str:
    """JUnit XML: one testcase per op, except that inherited failures are the details of the local
    failure (root cause) they follow, so a CI view shows one failing test per first divergence."""
    from junitparser import Failure, JUnitXml, Skipped, TestCase, TestSuite

    suite = TestSuite(f"opband {gate_title(c).removeprefix('opband gate: ')}")
    for o, inherited in group_by_root(ops):
        case = TestCase(o["key"], o["module"] or "<root>")
        detail = [f"{o['reason']}", f"input shapes {o['shape_signature']}, dtype {o['dtype']}"]
        if inherited:
            detail.append(f"{len(inherited)} later op(s) inherit this error (failing downstream of it):")
            detail += [f"  {i['verdict'].upper()} (inherited) {i['key']} | {i['reason']}" for i in inherited]
        if o["verdict"] == Verdict.FAIL:
            failure = Failure(o["reason"][:500], "opband.out_of_budget")
            failure.text = "\n".join(detail)
            case.result = [failure]
        elif o["verdict"] in (Verdict.NEW, Verdict.MISSING):
            case.result = [Skipped(o["reason"][:500])]
        elif o["verdict"] == Verdict.WARN or inherited:
            case.system_out = "WARNING | " + "\n".join(detail)
        suite.add_testcase(case)
    suite.update_statistics()
    xml = JUnitXml()
    xml.add_testsuite(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + xml.tostring().decode() + "\n"


def markdown_summary(c: dict[str, Any], ops: list[dict[str, Any]], limit: int = 30, link: str | None = None) -> str:
    """A Markdown summary for a PR comment or ``$GITHUB_STEP_SUMMARY``: the verdict, both runs, the link
    to the comparison on the dashboard, and the worst ops (inherited failures marked so)."""
    lines = [f"## opband gate: {(c.get('verdict') or c['status']).upper()}", ""]
    if c.get("target_run"):
        lines += [f"target **{run_name(c['target_run'])}** vs reference **{run_name(c.get('reference_run'))}**", ""]
    if link:
        lines += [f"[comparison {c['id']} on the dashboard]({link})", ""]
    lines += ["```", gate_headline(c), "```", "",
              f"| verdict | op key | input shapes | dtype | norm_l2 | {THRESHOLD} | reason |", "|---|---|---|---|---|---|---|"]
    for o in ops[:limit]:
        verdict = o["verdict"] + (" (inherited)" if o["inherited"] else "")
        lines.append(f"| {verdict} | `{o['key']}` | {o['shape_signature']} | {o['dtype']} | {fmt(o['norm_l2'])} | "
                     f"{fmt((o.get('budget') or {}).get('norm_l2'))} | {_cell(o['reason'])} |")
    if len(ops) > limit:
        lines += ["", f"... {len(ops) - limit} more ops" + (f": every op is on the [dashboard]({link})" if link else "")]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: pipes escaped, HTML-significant characters neutralised."""
    from html import escape

    return escape(text).replace("|", "\\|").replace("\n", " ")


def run_gate(server: str, project: str, reference: Path, target: Path, *, token: str | None = None,
             mode: str = "propagated", timeout: float = 600.0, junit: Path | None = None,
             markdown: Path | None = None, echo: Any = print, echo_err: Any = None,
             names: RunNames | None = None, show: Callable[[list[Any]], None] | None = None,
             narrow: bool = False) -> int:
    """Upload both bundles, compare, print the worst ops and the dashboard link; return the exit code
    (errors go to ``echo_err``, default stderr). ``names`` (label, target name, tags) name the target run;
    ``show`` prints the table's renderables on a terminal (default: ``echo`` of plain text), with
    ``narrow`` only the norm_l2 metric column.
    With ``$GITHUB_STEP_SUMMARY`` set, the Markdown summary is appended to that file too."""
    import sys

    echo_err = echo_err or (lambda line: print(line, file=sys.stderr))
    client = Client(server, token)
    try:
        ref = _upload(client, project, reference, None)
        tgt = _upload(client, project, target, names)
        created = client.create_comparison(project, ref["id"], tgt["id"], mode)
        with progress(f"comparison {created['id'][:8]} on the server", unit="status") as update:
            c = client.wait(created["id"], timeout, on_poll=lambda row: update(status=row["status"]))
        if c["status"] == "failed":
            echo(f"FAILED | comparison {c['id']} could not run: {c['error']}")
            return EXIT_ERROR
        with progress("fetching op results", unit="ops") as update:
            ops = all_ops(client, c["id"], on_page=lambda got, count: update(got, count))
        accepted = accepted_failures(client, project, c, ops) if c["verdict"] == Verdict.FAIL else None
    finally:
        client.close()
    link = dashboard_link(server, c["id"])
    if show is not None:
        show(gate_renderables(c, ops, metrics=("norm_l2",) if narrow else GATE_METRICS))
    else:
        echo(gate_table(c, ops))
    echo(f"dashboard: {link}")
    reports = [(junit, lambda: junit_xml(c, ops), "w"), (markdown, lambda: markdown_summary(c, ops, link=link), "w")]
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        reports.append((Path(summary), lambda: markdown_summary(c, ops, link=link), "a"))
    try:
        for path, render, how in reports:
            if path:
                with open(path, how, encoding="utf-8") as f:
                    f.write(render())
    except OSError as e:
        echo_err(f"error: cannot write a gate report: {e}; check that its folder exists and is writable")
        return EXIT_ERROR
    if accepted is not None:
        for line in accepted:
            echo(line)
        echo("PASSED | every local failure is accepted by a deviation that has not expired; "
             "the comparison's verdict stays fail on the dashboard")
        return EXIT_PASS
    return EXIT_FAIL if c["verdict"] == Verdict.FAIL else EXIT_PASS


def local_failures(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failing ops that are not inherited: the ones the service opens regressions for."""
    return [o for o in ops if o["verdict"] == Verdict.FAIL and not o["inherited"]]


def accepted_failures(client: Client, project: str, c: dict[str, Any], ops: list[dict[str, Any]]) -> list[str] | None:
    """``ACCEPTED | key | deviation …`` lines when every local failure of the comparison is a regression
    that an unexpired accepted deviation accepted (as the service decided it), else None (the gate fails)."""
    local = local_failures(ops)
    if not local:
        return None
    regs: list[dict[str, Any]] = []
    while True:
        page = client.regressions(project, status="accepted", limit=1000, offset=len(regs))
        regs += page["data"]
        if not page["data"] or len(regs) >= page["count"]:
            break
    deviations = {d["id"]: d for d in client.deviations(project)["data"]}
    by_op = {(r["key"], r["shape_signature"]): r for r in regs if r["last_comparison_id"] == c["id"]}
    lines = []
    for o in local:
        reg = by_op.get((o["key"], o["shape_signature"]))
        dev = deviations.get(reg["accepted_by"]) if reg is not None and reg.get("accepted_by") is not None else None
        if dev is None:
            return None
        expiry = f"expires {dev['expires_at']}" if dev.get("expires_at") else "does not expire"
        lines.append(f"ACCEPTED | {o['key']} | deviation #{dev['id']} ({dev['key_pattern']}) by {dev['author']}: "
                     f"{dev['reason']}; {expiry}")
    return lines


def _upload(client: Client, project: str, path: Path, names: RunNames | None) -> dict[str, Any]:
    size = path.stat().st_size
    with progress(f"uploading {path.name}", size, unit="bytes") as update:
        return client.upload(project, path, names=names, on_bytes=lambda sent: update(sent))


def all_ops(client: Client, comparison_id: str, page: int = 1000,
            on_page: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Every op result of a comparison, worst first, fetched page by page."""
    ops: list[dict[str, Any]] = []
    while True:
        batch = client.ops(comparison_id, limit=page, offset=len(ops), sort="worst", order="desc")
        ops += batch["data"]
        if on_page is not None:
            on_page(len(ops), batch["count"])
        if not batch["data"] or len(ops) >= batch["count"]:
            return ops
