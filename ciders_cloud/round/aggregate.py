"""``ciders-cloud aggregate``: one cloud round, from Δc packets to the next round's bundles (eq. 11–13),
and the first exchange of a round for a strategy that asks for one (FedNest's hypergradient).

Every packet is checked by :mod:`ciders_cloud.round.intake` before any state changes. The round commits
in two moves: round t+1's bundles are written first (unreferenced until the state says so), then
the server state is swapped in atomically. A rerun after a crash either redoes the round from scratch (same seeds,
same result) or, if the state already moved on with exactly these packets, reports it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ciders_cloud.models.backbones import backbone_part, label, pack, tagged
from ciders_cloud.models.device import cloud_device
from ciders_cloud.models.fidelity import Fidelity, measure_fidelity
from ciders_cloud.models.takd import Distiller, public_split
from ciders_cloud.models.teacher import CloudModels, load_cloud_models
from ciders_cloud.privacy import PrivateRelease
from ciders_cloud.round.aggregation import layer_means, participation_weights, reconstruct_displacement
from ciders_cloud.round.bundles import write_bundles
from ciders_cloud.round.intake import Received, check_displacements, check_round, client_consensus, read_packets
from ciders_cloud.run.config import RunConfig, TakdConfig, load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.logs import fidelity_record, write_round_log
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import CloudRound, round_hyperparams_for, round_takd, strategy_for
from ciders_edge.errors import PacketError
from ciders_edge.formats.atomic import write_safetensors
from ciders_edge.formats.packet import PROBE_KIND
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.profiles import load_profile
from ciders_edge.tensors import Tensors, add, non_finite, norm

__all__ = ["aggregate_packets", "aggregate_files", "aggregate_probes", "aggregate_secure"]


def _check_finite(tensors: Tensors, what: str) -> None:
    if (name := non_finite(tensors)) is not None:
        raise PacketError(f"{what}: tensor {name} is not finite; nothing was written")


def aggregate_files(
    run_dir: str | Path,
    packet_paths: list[str | Path],
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
) -> dict:
    """The CLI's body: read packet files and run :func:`aggregate_packets` (its TAKD, fidelity and
    hypergradient on ``device``; ``sampled``: the round's drawn clients, when it drew some)."""
    device = cloud_device(device)
    items = []
    for path in packet_paths:
        path = Path(path)
        if not path.is_file():
            raise PacketError(f"{path}: no such packet file")
        items.append((str(path), path.read_bytes()))
    return aggregate_packets(Path(run_dir), items, device=device, sampled=sampled)


def aggregate_packets(
    run_dir: Path,
    items: list[tuple[str, bytes]],
    drop_outliers: bool = False,
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
) -> dict:
    """Eq. (11)–(13) for one round; returns a summary of what happened.

    A packet whose displacement is not finite or an outlier fails the round, nothing written; with
    ``drop_outliers`` (the fleet, where one bad edge must not stop the others) it is left out with its
    reason in the summary's ``dropped``, and its client's c_i stays as it was. TAKD, fidelity and the
    strategy's own work (LFedNest's Hessian products) run on ``device`` (``auto``, ``cpu``, ``cuda``);
    the state stays on the CPU. ``sampled`` names the clients the round drew (simulate's and the fleet's);
    a private run that samples needs it, and refuses a packet from a client outside it.
    """
    device = cloud_device(device)
    run, state = _open(run_dir, secure=False)
    received = read_packets(run_dir, items)
    digests = sorted(r.digest for r in received)
    if state.last_round_digests and digests == state.last_round_digests and state.round > 0:
        return {**state.last_summary, "already_aggregated": True}
    release = PrivateRelease.of(run)
    spent = release.check_budget(state.round) if release else None  # before any packet is read
    hp = check_round(run_dir, run, state, received)
    if release:
        release.check_sample(sampled, [r.header.client_id for r in received], state.round)
    if not received and not release:  # a private round releases noise even when it sampled no one
        raise PacketError("no packets given; a round needs at least one")
    strategy = strategy_for(run)
    deltas, new_clients = _reconstruct(received, state, hp)  # (11)
    bad = check_displacements(received, deltas, state, outliers=release is None)
    if bad and not drop_outliers:
        raise PacketError(f"{next(iter(bad.values()))}; nothing was written")
    dropped = {received[i].packet.client_id: reason for i, reason in bad.items()}
    if bad:
        received = [r for i, r in enumerate(received) if i not in bad]
        if not received and not release:
            raise PacketError(f"round {state.round}: every packet was refused ({'; '.join(dropped.values())})")
        deltas, new_clients = _reconstruct(received, state, hp)
    num_examples = [r.packet.num_examples for r in received]
    weights = release.weights(len(received)) if release else participation_weights(num_examples)
    backbones = load_cloud_models(run_dir, run, state, device)
    cloud = CloudRound(run, state, hp, backbones)
    deltas, bilevel = strategy.adjust_displacements(deltas, [r.packet.tensors for r in received], weights, cloud)
    if release:  # the Gaussian mechanism on the clipped displacements' sum
        mean, privacy = release.mechanism.mean(deltas, state.messenger)
        privacy = {**privacy, **spent.to_dict()}
    else:
        mean, privacy = layer_means(deltas, weights, state.messenger), None
    round_ = {
        "clients": [r.packet.client_id for r in received],
        "weights": weights,
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "delta_norms": {r.packet.client_id: norm(d) for r, d in zip(received, deltas, strict=True)},
    }
    closing = {"bilevel": bilevel, "dropped": dropped, **({"privacy": privacy} if privacy is not None else {})}
    new = replace(state, clients=new_clients, last_round_digests=digests)
    return _commit(run_dir, run, state, new, hp, backbones, mean, round_, closing)


def aggregate_secure(
    run_dir: Path,
    mean: Tensors,
    clients: list[str],
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
) -> dict:
    """A secure round (``serve --secure-aggregation``): eq. (12)–(13) from the mean of the displacements of
    ``clients``, which Flower's SecAgg+ summed without the cloud seeing one of them (docs/privacy.md).

    The cloud keeps no c_i: it notes for each client the round it was summed in (the edge commits that
    round on it). Under DP each edge clipped its own displacement (``dp.clip_on = "edge"``) and the noise
    goes on their sum here."""
    device = cloud_device(device)
    run, state = _open(run_dir, secure=True)
    release = PrivateRelease.of(run)
    spent = release.check_budget(state.round) if release else None
    if release:
        release.check_sample(sampled, clients, state.round)
    if not clients and not release:
        raise PacketError(f"round {state.round}: the secure sum holds no client")
    if (name := non_finite(mean)) is not None:
        raise PacketError(f"round {state.round}: the secure sum's tensor {name} is not finite; nothing was written")
    hp = round_hyperparams_for(run, state.round)
    privacy = None
    if release:  # each edge clipped to C; the sum is the survivors' mean times their count
        mean, privacy = release.mechanism.release({k: t * len(clients) for k, t in mean.items()}, state.messenger)
        privacy = {**privacy, **spent.to_dict()}
    backbones = load_cloud_models(run_dir, run, state, device)
    weights = release.weights(len(clients)) if release else [1.0 / len(clients)] * len(clients)
    round_ = {"clients": list(clients), "weights": weights, "secure": True}
    closing = {"dropped": {}, **({"privacy": privacy} if privacy is not None else {})}
    new = replace(state, summed={**state.summed, **dict.fromkeys(clients, state.round)}, last_round_digests=[])
    return _commit(run_dir, run, state, new, hp, backbones, mean, round_, closing)


def _open(run_dir: Path, secure: bool) -> tuple[RunConfig, ServerState]:
    """The run and its state, if its rounds so far were of this kind (:meth:`ServerState.check_mode`)."""
    run, state = load_run(run_dir), ServerState.load(RunFolder(run_dir).server_state)
    state.check_mode(secure, run_dir)
    return run, state


def _commit(
    run_dir: Path,
    run: RunConfig,
    state: ServerState,
    new: ServerState,
    hp: RoundHyperparams,
    backbones: dict[str, CloudModels],
    mean: Tensors,
    round_: dict,
    closing: dict,
) -> dict:
    """Eq. (12) from the round's mean, eq. (13) on every backbone, then the commit: round t+1's bundles
    first (unreferenced until the state says so), then ``new`` (its clients, digests or sums already set)
    as the server state. Returns the round's summary: ``round_`` and ``closing`` around the step's figures."""
    strategy = strategy_for(run)
    v, c = strategy.server_step(state.messenger, state.consensus, mean, hp)  # (12), per layer
    _check_finite({"v": v, "c": c}, f"round {state.round}")
    steps, loss = round_takd(run, state.round)
    takd = {name: _distill(models, v, run, state, steps, loss) for name, models in backbones.items()}  # (13)
    reference = takd[next(iter(takd))]
    summary = {
        "round": state.round,
        "next_round": state.round + 1,
        "algorithm": run.algorithm,
        **round_,
        "v_change": norm({k: v[k] - state.messenger[k] for k in v}),
        "c_norm": norm(c),
        "takd_steps": len(reference.records),
        "takd_last": reference.records[-1] if reference.records else None,
        "fidelity": reference.fidelity.to_dict() if reference.fidelity else None,
        **closing,
    }
    if len(takd) > 1:  # the cost and fidelity of each backbone's TAKD
        summary["backbones"] = {name: t.summary() for name, t in takd.items()}
    first = next(iter(takd))
    new = replace(
        new,
        round=state.round + 1,
        messenger=v,
        backbone=pack({name: m.backbone_state() for name, m in backbones.items()}, first),
        consensus=c,
        optimizer=pack({name: t.optimizer for name, t in takd.items()}, first),
        takd_step=takd[first].step,
        last_summary=summary,
    )
    fidelities = {name: t.fidelity for name, t in takd.items()}
    bundles = write_bundles(run_dir, run, backbones, new, [load_profile(p) for p in run.profiles], fidelities)
    summary["bundles"] = {k: str(b.path) for k, b in bundles.items()}
    summary["bytes_down"] = {k: b.new_bytes for k, b in bundles.items()}
    folder = RunFolder(run_dir)
    write_round_log(folder.distill_log, state, _takd_log(run, state, takd))
    new.save(folder.server_state)  # the commit point
    return summary


def _takd_log(run: RunConfig, state: ServerState, takd: dict[str, Distilled]) -> list[dict]:
    """The round's TAKD steps, then each backbone's fidelity as the next round starts."""
    steps = [rec for name, t in takd.items() for rec in tagged(run, name, t.records)]
    closing = [tagged(run, n, [fidelity_record(state.round + 1, t.step, t.fidelity)]) for n, t in takd.items()]
    return steps + [rec for recs in closing for rec in recs]


def aggregate_probes(run_dir: Path, items: list[tuple[str, bytes]], device: str | torch.device = "cpu") -> dict:
    """The first exchange of a round (FedNest's): the edges' gradient packets, checked, turned into
    what their training needs (FedNest's global hypergradient h) and written to ``RUN/hypergradients/``
    for them; the server state does not change. The strategy's work runs on ``device``."""
    device = cloud_device(device)
    run = load_run(run_dir)
    state = ServerState.load(RunFolder(run_dir).server_state)
    received = read_packets(run_dir, items)
    if not received:
        raise PacketError(f"no probe packets given; {run.algorithm}'s first exchange needs at least one")
    for r in received:
        if r.header.metrics.get("kind") != PROBE_KIND:
            raise PacketError(f"{r.where}: not a probe packet ({run.algorithm}'s first exchange sends gradients)")
    hp = check_round(run_dir, run, state, received, expected={**state.messenger, **state.backbone})
    weights = participation_weights([r.packet.num_examples for r in received])
    cloud = CloudRound(run, state, hp, load_cloud_models(run_dir, run, state, device))
    h, report = strategy_for(run).aggregate_probes([r.packet.tensors for r in received], weights, cloud)
    path = RunFolder(run_dir).hypergradient(state.round)
    write_safetensors(path, h, {"round": str(state.round)})
    return {
        "round": state.round,
        "path": str(path),
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "bytes_down": path.stat().st_size,
        **report,
    }


def _reconstruct(received: list[Received], state: ServerState, hp) -> tuple[list[Tensors], dict[str, Tensors]]:
    """Eq. (11) for every packet, on the layers its profile trains, and the server's copies of c_i
    advanced by the decoded increments."""
    deltas, clients = [], dict(state.clients)
    for r in received:
        c_i = client_consensus(state, r.packet.client_id, list(r.dc))
        deltas.append(reconstruct_displacement(r.dc, c_i, state.consensus, hp.alpha, hp.gamma))
        clients[r.packet.client_id] = add(c_i, r.dc)
    return deltas, clients


@dataclass
class Distilled:
    """One backbone's eq. (13) in a round: its TAKD records, moments and step count, what it cost, and
    the emulator's fidelity after it."""

    records: list[dict]
    optimizer: Tensors
    step: int
    fidelity: Fidelity | None
    seconds: float

    def summary(self) -> dict:
        return {
            "takd_steps": len(self.records),
            "takd_seconds": round(self.seconds, 3),
            "takd_last": self.records[-1] if self.records else None,
            "fidelity": self.fidelity.to_dict() if self.fidelity else None,
        }


def _distill(
    models: CloudModels, v: Tensors, run: RunConfig, state: ServerState, steps: int, loss: TakdConfig
) -> Distilled:
    """Eq. (13) on one learnable backbone: T_L warm-started TAKD steps with the new messenger ``v`` held
    fixed (none for some baselines), then the emulator's fidelity to AdapFu under that messenger."""
    started = time.perf_counter()
    models.load_messenger(v)
    public, held = public_split(run, models.tokenizer)
    optimizer = backbone_part(run, state.optimizer, models.name)
    if not steps:
        return Distilled([], optimizer, state.takd_step, measure_fidelity(models, held), time.perf_counter() - started)
    distiller = Distiller(models, public, loss, optimizer, state.takd_step, run.seed)
    records = distiller.run(steps, round_=state.round, label=label(run, models.name, f"round {state.round} TAKD"))
    _check_finite(models.backbone_state(), f"round {state.round}: backbone {models.name}'s LoRA after TAKD")
    fidelity = measure_fidelity(models, held)
    return Distilled(
        records, distiller.optimizer_state(), distiller.step_count, fidelity, time.perf_counter() - started
    )
