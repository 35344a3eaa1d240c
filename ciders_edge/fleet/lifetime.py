"""Flower processes that end with the command that started them, even when it is killed with -9.

``serve`` and ``join`` stop their Flower processes on the way out, but a SIGKILL gives them no way
out: the SuperLink, the SuperNode and what they started would live on, holding the run's ports.
On Linux a process can ask the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``),
and the request survives ``exec``. :func:`guarded` wraps a command in this module, which makes
that request and then executes the command in its place:

    python -m ciders_edge.fleet.lifetime PARENT_PID -- COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["guarded", "end_with_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def guarded(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it receives SIGTERM when this process dies (as it is, off Linux)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-m", __name__, str(os.getpid()), "--", *cmd]


def end_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask for ``sig`` when our parent dies; exit now if ``parent`` (our parent at fork) is gone already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the request: nobody would signal us
        raise SystemExit(f"the parent process {parent} has exited")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m ciders_edge.fleet.lifetime PARENT_PID -- COMMAND [ARGS...]")
    end_with_parent(int(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
