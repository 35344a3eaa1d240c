"""The fleet's evidence for the deployed choice (ciders_edge/training/fleet_evidence.py): the pooled figures
against their definitions, the choice they change, and their way from the round's summaries into the next
bundle through simulate and ``ciders-cloud aggregate --reports``."""

import json
import math

import pytest
from tiny_runs import fast_study
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.study.simulate import simulate
from ciders_edge.cli import app as edge
from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.training.fleet_evidence import MIN_REPORTS, FleetEvidence
from ciders_edge.training.validation import Choice, deployable

runner = CliRunner()


def _report(p_gap, p_se, b_gap=None, b_se=None):
    out = {"val_gap_personalized_global": p_gap, "val_se_personalized_global": p_se}
    if b_gap is not None:
        out |= {"val_gap_deployed_base": b_gap, "val_se_deployed_base": b_se}
    return out


def test_the_pooled_gap_its_error_and_the_prior_are_their_definitions():
    """Personalized − global: mean (0.03 + 0.01 + 0.02) / 3 = 0.02, SE √(0.01² + 0.02² + 0.02²) / 3 = 0.01.
    Deployed − base over the reports that have it: −0.10, −0.02, −0.06: μ = −0.06, population variance
    0.0032 / 3, less the mean squared error (0.0001 + 0.0004 + 0.0001) / 3 = 0.0002: τ² = 0.0032/3 − 0.0002."""
    reports = [
        _report(0.03, 0.01, -0.10, 0.01),
        _report(0.01, 0.02, -0.02, 0.02),
        _report(0.02, 0.02, -0.06, 0.01),
        {"val_gap_personalized_global": float("nan"), "val_se_personalized_global": 0.1},  # not a number: left out
        {"val_gap_personalized_global": True, "val_se_personalized_global": 0.1},
        {"loss_last": 1.0},  # a client without a slice
    ]
    e = FleetEvidence.pool(reports, 4)
    assert (e.round, e.reports) == (4, 3)
    assert e.personalized_gap == pytest.approx(0.02) and e.personalized_se == pytest.approx(0.01)
    assert e.global_first  # 0.02 > 0.01: personalization lost beyond its error
    assert e.base_mean == pytest.approx(-0.06) and e.base_var == pytest.approx(0.0032 / 3 - 0.0002)
    noisy = [_report(0.02, 0.05, g, 0.5) for g in (-0.1, -0.02, -0.06)]  # the slices' noise exceeds the spread
    assert FleetEvidence.pool(noisy, 4).base_var == 0.0 and not FleetEvidence.pool(noisy, 4).global_first
    assert FleetEvidence.pool(reports[:2], 4) is None  # under MIN_REPORTS: no spread to estimate
    base_deployed = [_report(0.02, 0.01)] * MIN_REPORTS  # the base model deployed everywhere: no gap to it
    assert FleetEvidence.pool(base_deployed, 4) is None


def test_the_posterior_shrinks_a_clients_gap_toward_the_fleets():
    e = FleetEvidence(3, 8, 0.0, 0.0, base_mean=-0.05, base_var=0.03**2)
    mean, sd = e.posterior(0.01, 0.04)  # τ² = 0.0009, s² = 0.0016: weights 0.36 and 0.64
    assert mean == pytest.approx(0.36 * 0.01 + 0.64 * -0.05)
    assert sd == pytest.approx(math.sqrt(0.0009 * 0.0016 / 0.0025))
    assert e.replace(base_var=0.0).posterior(0.01, 0.04) == (-0.05, 0.0)  # no spread: the fleet's mean
    wide = e.replace(base_var=1e6).posterior(0.01, 0.04)  # a wide prior: the client's own gap and error
    assert wide[0] == pytest.approx(0.01, abs=1e-8) and wide[1] == pytest.approx(0.04, rel=1e-6)


@pytest.mark.parametrize(
    ("base_mean", "base_var", "deployed"),
    [
        (None, None, "base"),  # on its own: 0.01 ahead of the base model with an error of 0.02
        (-0.03, 0.0, "personalized"),  # the fleet's messengers beat it and the clients agree
        (0.02, 0.0, "base"),  # the fleet's messengers trail it
        (-0.03, 1.0, "base"),  # the clients disagree widely: each is left to its own slice
    ],
)
def test_the_base_models_test_takes_the_fleets_prior(base_mean, base_var, deployed):
    choices = [Choice("personalized", 3, nll=1.0, base_se=0.02), Choice("base", -1, nll=1.01, se=0.02)]
    fleet = None if base_mean is None else FleetEvidence(2, 8, 0.0, 0.0, base_mean, base_var)
    assert choices[deployable(choices, fleet=fleet)].messenger == deployed


def test_a_bundle_with_bad_evidence_is_refused_in_one_line(tiny_run, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    good = FleetEvidence(0, 3, 0.01, 0.02, -0.05, 0.0).to_dict()
    for bad, message in (({**good, "base_var": -1.0}, "must not be negative"), ({"round": 0}, "fleet_choice")):
        (bundle / "manifest.json").write_text(json.dumps({**manifest, "fleet_choice": bad}))
        with pytest.raises(BundleError, match=message):
            Bundle.load(bundle)
    (bundle / "manifest.json").write_text(json.dumps({**manifest, "fleet_choice": good}))
    assert FleetEvidence.of(Bundle.load(bundle).manifest) == FleetEvidence(**good)


def _evidence_of_states(states: list[ClientState]) -> list[dict]:
    """What each client reported, from its state's scores (round 0: this round's personalized messenger was
    the reference, so the global's ``se`` is the pair's)."""
    out = []
    for s in states:
        v, best = s.validation, s.best_info
        gap = {"val_gap_personalized_global": v["personalized"]["nll"] - v["global"]["nll"]}
        out.append({**gap, "val_se_personalized_global": v["global"]["se"]})
        if best["messenger"] != "base":
            gap, se = best["nll"] - v["base"]["nll"], v[_name(best)]["base_se"]
            out[-1] |= {"val_gap_deployed_base": gap, "val_se_deployed_base": se}
    return out


def _name(best: dict) -> str:
    return f"mix_{best['alpha']:g}" if best["messenger"] == "mix" else best["messenger"]


def test_simulate_sends_round_ts_pooled_validation_in_round_t_plus_1s_bundle(demo_dir, tmp_path):
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code", "units")]
    cfg = fast_study(demo_dir, data=data, clients=4, rounds=1, eval_generate=0, max_records=0, val_fraction=0.1)
    out = tmp_path / "sim"
    simulate(cfg, out)
    states = [ClientState.load(out / "clients" / f"client-0{i}") for i in range(4)]
    want = FleetEvidence.pool(_evidence_of_states(states), 0)
    assert want is not None, "every client deployed the base model: nothing to pool"
    got = FleetEvidence.of(Bundle.load(RunFolder(out / "run").bundle("cpu-laptop", 1)).manifest)
    assert got.to_dict() == pytest.approx(want.to_dict())
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rounds if r["type"] == "round")["fleet_choice"] == pytest.approx(want.to_dict())
    assert "fleet_choice" not in Bundle.load(RunFolder(out / "run").bundle("cpu-laptop", 0)).manifest


def test_aggregate_pools_the_reports_it_is_given_and_refuses_a_bad_one(tiny_run, demo_dir, tmp_path):
    """The reports are the edges' claims: the bundle carries exactly what they pool to (the first test's
    numbers), whatever the packets' own rounds scored; a device choosing on that bundle says it weighed them."""
    import shutil

    from tiny_runs import train_once

    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run)
    bundle = run / "bundles" / "cpu-laptop" / "round-0000"
    claims = [_report(0.03, 0.01, -0.10, 0.01), _report(0.01, 0.02, -0.02, 0.02), _report(0.02, 0.02, -0.06, 0.01)]
    packets, reports = [], []
    for i, fam in enumerate(("arithmetic", "dates", "code")):
        data = demo_dir / fam / "train.jsonl"
        packets.append(train_once(bundle, data, tmp_path / fam, f"c{i}", val_fraction=0.1).parent / "p.pkt")
        reports.append(tmp_path / f"{fam}.json")  # `train --json`'s output: progress, then the summary
        reports[-1].write_text("progress\n" + json.dumps({**claims[i], "client_id": f"c{i}"}))
    bad = tmp_path / "bad.json"
    bad.write_text('{"loss_last": 1.0}')
    args = ["aggregate", "--run", str(run), *(x for p in packets for x in ("--packets", str(p)))]
    r = runner.invoke(cloud, [*args, "--reports", str(bad)])
    assert r.exit_code == 1 and "bad.json: the report names no client_id" in r.output
    assert not RunFolder(run).bundle("cpu-laptop", 1).exists()  # refused before the round was read
    r = runner.invoke(cloud, [*args, *(x for p in reports for x in ("--reports", str(p))), "--json"])
    assert r.exit_code == 0, r.output
    want = FleetEvidence.pool(claims, 0).to_dict()
    assert json.loads(r.output.strip().splitlines()[-1])["fleet_choice"] == want
    assert FleetEvidence.of(Bundle.load(RunFolder(run).bundle("cpu-laptop", 1)).manifest).to_dict() == want
    args = ["validate", "--bundle", RunFolder(run).bundle("cpu-laptop", 1), "--state", tmp_path / "dates" / "state"]
    r = runner.invoke(edge, [*map(str, args), "--data", str(demo_dir / "dates" / "train.jsonl")])
    assert r.exit_code == 0, r.output
    assert "weighed with round 0's fleet evidence (reference: the global messenger)" in " ".join(r.output.split())
