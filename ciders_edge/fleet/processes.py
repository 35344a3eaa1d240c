"""Flower's programs as both sides start them: from this Python's environment, with their own home,
and stopped on the way out when a service manager sends SIGTERM (``join`` here, ``ciders-cloud serve``)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

from ciders_edge.errors import ConfigError

__all__ = ["flower_tool", "flower_env", "flower_processes", "stop_on_sigterm"]


def flower_env(home: Path) -> dict[str, str]:
    """The environment for Flower's programs: its home, and this environment's ``bin`` first on
    PATH, since they start their helpers (``flwr-clientapp``, ...) by bare name."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "FLWR_HOME": str(home.resolve()), "PATH": path}


def flower_processes(home: Path) -> dict[int, str]:
    """``{pid: command line}`` of the live processes whose FLWR_HOME is ``home``: everything a serve or
    join of that home started (Flower's own helpers too, whatever session or process group they put
    themselves in). Linux's /proc only; elsewhere none are found."""
    want = f"FLWR_HOME={home.resolve()}".encode()
    found = {}
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit():
            continue
        try:
            if want in (proc / "environ").read_bytes().split(b"\0"):  # a zombie's environ reads empty
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def stop_on_sigterm() -> None:
    """Turn SIGTERM (systemd, docker stop, kill) into KeyboardInterrupt, so the Flower processes we
    started are stopped on the way out instead of left running."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def flower_tool(name: str) -> str:
    """A Flower executable from this Python's environment."""
    sibling = Path(sys.executable).parent / name
    found = str(sibling) if sibling.is_file() else shutil.which(name)
    if not found:
        raise ConfigError(f"{name} not found: install the toolkit (it depends on flwr) in this environment")
    return found
