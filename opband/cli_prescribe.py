"""``opband prescribe``: which modules to keep at the reference precision so a low-precision model passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from opband.cli_common import Variant, fail, write_report


def prescribe(
    spec: Annotated[str, typer.Argument(help="package.module:function or path/to/file.py:function returning (model, inputs): the reference, at its own precision")],
    variant: Annotated[Variant, typer.Option(help="the low-precision variant to fix (with --target: the precision the target declares, for its budgets)")],
    target: Annotated[Optional[str], typer.Option("--target", metavar="SPEC2", help="your own low-precision model instead of a --variant of SPEC's: a second SPEC, modules matched by path")] = None,
    budgets: Annotated[Optional[Path], typer.Option(help="budgets for the model outputs (TOML/YAML/JSON as `opband compare --budgets`; keys /forward#0, /forward#0:1 ...); default: the variant's precision")] = None,
    metric: Annotated[str, typer.Option(help="the error that ranks modules and sets: norm_l2, max_abs, max_rel, mean_rel, rmse, ulp_max, mean_abs")] = "norm_l2",
    max_keep: Annotated[Optional[int], typer.Option(min=1, help="keep at most this many modules")] = None,
    max_runs: Annotated[int, typer.Option(min=1, help="run the target model at most this many times")] = 64,
    device: Annotated[str, typer.Option(help="cpu, cuda, npu ... (int8/w8a16/w4a16 use torch's CPU kernels)")] = "cpu",
    seed: Annotated[int, typer.Option(help="torch.manual_seed before building each model")] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the prescription as JSON")] = None,
    md: Annotated[Optional[Path], typer.Option("--md", help="write the prescription as Markdown (a PR comment)")] = None,
    toml: Annotated[Optional[Path], typer.Option("--toml", help="write the keep file `opband capture --variant V --keep FILE` reads")] = None,
) -> None:
    """Find the smallest set of modules to keep at the reference precision so the model's outputs pass.

    The reference runs once; during it each candidate module's low-precision form runs on the reference's
    own inputs to it (the error it adds, not the error it inherits). The most sensitive are each kept alone
    in one target run, then keeping the first 1, 2, 4 ... of the ranking is tried until the outputs pass,
    bisected to the shortest such prefix, and every module the outputs do not need is dropped again.
    The set passes (it was run) but need not be the global minimum. Exit 0 when the outputs pass (or
    already did), 1 when no set within --max-keep/--max-runs passed.
    """
    from hooks.keep import KeepError
    from hooks.prescribe import PrescribeError, prescribe as run_prescribe
    from hooks.spec import SpecError, UserCodeError

    from accuracy.errors import OpbandError
    from opband.terminal import console, progress

    with progress(f"prescribe {variant.value}: target runs", max_runs, unit="runs") as update:
        try:
            result = run_prescribe(spec, variant.value, target_spec=target, budgets=budgets, metric=metric,
                                   max_keep=max_keep, max_runs=max_runs, device=device, seed=seed,
                                   progress=lambda runs, status: update(runs, status=status))
        except UserCodeError as e:
            fail(f"{e}\nfix the code above and run `opband prescribe` again")
        except (PrescribeError, KeepError, SpecError, OpbandError, ValueError) as e:
            fail(str(e))
    out = console()
    for line in terminal_lines(result):
        out.print(line, highlight=False, soft_wrap=True)
    if json_out is not None:
        write_report(json_out, json.dumps(result.as_dict(), indent=2) + "\n")
    if md is not None:
        write_report(md, to_markdown(result))
    if toml is not None:
        write_report(toml, result.toml())
    if not result.found:
        raise typer.Exit(1)


def _fmt(v: Any) -> str:
    from accuracy.report import fmt

    try:
        return fmt(float(v))
    except (TypeError, ValueError):
        return str(v)


def _check_words(check: Any, metric: str) -> str:
    return f"{check.verdict.upper()} ({metric} {_fmt(check.worst)}; " + "; ".join(
        f"{o['output']} {o['reason']}" for o in check.outputs) + ")"


def terminal_lines(result: Any) -> list[str]:
    """The prescription as a person reads it in a terminal."""
    lines = [f"before: {_check_words(result.before, result.metric)}"]
    if result.after is None and result.found:
        return [*lines, "nothing to keep: the target already passes"]
    for k in result.keep:
        lines.append(f"  keep {k.module}  ({result.metric} without it {_fmt(k.error_without)}, with the set "
                     f"{_fmt(k.error_with)})")
    if result.after is not None:
        lines.append(f"after:  {_check_words(result.after, result.metric)}")
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"{result.runs} target runs over {result.candidates} candidate modules (the reference ran once)")
    if result.keep:
        lines += ["apply it:", f"  Python:  {result.python()}",
                  f"  capture: opband capture SPEC --variant {result.variant} --keep keep.toml   (keep.toml: "
                  f"{result.toml().strip().replace(chr(10), '; ')})"]
    return lines


def to_markdown(result: Any) -> str:
    """The prescription for a PR comment: verdicts before and after, the kept modules, the config."""
    verdict = "passes" if result.found else "no passing set found"
    lines = [f"## opband prescribe: {result.variant} {verdict}", "",
             f"- before: **{result.before.verdict}** ({result.metric} {_fmt(result.before.worst)})"]
    if result.after is not None:
        lines.append(f"- after: **{result.after.verdict}** ({result.metric} {_fmt(result.after.worst)})")
    lines.append(f"- {result.runs} target runs, {result.candidates} candidate modules")
    lines += [f"- note: {n}" for n in result.notes]
    if result.keep:
        lines += ["", f"| keep at reference precision | {result.metric} without it | {result.metric} with the set |",
                  "|---|---|---|"]
        lines += [f"| `{k.module}` | {_fmt(k.error_without)} | {_fmt(k.error_with)} |" for k in result.keep]
        lines += ["", "```toml", result.toml().rstrip(), "```", "", "```python", "import hooks.variants",
                  result.python(), "```"]
    return "\n".join(lines) + "\n"
