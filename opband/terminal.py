"""The terminal as the CLI sees it: colour and width come from it, progress bars only on a TTY.

In a CI log (stdout or stderr not a terminal) output is plain: no colour, no progress redraws and no
line folded to a guessed width; ``NO_COLOR`` and ``FORCE_COLOR`` are honoured (rich reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn,
    TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn,
)

#: the width of a line when the output is not a terminal: wide enough that no table cell is folded
PLAIN_WIDTH = 4000

#: ``update(completed, total=None, status=None)``: where a long step has got to
Update = Callable[..., None]


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width and colours on a TTY; plain and unwrapped
    otherwise."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=PLAIN_WIDTH, no_color=True, highlight=False, soft_wrap=True)


def _noop(*_args: object, **_kwargs: object) -> None:
    return None


@contextmanager
def progress(description: str, total: float | None = None, *, unit: str = "items") -> Iterator[Update]:
    """A progress bar on stderr while the block runs, only when stderr is a terminal (else a no-op).

    ``unit="bytes"`` shows sizes and speed; ``unit="status"`` a spinner with the elapsed time and the
    latest ``status`` (e.g. a server-side job's state); otherwise a bar of ``unit`` (pulsing until the
    total is known).
    """
    err = Console(stderr=True)
    if not err.is_terminal:
        yield _noop
        return
    if unit == "status":
        columns = [SpinnerColumn(), TextColumn("{task.description}"), TextColumn("[dim]{task.fields[status]}"),
                   TimeElapsedColumn()]
    elif unit == "bytes":
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn()]
    else:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                   TimeRemainingColumn()]
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total, status="")

        def update(completed: float | None = None, total: float | None = None, status: str | None = None) -> None:
            fields = {"status": status} if status is not None else {}
            bar.update(task, completed=completed, total=total if total is not None else bar.tasks[0].total, **fields)

        yield update
