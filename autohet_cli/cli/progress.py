"""A rich progress bar on stderr that domain code reports into through a callback."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(title: str, *, enabled: bool = True) -> Iterator[Callable[[float, str], None]]:
    """A transient bar where stderr is a terminal; elsewhere (a script, a CI log) it
    would draw nothing, so rich is not even imported (issue 32: 50 ms of every
    ``autohet plan``)."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda _f, _m: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(title, total=1.0, detail="")

        def report(fraction: float, detail: str) -> None:
            bar.update(task, completed=fraction, detail=detail[:60])

        yield report
