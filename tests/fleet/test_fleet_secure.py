"""Secure aggregation on loopback (docs/privacy.md): four edges, Flower's SecAgg+, one edge killed while it
trains. The round closes with the other three, its v and c are their plain aggregate within SecAgg+'s
quantization error, and no file of the cloud's holds one edge's displacement."""

from pathlib import Path

import numpy as np
import torch
from fleet_harness import wait_for
from tiny_runs import fast_study

from ciders_cloud.fleet.secure import CLIP_RANGE, QUANTIZATION
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.hyperparams import RoundHyperparams


def _training(state: Path) -> bool:
    """The edge has installed round 0's bundle: it is loading the model and training, not yet answering."""
    return (state / "bundle" / "manifest.json").is_file()


def _holds(root: Path, needles: list[bytes]) -> list[str]:
    """Files under ``root`` that contain any of ``needles``."""
    found = []
    for path in (p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [str(path) for n in needles if n in data]
    return found


def test_a_secure_round_survives_a_dead_edge_and_the_cloud_sees_only_the_mean(demo_dir, fleet_factory):
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code", "units")]
    fleet, ids = fleet_factory(fast_study(demo_dir, clients=4, data=data, rounds=1))
    before = ServerState.load(RunFolder(fleet.run_dir).server_state)
    fleet.serve(1, 4, 45, "--secure-aggregation")
    for cid in ids:
        fleet.join(cid, fleet.run_dir.parent / "data" / cid / "train.jsonl")
    *alive, victim = ids
    wait_for(lambda: _training(fleet.state(victim)), timeout=300, what=f"{victim} training round 0")
    fleet.kill(victim)  # after it shared its keys, before it sent its masked displacement
    assert fleet.wait("cloud", timeout=400) == 0, fleet.log("cloud")[-4000:]

    server = ServerState.load(RunFolder(fleet.run_dir).server_state)
    assert server.round == 1 and server.clients == {} and server.summed == dict.fromkeys(alive, 0)
    hp = RoundHyperparams.from_dict(
        Bundle.load(RunFolder(fleet.run_dir).bundle("cpu-laptop", 0)).manifest["hyperparameters"]
    )
    # round 0 starts from c = c_i = 0, so eq. (11) is Delta_i = dc_i / alpha, and dc_i is each edge's committed c_i
    deltas = {cid: {k: t / hp.alpha for k, t in ClientState.load(fleet.state(cid)).c_i.items()} for cid in alive}
    mean = {k: sum(d[k].double() for d in deltas.values()) / len(alive) for k in before.messenger}
    step = hp.tau * hp.local_steps * hp.eta
    err = 2 * CLIP_RANGE / QUANTIZATION  # per element of the mean: one stochastic-rounding step
    for k, v0 in before.messenger.items():
        assert torch.allclose(server.messenger[k].double(), v0.double() - step * mean[k], atol=step * err + 1e-6), k
        assert torch.allclose(server.consensus[k].double(), hp.alpha * mean[k], atol=hp.alpha * err + 1e-7), k
    assert max(float(m.abs().max()) for m in mean.values()) > 100 * err  # the test can tell a wrong mean

    log = fleet.fleet_log()
    rounds = [r for r in log if r["type"] == "round"]
    assert [(r["round"], r["clients"], r["left_out"]) for r in rounds] == [(0, alive, [victim])]
    said = [r["edge"] for r in log if r["type"] == "client" and "edge" in r]  # what each edge said in the clear
    assert len(said) == 3 and all(set(e) == {"round", "steps", "loss_first", "loss_last"} for e in said)
    # no file of the cloud's (state, logs, the SuperLink's database) holds one edge's displacement or Δc
    needles = [
        _needle(t[k], dtype)
        for d in deltas.values()
        for t in (d, {k: x * hp.alpha for k, x in d.items()})
        for k in list(t)[:3]
        for dtype in (np.float32, np.float64)
    ]
    assert not _holds(fleet.run_dir, needles)


def _needle(t: torch.Tensor, dtype) -> bytes:
    """Four consecutive elements around a tensor's largest, as bytes of ``dtype`` (none of them zero)."""
    flat = t.reshape(-1).numpy().astype(dtype)
    i = min(int(np.abs(flat).argmax()), flat.size - 4)
    return flat[i : i + 4].tobytes()
