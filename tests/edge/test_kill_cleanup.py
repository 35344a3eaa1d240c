"""Issue 59, items 1-2: `train` and `export` killed (SIGKILL at a named step) leave staging folders and temp
files named for their owner; the next write in that folder removes a dead owner's, never a live one's; a
rerun of a killed `train` leaves the state's metrics.jsonl with exactly the round's lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ciders_edge.faults import CRASH_ENV
from ciders_edge.formats.atomic import owner_alive, staging_dir, sweep_dead_staging, write_bytes
from ciders_edge.formats.client_state import ClientState

BIN = Path(sys.executable).parent


def _run(args: list, crash: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({CRASH_ENV: crash} if crash else {})}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".lock")


def test_a_dead_owners_staging_goes_at_the_next_write_and_a_live_ones_stays(tmp_path):
    live = staging_dir(tmp_path / "out")  # this process: alive
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = Path(f"/proc/{sleeper.pid}/stat").read_text().rpartition(")")[2].split()[19]
    other = tmp_path / f".out.{sleeper.pid}-{start}.abcdefgh"  # another live process's
    other.mkdir()
    sleeper.kill()
    sleeper.wait()
    dead = tmp_path / f".out.{sleeper.pid}-{start}.ijklmnop.tmp"
    dead.write_text("half a packet")
    legacy = tmp_path / ".out.qrstuvwx"  # from before owners were recorded: nobody knows
    legacy.mkdir()
    assert not owner_alive(f"{sleeper.pid}-{start}") and owner_alive(live.name.split(".")[2])
    write_bytes(tmp_path / "other.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, legacy.name, "other.json"])
    assert sweep_dead_staging(tmp_path) == []


def test_a_reused_pid_is_not_the_owner(tmp_path):
    mine = staging_dir(tmp_path / "out").name.split(".")[2]
    pid, start = mine.split("-")
    assert owner_alive(mine) and not owner_alive(f"{pid}-{int(start) + 1}")


def _train_args(tiny_run, demo_dir, tmp_path, out: str = "p.pkt") -> list:
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    data = demo_dir / "units" / "train.jsonl"
    return [BIN / "ciders-edge", "train", "--bundle", bundle, "--data", data, "--state", tmp_path / "s"] + [
        "--out", tmp_path / out, "--client-id", "k", "--steps", "3",
    ]  # fmt: skip


@pytest.mark.parametrize("point", ["committed", "published"])
def test_a_train_killed_after_its_commit_ends_with_the_rounds_lines_once(tiny_run, demo_dir, tmp_path, point):
    """Killed after the state's commit (the packet's bytes only in a temp file), or after the packet is
    published: the rerun publishes it (or says the round is trained), removes the temp file, and the
    metrics log holds the round's 3 lines, once."""
    args = _train_args(tiny_run, demo_dir, tmp_path)
    killed = _run(args, f"{point}:s")
    assert killed.returncode == -9, killed.stderr
    log = tmp_path / "s" / "metrics.jsonl"
    assert not log.exists()
    if point == "committed":
        assert [n for n in _hidden(tmp_path) if n.startswith(".p.pkt.")], "the killed train left its temp file"
    again = _run(args)
    if point == "committed":
        assert again.returncode == 0 and "its packet never left" in again.stdout + again.stderr
    else:
        assert again.returncode == 1 and "already trained round 0" in again.stderr
    assert _hidden(tmp_path) == [] and (tmp_path / "p.pkt").is_file()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["round"], x["step"]) for x in lines] == [(0, 1), (0, 2), (0, 3)]
    assert lines == ClientState.load(tmp_path / "s").round_log


def test_a_cut_or_partial_round_in_the_log_is_made_whole(tiny_run, demo_dir, tmp_path):
    args = _train_args(tiny_run, demo_dir, tmp_path)
    assert _run(args).returncode == 0
    log = tmp_path / "s" / "metrics.jsonl"
    whole = [json.loads(x) for x in log.read_text().splitlines()]
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + lines[1][:20])  # a crash mid-append
    again = _run(args)  # refused (round 0 is trained), but the log is repaired first
    assert again.returncode == 1 and [json.loads(x) for x in log.read_text().splitlines()] == whole


def test_a_killed_export_leaves_its_staging_until_the_next_export_there(trained, tmp_path):
    bundle, state = trained
    args = [BIN / "ciders-edge", "export", "--bundle", bundle, "--state", state, "--format", "hf"]
    killed = _run([*args, "--out", tmp_path / "ex"], "staged:ex")
    assert killed.returncode == -9 and not (tmp_path / "ex").exists()
    left = _hidden(tmp_path)
    assert len(left) == 1 and left[0].startswith(".ex.")
    done = _run([*args, "--out", tmp_path / "other"])
    assert done.returncode == 0, done.stderr
    assert _hidden(tmp_path) == [] and (tmp_path / "other" / "manifest.json").is_file()
