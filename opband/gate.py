"""``opband gate``: upload reference and target, wait for the comparison, print, exit 0/1/2."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from accuracy.manifest import RunNames
from accuracy.report import fmt, op_words
from opband.client import Client

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def gate_table(comparison: dict[str, Any], ops: list[dict[str, Any]], limit: int = 20) -> str:
    """Worst ops as a terminal table, then PASSED/FAILED lines CI logs can grep."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"opband gate: {comparison.get('target_variant')}@{comparison.get('target_device')}")
    for col in ("verdict", "op key", "input shapes", "dtype", "norm_l2", "max_abs", "cosine", "budget"):
        table.add_column(col, overflow="fold", justify="right" if col in ("norm_l2", "max_abs", "cosine", "budget") else "left")
    for o in ops[:limit]:
        budget = (o.get("budget") or {}).get("norm_l2")
        table.add_row(o["verdict"].upper() + (" (inherited)" if o["inherited"] else ""), o["key"], o["shape_signature"],
                      o["dtype"], "NaN/Inf" if o.get("nonfinite") else fmt(o["norm_l2"]), fmt(o["max_abs"]),
                      fmt(o["cosine"]), fmt(budget))
    buf = StringIO()
    console = Console(file=buf, width=160, no_color=True)
    console.print(table)
    console.print(gate_headline(comparison))
    return buf.getvalue()


def gate_headline(c: dict[str, Any]) -> str:
    verdict = c.get("verdict") or c["status"]
    word = "FAILED" if verdict == "fail" or c["status"] == "failed" else "PASSED"
    counts = ", ".join(f"{n} {v}" for v, n in (c.get("counts") or {}).items() if n)
    line = f"{word} | comparison {c['id']} | {verdict} | {counts}"
    fd = c.get("first_divergence")
    if fd:
        line += (f"\nFAILED | first divergence: {fd['key']} ({op_words(fd['key'], fd['op'])}, input shapes "
                 f"{fd['shape_signature']}) | {fd['reason']}")
    return line


def junit_xml(c: dict[str, Any], ops: list[dict[str, Any]]) -> str:
    failures = sum(1 for o in ops if o["verdict"] == "fail")
    cases = []
    for o in ops:
        body = ""
        if o["verdict"] == "fail":
            body = f"<failure message={quoteattr(o['reason'])}/>"
        elif o["verdict"] in ("new", "missing"):
            body = f"<skipped message={quoteattr(o['reason'])}/>"
        cases.append(f"<testcase classname={quoteattr(o['module'] or '<root>')} name={quoteattr(o['key'])}>{body}</testcase>")
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="opband" tests="{len(ops)}" '
            f'failures="{failures}" id={quoteattr(c["id"])}>{"".join(cases)}</testsuite>\n')


def markdown_summary(c: dict[str, Any], ops: list[dict[str, Any]], limit: int = 30) -> str:
    lines = [f"## opband gate: {(c.get('verdict') or c['status']).upper()}", "", "```", gate_headline(c), "```", "",
             "| verdict | op key | input shapes | dtype | norm_l2 | budget | reason |", "|---|---|---|---|---|---|---|"]
    for o in ops[:limit]:
        lines.append(f"| {o['verdict']} | `{o['key']}` | {o['shape_signature']} | {o['dtype']} | {fmt(o['norm_l2'])} | "
                     f"{fmt((o.get('budget') or {}).get('norm_l2'))} | {escape(o['reason']).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run_gate(server: str, project: str, reference: Path, target: Path, *, token: str | None = None,
             mode: str = "propagated", timeout: float = 600.0, junit: Path | None = None,
             markdown: Path | None = None, echo: Any = print, echo_err: Any = None,
             names: RunNames | None = None) -> int:
    """Upload both bundles, compare, print the worst ops; return the exit code (errors go to
    ``echo_err``, default stderr). ``names`` (label, target name, tags) name the target run."""
    import sys

    echo_err = echo_err or (lambda line: print(line, file=sys.stderr))
    client = Client(server, token)
    try:
        ref = client.upload(project, reference)
        tgt = client.upload(project, target, names=names)
        c = client.wait(client.create_comparison(project, ref["id"], tgt["id"], mode)["id"], timeout)
        if c["status"] == "failed":
            echo(f"FAILED | comparison {c['id']} could not run: {c['error']}")
            return EXIT_ERROR
        ops = all_ops(client, c["id"])
    finally:
        client.close()
    echo(gate_table(c, ops))
    try:
        if junit:
            junit.write_text(junit_xml(c, ops))
        if markdown:
            markdown.write_text(markdown_summary(c, ops))
    except OSError as e:
        echo_err(f"error: cannot write a gate report: {e}; check that its folder exists and is writable")
        return EXIT_ERROR
    return EXIT_FAIL if c["verdict"] == "fail" else EXIT_PASS


def all_ops(client: Client, comparison_id: str, page: int = 1000) -> list[dict[str, Any]]:
    """Every op result of a comparison, worst first, fetched page by page."""
    ops: list[dict[str, Any]] = []
    while True:
        batch = client.ops(comparison_id, limit=page, offset=len(ops), sort="worst", order="desc")
        ops += batch["data"]
        if not batch["data"] or len(ops) >= batch["count"]:
            return ops
