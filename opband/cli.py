"""The ``opband`` command line. Each subcommand parses flags and makes one library call."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="opband: find the operator that lost accuracy on new hardware or in low precision.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema (alembic migrations).", no_args_is_help=True)
token_app = typer.Typer(help="Project tokens for the service's auth.", no_args_is_help=True)
import_app = typer.Typer(help="Import peers' dumps (msprobe, Polygraphy) as bundles for compare, bands and the service.",
                         no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(import_app, name="import")
app.add_typer(token_app, name="token")

DataDir = Annotated[Path, typer.Option("--data-dir", help="embedded database and blobs live here", envvar="OPBAND_DATA_DIR")]
Label = Annotated[Optional[str], typer.Option(help="a name for this run, e.g. nightly-2026-12-01 or pr-1234")]
TargetName = Annotated[Optional[str], typer.Option("--target", "--target-name", help="the target name its drift series "
                       "and regressions are kept under, e.g. ascend-910b/bf16 (default: variant@device)")]
Tags = Annotated[Optional[list[str]], typer.Option("--tag", metavar="KEY=VALUE", help="free-form tag, repeatable: "
                 "branch=main, commit=abc123, cann=8.0.RC2, driver=24.1, op-library=1.3")]


class Variant(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"
    w8a16 = "w8a16"
    w4a16 = "w4a16"
    fp8_e4m3 = "fp8-e4m3"
    fp8_e5m2 = "fp8-e5m2"
    fp8_e4m3_rowwise = "fp8-e4m3-rowwise"
    fp8_e5m2_rowwise = "fp8-e5m2-rowwise"


class Mode(str, Enum):
    propagated = "propagated"
    replay = "replay"
    golden = "golden"


class Level(str, Enum):
    module = "module"
    api = "api"
    aten = "aten"


class CaptureMode(str, Enum):
    full = "full"
    summary = "summary"


MODE_HELP = ("propagated: two end-to-end runs (errors flow downstream; later failures are marked inherited); "
             "replay: the target is `opband capture --replay REF` (each op on the reference's inputs: every failure "
             "is local); golden: REF is a `--replay REF --golden` fp64 bundle, each op judged by its error against "
             "float64 relative to the reference's own")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"opband {version('opband')}")
        except PackageNotFoundError:
            typer.echo("opband (not installed: run `make venv` or `pip install -e .`)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                          help="print the version and exit")] = False,
) -> None:
    """opband: find the operator that lost accuracy on new hardware or in low precision."""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
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
) -> None:
    """Run the SPEC's model once under capture and write a bundle (or --replay a reference's ops)."""
    from hooks.runner import run_capture
    from hooks.spec import SpecError, UserCodeError

    from accuracy.errors import OpbandError

    if golden and replay is None:
        _fail("--golden recomputes a reference's ops in float64: give the reference with --replay REF_BUNDLE")
    if replay is not None and spec is not None:
        _fail(f"--replay re-runs the ops recorded in {replay} without running a model, so SPEC {spec} would be "
              "ignored: drop it (opband capture --replay REF -o OUT)")
    if replay is None and spec is None:
        _fail("give a SPEC (package.module:function or file.py:function returning (model, inputs)), "
              "or --replay REF_BUNDLE")
    names = _names(label, target, tags)
    try:
        path = run_capture(spec or "", out, device=device, variant=variant.value, level=level.value, mode=mode.value,
                           seed=seed, modules=modules, ops=ops, max_bytes=max_bytes, replay=replay, golden=golden,
                           names=names, allow_partial=allow_partial, compile=compile_, train_steps=train_steps,
                           optimizer=optimizer, lr=lr, **({"inputs": True} if inputs else {}),
                           **({"backward": True} if backward else {}))
    except UserCodeError as e:
        _fail(f"{e}\nno bundle written: fix the code above and run `opband capture` again")
    except OpbandError as e:
        _fail(f"--replay {replay}: {e}" if replay is not None else str(e))
    except (SpecError, ValueError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot write {out}: {e.strerror or e}; check that its folder is writable")
    from accuracy.bundle import Bundle

    from hooks.gemm import describe

    b = Bundle.open(path)
    if replay is not None:
        from hooks.replay import not_replayed

        for line in not_replayed(b.manifest.diagnostics):
            typer.echo(line)
    if "variant_coverage" in b.manifest.run:
        typer.echo("\n".join(describe(b.manifest.run["variant_coverage"])))
    engine = b.manifest.run.get("engine")
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(b.records)} records, "
               f"{sum(b.manifest.skipped_ops.values())} no-number ops skipped, {len(b.manifest.diagnostics)} diagnostics"
               + (f"; ops seen by the {engine}" if engine else "") + ")")


@app.command()
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
    import accuracy
    from accuracy.budgets import BudgetPolicy
    from accuracy.bundle import Bundle
    from accuracy.errors import OpbandError
    from accuracy.ranks import compare_ranks, is_rank_set
    from accuracy.report import print_renderables, table_metrics, text_renderables, to_html, to_json, to_markdown
    from opband.terminal import console, progress

    if is_rank_set(reference) or is_rank_set(target):  # multi-rank runs: pair bundles by rank
        from accuracy.report import ranks_to_dict, ranks_to_text

        try:
            policy = BudgetPolicy.from_config(budgets) if budgets else None
            ranked = compare_ranks(reference, target, mode=mode.value, budgets=policy)
        except (OpbandError, OSError, ValueError) as e:
            _fail(str(e))
        typer.echo(ranks_to_text(ranked, limit=limit))
        if json_out:
            write_report(json_out, json.dumps(ranks_to_dict(ranked), indent=2, allow_nan=False, default=str))
        raise typer.Exit(0 if ranked else 1)
    sides = {}
    for side, path in (("reference", reference), ("target", target)):
        try:
            sides[side] = Bundle.open(path)
        except OpbandError as e:
            _fail(f"{side} {path} is not a valid opband bundle: {e}")
    try:
        policy = BudgetPolicy.from_config(budgets) if budgets else None
        with progress("comparing ops", unit="ops") as update:
            report = accuracy.compare(sides["reference"], sides["target"], mode=mode.value, budgets=policy,
                                      progress=lambda done, total: update(done, total))
    except (OpbandError, OSError, ValueError) as e:
        _fail(str(e))
    out = console()
    print_renderables(out, text_renderables(report, limit=limit,
                                            metrics=table_metrics(out.width if out.is_terminal else None)))
    for out, render in ((json_out, to_json), (markdown, to_markdown), (html, to_html)):
        if out:
            write_report(out, render(report))
    raise typer.Exit(0 if report else 1)


def write_report(path: Path, text: str) -> None:
    """Write a report file, or exit 2 saying why it could not be written."""
    try:
        path.write_text(text)
    except OSError as e:
        _fail(f"cannot write {path}: {e.strerror or e}; check that its folder exists and is writable")


def _narrow_terminal() -> bool:
    """stdout is a terminal narrower than a full table needs."""
    from accuracy.report import WIDE
    from opband.terminal import console

    out = console()
    return out.is_terminal and out.width < WIDE


def _names(label: str | None, target: str | None, tags: list[str] | None):  # type: ignore[no-untyped-def]
    """The run's label, target name and tags from flags, or exit 2 saying what is wrong."""
    from accuracy.manifest import run_names

    try:
        return run_names(label, target, tags)
    except ValueError as e:
        _fail(str(e))


def _settings(**overrides: object):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from api.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        _fail("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors()))


def _open_db(settings):  # type: ignore[no-untyped-def]
    """The settings' database, refusing (exit 2, with what to do) one that cannot be reached or is
    not at the schema head."""
    from sqlalchemy.exc import DBAPIError

    from api.store.db import Database, SchemaOutOfDate, check_schema

    db = Database(settings)
    try:
        check_schema(db.engine)
    except SchemaOutOfDate as e:
        _fail(str(e))
    except DBAPIError as e:
        where = db.engine.url.render_as_string(hide_password=True)
        first = str(e.orig or e).strip().splitlines()[0][:300]
        _fail(f"cannot reach the database {where}: {first}. Is it running, and is OPBAND_DATABASE_URL right?")
    return db


def _check_port_free(host: str, port: int) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            _fail(f"cannot listen on {host}:{port}: {e.strerror}. Another `opband serve` may hold it: "
                  "pick another --port")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="bind address; beyond loopback needs OPBAND_AUTH=true")] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Run the service (API + dashboard at /) on embedded defaults: SQLite + a blob folder."""
    from api.store.db import upgrade
    from api.server import serve as run

    settings = _settings(host=host, port=port, data_dir=data_dir)
    _check_port_free(host, port)
    if settings.effective_database_url.startswith("sqlite"):  # the embedded default migrates itself
        upgrade(settings.effective_database_url)
    db = _open_db(settings)  # reachable and at the schema head, or exit 2 saying what to do
    database = db.engine.url.render_as_string(hide_password=True)
    db.dispose()
    typer.echo(f"opband serving on http://{host}:{port}/ (database {database}, blobs {settings.effective_store_url})")
    run(settings, migrate=False)


@app.command()
def upload(
    bundle: Annotated[Path, typer.Argument(help="bundle file")],
    server: Annotated[str, typer.Option(help="e.g. http://127.0.0.1:8000", envvar="OPBAND_SERVER")],
    project: Annotated[str, typer.Option(help="project name")],
    token: Annotated[Optional[str], typer.Option(envvar="OPBAND_TOKEN", help="project write token")] = None,
    label: Label = None,
    target: TargetName = None,
    tags: Tags = None,
) -> None:
    """Upload one bundle and print its row (the same bytes again give the same id); --label/--target/--tag name it."""
    from opband.client import Client, ClientError

    from opband.terminal import progress

    names = _names(label, target, tags)
    try:
        with progress(f"uploading {bundle.name}", bundle.stat().st_size if bundle.is_file() else None,
                      unit="bytes") as update:
            row = Client(server, token).upload(project, bundle, names=names, on_bytes=update)
    except (ClientError, OSError) as e:
        _fail(str(e))
    typer.echo(json.dumps(row, indent=2))
    if (names.target and row.get("target") != names.target) or (names.label and row.get("label") != names.label):
        typer.echo(f"note: these bytes were uploaded before (bundle {row['id']}, target {row.get('target')}, label "
                   f"{row.get('label')}); the same bytes are the same run, so the names given now are not applied",
                   err=True)


@app.command()
def gate(
    server: Annotated[str, typer.Option(help="opband server URL", envvar="OPBAND_SERVER")],
    project: Annotated[str, typer.Option(help="project name")],
    reference: Annotated[Path, typer.Option(help="reference bundle")],
    target: Annotated[Path, typer.Option(help="target bundle")],
    token: Annotated[Optional[str], typer.Option(envvar="OPBAND_TOKEN", help="project write token (when the server has auth on)")] = None,
    mode: Annotated[Mode, typer.Option(help=MODE_HELP)] = Mode.propagated,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the comparison")] = 600.0,
    junit: Annotated[Optional[Path], typer.Option(help="write JUnit XML (one testcase per op)")] = None,
    markdown: Annotated[Optional[Path], typer.Option(help="write a Markdown summary (for PR comments)")] = None,
    label: Label = None,
    target_name: Annotated[Optional[str], typer.Option("--target-name", help="the target run's target name, e.g. "
                           "ascend-910b/bf16: its series and regressions are kept under it (default: variant@device)")] = None,
    tags: Tags = None,
) -> None:
    """CI gate: exit 0 when every op is in band, 1 when one is out of band, 2 on usage/infrastructure errors."""
    from accuracy.report import print_renderables
    from opband.client import ClientError
    from opband.gate import EXIT_ERROR, run_gate
    from opband.terminal import console

    for p in (reference, target):
        if not p.is_file():
            _fail(f"{p} does not exist: capture it first with `opband capture`")
    try:
        code = run_gate(server, project, reference, target, token=token, mode=mode.value, timeout=timeout,
                        junit=junit, markdown=markdown, echo=typer.echo, names=_names(label, target_name, tags),
                        show=lambda items: print_renderables(console(), items), narrow=_narrow_terminal())
    except ClientError as e:
        typer.echo(f"error: {e}", err=True)
        code = EXIT_ERROR
    raise typer.Exit(code)


@app.command()
def demo(
    serve: Annotated[bool, typer.Option("--serve", metavar="", help="keep the server and dashboard up afterwards")] = False,
    data_dir: DataDir = Path(".opband/demo"),
    port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    targets: Annotated[str, typer.Option(help="comma-separated targets: variants, and fp32-bug (an injected kernel bug)")] = "bf16,int8,fp32-bug",
) -> None:
    """Capture a small Llama-style decoder (fp32 reference; bf16, int8 and a buggy fp32 target), upload, compare, show."""
    from opband.demo import run_demo

    raise typer.Exit(run_demo(data_dir, port=port, keep_serving=serve, targets=targets.split(","), echo=typer.echo))


@app.command()
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

    from accuracy.errors import OpbandError

    from accuracy.coverage import load_op_list

    try:
        ops = [*(ops or []), *(load_op_list(op_list) if op_list else [])]
        cfg = make_config(sweep_file, ops=ops, shapes=shapes, dtypes=dtypes, regimes=regimes,
                          from_bundle=str(from_bundle) if from_bundle else None, reference_device=reference_device,
                          target_device=target_device, seed=seed, max_shapes=max_shapes, exact_inputs=exact_inputs)
        result = run_sweep(cfg, out, reference=reference)
    except (CaseError, OpbandError, ValueError) as e:
        _fail(str(e))
    typer.echo(result.report.to_text())
    typer.echo(f"wrote {result.reference} and {', '.join(str(p) for p in result.targets.values())}")
    if json_out:
        write_report(json_out, result.report.to_json())
    raise typer.Exit(1 if check and not result.report else 0)


@app.command()
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
        _fail(str(e))
    typer.echo(report.to_text())
    if json_out:
        write_report(json_out, json.dumps(report.to_dict(), indent=2))


@import_app.command("msprobe")
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
        _fail(str(e))


@import_app.command("polygraphy")
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
        _fail(str(e))


def _echo_written(path: Path) -> None:
    from accuracy.bundle import Bundle

    b = Bundle.open(path)
    typer.echo(f"wrote {path} ({len(b.records)} records, {len(b.manifest.diagnostics)} diagnostics)")
    for d in b.manifest.diagnostics[:5]:
        typer.echo(f"  {d.key}: {d.message}")


@db_app.command("upgrade")
def db_upgrade(data_dir: DataDir = Path(".opband"), revision: str = "head") -> None:
    """Migrate the database (OPBAND_DATABASE_URL or the data dir's SQLite) to the latest schema."""
    from api.store.db import upgrade as run

    from sqlalchemy.exc import DBAPIError

    settings = _settings(data_dir=data_dir)
    where = settings.effective_database_url.split("@")[-1]
    try:
        run(settings.effective_database_url, revision)
    except DBAPIError as e:
        first = str(e.orig or e).strip().splitlines()[0][:300]
        _fail(f"cannot migrate the database {where}: {first}. Is it running and reachable, and are "
              "OPBAND_DATABASE_URL and its credentials right? Nothing was changed")
    typer.echo(f"database at {revision}: {where}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="the revision to go back to, e.g. 0003")],
                 data_dir: DataDir = Path(".opband")) -> None:
    """Migrate the database back to REVISION (before running an older opband); the data is kept."""
    from sqlalchemy.exc import DBAPIError

    from api.store.db import downgrade as run

    settings = _settings(data_dir=data_dir)
    where = settings.effective_database_url.split("@")[-1]
    try:
        run(settings.effective_database_url, revision)
    except DBAPIError as e:
        _fail(f"cannot migrate the database {where}: {str(e.orig or e).strip().splitlines()[0][:300]}")
    typer.echo(f"database at {revision}: {where}")


@token_app.command("create")
def token_create(
    project: Annotated[str, typer.Option(help="project the token is for (created if missing)")],
    read_only: Annotated[bool, typer.Option("--read-only", metavar="", help="may read, not write")] = False,
    name: Annotated[Optional[str], typer.Option(help="a label to recognise it by")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Create a project token and print it once (only its hash is stored)."""
    from api.auth import create_token

    db = _open_db(_settings(data_dir=data_dir))
    typer.echo(create_token(db, project, read_only=read_only, name=name))


@app.command()
def worker(
    data_dir: DataDir = Path(".opband"),
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535,
        help="serve Prometheus /metrics of this worker (jobs run, their durations, jobs by status) on this "
             "port; 0 picks a free one. Default: OPBAND_WORKER_METRICS_PORT, else off")] = None,
) -> None:
    """Run comparison jobs from the shared database until interrupted (scale-out workers)."""
    import signal

    from api.jobs.comparisons import run_worker_forever
    from api.observability import configure_logging, serve_worker_metrics
    from api.store.blobs import make_store

    settings = _settings(data_dir=data_dir)
    configure_logging(settings)
    db = _open_db(settings)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))  # finish the job, then exit
    typer.echo(f"opband worker on {db.engine.url.render_as_string(hide_password=True)}", err=True)
    port = metrics_port if metrics_port is not None else settings.worker_metrics_port
    if port is not None:
        try:
            bound = serve_worker_metrics(db, settings.worker_metrics_host, port)
        except OSError as e:
            typer.echo(f"error: cannot serve worker metrics on {settings.worker_metrics_host}:{port}: {e.strerror}. "
                       "Pick another --metrics-port (0 = any free port)", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"worker metrics at http://{settings.worker_metrics_host}:{bound}/metrics", err=True)
    try:
        run_worker_forever(db, make_store(settings.effective_store_url, settings.s3_endpoint_url), settings,
                           should_stop=lambda: bool(stopping))
    except KeyboardInterrupt:
        pass


@token_app.command("list")
def token_list(
    project: Annotated[Optional[str], typer.Option(help="only this project's tokens")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """List tokens (id, project, read-only, name, created); the secrets themselves are never stored."""
    from rich.console import Console
    from rich.table import Table

    from api.auth import list_tokens

    db = _open_db(_settings(data_dir=data_dir))
    table = Table("id", "project", "access", "name", "created")
    for tok, name in list_tokens(db, project):
        table.add_row(str(tok.id), name, "read-only" if tok.read_only else "write", tok.name or "",
                      tok.created_at.strftime("%Y-%m-%d %H:%M"))
    Console().print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(help="the id `opband token list` shows")],
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    from api.auth import revoke_token

    if not revoke_token(_open_db(_settings(data_dir=data_dir)), token_id):
        _fail(f"no token with id {token_id}: see `opband token list`")
    typer.echo(f"token {token_id} revoked")


@app.command()
def gc(
    apply: Annotated[bool, typer.Option("--apply", metavar="", help="remove what is found (default: only report)")] = False,
    grace_seconds: Annotated[float, typer.Option(help="leave blobs younger than this (uploads in flight)")] = 600,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Find blobs no bundle names, bundles whose blob is gone and stale upload temp files; --apply removes them."""
    from api.store.blobs import make_store
    from api.store.maintenance import gc as run_gc

    settings = _settings(data_dir=data_dir)
    store = make_store(settings.effective_store_url, settings.s3_endpoint_url)
    temp = getattr(store, "temp_dir", None)
    report = run_gc(_open_db(settings), store, apply=apply, grace_seconds=grace_seconds,
                    temp_dir=temp() if temp else None, stale_seconds=max(2 * settings.upload_idle_seconds, 60))
    typer.echo(json.dumps(report.as_dict(), indent=2))
    if not apply and (report.orphan_blobs or report.rows_without_blob or report.partials):
        typer.echo("dry run: nothing removed; run again with --apply to remove these", err=True)


project_app = typer.Typer(help="Whole projects: export to one file, import into any database (backup, SQLite -> "
                                "PostgreSQL), retention.", no_args_is_help=True)
app.add_typer(project_app, name="project")


def _store(settings):  # type: ignore[no-untyped-def]
    from api.store.blobs import make_store

    return make_store(settings.effective_store_url, settings.s3_endpoint_url)


@project_app.command("export")
def project_export(
    name: Annotated[str, typer.Argument(help="the project")],
    out: Annotated[Path, typer.Option("-o", "--out", help="the export file to write (a tar)")],
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Write a project's rows and blobs to one file (tokens are not exported: create new ones after import)."""
    from api.errors import ServiceError
    from api.store.transfer import export_project

    settings = _settings(data_dir=data_dir)
    try:
        counts = export_project(_open_db(settings), _store(settings), name, out)
    except ServiceError as e:
        _fail(str(e))
    typer.echo(json.dumps({"project": name, "file": str(out), "rows": counts}, indent=2))


@project_app.command("import")
def project_import(
    source: Annotated[Path, typer.Argument(help="a file from `opband project export`")],
    rename: Annotated[Optional[str], typer.Option("--as", help="import under this name")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Load an exported project into this database and blob store (run `opband db upgrade` first)."""
    from api.errors import ServiceError
    from api.store.transfer import import_project

    settings = _settings(data_dir=data_dir)
    try:
        counts = import_project(_open_db(settings), _store(settings), source, rename)
    except ServiceError as e:
        _fail(str(e))
    typer.echo(json.dumps({"file": str(source), "rows": counts}, indent=2))


@project_app.command("retention")
def project_retention(
    name: Annotated[str, typer.Argument(help="the project")],
    keep_runs: Annotated[int, typer.Option(min=0, help="per target name, keep the newest this many comparisons")] = 50,
    keep_days: Annotated[float, typer.Option(min=0, help="and everything younger than this")] = 90,
    apply: Annotated[bool, typer.Option("--apply", metavar="", help="delete (default: only report)")] = False,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Let old comparisons and bundles go; never what a baseline holds or a regression names."""
    from sqlalchemy import select

    from api.store.models import Project
    from api.store.retention import retention

    settings = _settings(data_dir=data_dir)
    db = _open_db(settings)
    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == name))
    if project is None:
        _fail(f"project {name!r} does not exist")
    typer.echo(json.dumps(retention(db, _store(settings), project, keep_runs, keep_days, apply).as_dict(), indent=2))


def main() -> None:
    app(prog_name="opband")


if __name__ == "__main__":
    sys.exit(main())
