"""The way a run folder takes through the code, and what a command loads: measures that keep a round's path short.

:func:`run_folder_way` records, while a call runs, each project module (``ciders_cloud``, ``ciders_edge``,
``export``) whose function is entered with the run folder in hand: an argument that is the run folder or a
path inside it (a ``Path`` or a ``str``), or a ``RunFolder`` rooted there. Consecutive entries into one module
are one step. :func:`climbs` counts the steps that climb back to a higher package: from a module to one on a
higher floor, the floors being docs/layout.md's cloud floors with the edge below them all (inside the edge,
or inside one cloud floor, no step climbs). A driver that reads the folder once and hands data down climbs
seldom; one that passes the folder to helper after helper, each reading it again, climbs at every helper.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent
PACKAGES = ("ciders_cloud", "ciders_edge", "export")


def _module(filename: str) -> str | None:
    """The project module a code object's file is, or ``None`` (a library's, ``<string>``)."""
    path = Path(filename)
    if not path.is_relative_to(ROOT) or path.suffix != ".py":
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] not in PACKAGES:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in_folder(value: Any, root: Path) -> bool:
    from ciders_cloud.run.folder import RunFolder

    if isinstance(value, RunFolder):
        return Path(value.root) == root
    if isinstance(value, str | Path) and len(str(value)) < 4096:
        path = Path(value)
        return path == root or path.is_relative_to(root)
    return False


def run_folder_way(call: Callable[[], Any], run_dir: Path) -> tuple[Any, list[str]]:
    """``call()``'s result and the run folder's way through it: the modules entered with ``run_dir`` in hand,
    one step per run of entries into the same module (module code run by an import is no step)."""
    root, way = Path(run_dir), []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>":
            return
        if (module := _module(frame.f_code.co_filename)) is None or (way and way[-1] == module):
            return
        code, local = frame.f_code, frame.f_locals
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(_in_folder(local.get(name), root) for name in arguments):
            way.append(module)

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, way


def cloud_floors() -> list[str]:
    """docs/layout.md's floor order of the cloud, bottom first."""
    line = next(ln for ln in (ROOT / "docs" / "layout.md").read_text().splitlines() if ln.startswith("Floors,"))
    return re.findall(r"`(\w+)`", line)


def _floor(module: str, floors: list[str]) -> int:
    """The edge is floor -1, under the cloud's ground floor ``run`` (0); a cloud module its subpackage's floor."""
    parts = module.split(".")
    if parts[0] != "ciders_cloud":
        return -1
    return floors.index(parts[1]) if len(parts) > 1 and parts[1] in floors else len(floors)


def climbs(way: list[str]) -> list[str]:
    """The way's steps that climb back to a higher package, as ``"from -> to"``."""
    floors = cloud_floors()
    return [f"{a} -> {b}" for a, b in zip(way, way[1:], strict=False) if _floor(b, floors) > _floor(a, floors)]


def modules_loaded(code: str) -> list[str]:
    """The project modules (packages' ``__init__`` included) in ``sys.modules`` after ``code`` runs in a fresh
    interpreter (a ``SystemExit`` is the end of a CLI's ``--help``)."""
    probe = (
        "import sys\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "except SystemExit:\n    pass\n"
        f"print({_MARK!r}, *sorted(m for m in sys.modules if m.split('.')[0] in {PACKAGES!r}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.rpartition(_MARK)[2].split()


_MARK = "-- modules loaded:"
