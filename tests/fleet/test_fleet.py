"""The fleet on loopback: `ciders-cloud serve` and `ciders-edge join` as real processes, TLS and
SuperNode authentication on, on the `tiny` model: a fleet run ends where `simulate` ends, bit for bit.
Each test is bounded in time; a fleet's failures are in test_fleet_recovery.py."""

from fleet_harness import check_edges_agree, equal_tensors, fleet_config

from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.study.simulate import simulate
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.model.split import shift_layers


def test_fleet_matches_simulate_bit_exactly(demo_dir, tmp_path, fleet_factory):
    cfg = fleet_config(demo_dir, clients=3)
    simulate(cfg, tmp_path / "sim")
    fleet, ids = fleet_factory(cfg)
    sim_run = tmp_path / "sim" / "run"
    assert Bundle.load(RunFolder(fleet.run_dir).bundle("cpu-laptop", 0)).bundle_id == (
        Bundle.load(RunFolder(sim_run).bundle("cpu-laptop", 0)).bundle_id
    )
    fleet.serve(rounds=3, min_clients=3, timeout=120)
    for cid in ids:
        fleet.join(cid, fleet.run_dir.parent / "data" / cid / "train.jsonl")
    assert fleet.wait("cloud", timeout=600) == 0, fleet.log("cloud")[-4000:]

    got, want = (ServerState.load(RunFolder(r).server_state) for r in (fleet.run_dir, sim_run))
    assert got.round == want.round == 3
    for part in ("messenger", "consensus", "backbone"):  # v, c and the learnable-backbone LoRA
        assert equal_tensors(getattr(got, part), getattr(want, part)), part
    assert got.clients.keys() == want.clients.keys()
    assert all(equal_tensors(got.clients[c], want.clients[c]) for c in ids)
    check_edges_agree(fleet, ids, got)

    log = fleet.fleet_log()
    rounds = [r for r in log if r["type"] == "round"]
    assert [r["clients"] for r in rounds] == [ids] * 3
    clients = [r for r in log if r["type"] == "client"]
    assert all(r["status"] == "aggregated" for r in clients)
    full = Bundle.load(RunFolder(fleet.run_dir).bundle("cpu-laptop", 0))
    full_bytes = full.delta_bytes(None)
    sent = {(r["round"], r["client"]): r for r in clients}
    for cid in ids:
        assert sent[0, cid]["bytes_down"] == full_bytes  # round 0 ships the whole bundle
        for t in (1, 2):  # later rounds only what changed: LoRA, consensus, manifest
            assert 0 < sent[t, cid]["bytes_down"] < 0.2 * full_bytes
            assert "backbone.safetensors" not in sent[t, cid]["files_down"]
            packet = (tmp_path / "sim" / "packets" / f"round-{t:04d}" / f"{cid}.pkt").stat().st_size
            assert sent[t, cid]["bytes_up"] == packet  # the same Δc packet as simulate's, byte for byte


def test_a_mixed_fleet_serves_each_edge_its_profile_and_matches_simulate(demo_dir, tmp_path, fleet_factory):
    """A laptop and a Pi in one fleet: each announces its profile at join, gets its profile's bundle (its own
    learnable backbone, its own trained depth), and the run ends where `simulate --profile-mix` ends, bit for bit."""
    mix = {"profile_mix": "cpu-laptop:1,rpi5-8gb:1", "drop_ratio": 0.0}
    mix["profile_splits"] = {"rpi5-8gb": {"messenger_depth": 1, "drop_ratio": 0.5}}
    cfg = fleet_config(demo_dir, clients=2).replace(rounds=2, **mix)
    simulate(cfg, tmp_path / "sim")
    fleet, (a, b) = fleet_factory(cfg)
    fleet.serve(rounds=2, min_clients=2, timeout=120)
    fleet.join(a, fleet.run_dir.parent / "data" / a / "train.jsonl")
    fleet.join(b, fleet.run_dir.parent / "data" / b / "train.jsonl", profile="rpi5-8gb")
    assert fleet.wait("cloud", timeout=600) == 0, fleet.log("cloud")[-4000:]

    got, want = (ServerState.load(RunFolder(r).server_state) for r in (fleet.run_dir, tmp_path / "sim" / "run"))
    for part in ("messenger", "consensus", "backbone"):
        assert equal_tensors(getattr(got, part), getattr(want, part)), part
    assert all(equal_tensors(got.clients[c], want.clients[c]) for c in (a, b))
    pi = ClientState.load(fleet.state(b))
    assert Bundle.load(fleet.state(b) / "bundle").manifest["profile"]["name"] == "rpi5-8gb"
    assert pi.kept_layers == [0, 2, 5]  # the Pi's backbone; its c_i, named by its AdapEmu, is the cloud's
    assert equal_tensors(shift_layers(pi.c_i, 3), got.clients[b]) and len(pi.c_i) < len(got.messenger)
    assert equal_tensors(ClientState.load(fleet.state(a)).c_i, got.clients[a])


def test_a_fleet_that_rechooses_deploys_what_simulate_deploys(demo_dir, tmp_path, fleet_factory):
    """`serve --rechoose`: after each round every online edge gets the new bundle and chooses its deployed
    messenger again (Flower's evaluate messages); the edges end deploying what `simulate --rechoose`'s clients
    deploy, bit for bit, and the cloud's log says what each chose."""
    cfg = fleet_config(demo_dir, clients=2).replace(rounds=2, max_records=20, val_fraction=0.1, rechoose=True)
    simulate(cfg, tmp_path / "sim")
    fleet, ids = fleet_factory(cfg)
    fleet.serve(2, 2, 120, "--rechoose")
    for cid in ids:
        fleet.join(cid, fleet.run_dir.parent / "data" / cid / "train.jsonl", "--val-fraction", "0.1")
    assert fleet.wait("cloud", timeout=600) == 0, fleet.log("cloud")[-4000:]

    for cid in ids:
        got, want = ClientState.load(fleet.state(cid)), ClientState.load(tmp_path / "sim" / "clients" / cid)
        assert got.best_info == want.best_info and got.best_info["scored_round"] == 2, cid
        assert equal_tensors(got.best, want.best), cid
    rechosen = [r for r in fleet.fleet_log() if r["type"] == "rechoice"]
    assert [(r["bundle_round"], r["client"], r["status"]) for r in rechosen] == [
        (t, cid, "chosen") for t in (1, 2) for cid in ids
    ]
    assert all(r["edge"]["deployed_nll"] > 0 and "val_nll_kept" in r["edge"] for r in rechosen)
