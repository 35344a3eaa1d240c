"""The packet intake of a cloud round: open the round, read its Δc packets and refuse what must not be aggregated.

:func:`open_round` reads what a round needs of its run folder once (the steps after it take values, not the
folder). Every check runs before any state changes: a packet for another round or bundle, from an unknown or
repeated client, with a bad tag, the wrong tensors, or a displacement that is not finite or an outlier.
``ciders-cloud aggregate`` (:mod:`ciders_cloud.round.aggregate`) and the fleet's coordinator both come through here.
"""

from __future__ import annotations

import hashlib
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ciders_cloud.models.layers import ProfileLayers
from ciders_cloud.run.config import RunConfig, load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import round_hyperparams_for, strategy_for
from ciders_edge.errors import PacketError
from ciders_edge.formats.bundle import bundle_id
from ciders_edge.formats.packet import PROBE_KIND, Packet, PacketHeader, consensus_digest, read_key_file
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.split import layer_of
from ciders_edge.tensors import Tensors, norm

__all__ = [
    "OpenedRound",
    "open_round",
    "packet_keys",
    "Received",
    "read_packets",
    "check_packets",
    "check_round",
    "check_displacements",
    "client_consensus",
    "CLIENT_ID",
]

MAX_DELTA_RATIO = 20.0  # a displacement this many times the median one is refused (see check_displacements)
CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class OpenedRound:
    """A round's run folder, read once by :func:`open_round`: the round's steps take these values, not the folder."""

    run: RunConfig
    state: ServerState
    keys: dict[str, bytes]  # client -> its packet key (RUN/keys/<client>.key): its packets must carry the tag
    bundle_ids: dict[str, str]  # this round's bundle ids -> their profiles
    aligned: Tensors | None  # the AdapEmu layers the bootstrap trained, which the cloud's backbones start from


def open_round(run_dir: Path, secure: bool) -> OpenedRound:
    """The run, its state (if its rounds so far were of this kind, :meth:`ServerState.check_mode`), the packet
    keys, this round's bundle ids (read from their manifests, the weights left unverified) and the aligned layers."""
    keys = packet_keys(run_dir)
    folder = RunFolder(run_dir)
    run, state = load_run(run_dir), ServerState.load(folder.server_state)
    state.check_mode(secure, run_dir)
    bundles, aligned = {p: folder.bundle(p, state.round) for p in run.profiles}, folder.aligned
    return OpenedRound(
        run,
        state,
        keys,
        bundle_ids={bundle_id(path): p for p, path in bundles.items()},
        aligned=load_file(aligned) if aligned.is_file() else None,
    )


def packet_keys(run_dir: Path) -> dict[str, bytes]:
    """Every client's key in ``RUN/keys/``, by client id."""
    return {path.stem: read_key_file(path) for path in RunFolder(run_dir).key_files()}


@dataclass
class Received:
    """A packet as read: its verified header first; its tensors once :func:`check_packets` has found
    the header's names and shapes to be the ones the run expects (so nothing else is decompressed)."""

    header: PacketHeader
    size: int
    digest: str
    where: str
    profile: str = ""  # whose bundle it was trained on (set by check_packets)
    dc: Tensors = field(default_factory=dict)  # its Δc_i, named as v is (set by check_packets)
    decoded: Packet | None = None  # set by check_packets

    @property
    def packet(self) -> Packet:
        if self.decoded is None:
            raise RuntimeError(f"{self.where}: the packet's tensors are read only by check_packets")
        return self.decoded


def read_packets(items: list[tuple[str, bytes]], keys: Mapping[str, bytes]) -> list[Received]:
    """Verify packets and read their headers (each with its client's key, where ``keys`` holds one:
    :func:`packet_keys`); the payloads stay compressed until :func:`check_packets` knows what they must hold."""
    out = []
    for where, data in items:
        client = Packet.peek_client_id(data, where)
        if not CLIENT_ID.fullmatch(client):
            raise PacketError(f"{where}: client id {client!r} is not a valid id (letters, digits, . _ -)")
        header = Packet.read_header(data, keys.get(client), where=where)
        out.append(Received(header, len(data), hashlib.sha256(data).hexdigest(), where))
    return out


def check_packets(
    received: list[Received],
    state: ServerState,
    run: RunConfig,
    bundle_ids: dict[str, str],
    hp: RoundHyperparams,
    expected: Tensors | None = None,
) -> None:
    """Refuse the whole round if any packet is for another round or bundle, from an unknown or
    repeated client, of the wrong shapes or layers, or not finite; set each one's ``profile`` and
    ``dc``. ``bundle_ids`` maps this round's bundle ids to their profiles. ``expected`` names the
    tensors a packet must hold (default: the messenger LoRA's of the layers its profile trains, and
    what the strategy adds, :meth:`Strategy.packet_tensors`)."""
    layers = ProfileLayers.of(run, state)
    extra = strategy_for(run).packet_tensors(state)
    seen: set[str] = set()
    for r in received:
        p, where = r.header, r.where
        if p.round != state.round:
            raise PacketError(f"{where}: packet is for round {p.round}, the server is at round {state.round}")
        if p.bundle_id not in bundle_ids:
            raise PacketError(
                f"{where}: packet was trained on bundle {p.bundle_id[:12]}, not one of round {state.round}'s"
            )
        r.profile = bundle_ids[p.bundle_id]
        profile = layers[r.profile]
        if run.client_ids and p.client_id not in run.client_ids:
            raise PacketError(f"{where}: unknown client id {p.client_id!r}")
        for name in ("gamma", "alpha"):  # eq. (11) inverts the edge's eq. (10) with the round's values
            if name not in p.metrics and p.metrics.get("kind") != PROBE_KIND:
                raise PacketError(f"{where}: the packet does not say which {name} it trained with")
            if name in p.metrics and p.metrics[name] != getattr(hp, name):
                raise PacketError(
                    f"{where}: trained with {name}={p.metrics[name]}, round {state.round} uses {getattr(hp, name)}"
                )
        _check_consensus_digest(p, state, profile, where)
        if p.client_id in seen:
            raise PacketError(f"{where}: a second packet from client {p.client_id!r} in round {state.round}")
        seen.add(p.client_id)
        trained = profile.to_own({k: state.messenger[k] for k in profile.trained})  # as the edge names them
        want = expected if expected is not None else {**trained, **extra}
        _check_layers(set(p.shapes), profile, r.profile, state.messenger, trained, where)
        if p.num_examples <= 0:
            raise PacketError(f"{where}: |D_i| must be positive, got {p.num_examples}")
        # the header's names and shapes against the run's, before one byte of the payload is decompressed
        r.decoded = Packet.from_header(p, {name: tuple(ref.shape) for name, ref in want.items()})
        r.decoded.check_finite(where)
        r.dc = profile.to_global({k: r.decoded.tensors[k] for k in trained if k in r.decoded.tensors})


def _check_layers(
    names: set[str], layers: ProfileLayers, profile: str, messenger: Tensors, trained: Tensors, where: str
) -> None:
    """A messenger tensor of a layer the packet's profile does not train is refused by name: its
    bundle froze that layer at v, so the edge has no business moving it."""
    frozen = sorted(names & (set(layers.to_own(messenger)) - set(trained)))
    if frozen:
        name, indices = frozen[0], sorted({layer_of(k) for k in trained})
        raise PacketError(
            f"{where}: tensor {name} is of messenger layer {layer_of(name)}, which profile {profile} does not "
            f"train (it trains layers {indices[0]}..{indices[-1]} of its AdapEmu); refused"
        )


def client_consensus(state: ServerState, client_id: str, trained: Sequence[str]) -> Tensors:
    """The cloud's copy of a client's c_i, named as v is: zero, on the layers it trains, before its first round."""
    zero = {k: torch.zeros_like(state.messenger[k]) for k in trained}
    return state.clients.get(client_id, zero)


def _check_consensus_digest(p: PacketHeader, state: ServerState, profile: ProfileLayers, where: str) -> None:
    """The edge's c_i and the cloud's copy must be the same tensors (eq. 11 uses the cloud's)."""
    if p.metrics.get("kind") == PROBE_KIND:
        return
    theirs = p.metrics.get("c_i_digest")
    if not isinstance(theirs, str):
        raise PacketError(f"{where}: the packet does not say which c_i it started from (metrics c_i_digest)")
    kept = state.clients.get(p.client_id)
    if kept is not None and set(kept) != set(profile.trained):
        raise PacketError(
            f"{where}: client {p.client_id!r} trained other messenger layers in an earlier round ({len(kept)} tensors, "
            f"now {len(profile.trained)}): a device that changes profile joins as a new client id"
        )
    mine = profile.to_own(client_consensus(state, p.client_id, profile.trained))
    if theirs != consensus_digest(mine):
        new = "" if p.client_id in state.clients else " (the cloud has never aggregated this client: c_i = 0)"
        raise PacketError(
            f"{where}: client {p.client_id!r} trained from a c_i (digest {theirs[:12]}) that is not the cloud's copy "
            f"({consensus_digest(mine)[:12]}){new}: the edge's state folder was lost, damaged or made for another "
            "run; restore it, or join as a new client id with a new --state"
        )


def check_displacements(
    received: list[Received], deltas: list[Tensors], state: ServerState, outliers: bool = True
) -> dict[int, str]:
    """The packets (by index) whose reconstructed displacement (eq. 11) is not finite or is an outlier,
    with the reason: a packet with a valid tag can still carry values that would wreck v and c for
    every edge. An outlier's norm is over ``MAX_DELTA_RATIO`` times the round's scale: the median of
    this round's and the last round's finite displacements when there are at least three, else |v|.

    Without ``outliers`` (differential privacy) only finiteness is checked: clipping bounds every
    client's influence, and a threshold set by the others' norms would let one client's data decide
    whether another's counts, past the mechanism's sensitivity.
    """
    norms = [norm(d) for d in deltas]
    bad = {
        i: f"{r.where}: client {r.packet.client_id!r}'s reconstructed displacement is not finite"
        for i, (r, n) in enumerate(zip(received, norms, strict=True))
        if not math.isfinite(n)
    }
    if not outliers:
        return bad
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


def check_round(opened: OpenedRound, received: list[Received], expected: Tensors | None = None) -> RoundHyperparams:
    """:func:`check_packets` against this round's bundles; returns the round's hyperparameters."""
    hp = round_hyperparams_for(opened.run, opened.state.round)
    check_packets(received, opened.state, opened.run, opened.bundle_ids, hp, expected)
    return hp
