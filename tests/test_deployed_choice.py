"""benchmarks/deployed_choice.py's verdicts and its judge (issue 58): the judge scores what the study's own
evaluation scores, and the report counts the targets from both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_runs import FAST, fast_study

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import deployed_choice  # noqa: E402
import deployed_judge  # noqa: E402


def _row(gap: float, over_base: float, se: float = 0.01, held: float | None = None) -> dict:
    nll = {"nll_deployed": 2.0, "nll_latest": 2.0, "nll_global": 2.1, "nll_base": 2.0 - over_base}
    return {"deployed": "mix", "gap": gap, "gap_held": gap if held is None else held, "over_base": over_base,
            "over_base_se": se, **nll}  # fmt: skip


def test_the_verdict_counts_each_target_as_measured_beyond_the_tolerance_and_beyond_the_noise():
    """Gaps 0.005, 0.02 (a client not sampled lately: 0.004 to the global it holds) and -0.001: 2 of 3 within
    0.01, 3 of 3 of the global each holds. Over the base 0.015 (SE 0.01: beyond the tolerance, within 2 SE),
    0.03 (SE 0.01: beyond both), 0.004 (beyond neither)."""
    rows = [_row(0.005, 0.015), _row(0.02, 0.03, held=0.004), _row(-0.001, 0.004)]
    s = deployed_choice.score(rows, 0.01)
    assert (s["within"], s["within_of_held"], s["clients"]) == (2, 3, 3)
    assert s["worse_than_base"] == 3 and s["worse_than_base_beyond_tolerance"] == 2
    assert s["worse_than_base_beyond_2se"] == 1 and s["worst_gap"] == 0.02


def test_a_study_row_has_no_standard_errors_to_count_by():
    records = [{"deployed": "personalized", "nll_full_deployed": 2.0, "nll_full_personal": 2.0,
                "nll_full_global": 2.1, "nll_full_base": 1.99}]  # fmt: skip
    s = deployed_choice.score_round(records, 0.01)
    assert s["worse_than_base"] == 1 and s["worse_than_base_beyond_2se"] is None and s["within_of_held"] is None


@pytest.fixture(scope="module")
def study(demo_dir, tmp_path_factory) -> Path:
    """A one-round tiny study whose clients each hold out a validation slice and deploy their best."""
    from ciders_cloud.study.simulate import simulate

    out = tmp_path_factory.mktemp("deployed") / "partial" / deployed_choice.ALGORITHM
    simulate(fast_study(demo_dir, rounds=1, eval_generate=0, max_records=0, val_fraction=0.1), out)
    return out


def test_the_judge_on_the_studys_records_agrees_with_its_evaluation(study):
    """Judged on the study's own eval records (its first ``eval_examples``), each client's deployed, latest,
    global and base NLL are the study's: one scoring of the same messengers on the same model."""
    path = deployed_judge.judge_round(study, FAST["eval_examples"])
    judged = json.loads(path.read_text())["clients"]
    evals = {r["client"]: r for r in map(json.loads, (study / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval"}  # fmt: skip
    assert judged and judged.keys() == evals.keys()
    for cid, j in judged.items():
        e = evals[cid]
        for mine, theirs in (("deployed", "deployed"), ("latest", "personal"), ("global", "global"), ("base", "base")):
            assert j[f"nll_{mine}"] == pytest.approx(e[f"nll_full_{theirs}"], rel=1e-5), (cid, mine)
        assert j["gap"] == pytest.approx(j["nll_deployed"] - min(j["nll_latest"], j["nll_global"]))
        assert j["stale_rounds"] == 0 and j["gap_held"] == j["gap"]  # every client trained in the one round
    assert deployed_judge.judge_round(study, FAST["eval_examples"]) is None  # a round is judged once


def test_a_client_short_of_eval_records_is_judged_on_records_past_the_cap_no_one_holds(demo_dir, tmp_path):
    """Capped at 14 records, each client holds out one. The judge tops it up to twice 4 with records of the
    client's own file past the cap, less those any client trains or evaluates on: client 0's file holds every
    record twice, so some past its cap are copies of records it trains on."""
    from ciders_cloud.run.folder import StudyFolder
    from ciders_cloud.study.simulate import client_ids, client_records, write_client_data
    from ciders_edge.data.records import read_jsonl

    twice = tmp_path / "twice.jsonl"
    twice.write_text((demo_dir / "arithmetic" / "train.jsonl").read_text() * 2)
    cfg = fast_study(demo_dir, max_records=14)
    cfg = cfg.replace(data=[str(twice), *cfg.data[1:]])
    study, ids = StudyFolder(tmp_path / "study"), client_ids(cfg.clients)
    write_client_data(cfg, study, ids)
    paths = deployed_judge.judge_records(study, cfg, 4)

    def key(record):
        return json.dumps({k: v for k, v in record.items() if k != "_where"}, sort_keys=True)

    def keys(path):
        return [key(r) for r in read_jsonl(path)]

    held = {k for c in ids for f in (study.train_data(c), study.eval_data(c)) for k in keys(f)}
    assert any(key(r) in held for r in client_records(cfg)[0][0][14:])  # copies of its records lie past the cap
    for cid, source in zip(ids, cfg.data, strict=True):
        judged = keys(paths[cid])
        assert len(judged) == 1 + 8 and judged[:1] == keys(study.eval_data(cid))
        assert set(judged) <= set(keys(source)) and not set(judged[1:]) & held
    assert deployed_judge.judge_records(study, cfg, 1) == {c: study.eval_data(c) for c in ids}  # enough held out


def test_the_report_shows_the_studys_rows_and_the_judges(study, tmp_path, monkeypatch):
    deployed_judge.judge_round(study, FAST["eval_examples"])  # None where the test above judged it
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    args = deployed_choice.argparse.Namespace(out=study.parents[1], settings="partial", val_fraction=0.1,
                                              tolerance=0.01, results="deployed_choice")  # fmt: skip
    deployed_choice.report(args)
    rows = [r.split(" | ") for r in (tmp_path / "results" / "deployed_choice.md").read_text().splitlines()
            if r.startswith("| partial |")]  # fmt: skip
    assert [r[2] for r in rows] == [f"study ({FAST['eval_examples']})", f"judge ({FAST['eval_examples']})"]
    study_means, judged_means = ([float(x) for x in r[4:8]] for r in rows)  # deployed, latest, global, base
    assert judged_means == pytest.approx(study_means, abs=2e-4)  # the same means, scored twice


def test_each_margin_is_held_to_the_targets_by_the_judges_scores():
    """One client whose slice puts the global messenger 0.03 ahead (SE 0.02) and a mix 0.05 ahead (SE 0.045):
    margin 0 picks the mix, 1 the global one, 2 the personalized one. The judge's records favour the global
    one by 0.02, so only margin 1 lands within 0.01 nats; the mix trails the base model."""
    import deployed_rules

    cands = [
        {"name": "personalized", "slice": 1.0, "se": 0.0, "judge": 2.02},
        {"name": "global", "slice": 0.97, "se": 0.02, "judge": 2.0},
        {"name": "mix_0.5", "slice": 0.95, "se": 0.045, "judge": 2.03},
        {"name": "base", "slice": 1.2, "se": 0.1, "judge": 2.025},
    ]
    rows = {m: deployed_rules.judge_margin({"c": cands}, m, 0.01) for m in (0.0, 1.0, 2.0)}
    assert [rows[m]["picks"] for m in rows] == [["mix_0.5"], ["global"], ["personalized"]]
    assert [rows[m]["within"] for m in rows] == [0, 1, 0]
    assert rows[0.0]["worse_than_base"] == 1 and rows[1.0]["worse_than_base"] == 0
    assert rows[0.0]["mean_gap"] == pytest.approx(0.03)


def test_a_re_choice_rule_measures_each_rivals_gap_against_its_reference():
    """A stale client whose kept best (a mix) trails the newest global by 0.1 on two records, record by record
    alike (a tiny standard error): every rule with the kept best as reference switches to the global; keeping the
    choice as it is (no re-choice) stays 0.1 behind on the judge's records."""
    import deployed_rechoice

    def cand(name, records, judge):
        return {"name": name, "slice": sum(records) / 4, "nll": records, "tokens": [2.0, 2.0], "judge": judge}

    client = {
        "stale_rounds": 5,
        "kept": "mix",
        "candidates": [
            cand("kept", [1.2, 1.2], 2.1),
            cand("personalized", [1.4, 1.0], 2.2),  # as good as the kept one on the slice, but noisy
            cand("global", [0.8, 0.8], 2.0),
            cand("base", [1.6, 1.6], 2.3),
        ],
    }
    keep = deployed_rechoice.judge_rule({"c": client}, (None, 0.0, None), 0.01)
    assert keep["picks"] == ["kept"] and keep["within"] == 0 and keep["worst_gap"] == pytest.approx(0.1)
    device = deployed_rechoice.judge_rule({"c": client}, deployed_rechoice.DEVICE, 0.01)
    assert device["picks"] == ["global"] and (device["within"], device["stale_within"], device["stale"]) == (1, 1, 1)
    by_personalized = deployed_rechoice.pick(client["candidates"], "personalized", 1.0, None)
    assert by_personalized["name"] == "global"  # its noisy gap to the global still beats one standard error


def test_the_base_models_test_deploys_it_where_a_messengers_lead_is_noise():
    """The kept messenger leads the base model by 0.025 nats a token on the slice: 0.15 ahead on one record, 0.1
    behind on the other (standard error 0.125). With the base model's test the device deploys the base model."""
    import deployed_rechoice

    def cand(name, records, judge):
        return {"name": name, "slice": sum(records) / 4, "nll": records, "tokens": [2.0, 2.0], "judge": judge}

    cands = [cand("kept", [1.0, 1.6], 2.02), cand("personalized", [1.0, 1.6], 2.02), cand("global", [1.1, 1.6], 2.01)]
    cands.append(cand("base", [1.3, 1.4], 2.0))
    assert deployed_rechoice.pick(cands, "kept", 1.0, None)["name"] == "kept"
    row = deployed_rechoice.judge_rule({"c": {"stale_rounds": 0, "candidates": cands}}, deployed_rechoice.DEVICE, 0.01)
    assert row["picks"] == ["base"] and row["worse_than_base"] == 0 and row["within"] == 1
