"""One writer per folder: an exclusive ``flock`` on a lock file inside it.

A run folder (``aggregate``, ``distill``, ``serve``...) and an edge's state folder (``train``) are
each read, worked on for a while, and committed as a new state; two writers at once would each
commit their own and lose the other's. The kernel drops a ``flock`` when its process dies, so a
killed command never leaves a stale lock: the file stays, the lock does not. The file records the
holder's PID and command for the message. Holding the lock, a command also finishes the swaps and
removes the staging folders and temp files that a killed writer left.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import remove_stale_staging

__all__ = ["folder_lock", "LOCK_FILE"]

LOCK_FILE = ".lock"


@contextmanager
def folder_lock(folder: str | Path, command: str) -> Iterator[None]:
    """Hold ``folder``'s lock for the block, or fail at once naming the command that holds it."""
    folder = Path(folder)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateError(f"{folder}: in use by {_holder(fd)}; wait for it to finish, then run again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command, "since": time.time()}).encode(), 0)
        remove_stale_staging(folder)  # no writer can be running: what a killed one left is garbage
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
