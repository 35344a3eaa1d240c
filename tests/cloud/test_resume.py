"""`simulate --resume`: a study run a few rounds at a time, or killed mid-round and resumed, ends as one
run straight through would; what it refuses, in one line."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from tiny_runs import fast_study, moved, state_bytes
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.study.resume import resume
from ciders_cloud.study.simulate import simulate
from ciders_edge.faults import CRASH_ENV

runner = CliRunner()
ROUNDS = 3


def _study(demo_dir, **kw):
    """Three clients, two sampled a round (so the draws must replay), evaluated after every round."""
    return fast_study(demo_dir, eval_generate=0, eval_every=1, participation=0.67, sampling="fixed", **kw)


def _records(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


@pytest.fixture(scope="module")
def straight(demo_dir, tmp_path_factory):
    """The study run straight through: what every resumed one must end as."""
    out = tmp_path_factory.mktemp("straight") / "sim"
    simulate(_study(demo_dir, rounds=ROUNDS), out)
    return out


def _same_study(out, straight) -> None:
    where = moved(_records(out), _records(straight))
    assert where is None, f"the resumed study's metrics differ at {where}"
    assert state_bytes(out / "run") == state_bytes(straight / "run")
    assert json.loads((out / "config.json").read_text()) == json.loads((straight / "config.json").read_text())
    assert not any((out / "snapshots").iterdir())  # every round committed: no kept state left


def test_a_study_run_a_round_at_a_time_ends_as_one_run(demo_dir, tmp_path, straight):
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1), out)
    assert resume(out, 2)["resumed_at"] == 1
    summary = resume(out, ROUNDS)
    assert (summary["resumed_at"], summary["rounds"]) == (2, ROUNDS)
    _same_study(out, straight)
    again = resume(out, ROUNDS)  # nothing left to run: the last evaluation, read back, and nothing added
    assert again["mean_nll_personal"] == summary["mean_nll_personal"]
    assert moved(_records(out), _records(straight)) is None


def test_a_resume_killed_mid_round_runs_that_round_again(demo_dir, tmp_path, straight):
    """SIGKILL once the second client of round 1 committed its state (a named step, no timing): the
    rerun puts back the states of that round's trained clients and ends as the straight run."""
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1), out)
    trained = [r["participants"] for r in _records(straight) if r["type"] == "round" and r["round"] == 1][0]
    cmd = [sys.executable, "-m", "ciders_cloud", "simulate", "--resume", "--out", str(out), "--rounds", str(ROUNDS)]
    env = {**os.environ, CRASH_ENV: f"committed:{trained[-1]}"}
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (out / "snapshots" / "round-0001").iterdir()) == trained
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"round 1 stopped after {len(trained)} trained; it runs again" in " ".join(rerun.stderr.split())
    _same_study(out, straight)


def test_resume_refuses_what_it_cannot_do_in_one_line(demo_dir, tmp_path, straight):
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=2), out)
    for args, message in [
        (["--rounds", "1"], f"--rounds 1: {out} has run 2 rounds already"),
        (["--rounds", "4", "--local-steps", "5"], "--local-steps: --resume goes on with the study as it was made"),
        (["--dp-clip", "1"], "--dp-clip: --resume goes on with the study as it was made"),
    ]:
        r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(out), *args])
        assert r.exit_code == 1 and message in " ".join(r.stderr.split()), (args, r.stderr)
        assert "Traceback" not in r.stderr
    r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(tmp_path / "none"), "--rounds", "2"])
    assert r.exit_code == 1 and "no config.json; --resume takes a study `simulate` made" in r.stderr, r.stderr
    assert [r["round"] for r in _records(out) if r["type"] == "round"] == [0, 1]  # nothing ran


def test_a_private_study_resumes_only_as_far_as_its_budget(demo_dir, tmp_path):
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1, dp={"clip": 1.0, "noise_multiplier": 1.0, "max_epsilon": 20.0}), out)
    r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(out), "--rounds", "400"])
    assert r.exit_code == 1 and "--rounds 400: the run's privacy budget epsilon 20 allows" in r.stderr, r.stderr
    assert json.loads((out / "config.json").read_text())["rounds"] == 1  # the refused target is not recorded


def test_a_metrics_log_cut_by_a_crash_is_read_to_its_last_whole_line_and_resumed(demo_dir, tmp_path, straight):
    """What a crash while a record was appended leaves: half a line. Resume reads up to the last whole
    line, says so, cuts the half from the file, and the study ends as the straight run; ``report`` reads it."""
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1), out)
    log = out / "metrics.jsonl"
    whole = log.read_bytes()
    log.write_bytes(whole + whole.splitlines()[-1][:25])
    r = runner.invoke(cloud, ["report", "--run", str(out), "--out", str(tmp_path / "report")])
    assert r.exit_code == 0 and "its last line is cut short" in " ".join(r.stderr.split()), r.output
    assert log.read_bytes().endswith(whole.splitlines()[-1][:25])  # report reads; it does not write
    r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(out), "--rounds", str(ROUNDS)])
    assert r.exit_code == 0 and "its last line is cut short" in " ".join(r.stderr.split()), r.output
    _same_study(out, straight)


@pytest.mark.parametrize(
    "damage, message",
    [
        (b'{"algorithm": "ciders", "rounds"', "not the study's config (not JSON: "),
        (b'{"algorithm": "\xff"}', "not the study's config (not UTF-8 at byte 15); restore it"),
        (b"[1, 2]", "not the study's config (a JSON list); restore it"),
    ],
)
def test_a_damaged_study_is_refused_in_one_line(demo_dir, tmp_path, damage, message):
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1), out)
    log = (out / "metrics.jsonl").read_bytes()
    (out / "config.json").write_bytes(damage)
    r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(out), "--rounds", "2"])
    assert r.exit_code == 1 and message in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and (out / "metrics.jsonl").read_bytes() == log
    lines = log.splitlines()
    (out / "metrics.jsonl").write_bytes(b"\n".join([lines[0], lines[1][:20], *lines[2:]]) + b"\n")
    r = runner.invoke(cloud, ["report", "--run", str(out), "--out", str(tmp_path / "report")])
    assert r.exit_code == 1 and "metrics.jsonl, line 2: not a JSON record" in " ".join(r.stderr.split()), r.stderr


@pytest.mark.parametrize("damage", ["edited", "removed"])
def test_a_damaged_or_removed_snapshot_is_refused_before_anyone_trains(demo_dir, tmp_path, straight, damage):
    """Killed once round 1's clients committed: an edited copy of a state from before the round, or the
    copies removed, is refused in one line naming it, before any client trains the round again."""
    out = tmp_path / "sim"
    simulate(_study(demo_dir, rounds=1), out)
    order = [r["participants"] for r in _records(straight) if r["type"] == "round" and r["round"] == 1][0]
    trained = sorted(order)
    cmd = [sys.executable, "-m", "ciders_cloud", "simulate", "--resume", "--out", str(out), "--rounds", "2"]
    env = {**os.environ, CRASH_ENV: f"committed:{order[-1]}"}  # the last of the round to train
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    kept = out / "snapshots" / "round-0001"
    if damage == "edited":  # a client that had a state before round 1 (one that trained round 0)
        target = next(p for c in trained if (p := kept / c / "current" / "consensus.safetensors").exists())
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x01
        target.write_bytes(bytes(data))
        message = f"{target}: client state fails its checksum"
    else:
        shutil.rmtree(kept)
        message = f"client {trained[0]} holds round 1, which the cloud never aggregated"
    states = {p: p.read_bytes() for p in sorted((out / "clients").rglob("*")) if p.is_file()}
    r = runner.invoke(cloud, ["simulate", "--resume", "--out", str(out), "--rounds", "2"])
    assert r.exit_code == 1 and message in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in sorted((out / "clients").rglob("*")) if p.is_file()} == states
    assert [x["round"] for x in _records(out) if x["type"] == "round"] == [0]
