"""Named crash points, so fault tests kill a command at an exact step instead of after a sleep.

A test sets ``CIDERS_CRASH_AT=<point>`` in a command's environment; when the command reaches
:func:`crash_point` with that name it dies by SIGKILL, as a power cut or the OOM killer would end it.
Points are ``<step>:<target folder or file name>``, for example ``swapped:server``: the run's server
state moved into place, its previous copy not yet removed. Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_ENV", "crash_point"]

CRASH_ENV = "CIDERS_CRASH_AT"


def crash_point(name: str) -> None:
    """Die here, at once and without cleanup, if the environment names this point."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
