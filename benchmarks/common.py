"""Shared by the benchmarks: machine facts, medians, and writing JSON + a markdown table."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_results(name: str, payload: dict, table: list[list[str]], header: list[str], notes: str = "") -> Path:
    """Write ``results/NAME.json`` and ``results/NAME.md`` with commit, machine and command line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit(), "machine": machine(), "command": " ".join(shlex.quote(a) for a in sys.argv)}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, **payload}, indent=2) + "\n")
    lines = [
        f"# {name}",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: {meta['commit']}",
        f"- machine: {meta['machine']}",
        "",
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    if notes:
        lines += ["", notes]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
