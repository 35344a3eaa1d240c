"""The CLIs' tables in a narrow terminal (60 columns): every key value (a name, a file, a row label) appears whole.

The commands run through their real entry point (``python -m ciders_edge``) with ``COLUMNS=60``, as a
user's narrow terminal or a pipe would; each table's ``--json`` twin holds the same keys.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from rich.console import Console

from ciders_edge.cli_utils import key_table
from ciders_edge.profiles import list_profiles

NARROW = {**os.environ, "COLUMNS": "60", "HF_HUB_OFFLINE": "1"}


def edge(*args: str) -> str:
    """``ciders-edge ARGS`` at 60 columns: stdout and stderr (the tables go to stderr)."""
    out = _run(args)
    return out.stdout + out.stderr


def edge_json(*args: str) -> dict:
    """The ``--json`` twin: the summary on stdout's last line."""
    return json.loads(_run([*args, "--json"]).stdout.strip().splitlines()[-1])


def _run(args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ciders_edge", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=NARROW, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def whole(text: str, values: list[str]) -> None:
    lines = text.splitlines()
    for value in values:
        assert any(value in line for line in lines), f"{value!r} is cut in:\n{text}"


def test_key_columns_stay_whole_at_any_width():
    rows = [("jetson-agx-orin-64gb", "a long value that must fold " * 3), ("cpu", "x")]
    for width in (20, 40, 80):
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(key_table(("name", "what"), rows), crop=False)
        whole(console.export_text(), ["jetson-agx-orin-64gb", "cpu"])


def test_profiles_names_whole_at_60_columns():
    names = [p.name for p in list_profiles()]
    whole(edge("profiles"), names)
    twin = edge_json("profiles")
    assert [p["name"] for p in twin["profiles"]] == names
    whole(edge("profiles", "jetson-agx-orin-64gb"), ["jetson-agx-orin-64gb", "memory_budget_gb"])


def test_evaluate_labels_and_file_names_whole_at_60_columns(tiny_run, demo_dir):
    run, _ = tiny_run
    bundle = run / "bundles" / "cpu-laptop" / "round-0000"
    files = [demo_dir / family / "eval.jsonl" for family in ("dates", "strings", "arithmetic")]
    args = ["evaluate", "--bundle", bundle, "--global", "--limit", "1", "--max-new-tokens", "2"]
    args += [a for f in files for a in ("--data", f)]
    twin = edge_json(*args)
    assert [r["data"] for r in twin["results"]] == list(map(str, files))
    label = "AdapFu" if twin["results"][0]["backbone"] == "full" else "AdapEmu"
    whole(edge(*args), [f"{label}, global messenger", *(f"{f.parent.name}/{f.name}" for f in files)])


def test_bench_runtime_whole_at_60_columns(tiny_run):
    run, _ = tiny_run
    bundle = run / "bundles" / "cpu-laptop" / "round-0000"
    args = ["bench", "--bundle", bundle, "--runtimes", "torch", "--repeats", "1", "--new-tokens", "2"]
    args += ["--train-steps", "0"]
    whole(edge(*args), ["runtime", "torch", "ref"])
    assert [r["runtime"] for r in edge_json(*args)["runtimes"]] == ["torch"]
