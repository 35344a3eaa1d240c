"""One writer per run folder: :func:`ciders_edge.formats.lock.folder_lock` on ``RUN/.lock``.

``aggregate``, ``distill``, ``hypergradient`` and ``serve`` all read the server state, work for a
while and commit a new one; the lock keeps a second one out, and its holder cleans up after a
killed one (interrupted swaps, staging folders).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ciders_cloud.run_folder import RunFolder
from ciders_edge.errors import StateError
from ciders_edge.formats.lock import folder_lock

__all__ = ["run_lock"]


@contextmanager
def run_lock(run_dir: str | Path, command: str) -> Iterator[None]:
    """Hold the run's lock for the block, or fail at once naming the command that holds it."""
    path = RunFolder(run_dir).lock
    if not path.parent.is_dir():
        raise StateError(f"{path.parent}: not a run folder; create one with `ciders-cloud prepare`")
    with folder_lock(path.parent, command):
        yield
