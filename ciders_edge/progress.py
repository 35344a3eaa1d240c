"""Progress on stderr (rich), so stdout stays clean for ``--json`` summaries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["console", "status", "progress_bar"]

console = Console(stderr=True)


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner for one long step of unknown length."""
    with console.status(message):
        yield
    console.print(f"[green]✓[/] {message}")


def progress_bar() -> Progress:
    """A bar with a live metrics field: ``progress.update(task, advance=1, metrics="loss=…")``."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[metrics]}"),
        console=console,
    )
