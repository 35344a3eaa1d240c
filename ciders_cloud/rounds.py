"""``ciders-cloud aggregate``: one cloud round, from Δc packets to the next round's bundles.

Every packet is checked before any state changes. The round commits in two moves: round t+1's
bundles are written first (unreferenced until the state says so), then the server state is
swapped in atomically. A rerun after a crash either redoes the round from scratch (same seeds,
same result) or, if the state already moved on with exactly these packets, reports it again.
"""

from __future__ import annotations

import hashlib
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ciders_cloud.aggregation import participation_weights, reconstruct_displacement, weighted_sum
from ciders_cloud.bilevel import cloud_indirect_term
from ciders_cloud.config import RunConfig
from ciders_cloud.fidelity import measure_fidelity
from ciders_cloud.prepare import (
    DISTILL_LOG,
    STATE_DIR,
    bundle_path,
    fidelity_record,
    load_cloud_models,
    load_run,
    write_bundles,
    write_round_log,
)
from ciders_cloud.server_state import ServerState
from ciders_cloud.strategies import get_strategy, round_hyperparams_for
from ciders_cloud.takd import Distiller, public_split
from ciders_edge.config import RoundHyperparams
from ciders_edge.errors import PacketError
from ciders_edge.formats.atomic import write_safetensors
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.packet import Packet, consensus_digest, read_key_file
from ciders_edge.profiles import load_profile
from ciders_edge.tensors import Tensors, add, norm
from ciders_edge.training.local_steps import mean_lr_multiplier
from ciders_edge.training.round import PROBE_KIND

__all__ = [
    "aggregate_packets",
    "aggregate_files",
    "check_packets",
    "hypergradient_packets",
    "hypergradient_path",
    "round_hyperparams_for",
    "KEYS_DIR",
]

KEYS_DIR = "keys"
HYPERGRADIENTS = "hypergradients"
MAX_DELTA_RATIO = 20.0  # a displacement this many times the median one is refused (see check_displacements)
CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class Received:
    packet: Packet
    size: int
    digest: str
    where: str


def read_packets(run_dir: Path, items: list[tuple[str, bytes]]) -> list[Received]:
    """Parse packets, verifying each with its client's key when ``RUN/keys/<client>.key`` exists."""
    out = []
    for where, data in items:
        client = Packet.peek_client_id(data, where)
        if not CLIENT_ID.fullmatch(client):
            raise PacketError(f"{where}: client id {client!r} is not a valid id (letters, digits, . _ -)")
        key_file = run_dir / KEYS_DIR / f"{client}.key"
        key = read_key_file(key_file) if key_file.is_file() else None
        packet = Packet.from_bytes(data, key, where=where)
        out.append(Received(packet, len(data), hashlib.sha256(data).hexdigest(), where))
    return out


def check_packets(
    received: list[Received],
    state: ServerState,
    run: RunConfig,
    bundle_ids: set[str],
    hp: RoundHyperparams,
    expected: Tensors | None = None,
) -> None:
    """Refuse the whole round if any packet is for another round or bundle, from an unknown or
    repeated client, of the wrong shapes, or not finite. ``expected`` names the tensors a packet
    must hold (default: the messenger LoRA's; LFedNest adds the backbone's grad_y f_i)."""
    if expected is None:
        expected = {**state.messenger, **(state.backbone if hp.send_grad_y else {})}
    seen: set[str] = set()
    for r in received:
        p, where = r.packet, r.where
        if p.round != state.round:
            raise PacketError(f"{where}: packet is for round {p.round}, the server is at round {state.round}")
        if p.bundle_id not in bundle_ids:
            raise PacketError(
                f"{where}: packet was trained on bundle {p.bundle_id[:12]}, not one of round {state.round}'s"
            )
        if run.clients and p.client_id not in run.clients:
            raise PacketError(f"{where}: unknown client id {p.client_id!r}")
        for name in ("gamma", "alpha"):  # eq. (11) inverts the edge's eq. (10) with the round's values
            if name not in p.metrics and p.metrics.get("kind") != PROBE_KIND:
                raise PacketError(f"{where}: the packet does not say which {name} it trained with")
            if name in p.metrics and p.metrics[name] != getattr(hp, name):
                raise PacketError(
                    f"{where}: trained with {name}={p.metrics[name]}, round {state.round} uses {getattr(hp, name)}"
                )
        _check_consensus_digest(p, state, where)
        if p.client_id in seen:
            raise PacketError(f"{where}: a second packet from client {p.client_id!r} in round {state.round}")
        seen.add(p.client_id)
        for name, ref in expected.items():
            got = p.tensors.get(name)
            if got is None or got.shape != ref.shape:
                shape = None if got is None else tuple(got.shape)
                raise PacketError(f"{where}: tensor {name} has shape {shape}, expected {tuple(ref.shape)}")
        if set(p.tensors) != set(expected):
            raise PacketError(f"{where}: unexpected tensors {sorted(set(p.tensors) - set(expected))[:2]}")
        if p.num_examples <= 0:
            raise PacketError(f"{where}: |D_i| must be positive, got {p.num_examples}")
        p.check_finite(where)


def _check_consensus_digest(p: Packet, state: ServerState, where: str) -> None:
    """The edge's c_i and the cloud's copy must be the same tensors (eq. 11 uses the cloud's)."""
    if p.metrics.get("kind") == PROBE_KIND:
        return
    theirs = p.metrics.get("c_i_digest")
    if not isinstance(theirs, str):
        raise PacketError(f"{where}: the packet does not say which c_i it started from (metrics c_i_digest)")
    mine = state.clients.get(p.client_id, {k: torch.zeros_like(t) for k, t in state.messenger.items()})
    if theirs != consensus_digest(mine):
        new = "" if p.client_id in state.clients else " (the cloud has never aggregated this client: c_i = 0)"
        raise PacketError(
            f"{where}: client {p.client_id!r} trained from a c_i (digest {theirs[:12]}) that is not the cloud's copy "
            f"({consensus_digest(mine)[:12]}){new}: the edge's state folder was lost, damaged or made for another "
            "run; restore it, or join as a new client id with a new --state"
        )


def check_displacements(received: list[Received], deltas: list[Tensors], state: ServerState) -> dict[int, str]:
    """The packets (by index) whose reconstructed displacement (eq. 11) is not finite or is an outlier,
    with the reason: a packet with a valid tag can still carry values that would wreck v and c for
    every edge. An outlier's norm is over ``MAX_DELTA_RATIO`` times the round's scale: the median of
    this round's and the last round's finite displacements when there are at least three, else |v|.
    """
    norms = [norm(d) for d in deltas]
    bad = {
        i: f"{r.where}: client {r.packet.client_id!r}'s reconstructed displacement is not finite"
        for i, (r, n) in enumerate(zip(received, norms, strict=True))
        if not math.isfinite(n)
    }
    history = [n for n in norms if math.isfinite(n)] + list((state.last_summary or {}).get("delta_norms", {}).values())
    if len(history) >= 3:
        scale, of = statistics.median(history), "the median displacement"
    else:
        scale, of = norm(state.messenger), "|v|"
    for i, (r, n) in enumerate(zip(received, norms, strict=True)):
        if i not in bad and n > MAX_DELTA_RATIO * scale:
            bad[i] = (
                f"{r.where}: client {r.packet.client_id!r}'s displacement norm {n:.3e} is over {MAX_DELTA_RATIO:g}x "
                f"{of} ({scale:.3e}) in round {state.round}; refused as an outlier"
            )
    return bad


def _check_finite(tensors: Tensors, what: str) -> None:
    for name, t in tensors.items():
        if isinstance(t, dict):
            _check_finite(t, f"{what} {name}")
        elif not torch.isfinite(t).all():
            raise PacketError(f"{what}: tensor {name} is not finite; nothing was written")


def aggregate_files(run_dir: str | Path, packet_paths: list[str | Path]) -> dict:
    """The CLI's body: read packet files and run :func:`aggregate_packets`."""
    items = []
    for path in packet_paths:
        path = Path(path)
        if not path.is_file():
            raise PacketError(f"{path}: no such packet file")
        items.append((str(path), path.read_bytes()))
    return aggregate_packets(Path(run_dir), items)


def aggregate_packets(run_dir: Path, items: list[tuple[str, bytes]], drop_outliers: bool = False) -> dict:
    """Eq. (11)–(13) for one round; returns a summary of what happened.

    A packet whose displacement is not finite or an outlier fails the round, nothing written; with
    ``drop_outliers`` (the fleet, where one bad edge must not stop the others) it is left out with its
    reason in the summary's ``dropped``, and its client's c_i stays as it was.
    """
    run = load_run(run_dir)
    state = ServerState.load(run_dir / STATE_DIR)
    received = read_packets(run_dir, items)
    digests = sorted(r.digest for r in received)
    if state.last_round_digests and digests == state.last_round_digests and state.round > 0:
        return {**state.last_summary, "already_aggregated": True}
    hp = _check_round(run_dir, run, state, received)
    if not received:
        raise PacketError("no packets given; a round needs at least one")
    strategy = get_strategy(run.algorithm)
    deltas, new_clients = _reconstruct(received, state, hp)  # (11)
    bad = check_displacements(received, deltas, state)
    if bad and not drop_outliers:
        raise PacketError(f"{next(iter(bad.values()))}; nothing was written")
    dropped = {received[i].packet.client_id: reason for i, reason in bad.items()}
    if bad:
        received = [r for i, r in enumerate(received) if i not in bad]
        if not received:
            raise PacketError(f"round {state.round}: every packet was refused ({'; '.join(dropped.values())})")
        deltas, new_clients = _reconstruct(received, state, hp)
    weights = participation_weights([r.packet.num_examples for r in received])
    models = load_cloud_models(run_dir, run, state)
    bilevel = {}
    if hp.send_grad_y:  # LFedNest: the hypergradient's indirect term, at the round's (x, y)
        grad_y = weighted_sum([r.packet.tensors for r in received], weights, state.backbone)
        q, bilevel = cloud_indirect_term(models, run, state, hp, grad_y)
        deltas = [add(d, q, mean_lr_multiplier(hp)) for d in deltas]  # as if added to every local step
    v, c = strategy.server_step(state.messenger, state.consensus, deltas, weights, hp)  # (12)
    _check_finite({"v": v, "c": c}, f"round {state.round}")
    models.load_messenger(v)
    records, optimizer, takd_step, fidelity = _distill(models, run, state, *strategy.takd(hp))  # (13)
    _check_finite(models.backbone_state(), f"round {state.round}: the backbone LoRA after TAKD")

    summary = {
        "round": state.round,
        "next_round": state.round + 1,
        "algorithm": run.algorithm,
        "clients": [r.packet.client_id for r in received],
        "weights": weights,
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "delta_norms": {r.packet.client_id: norm(d) for r, d in zip(received, deltas, strict=True)},
        "v_change": norm({k: v[k] - state.messenger[k] for k in v}),
        "c_norm": norm(c),
        "takd_steps": len(records),
        "takd_last": records[-1] if records else None,
        "fidelity": fidelity.to_dict() if fidelity else None,
        "bilevel": bilevel,
        "dropped": dropped,
    }
    new = ServerState(
        state.round + 1,
        v,
        models.backbone_state(),
        c,
        new_clients,
        optimizer,
        takd_step,
        state.rng,
        last_round_digests=digests,
        last_summary=summary,
    )
    bundles = write_bundles(run_dir, run, models, new, [load_profile(p) for p in run.profiles], fidelity)
    summary["bundles"] = {k: str(b.path) for k, b in bundles.items()}
    summary["bytes_down"] = {k: b.new_bytes for k, b in bundles.items()}
    new.last_summary = summary
    write_round_log(run_dir / DISTILL_LOG, state, records + [fidelity_record(state.round + 1, takd_step, fidelity)])
    new.save(run_dir / STATE_DIR)  # the commit point
    return summary


def _check_round(
    run_dir: Path, run: RunConfig, state: ServerState, received: list[Received], expected: Tensors | None = None
) -> RoundHyperparams:
    """:func:`check_packets` against this round's bundles; returns the round's hyperparameters."""
    bundle_ids = {Bundle.load(bundle_path(run_dir, p, state.round)).bundle_id for p in run.profiles}
    hp = round_hyperparams_for(run, state.round)
    check_packets(received, state, run, bundle_ids, hp, expected)
    return hp


def hypergradient_path(run_dir: Path, round_: int) -> Path:
    return run_dir / HYPERGRADIENTS / f"round-{round_:04d}.safetensors"


def hypergradient_packets(run_dir: Path, items: list[tuple[str, bytes]]) -> dict:
    """FedNest's cloud step between a round's two exchanges: the global hypergradient
    ``h = sum p_i grad_x f_i - grad_xy g [grad_yy g]^-1 sum p_i grad_y f_i`` from the probe
    packets, written for the edges' svrg steps; the server state does not change."""
    run = load_run(run_dir)
    state = ServerState.load(run_dir / STATE_DIR)
    received = read_packets(run_dir, items)
    if not received:
        raise PacketError("no probe packets given; FedNest's hypergradient needs at least one")
    for r in received:
        if r.packet.metrics.get("kind") != PROBE_KIND:
            raise PacketError(f"{r.where}: not a probe packet (FedNest's first exchange sends gradients)")
    hp = _check_round(run_dir, run, state, received, expected={**state.messenger, **state.backbone})
    weights = participation_weights([r.packet.num_examples for r in received])
    grads = [r.packet.tensors for r in received]
    grad_x = weighted_sum(grads, weights, state.messenger)
    grad_y = weighted_sum(grads, weights, state.backbone)
    q, info = cloud_indirect_term(load_cloud_models(run_dir, run, state), run, state, hp, grad_y)
    h = add(grad_x, q)
    path = hypergradient_path(run_dir, state.round)
    write_safetensors(path, h, {"round": str(state.round)})
    return {
        "round": state.round,
        "path": str(path),
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "bytes_down": path.stat().st_size,
        "grad_x_norm": norm(grad_x),
        "hypergradient_norm": norm(h),
        "bilevel": info,
    }


def _reconstruct(received: list[Received], state: ServerState, hp) -> tuple[list[Tensors], dict[str, Tensors]]:
    """Eq. (11) for every packet, and the server's copies of c_i advanced by the decoded increments."""
    deltas, clients = [], dict(state.clients)
    zero = {k: torch.zeros_like(t) for k, t in state.messenger.items()}
    for r in received:
        c_i = state.clients.get(r.packet.client_id, zero)
        dc = {k: r.packet.tensors[k] for k in zero}  # LFedNest's packets also hold grad_y f_i
        deltas.append(reconstruct_displacement(dc, c_i, state.consensus, hp.alpha, hp.gamma))
        clients[r.packet.client_id] = add(c_i, dc)
    return deltas, clients


def _distill(models, run: RunConfig, state: ServerState, steps: int, lambda_task: float | None):
    """Eq. (13): T_L warm-started TAKD steps with the new messenger held fixed (none for some baselines),
    then the emulator's fidelity to AdapFu under that messenger."""
    public, held = public_split(run, models.tokenizer)
    if not steps:
        return [], state.optimizer, state.takd_step, measure_fidelity(models, held)
    takd = run.takd_config.replace(lambda_task=lambda_task)
    distiller = Distiller(models, public, takd, state.optimizer, state.takd_step, run.seed)
    records = distiller.run(steps, round_=state.round, label=f"round {state.round} TAKD")
    return records, distiller.optimizer_state(), distiller.step_count, measure_fidelity(models, held)
