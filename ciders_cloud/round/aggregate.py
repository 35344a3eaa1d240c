"""``ciders-cloud aggregate``: drive one cloud round, from Δc packets to the next round's bundles (eq. 11–13).

:mod:`.intake` opens the round (the run folder read once) and checks every packet before any state changes;
eq. (11) reconstructs each displacement, the strategy adjusts them, the weighted (or private) mean goes to
:func:`.commit.commit_round` (eq. 12, eq. 13 in :mod:`.distill`, the bundles, the state). A rerun after a
crash either redoes the round from scratch (same seeds, same result) or, if the state already moved on with
exactly these packets, reports it again. A secure round's sum arrives instead through :mod:`.secure`; a
strategy's first exchange through :mod:`.probes`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ciders_cloud.models.device import cloud_device
from ciders_cloud.models.teacher import build_backbones
from ciders_cloud.privacy import PrivateRelease, study_generator
from ciders_cloud.round.commit import commit_round
from ciders_cloud.round.intake import (
    Received,
    check_displacements,
    check_round,
    client_consensus,
    open_round,
    read_packets,
)
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import CloudRound, strategy_for
from ciders_cloud.strategies.aggregation import layer_means, participation_weights, reconstruct_displacement
from ciders_edge.errors import PacketError
from ciders_edge.tensors import Tensors, add, norm
from ciders_edge.training.fleet_evidence import FleetEvidence

__all__ = ["aggregate_packets", "aggregate_files"]


def aggregate_files(
    run_dir: str | Path,
    packet_paths: list[str | Path],
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
    noise_seed: int | None = None,
    reports: dict[str, dict] | None = None,
) -> dict:
    """The CLI's body: read packet files and run :func:`aggregate_packets` (its TAKD, fidelity and
    strategy's own work on ``device``; ``sampled``: the round's drawn clients, when it drew some;
    ``noise_seed``: a study's seed, which its DP noise is drawn from; ``reports``: the clients' round
    summaries by id)."""
    device = cloud_device(device)
    items = []
    for path in packet_paths:
        path = Path(path)
        if not path.is_file():
            raise PacketError(f"{path}: no such packet file")
        items.append((str(path), path.read_bytes()))
    return aggregate_packets(
        Path(run_dir), items, device=device, sampled=sampled, noise_seed=noise_seed, reports=reports
    )


def aggregate_packets(
    run_dir: Path,
    items: list[tuple[str, bytes]],
    drop_outliers: bool = False,
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
    noise_seed: int | None = None,
    reports: dict[str, dict] | None = None,
) -> dict:
    """Eq. (11)–(13) for one round; returns a summary of what happened.

    A packet whose displacement is not finite or an outlier fails the round, nothing written; with
    ``drop_outliers`` (the fleet, where one bad edge must not stop the others) it is left out with its
    reason in the summary's ``dropped``, and its client's c_i stays as it was. TAKD, fidelity and the
    strategy's own work (a bilevel baseline's Hessian products) run on ``device`` (``auto``, ``cpu``, ``cuda``);
    the state stays on the CPU. ``sampled`` names the clients the round drew (simulate's and the fleet's);
    a private run that samples needs it, and refuses a packet from a client outside it. A private round's
    noise comes from a fresh OS seed, or from ``noise_seed`` and the round in a study (it repeats).
    ``reports`` (each client's round summary, by id) pool into the next bundles' evidence for the deployed
    choice; a private run pools none, as the numbers describe each client's data beside the noise.
    """
    device = cloud_device(device)
    opened = open_round(run_dir, secure=False)
    run, state = opened.run, opened.state
    received = read_packets(items, opened.keys)
    digests = sorted(r.digest for r in received)
    if state.last_round_digests and digests == state.last_round_digests and state.round > 0:
        return {**state.last_summary, "already_aggregated": True}
    release = PrivateRelease.of(run)
    spent = release.check_budget(state.round) if release else None  # before any packet is read
    hp = check_round(opened, received)
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
    backbones = build_backbones(run, state, opened.aligned, device)
    cloud = CloudRound(run, state, hp, backbones)
    deltas, bilevel = strategy.adjust_displacements(deltas, [r.packet.tensors for r in received], weights, cloud)
    if release:  # the Gaussian mechanism on the clipped displacements' sum
        noise = study_generator(noise_seed, state.round) if noise_seed is not None else None
        mean, privacy = release.mechanism.mean(deltas, state.messenger, noise)
        privacy = {**privacy, **spent.to_dict()}
    else:
        mean, privacy = layer_means(deltas, weights, state.messenger), None
    round_ = {
        "clients": [r.packet.client_id for r in received],
        "weights": weights,
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "delta_norms": {r.packet.client_id: norm(d) for r, d in zip(received, deltas, strict=True)},
    }
    evidence = None if release else FleetEvidence.pool(_reported(reports, round_["clients"]), state.round)
    fleet_choice = evidence.to_dict() if evidence else None
    closing = {"bilevel": bilevel, "dropped": dropped, **({"privacy": privacy} if privacy is not None else {})}
    if fleet_choice:
        closing["fleet_choice"] = fleet_choice
    new = replace(state, clients=new_clients, last_round_digests=digests, fleet_choice=fleet_choice)
    return commit_round(run_dir, run, state, new, hp, backbones, mean, round_, closing)


def _reported(reports: dict[str, dict] | None, clients: list[str]) -> list[dict]:
    """The summaries of the clients whose packets the round took, in their order."""
    return [reports[c] for c in clients if c in reports] if reports else []


def _reconstruct(received: list[Received], state: ServerState, hp) -> tuple[list[Tensors], dict[str, Tensors]]:
    """Eq. (11) for every packet, on the layers its profile trains, and the server's copies of c_i
    advanced by the decoded increments."""
    deltas, clients = [], dict(state.clients)
    for r in received:
        c_i = client_consensus(state, r.packet.client_id, list(r.dc))
        deltas.append(reconstruct_displacement(r.dc, c_i, state.consensus, hp.alpha, hp.gamma))
        clients[r.packet.client_id] = add(c_i, r.dc)
    return deltas, clients
