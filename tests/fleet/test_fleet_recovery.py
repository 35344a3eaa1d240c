"""The fleet when things go wrong, on loopback as in test_fleet.py: an edge that dies and a cloud that
restarts, a node the cloud never registered, and `kill -9` of `serve`. Each test is bounded in time."""

import json
import os
import signal

from fleet_harness import check_edges_agree, fleet_config, wait_for

from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.fleet.processes import flower_processes
from ciders_edge.formats.client_state import ClientState


def test_fleet_survives_a_dead_edge_and_a_cloud_restart(demo_dir, fleet_factory):
    fleet, (a, b) = fleet_factory(fleet_config(demo_dir, clients=2))
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
    check_edges_agree(fleet, [a, b], server)
    assert ClientState.load(fleet.state(b)).counters["rounds"] == 2  # rounds 0 and 2


def test_unregistered_node_is_refused(demo_dir, fleet_factory):
    fleet, (a,) = fleet_factory(fleet_config(demo_dir, clients=1))
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
    fleet, _ = fleet_factory(fleet_config(demo_dir, clients=1))
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
    # the kernel signals each child as its parent dies, and each stops gracefully: seconds, more under load
    wait_for(lambda: not flower_processes(home), timeout=60, what=lambda: f"these ending: {flower_processes(home)}")
