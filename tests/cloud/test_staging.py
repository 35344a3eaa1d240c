"""A failed `simulate` or `report` leaves no `--out` (or the earlier report, whole): both build in a
hidden folder beside it and rename it into place at the end."""

import fcntl
import json
import os
from pathlib import Path

import pytest
from tiny_runs import fast_study as sim_cfg
from typer.testing import CliRunner

import ciders_cloud.study.report as report_module
import ciders_edge.fleet.virtual as virtual_module
from ciders_cloud.cli import app as cloud
from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import LOCK_FILE as BUILDING
from ciders_cloud.study.report import report
from ciders_cloud.study.simulate import simulate
from ciders_edge.errors import ConfigError, PacketError

runner = CliRunner()


def test_a_simulate_failing_mid_round_leaves_no_out_and_its_rerun_works(demo_dir, tmp_path, monkeypatch):
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates")]
    cfg, out = sim_cfg(demo_dir, clients=2, data=data, rounds=1, eval_generate=0), tmp_path / "sim"

    def lost(*args, **kwargs):
        raise PacketError("a packet was lost")

    monkeypatch.setattr(virtual_module, "train", lost)  # round 0, after prepare: a client's job
    with pytest.raises(PacketError, match="lost"):
        simulate(cfg, out)
    assert list(tmp_path.iterdir()) == []  # neither --out nor a staging folder
    monkeypatch.undo()

    summary = simulate(cfg, out)
    assert summary["out"] == str(out) and summary["run"] == str(out / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim"] and not (out / BUILDING).exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["type"] == "round"] == [0]
    public = Path(load_run(out / "run").public_data)  # the run is usable where it was published
    assert public == out.absolute() / "data" / "public.jsonl" and public.is_file()


def test_a_simulate_failing_while_building_leaves_no_out(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match="one --data file per client"):
        simulate(sim_cfg(demo_dir, clients=2), tmp_path / "sim")  # three files for two clients
    assert list(tmp_path.iterdir()) == []


def test_simulate_sweeps_a_killed_runs_staging_folder_but_not_a_live_one(demo_dir, tmp_path):
    stale, live, other = (tmp_path / f".sim.{name}" for name in ("killed", "running", "foreign"))
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (stale / BUILDING).write_text("")
    (live / BUILDING).write_text("")
    fd = os.open(live / BUILDING, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the process building it holds it
    try:
        with pytest.raises(ConfigError, match="one --data file per client"):
            simulate(sim_cfg(demo_dir, clients=2), tmp_path / "sim")
    finally:
        os.close(fd)
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_a_failed_simulate_cli_leaves_nothing_to_block_its_rerun(demo_dir, tmp_path):
    out = tmp_path / "sim"
    data = [a for f in ("units", "strings", "dates") for a in ("--data", str(demo_dir / f / "train.jsonl"))]
    r = runner.invoke(
        cloud, ["simulate", "--model", "tiny", *data, "--clients", "2", "--partition", "per-file", "--out", str(out)]
    )
    assert r.exit_code == 1 and "one --data file per client" in r.stderr
    assert not out.exists()  # today's rerun was refused: "already exists and is not empty"


def _metrics_run(root: Path, rounds: int) -> Path:
    rows = [{"type": "baseline", "round": 0, "client": "c0", "nll_emu": 2.0}]
    for t in range(rounds):
        rows += [
            {"type": "client", "round": t, "client": "c0", "gamma": 0.01, "loss_last": 1.0 / (t + 1)},
            {"type": "round", "round": t, "algorithm": "fedavg", "bytes_up": 10, "bytes_down": 20, "wall_s": 1.0},
            {"type": "eval", "round": t, "client": "c0", "nll_personal": 1.5 - t / 10, "nll_global": 1.6},
        ]
    for r in rows:
        if r["type"] == "client":
            r.update({"E-RAE": 0.1, "S-PPR": 0.5, "S-DR": 0.5, "PPR": 0.4})
    root.mkdir()
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_a_failed_report_leaves_no_out_and_keeps_the_earlier_report(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    report([_metrics_run(tmp_path / "a", 2)], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "summary.md" in before and "loss.png" in before

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report_module, "_summary", broken)  # after every plot is drawn
    with pytest.raises(RuntimeError):
        report([_metrics_run(tmp_path / "b", 4)], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # not a mix of old and new plots
    with pytest.raises(RuntimeError):
        report([tmp_path / "b"], tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "rep"]


def test_report_replaces_an_earlier_report_but_no_other_folder(tmp_path):
    out = tmp_path / "rep"
    report([_metrics_run(tmp_path / "a", 2)], out)
    (out / "stale.png").write_bytes(b"old")
    report([tmp_path / "a"], out)
    assert not (out / "stale.png").exists() and (out / "summary.md").is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds notes.txt, which `report` did not write"):
        report([tmp_path / "a"], mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_report_cli_with_a_bad_run_writes_no_out(tmp_path):
    r = runner.invoke(cloud, ["report", "--run", str(tmp_path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no metrics.jsonl" in r.stderr
    assert not (tmp_path / "o").exists()
