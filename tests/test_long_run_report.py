"""benchmarks/long_run.py's report on studies' metrics.jsonl: which round each row is read at, and against what."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import long_run  # noqa: E402


def _study(out: Path, rounds: int, nll: float, wall_s: float) -> None:
    """A two-client study's metrics, evaluated every 2 rounds; its matched NLL at round t is ``nll - t/100``."""
    rows = [{"type": "baseline", "nll_emu": 3.0, "nll_full": 2.0} for _ in range(2)]
    for t in range(rounds):
        rows.append({"type": "round", "round": t, "wall_s": wall_s, "participants": ["a", "b"]})
        rows[-1] |= {"bytes_up": 10, "bytes_down": 100}
        if t % 2 == 1:
            m = nll - (t + 1) / 100
            rows.append({"type": "cross", "round": t, "matrix": [[m, 9.0], [9.0, m]], "delta_cross": 0.5})
            rows += [{"type": "eval", "round": t, "nll_full_personal": m - 1, "nll_full_global": m - 0.5,
                      "nll_global": m + 1} for _ in "ab"]  # fmt: skip
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _args(out: Path, settings: str, results: str = "long_run") -> long_run.argparse.Namespace:
    """A report call's arguments, as ``long_run.py --out <out> --settings <settings> --results <results>``."""
    return long_run.argparse.Namespace(out=out, settings=settings, results=results)


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(long_run, "RESULTS", tmp_path / "results")
    return tmp_path / "results"


def test_report_reads_the_table_at_the_common_round_and_each_ablation_arm_at_its_own(tmp_path, results):
    runs = tmp_path / "runs"
    _study(runs / "b" / "fedavg", rounds=6, nll=3.0, wall_s=40)
    _study(runs / "b" / "ciders-fo", rounds=4, nll=2.9, wall_s=60)
    _study(runs / "b" / "ciders-fo-no-takd", rounds=2, nll=2.95, wall_s=45)  # behind: must not pull the table back
    long_run.report(_args(runs, "b"))
    md = (results / "long_run.md").read_text()
    table = {row.split(" | ")[1]: row.split(" | ") for row in md.splitlines() if row.startswith("| b |")}
    assert table["ciders-fo"][2:5] == ["4", "2.8600", "-0.1000"]  # at round 4, the last both main studies reached
    assert table["fedavg"][2:5] == ["4", "2.9600", "+0.0000"]
    assert table["ciders-fo"][10] == "2.3600" and table["ciders-fo"][13] == "1.50x"  # the global messenger on AdapFu
    arm = table["ciders-fo-no-takd"]  # at round 2: vs CIDERS-FO (2.88) and FedAvg (2.98) there
    assert arm[2:6] == ["2", "2.9300", "+0.0500", "-0.0500"]
    assert arm[10].strip(" |") == "0.75x"
    assert (results / "long_run" / "b.png").stat().st_size > 0
    saved = json.loads((results / "long_run.json").read_text())
    assert saved["settings"]["b"]["ciders-fo"]["points"][0] == {
        "round": 0, "matched": 3.0, "adapfu": 2.0, "global": 3.0, "adapfu_global": 2.0, "delta_cross": 0.0, "bytes": 0,
    }  # fmt: skip


def test_a_report_covers_the_settings_it_holds_and_those_named_not_every_study_under_out(tmp_path, results):
    runs = tmp_path / "runs"  # B's studies and partial participation's in one folder
    _study(runs / "b" / "fedavg", rounds=4, nll=3.0, wall_s=40)
    _study(runs / "partial" / "fedavg", rounds=4, nll=3.2, wall_s=40)
    long_run.report(_args(runs, "partial", results="long_run_partial"))
    saved = json.loads((results / "long_run_partial.json").read_text())["settings"]
    assert set(saved) == {"partial"}
    assert "| b |" not in (results / "long_run_partial.md").read_text()
    assert not (results / "long_run_partial" / "b.png").exists()
    record = results / "long_run_partial.json"  # as reports wrote it before: every setting, the empty ones too
    record.write_text(json.dumps({**json.loads(record.read_text()), "settings": {"b": {}, **saved}}))
    long_run.report(_args(runs, "partial", results="long_run_partial"))
    assert set(json.loads(record.read_text())["settings"]) == {"partial"}
    long_run.report(_args(runs, "b", results="long_run_partial"))  # partial stays: the report holds it
    assert set(json.loads((results / "long_run_partial.json").read_text())["settings"]) == {"b", "partial"}


def test_a_curve_is_at_its_plateau_once_eight_rounds_lower_its_best_by_under_0_02():
    def curve(*matched: float) -> dict:  # evaluated every 4 rounds from round 0
        return {"points": [{"round": 4 * i, "matched": m} for i, m in enumerate(matched)]}

    assert long_run._recent_gain(curve(4.17, 4.10, 4.05, 4.02), 12) == "+0.0800"  # best 4.10 at 4, 4.02 since
    assert long_run._recent_gain(curve(4.17, 4.10, 4.05, 4.02, 4.04, 4.03), 20) == "-0.0100 (plateau)"
    assert long_run._recent_gain(curve(4.17, 4.10, 4.05, 4.02, 4.01, 4.005), 20) == "+0.0150 (plateau)"
    assert long_run._recent_gain(curve(4.17, 4.10, 4.05, 4.02, 4.01, 3.99), 20) == "+0.0300"
    assert long_run._recent_gain(curve(4.17, 4.10, 4.05, 4.02), 8) == "+0.1200"  # read at round 8, not the last
    assert long_run._recent_gain(curve(4.17, 4.10), 4) == "-"  # not 8 rounds yet


def test_a_study_lost_with_its_machine_keeps_its_place_and_a_further_one_replaces_it(tmp_path, results, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    _study(first / "b" / "fedavg", rounds=6, nll=3.0, wall_s=40)
    _study(first / "b" / "ciders-fo", rounds=6, nll=2.9, wall_s=60)
    monkeypatch.setattr(sys, "argv", ["long_run.py", "--settings", "b"])
    long_run.report(_args(first, "b"))
    _study(second / "c0.1" / "fedavg", rounds=2, nll=4.0, wall_s=100)  # a later session: b's folders are gone
    _study(second / "b" / "fedavg", rounds=2, nll=3.5, wall_s=40)  # and b's FedAvg started over: not as far
    _study(second / "b" / "ciders-fo", rounds=8, nll=2.9, wall_s=60)  # CIDERS-FO resumed further
    grown_by = [  # as grow() notes it: first a call before the calls were listed with their rounds
        {"command": "long_run.py --settings b --algorithms ciders-fo", "commit": "abc1234"},
        {"command": "long_run.py --settings b --rounds 8", "commit": "def5678", "rounds": [7, 8]},
    ]
    (second / "b" / "ciders-fo" / long_run.SOURCE).write_text(json.dumps(grown_by))
    monkeypatch.setattr(sys, "argv", ["long_run.py", "--settings", "c0.1"])
    long_run.report(_args(second, "c0.1"))
    saved = json.loads((results / "long_run.json").read_text())["settings"]
    source = {(s, a): [c["command"] for c in c["sources"]] for s, runs in saved.items() for a, c in runs.items()}
    assert source == {
        ("b", "fedavg"): ["long_run.py --settings b"],  # the record: its folder is gone
        ("b", "ciders-fo"): [c["command"] for c in grown_by],  # the live study reaches further
        ("c0.1", "fedavg"): ["long_run.py --settings c0.1"],
    }
    assert saved["b"]["fedavg"]["points"][-1]["round"] == 6 and saved["b"]["ciders-fo"]["points"][-1]["round"] == 8
    md = (results / "long_run.md").read_text()
    assert "| b | fedavg | 6 | 2.9400 |" in md and "| c0.1 | fedavg | 2 | 3.9800 |" in md
    assert "- b: `long_run.py --settings b` at" in md and "`long_run.py --settings c0.1` at" in md
    assert "; `long_run.py --settings b --rounds 8` at def5678 (rounds 7-8)" in md
    long_run.report(_args(tmp_path / "third", "b"))  # none live: the record, read back
    again = json.loads((results / "long_run.json").read_text())["settings"]
    assert again["b"]["ciders-fo"]["sources"] == saved["b"]["ciders-fo"]["sources"]


def test_off_the_cpu_every_client_runs_a_copy_of_its_profile_that_targets_the_gpu(tmp_path, monkeypatch):
    from ciders_edge.profiles import load_profile

    monkeypatch.setenv("CIDERS_HOME", str(tmp_path))
    args = long_run.argparse.Namespace(out=tmp_path, profile="rpi5-8gb", device="cpu")
    assert long_run.edge_profile(args) == "rpi5-8gb"
    args = long_run.argparse.Namespace(out=tmp_path, profile="rpi5-8gb", device="cuda")
    assert long_run.edge_profile(args) == "rpi5-8gb-cuda"  # a name: a simulation keys its bundles by it
    copy, shipped = load_profile("rpi5-8gb-cuda"), load_profile("rpi5-8gb")
    assert copy.target == "cuda"
    assert copy.to_dict() | {"name": "rpi5-8gb", "target": "cpu"} == shipped.to_dict()
    assert long_run.edge_profile(args) == "rpi5-8gb-cuda"


def test_rounds_a_stopped_call_ran_go_to_the_call_that_ends_them(tmp_path):
    _study(out := tmp_path / "b" / "fedavg", rounds=11, nll=3.0, wall_s=40)  # 11 rounds done, 8 of them noted
    (out / long_run.SOURCE).write_text(json.dumps([{"command": "c", "commit": "x", "rounds": [1, 8]}]))
    assert long_run._rounds_noted(out) == 8
    (out / long_run.SOURCE).write_text(json.dumps({"command": "c", "commit": "x"}))  # noted before rounds were
    assert long_run._rounds_noted(out) == 11


def test_a_call_stopped_by_a_signal_notes_the_rounds_it_finished(tmp_path, monkeypatch):
    from ciders_cloud.study import resume as resume_module
    from ciders_cloud.study.config import SimConfig

    _study(out := tmp_path / "b" / "fedavg", rounds=8, nll=3.0, wall_s=40)
    (out / long_run.SOURCE).write_text(json.dumps([{"command": "c", "commit": "x", "rounds": [1, 8]}]))
    cfg = SimConfig(data=["train.jsonl"], algorithm="fedavg", rounds=20)
    (out / "config.json").write_text(json.dumps(cfg.replace(rounds=8).to_dict()))

    def stopped_after_round_11(path, rounds, device):  # three rounds done, then `timeout`'s SIGTERM (as exit 143)
        with (path / "metrics.jsonl").open("a") as f:
            f.writelines(json.dumps({"type": "round", "round": t}) + "\n" for t in (8, 9, 10))
        raise SystemExit(143)

    monkeypatch.setattr(resume_module, "resume", stopped_after_round_11)
    with pytest.raises(SystemExit):
        long_run.grow(cfg, out, 12)
    assert [s["rounds"] for s in long_run._sources(out)] == [[1, 8], [9, 11]]


def test_grow_says_whether_it_ran_a_round_so_that_a_pass_that_ran_none_writes_no_report(tmp_path, monkeypatch):
    from ciders_cloud.study import resume as resume_module
    from ciders_cloud.study.config import SimConfig

    _study(out := tmp_path / "b" / "fedavg", rounds=8, nll=3.0, wall_s=40)
    (out / long_run.SOURCE).write_text(json.dumps([{"command": "c", "commit": "x", "rounds": [1, 8]}]))
    cfg = SimConfig(data=["train.jsonl"], algorithm="fedavg", rounds=12)
    (out / "config.json").write_text(json.dumps(cfg.replace(rounds=8).to_dict()))

    def one_round(path, rounds, device):
        with (path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"type": "round", "round": long_run._rounds_done(path)}) + "\n")
        (path / "config.json").write_text(json.dumps(cfg.replace(rounds=rounds).to_dict()))

    monkeypatch.setattr(resume_module, "resume", one_round)
    assert long_run.grow(cfg, out, 4) is False  # at round 8 already: a resumed call's earlier target
    assert long_run.grow(cfg, out, 9) is True
    assert [s["rounds"] for s in long_run._sources(out)] == [[1, 8], [9, 9]]


def test_a_diverged_study_is_left_out_of_an_nll_panels_range_and_named_so():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 4, 8], [3.3, 3.0, 2.9], label="ciders-fo")
    ax.plot([0, 4, 8], [3.3, 3.4, 3.6], label="fedavg")  # rose, but by less than 0.5 nats: kept in view
    before = ax.get_ylim()
    long_run._off_the_chart(ax, base=3.3)
    assert ax.get_ylim() == before and [line.get_label() for line in ax.get_lines()] == ["ciders-fo", "fedavg"]
    ax.plot([0, 4, 8], [3.3, 4.0, 6.2], label="scaffold")
    long_run._off_the_chart(ax, base=3.3)
    low, high = ax.get_ylim()
    assert low < 2.9 and 3.6 < high < 4.0
    assert [line.get_label() for line in ax.get_lines()] == ["ciders-fo", "fedavg", "scaffold (off the chart)"]
    plt.close(fig)
