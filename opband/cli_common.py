"""What the ``opband`` subcommands share: option types, choice enums, and the helpers that turn a
library error into ``error: ...`` on stderr and exit code 2."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

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


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def write_report(path: Path, text: str) -> None:
    """Write a report file, or exit 2 saying why it could not be written."""
    try:
        path.write_text(text)
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror or e}; check that its folder exists and is writable")


def narrow_terminal() -> bool:
    """stdout is a terminal narrower than a full table needs."""
    from accuracy.report import WIDE
    from opband.terminal import console

    out = console()
    return out.is_terminal and out.width < WIDE


def names_from_flags(label: str | None, target: str | None, tags: list[str] | None):  # type: ignore[no-untyped-def]
    """The run's label, target name and tags from flags, or exit 2 saying what is wrong."""
    from accuracy.manifest import run_names

    try:
        return run_names(label, target, tags)
    except ValueError as e:
        fail(str(e))


def settings_from_flags(**overrides: object):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from api.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        fail("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors()))


def open_db(settings):  # type: ignore[no-untyped-def]
    """The settings' database, refusing (exit 2, with what to do) one that cannot be reached or is
    not at the schema head."""
    from sqlalchemy.exc import DBAPIError

    from api.store.db import Database, SchemaOutOfDate, check_schema

    db = Database(settings)
    try:
        check_schema(db.engine)
    except SchemaOutOfDate as e:
        fail(str(e))
    except DBAPIError as e:
        where = db.engine.url.render_as_string(hide_password=True)
        first = str(e.orig or e).strip().splitlines()[0][:300]
        fail(f"cannot reach the database {where}: {first}. Is it running, and is OPBAND_DATABASE_URL right?")
    return db


