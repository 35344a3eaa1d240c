"""benchmarks/common.py's run_simulate: a benchmark study killed mid-run goes on from its last committed round
when run again (the 1,000-client privacy study runs for hours), and ends as a run straight through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tiny_runs import fast_study, state_bytes

from ciders_cloud.study.simulate import simulate
from ciders_edge.faults import CRASH_ENV

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TESTS = Path(__file__).resolve().parent


def _study(demo_dir):
    """Three clients, two sampled a round: round 1 trains a client round 0 did not."""
    return fast_study(demo_dir, rounds=2, eval_generate=0, participation=0.67, sampling="fixed")


def _rounds(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows if r["type"] in ("round", "cross")]


def test_a_killed_benchmark_study_resumes_from_its_last_round(demo_dir, tmp_path, capsys):
    straight = tmp_path / "straight"
    simulate(_study(demo_dir), straight)
    participants = [r["participants"] for r in _rounds(straight) if r["type"] == "round"]
    newcomer = next(c for c in participants[1] if c not in participants[0])  # its first commit is in round 1
    out = tmp_path / "bench"
    script = (
        f"import sys; sys.path[:0] = [{str(BENCHMARKS)!r}, {str(TESTS)!r}]; from pathlib import Path; import common; "
        f"from tiny_runs import fast_study; common.run_simulate(fast_study(Path({str(demo_dir)!r}), rounds=2, "
        f"eval_generate=0, participation=0.67, sampling='fixed'), Path({str(out)!r}))"
    )
    killed = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, CRASH_ENV: f"committed:{newcomer}"}, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [r["round"] for r in _rounds(out) if r["type"] == "round"] == [0]  # round 0 kept, round 1 cut short

    sys.path[:0] = [str(BENCHMARKS)]
    import common

    common.run_simulate(_study(demo_dir), out)
    assert f"{out}: unfinished, resumed" in capsys.readouterr().out  # round 0 not trained again
    rounds = lambda rows: [r for r in rows if r["type"] == "round"]  # noqa: E731
    assert rounds(_rounds(out)) == rounds(_rounds(straight)) and _rounds(out)[-1] == _rounds(straight)[-1]
    assert state_bytes(out / "run") == state_bytes(straight / "run")
    assert common._finished(_study(demo_dir), out)  # and a third call reads it back


def test_a_private_study_grown_from_one_round_keeps_the_budget_of_all_its_rounds(demo_dir, tmp_path):
    """run_simulate's first call runs one round: a target epsilon must still be spent over the study's rounds
    (its noise multiplier as a straight run's), or the resume to the second round is refused by the budget."""
    sys.path[:0] = [str(BENCHMARKS)]
    import common

    cfg = fast_study(demo_dir, rounds=2, eval_generate=0, dp={"clip": 1.0, "target_epsilon": 8.0})
    simulate(cfg, tmp_path / "straight")
    common.run_simulate(cfg, tmp_path / "grown")
    z = [json.loads((tmp_path / s / "run" / "run.json").read_text())["dp"] for s in ("straight", "grown")]
    assert z[0]["noise_multiplier"] == z[1]["noise_multiplier"] and z[1]["rounds"] == 2
    assert [r["round"] for r in _rounds(tmp_path / "grown") if r["type"] == "round"] == [0, 1]


def test_a_study_saved_before_a_setting_existed_is_still_the_same_study(tmp_path):
    """A config.json written before ``rechoose`` existed lacks the key: the study ran with its default, so a
    benchmark resumes it rather than starting over (which deletes it) or refusing it."""
    sys.path[:0] = [str(BENCHMARKS)]
    import common

    from ciders_cloud.study.config import SimConfig

    cfg = SimConfig(data=["a.jsonl"], rounds=20, val_fraction=0.1)
    saved = {k: v for k, v in json.loads(json.dumps(cfg.to_dict())).items() if k != "rechoose"}
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rounds": 8}))
    assert common._same_study(cfg, tmp_path) and not common._same_study(cfg, tmp_path, rounds=True)
    assert not common._same_study(cfg.replace(rechoose=True), tmp_path)  # a setting it did not run with
    assert not common._same_study(cfg, tmp_path / "none")
