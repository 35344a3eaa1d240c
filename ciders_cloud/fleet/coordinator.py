"""A fleet round on the cloud, without Flower: the ServerApp only moves these values over the network.

Edges are known by the public keys in ``RUN/nodes/<client-id>.pub`` (the ones ``serve`` registers
with the SuperLink), so a node's client id comes from the key it authenticated with, never from
what it claims. Each reply is checked on its own; a bad packet is refused and logged, and the
round closes with the others through :func:`ciders_cloud.round.aggregate.aggregate_packets`, the code of
``ciders-cloud aggregate``. Every client-round goes to ``RUN/fleet/log.jsonl`` with its bytes.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from ciders_cloud.fleet.secure import CLIP_RANGE
from ciders_cloud.models.layers import ProfileLayers
from ciders_cloud.round.aggregate import aggregate_packets
from ciders_cloud.round.intake import CLIENT_ID, check_packets, packet_keys, read_packets
from ciders_cloud.round.secure import aggregate_secure
from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.sampling import sample_clients
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import round_hyperparams_for
from ciders_edge.errors import CidersError, ConfigError, PacketError
from ciders_edge.fleet.bundle_sync import files_to_ship
from ciders_edge.fleet.protocol import consensus_digest
from ciders_edge.formats.atomic import append_jsonl
from ciders_edge.formats.bundle import MANIFEST, Bundle
from ciders_edge.tensors import Tensors

__all__ = ["Coordinator", "Edge", "node_keys"]


@dataclass(frozen=True)
class Edge:
    node_id: int
    client_id: str


def node_keys(run_dir: Path, allowed: list[str] | None = None) -> dict[bytes, str]:
    """``{public key (PEM, as Flower reports it): client id}`` from ``RUN/nodes/*.pub``."""
    keys: dict[bytes, str] = {}
    for path in RunFolder(run_dir).node_keys():
        if not CLIENT_ID.fullmatch(path.stem) or (allowed and path.stem not in allowed):
            why = (
                "letters, digits, . _ -"
                if not CLIENT_ID.fullmatch(path.stem)
                else "the run accepts " + ", ".join(allowed)
            )
            raise ConfigError(f"{path}: {path.stem!r} is not a client id of this run ({why})")
        try:
            key = serialization.load_ssh_public_key(path.read_bytes())
        except (ValueError, TypeError):
            raise ConfigError(f"{path}: not an OpenSSH public key (an edge's node-key.pub)") from None
        pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        if pem in keys:
            raise ConfigError(f"{path}: the same key as {keys[pem]}.pub; each edge has its own")
        keys[pem] = path.stem
    return keys


class Coordinator:
    """The cloud's decisions for one run folder; reloads the server state at each round."""

    def __init__(self, run_dir: str | Path, secure: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.secure = secure  # rounds summed by Flower's SecAgg+: the cloud then keeps no c_i
        self.folder = RunFolder(run_dir)
        self.run = load_run(self.run_dir)
        self.keys = node_keys(self.run_dir, self.run.client_ids)
        self.state = ServerState.load(self.folder.server_state)
        self.started = self.state.round  # where this ServerApp took the run up
        self._bundles: dict[str, Bundle] = {}  # this round's, verified once
        self._client_keys: dict[str, bytes] | None = None  # RUN/keys/, read once a round (not once a reply)
        self._bytes: dict[tuple[str, str], bytes] = {}  # their files, read once for every edge
        self._layers: dict[str, ProfileLayers] | None = None
        self._rng = random.SystemRandom()  # who is sampled is not to be foretold from the run's files
        self.sampled: list[str] | None = None  # this round's draw, which the aggregation checks packets against

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def private(self) -> bool:
        """Whether the run's aggregate is differentially private (a round then releases even with no packet)."""
        return bool(self.run.dp)

    @property
    def secure_range(self) -> float:
        """The elementwise bound SecAgg+ clips displacements to before quantizing: C under DP (each edge
        clipped its norm to C already), else :data:`~ciders_cloud.fleet.secure.CLIP_RANGE`."""
        dp = self.run.privacy
        return dp.clip if dp is not None else CLIP_RANGE

    def sample(self, online: list[Edge]) -> tuple[list[Edge], list[str]]:
        """This round's participants: the online edges among the run's sample of its clients (all of them
        at participation 1), and the sampled clients that are not online (they drop out of the round)."""
        population = self.run.client_ids or sorted(self.keys.values())
        chosen = sample_clients(population, self.run.participation, self.run.sampling, self._rng, self.private)
        self.sampled = chosen
        here = {e.client_id for e in online}
        return [e for e in online if e.client_id in chosen], [cid for cid in chosen if cid not in here]

    def edges(self, nodes) -> list[Edge]:
        """The online nodes whose key is one of this run's, by client id (the order packets are aggregated in)."""
        found = [Edge(n.node_id, self.keys[n.public_key]) for n in nodes if n.public_key in self.keys]
        return sorted(found, key=lambda e: e.client_id)

    def sync_request(self, edge: Edge) -> dict:
        """Who the node is and the cloud's copy of its c_i: the edge settles its last round against it.
        The digest is given as each profile's AdapEmu names the tensors (``c_i_digests``, JSON), since
        the node says its profile only in its answer; ``c_i_digest`` is under v's names."""
        c_i = self.state.clients.get(edge.client_id)
        own = {p: layers.to_own(c_i) if c_i is not None else None for p, layers in self.layers.items()}
        request = {
            "client_id": edge.client_id,
            "round": self.round,
            "c_i_digest": consensus_digest(c_i),
            "c_i_digests": json.dumps({p: consensus_digest(t) for p, t in own.items()}),
        }
        if self.secure:  # no c_i here: the edge commits the round its displacement was summed in
            request["summed_round"] = self.state.summed.get(edge.client_id, -1)
        return request

    @property
    def layers(self) -> dict[str, ProfileLayers]:
        """Each profile's messenger layers and naming (the same for the whole run; read once)."""
        if self._layers is None:
            self._layers = ProfileLayers.of(self.run, self.state)
        return self._layers

    def train_request(self, edge: Edge, answer: dict) -> tuple[dict, dict[str, bytes]]:
        """This round's bundle for the edge's profile: the manifest, and the files the edge lacks."""
        profile = answer.get("profile") if isinstance(answer, dict) else None
        if profile not in self.run.profiles:
            raise ConfigError(
                f"{edge.client_id} runs profile {profile!r}; this run ships {', '.join(self.run.profiles)}"
            )
        held = answer.get("held")
        if not isinstance(held, dict):
            raise ConfigError(f"{edge.client_id} sent an unreadable sync answer")
        bundle = self.bundle(profile)
        files = {rel: self._file(profile, rel) for rel in files_to_ship(bundle, held)}
        config = {**self.sync_request(edge), "manifest": (bundle.path / MANIFEST).read_bytes()}
        return config, files

    def check(self, edge: Edge, packet: bytes) -> None:
        """Refuse a packet from another client than the authenticated node, or for another round or bundle."""
        where = f"round {self.round} reply of {edge.client_id}"
        [received] = read_packets([(where, packet)], self.client_keys)
        if received.header.client_id != edge.client_id:
            raise PacketError(
                f"{where}: packet claims client {received.header.client_id!r}, the node is {edge.client_id!r}"
            )
        bundle_ids = {self.bundle(p).bundle_id: p for p in self.run.profiles}
        hp = round_hyperparams_for(self.run, self.round)
        check_packets([received], self.state, self.run, bundle_ids, hp)

    def close_round(self, packets: dict[Edge, bytes], reports: dict[str, dict] | None = None) -> dict:
        """Aggregate the accepted packets (eq. 11-13, in client-id order) and move to the next round;
        ``reports``: what each edge said of its round, by client id (its validation pools into the next
        bundles' evidence for the deployed choice)."""
        items = [
            (f"round {self.round} reply of {e.client_id}", packets[e])
            for e in sorted(packets, key=lambda e: e.client_id)
        ]
        summary = aggregate_packets(self.run_dir, items, drop_outliers=True, sampled=self.sampled, reports=reports)
        self._next_round()
        return summary

    def close_secure_round(self, mean: Tensors, edges: list[Edge]) -> dict:
        """Eq. (12)-(13) from the secure mean of ``edges``' displacements, and on to the next round."""
        summary = aggregate_secure(self.run_dir, mean, sorted(e.client_id for e in edges), sampled=self.sampled)
        self._next_round()
        return summary

    def _next_round(self) -> None:
        """The state the round committed; this round's bundles, their files and the keys are read anew."""
        self.state = ServerState.load(self.folder.server_state)
        self._bundles, self._bytes, self._client_keys = {}, {}, None

    @property
    def client_keys(self) -> dict[str, bytes]:
        """The clients' packet keys (``RUN/keys/<client>.key``) this round."""
        if self._client_keys is None:
            self._client_keys = packet_keys(self.run_dir)
        return self._client_keys

    def _file(self, profile: str, rel: str) -> bytes:
        if (profile, rel) not in self._bytes:
            self._bytes[profile, rel] = (self.bundle(profile).path / rel).read_bytes()
        return self._bytes[profile, rel]

    def bundle(self, profile: str) -> Bundle:
        if profile not in self._bundles:
            self._bundles[profile] = Bundle.load(self.folder.bundle(profile, self.round))
        return self._bundles[profile]

    def log(self, records: list[dict]) -> None:
        """Add ``records`` to ``RUN/fleet/log.jsonl``, each stamped with the time."""
        append_jsonl(self.folder.fleet_log, [{"time": time.time(), **r} for r in records])


def validation_line(report: dict) -> str | None:
    """What an edge's validation says, for the cloud's log: the messenger it deploys and its held-out NLL
    beside its personalized and global ones (so the log shows, client by client, whether personalization
    helps); ``None`` for an edge that scored none."""
    if not isinstance(report.get("deployed_nll"), float):
        return None
    nll = {k: report.get(f"val_nll_{k}") for k in ("personalized", "global", "base")}
    rivals = ", ".join(f"{k} {v:.4f}" for k, v in nll.items() if isinstance(v, float))
    return (
        f"deploys {report.get('deployed', '?')}: NLL {report['deployed_nll']:.4f} on "
        f"{report.get('val_records', '?')} held-out records ({rivals})"
    )


def refusal(err: Exception) -> str:
    """One line for the log: our own errors as they are, anything else with its type."""
    return str(err) if isinstance(err, CidersError) else f"{type(err).__name__}: {err}"
