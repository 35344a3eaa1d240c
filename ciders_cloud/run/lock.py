"""One writer per run folder: :func:`ciders_edge.formats.lock.folder_lock` on ``RUN/.lock``.

``aggregate``, ``distill`` and ``serve`` all read the server state, work for a
while and commit a new one; the lock keeps a second one out, and its holder cleans up after a
killed one (interrupted swaps, staging folders).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ciders_cloud.run.folder import RunFolder
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.lock import folder_lock

__all__ = ["run_lock", "claim_new_run"]


@contextmanager
def run_lock(run_dir: str | Path, command: str) -> Iterator[None]:
    """Hold the run's lock for the block, or fail at once naming the command that holds it."""
    path = RunFolder(run_dir).lock
    if not path.parent.is_dir():
        raise StateError(f"{path.parent}: not a run folder; create one with `ciders-cloud prepare`")
    with folder_lock(path.parent, command):
        yield


@contextmanager
def claim_new_run(out: Path) -> Iterator[None]:
    """Claim ``out`` for one ``prepare``: made (an empty folder) if missing, and ``flock``-ed for the
    block, so a second ``prepare --out`` of the same folder is refused at once, not after its
    bootstrap (it used to fail at the end with ``OSError [Errno 39]``). A claim this call made is
    removed again if the block fails; a killed prepare leaves an empty folder the next one takes."""
    created = _make_dir(out)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = f"{out} is being written by another prepare; wait for it or choose another --out"
            raise StateError(busy) from None
        if os.stat(out).st_ino != os.fstat(fd).st_ino or any(out.iterdir()):  # the other one finished meanwhile
            raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")
        try:
            yield
        except BaseException:
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            raise
    finally:
        os.close(fd)


def _make_dir(out: Path) -> bool:
    """Make ``out`` (and its parents); whether this call made it (False: it was there)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out.mkdir()
    except FileExistsError:
        return False
    return True
