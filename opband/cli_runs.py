"""``opband capture`` and ``opband compare``: make a bundle, and judge two bundles offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opband.cli_common import (
    MODE_HELP, CaptureMode, Label, Level, Mode, Tags, TargetName, Variant, fail, names_from_flags, write_report,
)


def capture(
    out: Annotated[Path, typer.Option("-o", "--out", help="bundle file to write")],
    spec: Annotated[Optional[str], typer.Argument(help="package.module:function or path/to/file.py:function returning (model, inputs); not given with --replay (the reference's ops are re-run, no model)")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, npu ... (default: best available)")] = None,
    variant: Annotated[Variant, typer.Option(help="precision/quantization of the target run")] = Variant.fp32,
    level: Annotated[Level, typer.Option(help="module (forward hooks), api (torch functions) or aten (every ATen op)")] = Level.aten,
    mode: Annotated[CaptureMode, typer.Option(help="full (tensors) or summary (on-device statistics only)")] = CaptureMode.full,
    seed: Annotated[int, typer.Option(help="torch.manual_seed before building the model")] = 0,
    modules: Annotated[Optional[list[str]], typer.Option("--module", help="module path glob to keep (repeatable)")] = None,
    ops: Annotated[Optional[list[str]], typer.Option("--op", help="op name glob to keep (repeatable)")] = None,
    max_bytes: Annotated[Optional[int], typer.Option(help="past this many tensor bytes keep summaries only")] = None,
    inputs: Annotated[bool, typer.Option("--inputs", metavar="", help="also record op inputs (needed to --replay this bundle)")] = False,
    replay: Annotated[Optional[Path], typer.Option(help="re-run each op of this reference bundle (captured with --inputs) alone")] = None,
    golden: Annotated[bool, typer.Option("--golden", metavar="", help="with --replay: recompute each op in float64 on cpu")] = False,
    label: Label = None,
    target: TargetName = None,
    tags: Tags = None,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", metavar="", help="capture a quantizing variant even if it replaces under half of the GEMM-like modules")] = False,
    compile_: Annotated[bool, typer.Option("--compile", metavar="", help="torch.compile each block (decoder layer): block outputs stay observable and pair with an eager reference")] = False,
    backward: Annotated[bool, typer.Option("--backward", metavar="", help="run training steps (loss from the SPEC's loss_fn or the model's .loss) and record gradients and parameter updates")] = False,
    train_steps: Annotated[Optional[int], typer.Option(min=1, help="with --backward: training steps to run (default 1)")] = None,
    optimizer: Annotated[str, typer.Option(help="with --backward: sgd or adamw")] = "sgd",
    lr: Annotated[float, typer.Option(help="with --backward: learning rate")] = 1e-3,
    generate: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="run a greedy generate() of N new tokens instead of one forward (a transformers model): the prefill and each decode step are steps of their own, and the bundle keeps the tokens each step chose")] = None,
    teacher_force: Annotated[Optional[Path], typer.Option(metavar="REF", help="with --generate: make each step choose the token the reference bundle REF (captured with --generate) chose, so every step stays comparable")] = None,
    keep: Annotated[Optional[Path], typer.Option(metavar="FILE", help="keep the modules this file lists (TOML/YAML/JSON, as `opband prescribe --toml` writes it) at the model's own precision inside --variant")] = None,
) -> None:
    """Run the SPEC's model once under capture and write a bundle (or --replay a reference's ops)."""
    _check_capture_flags(spec, replay, golden, generate, teacher_force, backward)
    kept = _keep_paths(keep, variant.value, replay) if keep is not None else []
    path = _run_capture(spec, out, replay, device=device, variant=variant.value, level=level.value, mode=mode.value,
                        seed=seed, modules=modules, ops=ops, max_bytes=max_bytes, golden=golden,
                        names=names_from_flags(label, target, tags), allow_partial=allow_partial, compile=compile_,
                        train_steps=train_steps, optimizer=optimizer, lr=lr, generate=generate,
                        teacher_force=teacher_force, keep=kept, **({"inputs": True} if inputs else {}),
                        **({"backward": True} if backward else {}))
    _echo_captured(path, replay)


def _keep_paths(path: Path, variant: str, replay: Path | None) -> list[str]:
    """The module paths of a ``--keep`` file, or exit 2 saying what is wrong with it."""
    from hooks.keep import read_keep_file

    from accuracy.errors import OpbandError

    if replay is not None:
        fail("--keep changes the model a capture runs; --replay runs no model: drop one of them")
    if variant == "fp32":
        fail("--keep keeps modules at the model's own precision inside a lower-precision --variant: give --variant")
    try:
        return read_keep_file(path, variant)
    except OpbandError as e:
        fail(str(e))


def _check_capture_flags(spec: str | None, replay: Path | None, golden: bool, generate: int | None = None,
                         teacher_force: Path | None = None, backward: bool = False) -> None:
    """Exit 2 on a SPEC/--replay/--golden/--generate combination that cannot run, saying what to give instead."""
    if teacher_force is not None and generate is None:
        fail("--teacher-force feeds a generation the reference's tokens: add --generate N (N new tokens)")
    if generate is not None and (backward or replay is not None):
        fail("--generate runs a greedy generation of the SPEC's model: it does not combine with "
             + ("--backward" if backward else "--replay"))
    if golden and replay is None:
        fail("--golden recomputes a reference's ops in float64: give the reference with --replay REF_BUNDLE")
    if replay is not None and spec is not None:
        fail(f"--replay re-runs the ops recorded in {replay} without running a model, so SPEC {spec} would be "
             "ignored: drop it (opband capture --replay REF -o OUT)")
    if replay is None and spec is None:
        fail("give a SPEC (package.module:function or file.py:function returning (model, inputs)), "
             "or --replay REF_BUNDLE")


def _run_capture(spec: str | None, out: Path, replay: Path | None, **options: object) -> Path:
    """:func:`hooks.runner.run_capture`, its errors turned into exit 2 with what to do."""
    from hooks.runner import run_capture
    from hooks.spec import SpecError, UserCodeError

    from accuracy.errors import OpbandError

    try:
        return run_capture(spec or "", out, replay=replay, **options)  # type: ignore[no-any-return]
    except UserCodeError as e:
        fail(f"{e}\nno bundle written: fix the code above and run `opband capture` again")
    except OpbandError as e:
        fail(f"--replay {replay}: {e}" if replay is not None else str(e))
    except (SpecError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror or e}; check that its folder is writable")


def _echo_captured(path: Path, replay: Path | None) -> None:
    """What the capture wrote: ops not replayed, the variant's coverage, the bundle's size and counts."""
    from accuracy.bundle import Bundle

    from hooks.gemm import describe

    b = Bundle.open(path)
    if replay is not None:
        from hooks.replay import not_replayed

        for line in not_replayed(b.manifest.diagnostics):
            typer.echo(line)
    if "variant_coverage" in b.manifest.run:
        typer.echo("\n".join(describe(b.manifest.run["variant_coverage"])))
    gen = b.manifest.run.get("generation")
    if isinstance(gen, dict):
        rows = gen.get("tokens") or []
        typer.echo(f"generated {gen.get('new_tokens')} tokens for each of {len(rows)} sequence(s)"
                   + (" (teacher-forced)" if gen.get("teacher_forced") else "") + f": {rows[0] if rows else []}"
                   + (" ..." if len(rows) > 1 else ""))
    engine = b.manifest.run.get("engine")
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(b.records)} records, "
               f"{sum(b.manifest.skipped_ops.values())} no-number ops skipped, {len(b.manifest.diagnostics)} diagnostics"
               + (f"; ops seen by the {engine}" if engine else "") + ")")


def compare(
    reference: Annotated[Path, typer.Argument(help="reference bundle (e.g. the GPU fp32 run); for a multi-rank run: "
                                                    "its base name (run.bundle for run.rank0.bundle ...), a folder of "
                                                    "rank bundles, or a path with {rank}")],
    target: Annotated[Path, typer.Argument(help="target bundle (NPU / CPU / bf16 / int8 ...), or a multi-rank run as above")],
    mode: Annotated[Mode, typer.Option(help=MODE_HELP)] = Mode.propagated,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the JSON report here")] = None,
    markdown: Annotated[Optional[Path], typer.Option(help="write a Markdown report here")] = None,
    html: Annotated[Optional[Path], typer.Option(help="write a standalone HTML report here")] = None,
    budgets: Annotated[Optional[Path], typer.Option(help="per-op budget overrides: a .toml, .yaml/.yml or .json file "
                                                         "(docs/budgets.md)")] = None,
    limit: Annotated[int, typer.Option(help="rows in the terminal table")] = 20,
) -> None:
    """Compare two bundles offline; exit 0 in budget, 1 out of budget, 2 on bad input."""
    from accuracy.ranks import is_rank_set
    from accuracy.report import to_html, to_json, to_markdown

    if is_rank_set(reference) or is_rank_set(target):  # multi-rank runs: pair bundles by rank
        raise typer.Exit(_compare_ranks(reference, target, mode.value, budgets, json_out, limit))
    report = _compare_bundles(reference, target, mode.value, budgets)
    _print_report(report, limit)
    for out, render in ((json_out, to_json), (markdown, to_markdown), (html, to_html)):
        if out:
            write_report(out, render(report))
    raise typer.Exit(0 if report else 1)


def _budget_policy(budgets: Path | None):  # type: ignore[no-untyped-def]
    from accuracy.budgets import BudgetPolicy

    return BudgetPolicy.from_config(budgets) if budgets else None


def _compare_ranks(reference: Path, target: Path, mode: str, budgets: Path | None, json_out: Path | None,
                   limit: int) -> int:
    """Two multi-rank runs compared rank by rank: print the table, write the JSON; the exit code."""
    from accuracy.errors import OpbandError
    from accuracy.ranks import compare_ranks
    from accuracy.report import ranks_to_dict, ranks_to_text

    try:
        ranked = compare_ranks(reference, target, mode=mode, budgets=_budget_policy(budgets))
    except (OpbandError, OSError, ValueError) as e:
        fail(str(e))
    typer.echo(ranks_to_text(ranked, limit=limit))
    if json_out:
        write_report(json_out, json.dumps(ranks_to_dict(ranked), indent=2, allow_nan=False, default=str))
    return 0 if ranked else 1


def _compare_bundles(reference: Path, target: Path, mode: str, budgets: Path | None):  # type: ignore[no-untyped-def]
    """:func:`accuracy.compare` of two bundle files (with a progress bar), or exit 2 saying which input is bad."""
    import accuracy
    from accuracy.bundle import Bundle
    from accuracy.errors import OpbandError
    from opband.terminal import progress

    sides = {}
    for side, path in (("reference", reference), ("target", target)):
        try:
            sides[side] = Bundle.open(path)
        except OpbandError as e:
            fail(f"{side} {path} is not a valid opband bundle: {e}")
    try:
        policy = _budget_policy(budgets)
        with progress("comparing ops", unit="ops") as update:
            return accuracy.compare(sides["reference"], sides["target"], mode=mode, budgets=policy,
                                    progress=lambda done, total: update(done, total))
    except (OpbandError, OSError, ValueError) as e:
        fail(str(e))


def _print_report(report, limit: int) -> None:  # type: ignore[no-untyped-def]
    """The per-op table, worst first, as wide as the terminal (all metric columns in a log)."""
    from accuracy.report import print_renderables, table_metrics, text_renderables
    from opband.terminal import console

    out = console()
    print_renderables(out, text_renderables(report, limit=limit,
                                            metrics=table_metrics(out.width if out.is_terminal else None)))
