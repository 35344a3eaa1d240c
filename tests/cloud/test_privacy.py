"""Client-level differential privacy (docs/privacy.md): the clip and the noise against their definitions,
the accountant against the library and a published setting, and a private run through the real commands."""

import json
import math
import random
import re

import dp_accounting
import pytest
import torch
from conftest import fast_run_config
from dp_accounting import rdp
from tiny_runs import fast_study, prepare_args, two_clients_round0
from typer.testing import CliRunner

from ciders_cloud import prepare
from ciders_cloud.cli import app as cloud
from ciders_cloud.privacy import (
    BudgetError,
    GaussianMechanism,
    PrivacySettings,
    PrivateRelease,
    solve_noise_multiplier,
    study_generator,
)
from ciders_cloud.privacy.accountant import epsilon
from ciders_cloud.round.aggregate import aggregate_files, aggregate_packets
from ciders_cloud.run.config import load_run
from ciders_cloud.run.dp_settings import MIN_NOISE
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.sampling import sample_clients
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.study.simulate import simulate
from ciders_edge.errors import ConfigError, PacketError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.tensors import norm
from ciders_edge.training.equations import clip_displacement

runner = CliRunner()


def delta_of_norm(n: float, shapes=None) -> dict[str, torch.Tensor]:
    """A random displacement of L2 norm ``n`` over tensors of ``shapes`` (by name)."""
    t = {k: torch.randn(shape, dtype=torch.float64) for k, shape in (shapes or {"a": (3, 4), "b": (4, 3)}).items()}
    scale = n / norm(t)
    return {k: x * scale for k, x in t.items()}


def test_a_displacement_of_ten_c_enters_with_norm_c_and_one_of_half_c_unchanged():
    c = 0.7
    big, small = delta_of_norm(10 * c), delta_of_norm(c / 2)
    assert norm(clip_displacement(big, c)) == pytest.approx(c, rel=1e-12)
    assert all(torch.equal(clip_displacement(small, c)[k], small[k]) for k in small)
    like = {k: torch.zeros_like(t) for k, t in big.items()}
    mean, report = GaussianMechanism(c, 0.0, 1.0).mean([big], like)  # no noise, D = 1: the mean is the clipped one
    assert norm(mean) == pytest.approx(c, rel=1e-12) and report["clipped"] == 1
    mean, report = GaussianMechanism(c, 0.0, 1.0).mean([small], like)
    assert norm(mean) == pytest.approx(c / 2, rel=1e-12) and report["clipped"] == 0
    direction = {k: big[k] / norm(big) for k in big}  # clipping scales; it never turns
    assert all(torch.allclose(clip_displacement(big, c)[k], c * direction[k]) for k in big)


def test_the_noise_on_the_mean_has_std_z_c_over_d_and_no_two_rounds_share_it():
    z, c, d = 1.3, 0.5, 4.0
    shapes = {"w": (200, 100), "u": (50,)}
    like = {k: torch.zeros(shape, dtype=torch.float64) for k, shape in shapes.items()}
    deltas = [delta_of_norm(0.2, shapes) for _ in range(3)]
    exact = {k: sum(x[k] for x in deltas) / d for k in like}  # every norm is under C: nothing clipped
    mechanism = GaussianMechanism(c, z, d)
    # the moments on a fixed seed: a 3-sigma bound on OS-seeded noise would fail one run in 370
    first, report = mechanism.mean(deltas, like, study_generator(7, 0))
    second, third = (mechanism.mean(deltas, like)[0] for _ in range(2))  # production: OS-seeded each round
    noise = torch.cat([(first[k] - exact[k]).reshape(-1) for k in like])
    assert float(noise.std()) == pytest.approx(z * c / d, rel=0.03)
    assert float(noise.mean()) == pytest.approx(0.0, abs=3 * z * c / d / math.sqrt(noise.numel()))
    assert report["noise_std_of_mean"] == pytest.approx(z * c / d)
    rounds = [torch.cat([(m[k] - exact[k]).reshape(-1) for k in like]) for m in (second, third)]
    assert abs(float(torch.corrcoef(torch.stack(rounds))[0, 1])) < 0.05  # 7 sigma: a fresh seed each round


def test_a_studys_noise_repeats_for_its_seed_and_round_and_differs_between_rounds():
    mechanism, like = GaussianMechanism(1.0, 1.0, 1.0), {"w": torch.zeros(1000, dtype=torch.float64)}
    noise = {(seed, t): mechanism.mean([], like, study_generator(seed, t))[0]["w"] for seed in (0, 1) for t in (0, 1)}
    assert torch.equal(noise[0, 0], mechanism.mean([], like, study_generator(0, 0))[0]["w"])
    for a, b in ((noise[0, 0], noise[0, 1]), (noise[0, 0], noise[1, 0])):
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.15


def test_epsilon_of_a_published_setting_matches_the_library_and_the_paper():
    """Abadi et al. 2016 (Deep Learning with DP, §5): q = 0.01, sigma = 4, 10,000 steps, delta = 1e-5 cost
    epsilon 1.26 by the moments accountant; RDP (the same bound, tighter orders) must not exceed it."""
    ours = epsilon(4.0, 10_000, 1e-5, "poisson", 0.01, 60_000)
    direct = rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(4.0)), 10_000)
    assert ours == direct.get_epsilon(1e-5) and 0.9 < ours <= 1.26
    # a fixed m of N without replacement: neighbours replace a client, so the sum moves by up to 2C
    wor = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    wor.compose(dp_accounting.SampledWithoutReplacementDpEvent(50, 10, dp_accounting.GaussianDpEvent(0.6)), 20)
    assert epsilon(1.2, 20, 0.02, "fixed", 0.2, 50) == wor.get_epsilon(0.02)
    assert epsilon(1.0, 0, 1e-5, "poisson", 0.1, 10) == 0.0 and epsilon(0.0, 3, 1e-5, "poisson", 0.1, 10) == math.inf
    # more rounds cost more; more noise or less sampling cost less
    assert epsilon(1.0, 20, 0.02, "poisson", 0.2, 50) > epsilon(1.0, 10, 0.02, "poisson", 0.2, 50)
    assert epsilon(2.0, 20, 0.02, "poisson", 0.2, 50) < epsilon(1.0, 20, 0.02, "poisson", 0.2, 50)
    assert epsilon(1.0, 20, 0.02, "poisson", 0.1, 50) < epsilon(1.0, 20, 0.02, "poisson", 0.2, 50)


def test_the_noise_multiplier_is_solved_from_a_target_and_an_unreachable_one_is_one_line():
    dp = PrivacySettings(clip=1.0, target_epsilon=8.0, rounds=20)
    z = solve_noise_multiplier(dp, "poisson", 0.2, 50)
    spent = epsilon(z, 20, 1 / 50, "poisson", 0.2, 50)
    assert spent <= 8.0 and spent == pytest.approx(8.0, rel=0.01)
    with pytest.raises(ConfigError, match=r"unreachable in 100000 rounds") as err:
        solve_noise_multiplier(dp.replace(target_epsilon=1e-3, rounds=100_000), "fixed", 1.0, 50)
    assert "\n" not in str(err.value)
    z = solve_noise_multiplier(dp.replace(target_epsilon=1000.0, rounds=1), "poisson", 1e-6, 10**6)
    assert MIN_NOISE < z and epsilon(z, 1, 1e-6, "poisson", 1e-6, 10**6) <= 1000.0  # the largest target solves


@pytest.mark.parametrize(
    ("dp", "message"),
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, "`dp.clip` must be a positive number"),
        ({"clip": -1.0, "noise_multiplier": 1.0}, "`dp.clip` must be a positive number"),
        ({"clip": 1.0, "noise_multiplier": -0.5}, "`dp.noise_multiplier` must be in [0, 100]"),
        ({"clip": 1.0, "noise_multiplier": 1e300}, "`dp.noise_multiplier` must be in [0, 100]"),
        ({"clip": 1.0, "target_epsilon": 1e300, "rounds": 3}, "`dp.target_epsilon` must be in (0, 1000]"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "max_epsilon": 1e300}, "`dp.max_epsilon` must be in (0, 1000]"),
        ({"clip": 1.0}, "needs `noise_multiplier`, or `target_epsilon`"),
        ({"clip": 1.0, "target_epsilon": 2.0}, "needs `dp.rounds`"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 1.5}, "`dp.delta` must be in (0, 1)"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "clip_on": "phone"}, "`clip_on` must be a string, one of 'cloud'"),
    ],
)
def test_bad_privacy_settings_are_one_line(dp, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        PrivacySettings.from_dict(dp)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp-clip", "1", "--dp-noise", "1"], "differential privacy needs the run's clients (--client"),
        (["--client", "a", "--dp-clip", "0", "--dp-noise", "1"], "`dp.clip` must be a positive number"),
        (["--client", "a", "--dp-clip", "1", "--dp-noise", "-1"], "`dp.noise_multiplier` must be in [0, 100]"),
        (
            ["--client", "a", "--client", "b", "--dp-clip", "1", "--dp-epsilon", "1e300", "--dp-rounds", "3"],
            "`dp.target_epsilon` must be in (0, 1000]",
        ),  # fmt: skip
        (
            ["--client", "a", "--client", "b", "--dp-clip", "1", "--dp-epsilon", "1", "--dp-rounds", "100000"],
            "is unreachable in 100000 rounds",
        ),
        (["--client", "a", "--dp-clip", "1", "--dp-noise", "1"], "with one client: delta = 1/N is 1"),
        (
            ["--client", "a", "--client", "b", "--dp-clip", "1", "--dp-noise", "1", "--algorithm", "fednest"],
            "fednest cannot run with",
        ),
        (
            ["--client", "a", "--client", "b", "--dp-clip", "1", "--dp-noise", "1", "--algorithm", "localot"],
            "localot cannot run with",
        ),
        (["--participation", "0"], "`participation` must be in (0, 1]"),
        (["--sampling", "lottery"], "`sampling` must be a string, one of 'fixed', 'poisson'"),
    ],
)
def test_prepare_refuses_bad_privacy_flags_in_one_line(demo_dir, tmp_path, extra, message):
    out = tmp_path / "run"
    result = runner.invoke(cloud, prepare_args(demo_dir, out, *extra))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and not out.exists()


def test_sampling_takes_a_fixed_count_or_each_client_with_probability_q():
    ids = [f"c{i:02d}" for i in range(50)]
    rng = random.Random(0)
    assert all(len(sample_clients(ids, 0.2, "fixed", rng)) == 10 for _ in range(20))
    sizes = [len(sample_clients(ids, 0.2, "poisson", rng, private=True)) for _ in range(2000)]
    assert sum(sizes) / len(sizes) == pytest.approx(10, rel=0.03)
    hits = {cid: 0 for cid in ids}
    for _ in range(2000):
        for cid in sample_clients(ids, 0.2, "poisson", rng, private=True):
            hits[cid] += 1
    assert all(300 < n < 500 for n in hits.values())  # each client about q of the rounds (400 expected)
    few = ["a", "b"]
    assert any(not sample_clients(few, 0.05, "poisson", rng, private=True) for _ in range(200))  # a round of no one
    assert all(sample_clients(few, 0.05, "poisson", rng) for _ in range(200))  # without DP: at least one


def test_edge_clipping_bounds_the_displacement_the_cloud_reconstructs(demo_dir, tmp_path):
    dp = {"clip": 0.05, "noise_multiplier": 0.0, "clip_on": "edge"}
    run = fast_run_config(demo_dir, client_ids=["a", "b"], dp=dp)
    root = two_clients_round0(run, demo_dir, tmp_path)
    bundle = Bundle.load(root / "run" / "bundles" / "cpu-laptop" / "round-0000")
    assert bundle.manifest["hyperparameters"]["displacement_clip"] == 0.05
    assert RoundHyperparams.from_dict(bundle.manifest["hyperparameters"]).displacement_clip == 0.05
    s = aggregate_files(root / "run", [root / "a.pkt", root / "b.pkt"])
    assert max(s["privacy"]["norms_before_clip"]) <= 0.05 * (1 + 1e-5)  # the edges clipped (fp32 codec)
    assert max(s["delta_norms"].values()) <= 0.05 * (1 + 1e-5)
    cloud = fast_run_config(demo_dir, client_ids=["a", "b"], dp={**dp, "clip_on": "cloud"})
    other = two_clients_round0(cloud, demo_dir, tmp_path / "cloud")
    assert (
        "displacement_clip" not in Bundle.load(other / "run/bundles/cpu-laptop/round-0000").manifest["hyperparameters"]
    )
    s = aggregate_files(other / "run", [other / "a.pkt", other / "b.pkt"])
    assert s["privacy"]["clipped"] == 2 and min(s["privacy"]["norms_before_clip"]) > 0.05  # the cloud clipped
    assert s["weights"] == [0.5, 0.5]  # uniform over D = 2, whatever each client's data size


def test_a_round_past_the_budget_is_refused_and_nothing_is_written(demo_dir, tmp_path):
    run = fast_run_config(demo_dir, client_ids=["a", "b"], dp={"clip": 1.0, "target_epsilon": 4.0, "rounds": 1})
    root = two_clients_round0(run, demo_dir, tmp_path)
    z = load_run(root / "run").privacy.noise_multiplier
    assert z > 0 and epsilon(z, 1, 0.5, "fixed", 1.0, 2) == pytest.approx(4.0, rel=0.01)
    first = aggregate_files(root / "run", [root / "a.pkt", root / "b.pkt"])
    assert first["privacy"]["epsilon"] <= 4.0 and first["privacy"]["rounds"] == 1
    manifest = Bundle.load(first["bundles"]["cpu-laptop"]).manifest
    assert manifest["privacy"]["epsilon"] == first["privacy"]["epsilon"]  # what v and c of round 1 have spent
    folder = RunFolder(root / "run")
    before = (folder.server_state / "state.json").read_bytes()
    with pytest.raises(BudgetError, match=r"round 1 would spend epsilon .* over the run's budget 4") as err:
        aggregate_files(root / "run", [root / "a.pkt"])  # round 1's budget is checked before its packets
    assert "\n" not in str(err.value)
    assert (folder.server_state / "state.json").read_bytes() == before
    assert ServerState.load(folder.server_state).round == 1 and not folder.bundle("cpu-laptop", 2).exists()


def test_a_private_study_reports_what_each_round_spent(demo_dir, tmp_path):
    cfg = fast_study(demo_dir, rounds=2, dp={"clip": 1.0, "target_epsilon": 6.0}, participation=0.67)
    simulate(cfg, tmp_path / "study")
    rows = [json.loads(line) for line in (tmp_path / "study" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["type"] == "round"]
    run = load_run(tmp_path / "study" / "run")
    release = PrivateRelease.of(run)
    assert run.dp["rounds"] == 2 and release.denominator == 2  # the study's rounds were planned; m = round(0.67 * 3)
    for r in rounds:
        assert r["privacy"]["epsilon"] == release.spent(r["round"] + 1).epsilon
        assert "norms_before_clip" not in r["privacy"] and len(r["participants"]) == 2
    assert rounds[-1]["privacy"]["epsilon"] <= 6.0
    last = Bundle.load(RunFolder(tmp_path / "study" / "run").bundle("cpu-laptop", 2)).manifest
    assert last["privacy"]["epsilon"] == rounds[-1]["privacy"]["epsilon"]
    result = runner.invoke(cloud, ["report", "--run", str(tmp_path / "study"), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert f"{rounds[-1]['privacy']['epsilon']:.3g} (δ 0.33)" in summary


def test_a_private_round_that_sampled_no_one_still_releases_its_noise(demo_dir, tmp_path):
    """Skipping it would tell who was (not) sampled; its mean is the noise alone, and no c_i moves."""
    run = fast_run_config(demo_dir, client_ids=["a", "b"], sampling="poisson", participation=0.5)
    private = run.replace(dp={"clip": 0.1, "noise_multiplier": 1.0})
    prepare(private, tmp_path / "run")
    before = ServerState.load(RunFolder(tmp_path / "run").server_state)
    s = aggregate_packets(tmp_path / "run", [], sampled=[])  # the round's draw named no one
    after = ServerState.load(RunFolder(tmp_path / "run").server_state)
    assert s["clients"] == [] and after.round == 1 and after.clients == before.clients == {}
    hp = RoundHyperparams.from_dict(private.hyperparameters)
    step = {
        k: (before.messenger[k] - after.messenger[k]) / (hp.tau * hp.local_steps * hp.eta) for k in before.messenger
    }
    noise = torch.cat([t.reshape(-1) for t in step.values()])
    assert float(noise.std()) == pytest.approx(1.0 * 0.1 / 1.0, rel=0.1)  # z C / D, D = q N = 1
    with pytest.raises(PacketError, match="a round needs at least one"):
        aggregate_packets(two_clients_round0(run, demo_dir, tmp_path / "plain") / "run", [])  # without DP: refused


def test_a_sampling_private_run_takes_only_its_rounds_draw(demo_dir, tmp_path):
    """Its epsilon counts on the sample simulate or serve drew: by hand, aggregate would credit an amplification
    nobody earned, so it refuses; a packet from a client outside the draw is refused too."""
    run = fast_run_config(
        demo_dir, client_ids=["a", "b", "c"], participation=0.67, dp={"clip": 1.0, "noise_multiplier": 1.0}
    )
    root = two_clients_round0(run, demo_dir, tmp_path)
    before = (RunFolder(root / "run").server_state / "state.json").read_bytes()
    packets = ["--packets", str(root / "a.pkt"), "--packets", str(root / "b.pkt")]
    result = runner.invoke(cloud, ["aggregate", "--run", str(root / "run"), *packets])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "run its rounds with `simulate` or `serve`" in lines[0]
    with pytest.raises(PacketError, match="client 'b' was not sampled this round"):
        aggregate_files(root / "run", [root / "a.pkt", root / "b.pkt"], sampled=["a", "c"])
    assert (RunFolder(root / "run").server_state / "state.json").read_bytes() == before
    assert aggregate_files(root / "run", [root / "a.pkt", root / "b.pkt"], sampled=["a", "b"])["next_round"] == 1


def test_simulate_refuses_rounds_the_budget_cannot_pay_before_it_trains(demo_dir, tmp_path):
    dp = {"clip": 1.0, "noise_multiplier": 0.8, "max_epsilon": 3.0}
    with pytest.raises(BudgetError, match=r"--rounds 3: the run's privacy budget epsilon 3 allows (\d+) rounds") as err:
        simulate(fast_study(demo_dir, rounds=3, dp=dp), tmp_path / "study")
    allowed = int(err.value.args[0].split("allows ")[1].split()[0])
    release = PrivateRelease(PrivacySettings.from_dict(dp), "fixed", 1.0, 3)
    assert release.spent(allowed).epsilon <= 3.0 < release.spent(allowed + 1).epsilon and allowed < 3
    assert not (tmp_path / "study").exists()
