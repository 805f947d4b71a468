"""The service side of the CLI: ``opband serve``, ``worker``, ``upload``, ``gate`` and ``demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opband.cli_common import (
    MODE_HELP, DataDir, Label, Mode, Tags, TargetName, fail, names_from_flags, narrow_terminal, open_db,
    settings_from_flags,
)


def _check_port_free(host: str, port: int) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            fail(f"cannot listen on {host}:{port}: {e.strerror}. Another `opband serve` may hold it: "
                 "pick another --port")


def serve(
    host: Annotated[str, typer.Option(help="bind address; beyond loopback needs OPBAND_AUTH=true")] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Run the service (API + dashboard at /) on embedded defaults: SQLite + a blob folder."""
    from api.store.db import upgrade
    from api.server import serve as run

    settings = settings_from_flags(host=host, port=port, data_dir=data_dir)
    _check_port_free(host, port)
    if settings.effective_database_url.startswith("sqlite"):  # the embedded default migrates itself
        upgrade(settings.effective_database_url)
    db = open_db(settings)  # reachable and at the schema head, or exit 2 saying what to do
    database = db.engine.url.render_as_string(hide_password=True)
    db.dispose()
    typer.echo(f"opband serving on http://{host}:{port}/ (database {database}, blobs {settings.effective_store_url})")
    run(settings, migrate=False)


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

    names = names_from_flags(label, target, tags)
    try:
        with progress(f"uploading {bundle.name}", bundle.stat().st_size if bundle.is_file() else None,
                      unit="bytes") as update:
            row = Client(server, token).upload(project, bundle, names=names, on_bytes=update)
    except (ClientError, OSError) as e:
        fail(str(e))
    typer.echo(json.dumps(row, indent=2))
    if (names.target and row.get("target") != names.target) or (names.label and row.get("label") != names.label):
        typer.echo(f"note: these bytes were uploaded before (bundle {row['id']}, target {row.get('target')}, label "
                   f"{row.get('label')}); the same bytes are the same run, so the names given now are not applied",
                   err=True)


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
            fail(f"{p} does not exist: capture it first with `opband capture`")
    try:
        code = run_gate(server, project, reference, target, token=token, mode=mode.value, timeout=timeout,
                        junit=junit, markdown=markdown, echo=typer.echo,
                        names=names_from_flags(label, target_name, tags), show=lambda items: print_renderables(console(), items), narrow=narrow_terminal())
    except ClientError as e:
        typer.echo(f"error: {e}", err=True)
        code = EXIT_ERROR
    raise typer.Exit(code)


def demo(
    serve: Annotated[bool, typer.Option("--serve", metavar="", help="keep the server and dashboard up afterwards")] = False,
    data_dir: DataDir = Path(".opband/demo"),
    port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    targets: Annotated[str, typer.Option(help="comma-separated targets: variants, and fp32-bug (an injected kernel bug)")] = "bf16,int8,fp32-bug",
) -> None:
    """Capture a small Llama-style decoder (fp32 reference; bf16, int8 and a buggy fp32 target), upload, compare, show."""
    from opband.demo import run_demo

    raise typer.Exit(run_demo(data_dir, port=port, keep_serving=serve, targets=targets.split(","), echo=typer.echo))


def worker(
    data_dir: DataDir = Path(".opband"),
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535,
        help="serve Prometheus /metrics of this worker (jobs run, their durations, jobs by status) on this "
             "port; 0 picks a free one. Default: OPBAND_WORKER_METRICS_PORT, else off")] = None,
) -> None:
    """Run comparison jobs from the shared database until interrupted (scale-out workers)."""
    import signal

    from api.jobs.comparisons import run_worker_forever
    from api.observability import configure_logging
    from api.store.blobs import store_from_settings

    settings = settings_from_flags(data_dir=data_dir)
    configure_logging(settings)
    db = open_db(settings)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))  # finish the job, then exit
    typer.echo(f"opband worker on {db.engine.url.render_as_string(hide_password=True)}", err=True)
    _serve_worker_metrics(db, settings, metrics_port if metrics_port is not None else settings.worker_metrics_port)
    try:
        run_worker_forever(db, store_from_settings(settings), settings,
                           should_stop=lambda: bool(stopping))
    except KeyboardInterrupt:
        pass


def _serve_worker_metrics(db, settings, port: int | None) -> None:  # type: ignore[no-untyped-def]
    """Serve the worker's Prometheus /metrics on ``port`` (None: off), or exit 2 when it cannot listen."""
    from api.observability import serve_worker_metrics

    if port is None:
        return
    try:
        bound = serve_worker_metrics(db, settings.worker_metrics_host, port)
    except OSError as e:
        typer.echo(f"error: cannot serve worker metrics on {settings.worker_metrics_host}:{port}: {e.strerror}. "
                   "Pick another --metrics-port (0 = any free port)", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"worker metrics at http://{settings.worker_metrics_host}:{bound}/metrics", err=True)
