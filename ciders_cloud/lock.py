"""One writer per run folder: an exclusive ``flock`` on ``RUN/.lock``.

``aggregate``, ``distill``, ``hypergradient`` and ``serve`` all read the server state, work for a
while and commit a new one; two at once would each commit their own round and lose the other's.
The kernel drops a ``flock`` when its process dies, so a killed command never leaves a stale lock:
the file stays, the lock does not. The file records the holder's PID and command for the message.
Holding the lock, a command also removes the staging folders and temp files a killed one left.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ciders_cloud.run_folder import RunFolder
from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import remove_stale_staging

__all__ = ["run_lock"]


@contextmanager
def run_lock(run_dir: str | Path, command: str) -> Iterator[None]:
    """Hold the run's lock for the block, or fail at once naming the command that holds it."""
    path = RunFolder(run_dir).lock
    if not path.parent.is_dir():
        raise StateError(f"{path.parent}: not a run folder; create one with `ciders-cloud prepare`")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateError(f"{path.parent}: in use by {_holder(fd)}; wait for it to finish, then run again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command, "since": time.time()}).encode(), 0)
        remove_stale_staging(path.parent)  # no writer can be running: what a killed one left is garbage
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%H:%M:%S", time.localtime(info["since"]))
        return f"`{info['command']}` (PID {info['pid']}, since {since})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another command"
