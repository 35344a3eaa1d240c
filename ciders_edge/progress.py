"""Progress on stderr (rich), so stdout stays clean for ``--json`` summaries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["console", "status", "progress_bar", "LazyBar"]

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
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"),
        console=console,
    )


class LazyBar:
    """A progress bar that appears at its first update, so errors raised before work starts
    print alone, without an empty bar above them."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._progress: Progress | None = None
        self._task = None

    def update(self, total: int | None, metrics: str, completed: int | None = None) -> None:
        """One more step done (or ``completed`` steps of a new ``total``, for a bar reused per phase)."""
        if self._progress is None:
            self._progress = progress_bar()
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=total, metrics="")
        if completed is None:
            self._progress.update(self._task, advance=1, total=total, metrics=metrics)
        else:
            self._progress.update(self._task, completed=completed, total=total, metrics=metrics)

    def __enter__(self) -> LazyBar:
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
