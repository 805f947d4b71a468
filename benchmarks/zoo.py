"""The zoo table: every model x case of ``tests/zoo.py`` -> verdict and first divergence.

Run: ``.venv/bin/python benchmarks/zoo.py [--fast] [--model NAME ...]``. Each cell is right (green)
when a benign case passes, or a fault's first divergence lies in the module it was injected
into; the last lines count the wrong cells. Exit status 1 when any cell is wrong.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

import zoo  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="only the models in the make-test subset")
    ap.add_argument("--model", action="append", help="only these models (repeatable)")
    ap.add_argument("--case", action="append", help="only these cases (repeatable), e.g. bf16, fault:weight")
    ap.add_argument("--level", choices=("aten", "module"), default="aten", help="capture level of both runs")
    ap.add_argument("--inputs", action="store_true",
                    help="aten level: also record each op's inputs (a dataflow graph for the first-divergence walk)")
    args = ap.parse_args()
    zoo.CAPTURE_OPTIONS.update(level=args.level, inputs=args.inputs)
    todo = [(m, c) for m, c in zoo.all_cases(args.fast)
            if (not args.model or m.name in args.model) and (not args.case or c.name in args.case)]
    rows = []
    wrong = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        refs: dict[str, Path] = {}
        for m, c in track(todo, description="zoo", transient=True):
            if m.name not in refs:
                refs[m.name] = zoo.capture_run(m, None, Path(tmp) / f"{m.name}-ref.bundle")
            rep = zoo.run_case(m, c, Path(tmp), refs[m.name])
            problem = zoo.judge_case(c, rep)
            wrong += problem is not None
            verdict, fd = zoo.describe(rep)
            rows.append((m.name, c.name, c.module or "-", verdict, fd, problem))
    table = Table(title=f"opband zoo: {len(rows)} cases, {time.monotonic() - started:.0f}s")
    for col in ("model", "case", "fault module", "verdict", "first divergence", "right"):
        table.add_column(col)
    for name, case, module, verdict, fd, problem in rows:
        table.add_row(name, case, module, verdict, fd, "[green]yes[/]" if problem is None else "[red]NO[/]")
    console = Console(width=200)
    console.print(table)
    for *_, problem in rows:
        if problem:
            console.print(f"FAILED | {problem}", markup=False)
    console.print(f"{'PASSED' if not wrong else 'FAILED'} | {len(rows) - wrong} of {len(rows)} cases right")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
