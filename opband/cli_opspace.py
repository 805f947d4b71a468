"""The op-space baseline's commands: ``opband sweep``, ``opband coverage`` and ``opband import``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opband.cli_common import fail, write_report


def sweep(
    sweep_file: Annotated[Optional[Path], typer.Argument(help="TOML/YAML sweep file (ops, shapes, dtypes, regimes ...); flags override it")] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="folder for reference.bundle and one <dtype>.bundle per target dtype")] = Path("sweep"),
    ops: Annotated[Optional[list[str]], typer.Option("--op", help="built-in name (softmax), ATen op (aten.erf) or torch function (torch.special.erf); repeatable. Default: the --from-bundle ops, else the built-in LLM list")] = None,
    op_list: Annotated[Optional[Path], typer.Option(help="sweep the ops of this file too, one per line (as `opband coverage --op-list`)")] = None,
    shapes: Annotated[Optional[list[str]], typer.Option("--shape", help="input shapes as 'AxB,CxD' (one per tensor input); repeatable; replaces each op's defaults")] = None,
    dtypes: Annotated[Optional[list[str]], typer.Option("--dtype", help="target dtype: fp32 fp16 bf16 int8 fp8-e4m3 fp8-e5m2; repeatable (default bf16, fp16, int8)")] = None,
    regimes: Annotated[Optional[list[str]], typer.Option("--regime", help="normal large near_zero subnormal nonfinite ill_conditioned; repeatable (default all)")] = None,
    from_bundle: Annotated[Optional[Path], typer.Option(help="sweep the ATen ops of this captured bundle at their recorded input shapes")] = None,
    reference: Annotated[Optional[Path], typer.Option(help="an existing sweep reference.bundle (e.g. made on the GPU machine): run only the --dtype targets on --target-device, on its stored inputs")] = None,
    reference_device: Annotated[Optional[str], typer.Option(help="reference device (default cuda when present, else cpu)")] = None,
    target_device: Annotated[Optional[str], typer.Option(help="target device (default cpu)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="seed of the generated inputs")] = None,
    max_shapes: Annotated[Optional[int], typer.Option(help="with --from-bundle: input shapes per op, most frequent first (default 3)")] = None,
    exact_inputs: Annotated[Optional[bool], typer.Option("--exact-inputs/--raw-inputs", help="round inputs to what the target dtypes hold, so the sweep measures kernels, not input casts (default on)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write every row (op, dtype, shape, regime, verdict, errors) as JSON")] = None,
    check: Annotated[bool, typer.Option("--check", metavar="", help="exit 1 when a case fails (default: report only)")] = False,
) -> None:
    """Sweep ops x shapes x dtypes x value regimes without a model: same stored inputs on the reference and each
    target; writes ordinary bundles (compare them with `opband compare REF T --mode replay`) and a table per dtype."""
    from hooks.opcases import CaseError
    from hooks.opsweep import make_config, run_sweep

    from accuracy.coverage import load_op_list
    from accuracy.errors import OpbandError

    try:
        ops = [*(ops or []), *(load_op_list(op_list) if op_list else [])]
        cfg = make_config(sweep_file, ops=ops, shapes=shapes, dtypes=dtypes, regimes=regimes,
                          from_bundle=str(from_bundle) if from_bundle else None, reference_device=reference_device,
                          target_device=target_device, seed=seed, max_shapes=max_shapes, exact_inputs=exact_inputs)
        result = run_sweep(cfg, out, reference=reference)
    except (CaseError, OpbandError, ValueError) as e:
        fail(str(e))
    typer.echo(result.report.to_text())
    typer.echo(f"wrote {result.reference} and {', '.join(str(p) for p in result.targets.values())}")
    if json_out:
        write_report(json_out, result.report.to_json())
    raise typer.Exit(1 if check and not result.report else 0)


def coverage(
    bundles: Annotated[list[Path], typer.Argument(help="bundles: captures, sweep references and targets, imports")],
    op_list: Annotated[Optional[Path], typer.Option(help="file of ops to cover, one per line (aten.mm, aten.add.Tensor); prints the covered share")] = None,
    reference: Annotated[Optional[Path], typer.Option(help="judge every non-sweep target against this reference (default: the first fp32 capture of the same model)")] = None,
    judge: Annotated[bool, typer.Option("--judge/--no-judge", help="compare targets with their references for pass/fail (default on)")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the matrix as JSON")] = None,
) -> None:
    """Which ops, overloads, dtypes, input-shape classes and value regimes these runs exercised, per model, with
    pass/fail and band state, and the share of an op list they cover."""
    from accuracy.coverage import coverage_of_bundles, load_op_list
    from accuracy.errors import OpbandError

    try:
        report = coverage_of_bundles(bundles, load_op_list(op_list) if op_list else None, judge=judge, reference=reference)
    except OpbandError as e:
        fail(str(e))
    typer.echo(report.to_text())
    if json_out:
        write_report(json_out, json.dumps(report.to_dict(), indent=2))


def import_msprobe(
    dump: Annotated[Path, typer.Argument(help="msprobe dump_path (one step/rank), its step*/proc*/ folder, or dump.json")],
    out: Annotated[Path, typer.Option("-o", "--out", help="bundle file to write")],
) -> None:
    """An msprobe (MindStudio Probe) PyTorch dump -> bundle. L0 and mix-level keys match `opband capture`'s;
    tensors are read by torch's weights_only loader (anything else is refused)."""
    from hooks.peers import PeerDumpError, import_msprobe as run

    try:
        _echo_written(run(dump, out))
    except PeerDumpError as e:
        fail(str(e))


def import_polygraphy(
    results: Annotated[Path, typer.Argument(help="JSON from `polygraphy run ... --save-outputs RESULTS.json`")],
    out: Annotated[Path, typer.Option("-o", "--out", help="bundle file to write")],
    runner: Annotated[Optional[str], typer.Option(help="runner name, when the file holds several")] = None,
    iteration: Annotated[int, typer.Option(help="which iteration of the runner")] = 0,
) -> None:
    """Polygraphy run results -> bundle (ONNX output names become module/op keys; arrays read with allow_pickle=False)."""
    from hooks.peers import PeerDumpError, import_polygraphy as run

    try:
        _echo_written(run(results, out, runner=runner, iteration=iteration))
    except PeerDumpError as e:
        fail(str(e))


def _echo_written(path: Path) -> None:
    from accuracy.bundle import Bundle

    b = Bundle.open(path)
    typer.echo(f"wrote {path} ({len(b.records)} records, {len(b.manifest.diagnostics)} diagnostics)")
    for d in b.manifest.diagnostics[:5]:
        typer.echo(f"  {d.key}: {d.message}")
