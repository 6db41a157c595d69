"""A rich progress bar on stderr that domain code reports into through a callback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(title: str, *, enabled: bool = True) -> Iterator[Callable[[float, str], None]]:
    if not enabled:
        yield lambda _f, _m: None
        return
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
