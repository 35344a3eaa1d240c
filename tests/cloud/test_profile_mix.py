"""One fleet, several profiles: each profile trains its own top messenger layers on its own learnable
backbone; the cloud aggregates layer by layer (eq. 11-13 per layer) on `tiny`."""

import json
import shutil

import pytest
import torch
from conftest import fast_run_config
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.preparation import prepare
from ciders_cloud.round.aggregate import aggregate_files
from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.run.splits import fleet_split
from ciders_cloud.strategies import check_run
from ciders_cloud.strategies.aggregation import aggregate, participation_weights, weighted_sum
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.report import report
from ciders_edge.errors import ConfigError
from ciders_edge.fleet.edge import cloud_digest
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.packet import Packet
from ciders_edge.model.split import layer_of, shift_layers
from ciders_edge.profiles import load_profile
from ciders_edge.training.equations import reconstruct_displacement
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()
LAPTOP, PI = "cpu-laptop", "rpi5-8gb"
# tiny has 8 layers; messenger a = 2: the laptop trains both on a backbone of all 6 layers, the Pi the
# top one on a backbone of 3 (kept [0, 2, 5]), so its messenger layers sit 3 AdapEmu indices lower
MIXED = {"messenger_depth": 2, "drop_ratio": 0.0, "profile_splits": {PI: {"messenger_depth": 1, "drop_ratio": 0.5}}}


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_eq12_per_layer_by_hand():
    """Layer 4 is trained by client A only, layer 5 by A and B, layer 6 by nobody this round."""
    v = {"layers.4.w": _t(1, 1), "layers.5.w": _t(2, 2), "layers.6.w": _t(3, 3)}
    c = {"layers.4.w": _t(0.5, 0), "layers.5.w": _t(0, 0.5), "layers.6.w": _t(1, 1)}
    deltas = [{"layers.4.w": _t(1, 2), "layers.5.w": _t(3, 4)}, {"layers.5.w": _t(-1, 0)}]
    p = participation_weights([30, 10])  # |D_A| = 30, |D_B| = 10
    tau, k, eta, alpha = 1.0, 2, 0.1, 0.5
    v_new, c_new = aggregate(v, c, deltas, p, tau, k, eta, alpha)
    mean5 = 0.75 * _t(3, 4) + 0.25 * _t(-1, 0)  # layer 5: both clients, weights 30/40 and 10/40
    assert torch.allclose(v_new["layers.4.w"], _t(1, 1) - 0.2 * _t(1, 2))  # layer 4: A alone, weight 1
    assert torch.allclose(v_new["layers.5.w"], _t(2, 2) - 0.2 * mean5)
    assert torch.equal(v_new["layers.6.w"], v["layers.6.w"]) and torch.equal(c_new["layers.6.w"], c["layers.6.w"])
    assert torch.allclose(c_new["layers.4.w"], 0.5 * _t(0.5, 0) + 0.5 * _t(1, 2))
    assert torch.allclose(c_new["layers.5.w"], 0.5 * _t(0, 0.5) + 0.5 * mean5)


def test_eq12_is_the_papers_to_the_bit_when_every_client_trains_every_layer():
    torch.manual_seed(0)
    v = {f"layers.{i}.w": torch.randn(64) for i in range(3)}
    c = {k: torch.randn(64) for k in v}
    deltas = [{k: torch.randn(64) for k in v} for _ in range(3)]
    p = participation_weights([7, 11, 13])
    v_new, c_new = aggregate(v, c, deltas, p, 1.0, 5, 3e-3, 0.3)
    mean = weighted_sum(deltas, p, v)  # eq. (12) as written, before it went per layer
    assert all(torch.equal(v_new[k], v[k] + (-1.0 * 5 * 3e-3) * mean[k]) for k in v)
    assert all(torch.equal(c_new[k], (1 - 0.3) * c[k] + 0.3 * mean[k]) for k in c)


def test_fleet_split_takes_each_profiles_depth_and_backbone():
    laptop, pi = load_profile(LAPTOP), load_profile(PI)
    assert fleet_split([laptop], None, None) == {"messenger_depth": 6, "drop_ratio": 0.2}
    assert fleet_split([laptop, pi], None, None) == {
        "messenger_depth": 6,
        "drop_ratio": 0.2,
        "profile_splits": {PI: {"messenger_depth": 2, "drop_ratio": 0.5}},
    }
    assert fleet_split([laptop, pi], None, 0.3)["profile_splits"] == {PI: {"messenger_depth": 2, "drop_ratio": 0.3}}


def test_a_profile_deeper_than_the_messenger_is_refused_with_the_range(tmp_path, demo_dir):
    with pytest.raises(ConfigError, match=r"profile rpi5-8gb trains 3 messenger layers.*allowed 1\.\.2"):
        RunConfig(profiles=[LAPTOP, PI], messenger_depth=2, profile_splits={PI: {"messenger_depth": 3}})
    out = tmp_path / "run"
    args = ["prepare", "--model", "tiny", "--profile", LAPTOP, "--profile", PI, "--messenger-depth", "4"]
    r = runner.invoke(cloud, [*args, "--public-data", str(demo_dir / "public.jsonl"), "--out", str(out)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "profile cpu-laptop trains 6 messenger layers, but the run's messenger has 4: allowed 1..4" in r.stderr
    assert not out.exists()


def test_fednest_needs_one_split_and_prepare_refuses_before_any_work(tmp_path):
    run = RunConfig(profiles=[LAPTOP, PI], algorithm="fednest", **MIXED)  # the run's data are fine
    for make in (lambda: check_run(run), lambda: prepare(run, tmp_path / "run")):
        with pytest.raises(ConfigError, match="fednest needs one messenger depth and one learnable backbone"):
            make()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"profile_splits": {PI: {"messenger_depth": "two"}}}, "takes an integer `messenger_depth`"),
        ({"profile_splits": {PI: {"drop_ratio": True}}}, "a number `drop_ratio`"),
        ({"profile_splits": {PI: {"depth": 1}}}, "`profile_splits.rpi5-8gb` takes"),
        ({"profile_splits": {"cuda-24gb": {"messenger_depth": 1}}}, "'cuda-24gb' is not one of the run's profiles"),
        ({"profile_splits": {PI: {"drop_ratio": 0.2000001}}}, "too close to tell apart"),
        ({"drop_ratio": 0.3, "profile_splits": {p: {"drop_ratio": 0.5} for p in (LAPTOP, PI)}}, "no profile runs"),
    ],
)
def test_bad_profile_splits_are_one_line_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**{"profiles": [LAPTOP, PI], "messenger_depth": 2, "drop_ratio": 0.2, **changes})


def test_an_edge_of_a_profile_the_run_lacks_is_told_so():
    request = {"c_i_digest": "v", "c_i_digests": json.dumps({LAPTOP: "x", PI: "y"})}
    assert cloud_digest(request, PI) == "y" and cloud_digest({"c_i_digest": "v"}, PI) == "v"
    with pytest.raises(ConfigError, match="ships no bundle for profile 'cuda-24gb'; it ships cpu-laptop, rpi5-8gb"):
        cloud_digest(request, "cuda-24gb")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, demo_dir):
    """A prepared mixed run, and round 0's packets: client a on the laptop, b and c on the Pi."""
    from ciders_cloud import prepare

    root = tmp_path_factory.mktemp("mixed")
    prepare(fast_run_config(demo_dir, profiles=[LAPTOP, PI], storage="fp32", **MIXED), root / "run")
    for cid, profile, family in (("a", LAPTOP, "dates"), ("b", PI, "code"), ("c", PI, "arithmetic")):
        bundle, data = RunFolder(root / "run").bundle(profile, 0), demo_dir / family / "train.jsonl"
        train(bundle, data, root / cid, root / f"{cid}.pkt", RoundOptions(profile=profile, client_id=cid))
    return root


def test_each_profile_gets_its_backbone_and_trains_its_top_layers(mixed):
    laptop, pi = (Bundle.load(RunFolder(mixed / "run").bundle(p, 0)) for p in (LAPTOP, PI))
    assert laptop.manifest["split"]["kept"] == [0, 1, 2, 3, 4, 5] and "trained" not in laptop.manifest["split"]
    assert pi.manifest["split"]["kept"] == [0, 2, 5] and pi.manifest["split"]["trained"] == 1
    assert sorted({layer_of(k) for k in laptop.messenger_lora()}) == [6, 7]
    assert sorted({layer_of(k) for k in pi.messenger_lora()}) == [3, 4]  # the whole messenger, at v
    assert sorted({layer_of(k) for k in pi.consensus()}) == [4]  # c of the layer it trains
    # the Pi's packet and c_i hold its top layer only; its personalized messenger keeps the lower one at v
    assert {layer_of(k) for k in Packet.load(mixed / "b.pkt").tensors} == {4}
    state = ClientState.load(mixed / "b")
    assert {layer_of(k) for k in state.c_i} == {4}
    frozen = {k: t for k, t in pi.messenger_lora().items() if layer_of(k) == 3}
    assert all(torch.equal(state.personalized[k], t.float()) for k, t in frozen.items())
    assert not all(torch.equal(state.personalized[k], t.float()) for k, t in pi.messenger_lora().items())


def test_an_edge_that_changed_profile_is_told_so_not_that_its_state_was_lost(mixed, tmp_path):
    """Client b trained round 0 as the Pi; joined again as a laptop, its state matches the cloud's c_i under
    the Pi's names: the refusal names the profile change, and the state stays as it was."""
    from ciders_cloud.fleet.coordinator import Coordinator, Edge
    from ciders_edge.errors import StateError
    from ciders_edge.fleet.edge import other_profiles, settle

    shutil.copytree(mixed / "run", tmp_path / "run")
    aggregate_files(tmp_path / "run", [mixed / f"{c}.pkt" for c in "abc"])
    request = Coordinator(tmp_path / "run").sync_request(Edge(0, "b"))
    shutil.copytree(mixed / "b", tmp_path / "b")
    assert settle(tmp_path / "b", "b", cloud_digest(request, PI), 1, other_profiles(request, PI)).round == 0
    with pytest.raises(StateError, match=f"this state trained as profile {PI}, and this node now runs another"):
        settle(tmp_path / "b", "b", cloud_digest(request, LAPTOP), 1, other_profiles(request, LAPTOP))
    with pytest.raises(StateError, match="trained outside this run"):  # no profile's copy: a foreign state
        settle(tmp_path / "b", "b", cloud_digest(request, LAPTOP), 1, {})
    assert ClientState.load(tmp_path / "b").round == 0


def test_the_frozen_messenger_layers_draw_no_randomness(mixed, tmp_path, demo_dir):
    """The Pi's lower messenger layer is frozen: no LoRA dropout there (at round 1, where v moved it), so
    its round does not depend on the process's RNG and a fleet edge trains it as `simulate` does."""
    shutil.copytree(mixed / "run", tmp_path / "run")
    aggregate_files(tmp_path / "run", [mixed / f"{c}.pkt" for c in "abc"])
    bundle, data = RunFolder(tmp_path / "run").bundle(PI, 1), demo_dir / "code" / "train.jsonl"
    packets = []
    for seed in (1, 2):
        shutil.copytree(mixed / "b", tmp_path / f"state-{seed}")
        state = ClientState.load(tmp_path / f"state-{seed}")
        state.rng = torch.Generator().manual_seed(seed).get_state()  # another process's RNG after round 0
        state.save(tmp_path / f"state-{seed}")
        train(
            bundle, data, tmp_path / f"state-{seed}", tmp_path / f"{seed}.pkt", RoundOptions(profile=PI, client_id="b")
        )
        packets.append(Packet.load(tmp_path / f"{seed}.pkt").tensors)
    assert packets[0].keys() == packets[1].keys()
    assert all(torch.equal(packets[0][k], packets[1][k]) for k in packets[0])


def test_per_layer_aggregation_on_tiny_by_hand(mixed, tmp_path):
    shutil.copytree(mixed / "run", tmp_path / "run")
    run = tmp_path / "run"
    before = ServerState.load(RunFolder(run).server_state)
    hp = json.loads((RunFolder(run).bundle(LAPTOP, 0) / "manifest.json").read_text())["hyperparameters"]
    summary = aggregate_files(run, [mixed / f"{c}.pkt" for c in "abc"])
    after = ServerState.load(RunFolder(run).server_state)

    # eq. (11) by hand: each packet's Δc renamed to v's names (the Pi's messenger sits 3 layers lower)
    packets = {c: Packet.load(mixed / f"{c}.pkt") for c in "abc"}
    dc = {"a": packets["a"].tensors, **{c: shift_layers(packets[c].tensors, 3) for c in "bc"}}
    zero = {c: {k: torch.zeros_like(t) for k, t in dc[c].items()} for c in "abc"}  # c_i before round 0
    delta = {c: reconstruct_displacement(dc[c], zero[c], before.consensus, hp["alpha"], hp["gamma"]) for c in "abc"}
    n = {c: packets[c].num_examples for c in "abc"}
    step = hp["tau"] * hp["local_steps"] * hp["eta"]
    for k, v in before.messenger.items():
        who = [c for c in "abc" if k in delta[c]]
        assert who == (["a", "b", "c"] if layer_of(k) == 7 else ["a"])  # layer 6: the laptop's alone
        mean = sum(n[c] / sum(n[w] for w in who) * delta[c][k] for c in who)
        assert torch.allclose(after.messenger[k], v - step * mean, rtol=1e-5, atol=1e-7), k
        want_c = (1 - hp["alpha"]) * before.consensus[k] + hp["alpha"] * mean
        assert torch.allclose(after.consensus[k], want_c, rtol=1e-5, atol=1e-7), k
    for c in "abc":  # each c_i is kept on the layers its client trains
        assert after.clients[c].keys() == dc[c].keys()
        assert all(torch.equal(after.clients[c][k], t) for k, t in dc[c].items())
    assert set(summary["backbones"]) == {"drop0", "drop0.5"}
    assert all(b["takd_steps"] == 1 and b["takd_seconds"] > 0 for b in summary["backbones"].values())
    # round 1's Pi bundle holds the new v, as its backbone names it
    pi1 = Bundle.load(RunFolder(run).bundle(PI, 1))
    assert all(torch.equal(pi1.messenger_lora()[k], t) for k, t in shift_layers(after.messenger, -3).items())


def test_a_packet_with_a_layer_its_profile_does_not_train_is_refused(mixed, tmp_path):
    shutil.copytree(mixed / "run", tmp_path / "run")
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in RunFolder(run).server_state.iterdir()}
    p = Packet.load(mixed / "b.pkt")
    lower = {k.replace("layers.4.", "layers.3."): t for k, t in p.tensors.items()}  # the layer the Pi froze
    fields = {"client_id": p.client_id, "round": p.round, "bundle_id": p.bundle_id, "codec": p.codec}
    bad = Packet(**fields, num_examples=p.num_examples, tensors={**p.tensors, **lower}, metrics=p.metrics)
    bad.save(tmp_path / "bad.pkt")
    args = ["aggregate", "--run", str(run), "--packets", str(mixed / "a.pkt"), "--packets", str(tmp_path / "bad.pkt")]
    r = runner.invoke(cloud, args)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "is of messenger layer 3, which profile rpi5-8gb does not train (it trains layers 4..4" in r.stderr
    assert {p.name: p.read_bytes() for p in RunFolder(run).server_state.iterdir()} == before
    assert not RunFolder(run).bundle(PI, 1).exists()


def test_a_client_that_changes_profile_is_told_to_join_anew(mixed, tmp_path, demo_dir):
    shutil.copytree(mixed / "run", tmp_path / "run")
    aggregate_files(tmp_path / "run", [mixed / f"{c}.pkt" for c in "abc"])  # b trained the Pi's layer
    bundle = RunFolder(tmp_path / "run").bundle(LAPTOP, 1)
    train(
        bundle,
        demo_dir / "code" / "train.jsonl",
        tmp_path / "b-laptop",
        tmp_path / "b.pkt",
        RoundOptions(client_id="b"),
    )
    r = runner.invoke(cloud, ["aggregate", "--run", str(tmp_path / "run"), "--packets", str(tmp_path / "b.pkt")])
    assert r.exit_code == 1 and "a device that changes profile joins as a new client id" in r.stderr


def test_one_profile_in_a_two_profile_run_equals_a_one_profile_run(tmp_path, demo_dir):
    """Every client on the laptop: a run that also ships the Pi a bundle (same split, so one backbone)
    and a run of the laptop alone aggregate to the same v, c and backbone LoRA, bit for bit."""
    from ciders_cloud import prepare

    states = []
    for name, profiles in (("one", [LAPTOP]), ("two", [LAPTOP, PI])):
        run = tmp_path / name
        prepare(fast_run_config(demo_dir, profiles=profiles, storage="fp32"), run)
        packets = []
        for cid, family in (("a", "dates"), ("b", "code")):
            bundle = RunFolder(run).bundle(LAPTOP, 0)
            out = tmp_path / f"{name}-{cid}.pkt"
            train(
                bundle, demo_dir / family / "train.jsonl", tmp_path / f"{name}-{cid}", out, RoundOptions(client_id=cid)
            )
            packets.append(out)
        aggregate_files(run, packets)
        states.append(ServerState.load(RunFolder(run).server_state))
    one, two = states
    for part in ("messenger", "consensus", "backbone", "optimizer"):
        a, b = getattr(one, part), getattr(two, part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_simulate_a_profile_mix_through_the_cli(tmp_path, demo_dir):
    config = tmp_path / "mix.toml"
    config.write_text(
        "messenger_depth = 2\ndrop_ratio = 0.0\nlayer_steps = 2\nalign_steps = 1\n"
        "[profile_splits.rpi5-8gb]\nmessenger_depth = 1\ndrop_ratio = 0.5\n"
        "[takd]\nseq_len = 64\nbatch_size = 2\n[hyperparameters]\ntakd_steps = 1\n"
    )
    data = [x for f in ("arithmetic", "dates", "code") for x in ("--data", str(demo_dir / f / "train.jsonl"))]
    args = ["simulate", "--model", "tiny", "--config", str(config), "--profile-mix", f"{LAPTOP}:2,{PI}:1", *data]
    args += ["--partition", "per-file", "--rounds", "1", "--local-steps", "2", "--max-records", "14"]
    args += ["--eval-examples", "2", "--eval-generate", "1", "--out", str(tmp_path / "study"), "--json"]
    r = runner.invoke(cloud, args)
    assert r.exit_code == 0, r.output[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "study" / "metrics.jsonl").read_text().splitlines()]
    profiles = {r["client"]: r["profile"] for r in rows if r["type"] == "eval"}
    assert profiles == {"client-00": LAPTOP, "client-01": LAPTOP, "client-02": PI}
    assert {r["profile"] for r in rows if r["type"] == "cross"} == {LAPTOP, PI}
    [round0] = [r for r in rows if r["type"] == "round"]
    assert set(round0["backbones"]) == {"drop0", "drop0.5"}  # each one's TAKD cost and fidelity
    assert json.loads((tmp_path / "study" / "config.json").read_text())["clients"] == 3
    report([tmp_path / "study"], tmp_path / "report")
    table = (tmp_path / "report" / "summary.md").read_text().split("each client on its profile")[1]
    assert "| client-02 | rpi5-8gb | code |" in table and table.count("| cpu-laptop |") == 2
    bad = runner.invoke(cloud, [*args[:-3], "--clients", "2", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 1 and "makes 3 clients, but `clients` is 2" in bad.stderr


def test_a_profile_mix_is_parsed_or_refused():
    cfg = SimConfig(data=["x"], clients=3, profile_mix=f"{LAPTOP}:2, {PI}:1")
    assert cfg.client_profiles(["a", "b", "c"]) == {"a": LAPTOP, "b": LAPTOP, "c": PI}
    for text in (f"{LAPTOP}:0", f"{LAPTOP}", f"{LAPTOP}:1,{LAPTOP}:2"):
        with pytest.raises(ConfigError, match="PROFILE:COUNT"):
            SimConfig(data=["x"], clients=1, profile_mix=text)
