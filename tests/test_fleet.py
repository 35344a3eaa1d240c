"""The fleet on loopback: `ciders-cloud serve` and `ciders-edge join` as real processes, TLS and
SuperNode authentication on, on the `tiny` model. Each test is bounded in time."""

import json
import os
import signal

import pytest
import torch
from fleet_harness import Fleet, flower_processes, wait_for
from test_simulate import _cfg as sim_cfg

from ciders_cloud.run_folder import RunFolder
from ciders_cloud.server_state import ServerState
from ciders_cloud.study.simulate import SimConfig, prepare_study, simulate
from ciders_edge.fleet.edge import PENDING
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.model.split import shift_layers


def _cfg(demo_dir, clients: int) -> SimConfig:
    """`test_simulate`'s fast tiny study, with the first ``clients`` of its data files."""
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code")[:clients]]
    return sim_cfg(demo_dir, clients=clients, data=data)


@pytest.fixture
def fleet_factory(tmp_path):
    fleets = []

    def make(cfg: SimConfig) -> tuple[Fleet, list[str]]:
        run_dir, ids, _ = prepare_study(cfg, tmp_path / "fleet")
        fleet = Fleet(run_dir, tmp_path / "edges")
        (tmp_path / "edges").mkdir()
        for cid in ids:
            fleet.register(cid)
        fleets.append(fleet)
        return fleet, ids

    yield make
    for f in fleets:
        f.close()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_edges_agree(fleet: Fleet, ids: list[str], server: ServerState) -> None:
    """After the run each edge has committed its last round, and its c_i is the cloud's copy."""
    for cid in ids:
        edge = ClientState.load(fleet.state(cid))
        assert not (fleet.state(cid) / PENDING).exists()
        assert _equal(edge.c_i, server.clients[cid]), cid


def test_fleet_matches_simulate_bit_exactly(demo_dir, tmp_path, fleet_factory):
    cfg = _cfg(demo_dir, clients=3)
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
        assert _equal(getattr(got, part), getattr(want, part)), part
    assert got.clients.keys() == want.clients.keys()
    assert all(_equal(got.clients[c], want.clients[c]) for c in ids)
    _check_edges_agree(fleet, ids, got)

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


def test_fleet_survives_a_dead_edge_and_a_cloud_restart(demo_dir, fleet_factory):
    fleet, (a, b) = fleet_factory(_cfg(demo_dir, clients=2))
    data = {cid: fleet.run_dir.parent / "data" / cid / "train.jsonl" for cid in (a, b)}
    fleet.serve(rounds=3, min_clients=2, timeout=60)  # a round waits this long for a dead edge
    fleet.join(a, data[a])
    fleet.join(b, data[b])
    fleet.wait_for_round(1, timeout=300)
    fleet.kill(b)  # the edge dies as round 1 starts
    fleet.wait_for_round(2, timeout=300)  # round 1 closes with the other after the timeout
    fleet.kill("cloud")  # the cloud host dies between rounds: serve, SuperLink, ServerApp
    fleet.join(b, data[b])  # the edge comes back
    fleet.serve(rounds=3, min_clients=2, timeout=60, name="cloud-again")
    assert fleet.wait("cloud-again", timeout=400) == 0, fleet.log("cloud-again")
    assert "at round 2 of 3" in fleet.log("cloud-again")  # resumed from the run folder

    rounds = [r for r in fleet.fleet_log() if r["type"] == "round"]
    assert [(r["round"], r["clients"]) for r in rounds] == [(0, [a, b]), (1, [a]), (2, [a, b])]
    assert rounds[1]["left_out"] == [b]
    server = ServerState.load(RunFolder(fleet.run_dir).server_state)
    assert server.round == 3
    _check_edges_agree(fleet, [a, b], server)
    assert ClientState.load(fleet.state(b)).counters["rounds"] == 2  # rounds 0 and 2


def test_a_mixed_fleet_serves_each_edge_its_profile_and_matches_simulate(demo_dir, tmp_path, fleet_factory):
    """A laptop and a Pi in one fleet: each announces its profile at join, gets its profile's bundle (its own
    learnable backbone, its own trained depth), and the run ends where `simulate --profile-mix` ends, bit for bit."""
    mix = {"profile_mix": "cpu-laptop:1,rpi5-8gb:1", "drop_ratio": 0.0}
    mix["profile_splits"] = {"rpi5-8gb": {"messenger_depth": 1, "drop_ratio": 0.5}}
    cfg = _cfg(demo_dir, clients=2).replace(rounds=2, **mix)
    simulate(cfg, tmp_path / "sim")
    fleet, (a, b) = fleet_factory(cfg)
    fleet.serve(rounds=2, min_clients=2, timeout=120)
    fleet.join(a, fleet.run_dir.parent / "data" / a / "train.jsonl")
    fleet.join(b, fleet.run_dir.parent / "data" / b / "train.jsonl", profile="rpi5-8gb")
    assert fleet.wait("cloud", timeout=600) == 0, fleet.log("cloud")[-4000:]

    got, want = (ServerState.load(RunFolder(r).server_state) for r in (fleet.run_dir, tmp_path / "sim" / "run"))
    for part in ("messenger", "consensus", "backbone"):
        assert _equal(getattr(got, part), getattr(want, part)), part
    assert all(_equal(got.clients[c], want.clients[c]) for c in (a, b))
    pi = ClientState.load(fleet.state(b))
    assert Bundle.load(fleet.state(b) / "bundle").manifest["profile"]["name"] == "rpi5-8gb"
    assert pi.kept_layers == [0, 2, 5]  # the Pi's backbone; its c_i, named by its AdapEmu, is the cloud's
    assert _equal(shift_layers(pi.c_i, 3), got.clients[b]) and len(pi.c_i) < len(got.messenger)
    assert _equal(ClientState.load(fleet.state(a)).c_i, got.clients[a])


def test_unregistered_node_is_refused(demo_dir, fleet_factory):
    fleet, (a,) = fleet_factory(_cfg(demo_dir, clients=1))
    fleet.serve(rounds=1, min_clients=1, timeout=15)
    stranger = fleet.state("stranger")
    stranger.mkdir()
    data = fleet.run_dir.parent / "data" / a / "train.jsonl"
    fleet.join("stranger", data, "--admit-wait", "5")  # its key is made by join and never registered
    assert fleet.wait("stranger", timeout=60) == 1  # gives up after --admit-wait, not the default 60 s
    assert "did not admit this node" in fleet.log("stranger")
    assert json.loads((fleet.run_dir / "server" / "state.json").read_text())["round"] == 0


def test_kill_9_of_serve_alone_ends_every_process_it_started(demo_dir, fleet_factory):
    """SIGKILL to serve's pid only (its process group lives on): the SuperLink, Flower's SuperExec (in a
    session of its own) and the ServerApp end with it instead of lingering on the run's ports."""
    fleet, _ = fleet_factory(_cfg(demo_dir, clients=1))
    fleet.serve(rounds=1, min_clients=1, timeout=60)  # no edge joins: the ServerApp waits for one
    home = RunFolder(fleet.run_dir).flower_home
    running = wait_for(
        lambda: (p := flower_processes(home)) and any("flwr-serverapp" in c for c in p.values()) and p,
        timeout=120,
        what="the ServerApp running",
    )
    assert any("ciders_cloud.fleet.superlink" in c for c in running.values()), running
    serve = fleet.procs.pop("cloud")
    os.kill(serve.pid, signal.SIGKILL)
    serve.wait()
    # the kernel signals each child as its parent dies; 10 s is the least the linger was seen to last
    wait_for(lambda: not flower_processes(home), timeout=10, what=lambda: f"these ending: {flower_processes(home)}")
