"""The ``opband`` command line: the command tree. Each subcommand parses flags and makes one library call;
the commands live by concept in ``cli_runs`` (capture, compare), ``cli_prescribe`` (prescribe), ``cli_service`` (serve, upload, gate, demo,
worker), ``cli_opspace`` (sweep, coverage, import) and ``cli_admin`` (db, token, gc, project)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from opband import cli_admin, cli_opspace, cli_prescribe, cli_runs, cli_service

app = typer.Typer(help="opband: find the operator that lost accuracy on new hardware or in low precision.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema (alembic migrations).", no_args_is_help=True)
token_app = typer.Typer(help="Project tokens for the service's auth.", no_args_is_help=True)
import_app = typer.Typer(help="Import peers' dumps (msprobe, Polygraphy) as bundles for compare, bands and the service.",
                         no_args_is_help=True)
project_app = typer.Typer(help="Whole projects: export to one file, import into any database (backup, SQLite -> "
                                "PostgreSQL), retention.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(import_app, name="import")
app.add_typer(token_app, name="token")
app.add_typer(project_app, name="project")


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


# `opband --help` lists the commands in this order, then the groups in add_typer order above.
for command in (cli_runs.capture, cli_runs.compare, cli_prescribe.prescribe, cli_service.serve, cli_service.upload, cli_service.gate,
                cli_service.demo, cli_opspace.sweep, cli_opspace.coverage, cli_service.worker, cli_admin.gc):
    app.command()(command)
db_app.command("upgrade")(cli_admin.db_upgrade)
db_app.command("downgrade")(cli_admin.db_downgrade)
import_app.command("msprobe")(cli_opspace.import_msprobe)
import_app.command("polygraphy")(cli_opspace.import_polygraphy)
token_app.command("create")(cli_admin.token_create)
token_app.command("list")(cli_admin.token_list)
token_app.command("revoke")(cli_admin.token_revoke)
project_app.command("export")(cli_admin.project_export)
project_app.command("import")(cli_admin.project_import)
project_app.command("retention")(cli_admin.project_retention)


def main() -> None:
    app(prog_name="opband")


if __name__ == "__main__":
    sys.exit(main())
