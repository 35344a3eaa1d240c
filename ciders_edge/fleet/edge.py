"""What a fleet round does on the edge, without Flower (the ClientApp only unwraps messages).

An edge commits a round only once the cloud has aggregated it: training leaves the new state
(c_i advanced by the decoded Δc, the personalized messenger) under ``STATE/pending``, and the
next sync promotes it if the cloud's copy of c_i equals it, or drops it if the cloud never used
the packet (the edge died, the reply came too late, the packet was refused). So c_i on the edge
always equals the cloud's copy, whatever was killed when.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ciders_edge.data.holdout import VAL_FRACTION, check_val_fraction
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.fleet.bundle_sync import held_files, install_bundle
from ciders_edge.fleet.protocol import consensus_digest, summed_round
from ciders_edge.formats.atomic import append_jsonl
from ciders_edge.formats.client_state import METRICS_LOG, ClientState

__all__ = [
    "EdgeConfig",
    "CloudRequest",
    "settle",
    "sync",
    "train_pending",
    "choose_on",
    "cloud_digest",
    "PENDING",
    "BUNDLE",
]

PENDING = "pending"  # a trained round the cloud has not confirmed yet
BUNDLE = "bundle"  # the edge's copy of the current bundle


@dataclass(frozen=True)
class EdgeConfig:
    """This device's settings, passed to its SuperNode as ``--node-config`` by ``ciders-edge join``."""

    state: Path
    data: Path
    profile: str
    codec: str = "fp32"
    key: Path | None = None  # packet authentication key (the cloud holds the same in RUN/keys)
    val_fraction: float = VAL_FRACTION  # held out of the data to choose the deployed messenger (train's)

    def to_node_config(self) -> str:
        items = {"state": str(self.state), "data": str(self.data), "profile": self.profile, "codec": self.codec}
        items["val_fraction"] = self.val_fraction
        if self.key is not None:
            items["key"] = str(self.key)
        return " ".join(f"{k}={json.dumps(v)}" for k, v in items.items())  # TOML basic strings

    @classmethod
    def from_node_config(cls, cfg: Mapping) -> EdgeConfig:
        try:
            key = cfg.get("key")
            return cls(
                Path(cfg["state"]),
                Path(cfg["data"]),
                str(cfg["profile"]),
                str(cfg.get("codec", "fp32")),
                Path(key) if key else None,
                check_val_fraction(float(cfg.get("val_fraction", VAL_FRACTION))),
            )
        except KeyError as err:
            raise ConfigError(
                f"the SuperNode's --node-config lacks {err.args[0]!r}; start it with `ciders-edge join`"
            ) from None


def settle(
    state_dir: Path,
    client_id: str,
    cloud_digest: str,
    cloud_round: int,
    elsewhere: Mapping[str, str] | None = None,
    summed_round: int | None = None,
) -> ClientState | None:
    """Make the committed state the one the cloud's copy of c_i says it is; return it.

    A pending round is committed when the cloud's c_i equals its c_i, and dropped once the cloud
    is past that round without it; a late (stale) message of the same round leaves it pending.
    ``elsewhere`` is the cloud's digest under each other profile's names: a state that matches
    one of them was trained as that profile, which a mismatch then says. Under secure aggregation
    the cloud holds no c_i: ``summed_round``, the last round whose secure sum held this client's
    displacement, commits the pending round instead, and the edge's c_i is the only copy."""
    committed = ClientState.load(state_dir)
    if committed is not None and committed.client_id != client_id:
        raise StateError(
            f"{state_dir}: this state belongs to client {committed.client_id!r}, "
            f"but the cloud knows this node as {client_id!r}"
        )
    pending = ClientState.load(state_dir / PENDING)
    if pending is not None and cloud_round > pending.round:
        used = (
            pending.round == summed_round if summed_round is not None else consensus_digest(pending.c_i) == cloud_digest
        )
        if used:
            pending.save(state_dir)  # the cloud aggregated our last round: commit it
            committed, pending = pending, None
    if pending is None or cloud_round > pending.round:
        shutil.rmtree(state_dir / PENDING, ignore_errors=True)
    if summed_round is not None:  # secure rounds: the cloud has no copy to compare with
        return committed
    mine = consensus_digest(committed.c_i if committed else None)
    was = [p for p, d in (elsewhere or {}).items() if d == mine and mine]
    if mine != cloud_digest and was:
        raise StateError(
            f"{state_dir}: this state trained as profile {was[0]}, and this node now runs another profile; "
            f"join with --profile {was[0]}, or as a new client id with a new --state (a device that changes "
            "profile is a new client)"
        )
    if mine != cloud_digest:
        raise StateError(
            f"{state_dir}: this state's c_i differs from the cloud's copy for {client_id!r} "
            f"({mine[:12] or 'none'} here, {cloud_digest[:12] or 'none'} there); it was trained outside this run"
        )
    return committed


def cloud_digest(request: Mapping, profile: str) -> str:
    """The cloud's digest of this client's c_i as ``profile``'s AdapEmu names the tensors (profiles
    on another learnable backbone name the messenger layers differently)."""
    if "c_i_digests" not in request:  # a cloud of one split names them as this edge does
        return str(request["c_i_digest"])
    digests = json.loads(str(request["c_i_digests"]))
    if profile not in digests:
        raise ConfigError(f"this run ships no bundle for profile {profile!r}; it ships {', '.join(digests)}")
    return str(digests[profile])


def other_profiles(request: Mapping, profile: str) -> dict[str, str]:
    """The cloud's digests of this client's c_i under the names of the profiles other than ``profile``."""
    if "c_i_digests" not in request:
        return {}
    return {p: str(d) for p, d in json.loads(str(request["c_i_digests"])).items() if p != profile}


@dataclass(frozen=True)
class CloudRequest:
    """What a sync or round message from the cloud says: who this node is, the cloud's round and its copy of
    the node's c_i (as a digest under this profile's names and the others'), and the round's bundle manifest."""

    client_id: str
    digest: str
    round: int
    elsewhere: Mapping[str, str]
    summed_round: int | None = None  # secure rounds: the last round whose sum held this client
    manifest: bytes = b""

    @classmethod
    def of(cls, record: Mapping, profile: str) -> CloudRequest:
        manifest = bytes(record["manifest"]) if "manifest" in record else b""
        digest, elsewhere = cloud_digest(record, profile), other_profiles(record, profile)
        return cls(str(record["client_id"]), digest, int(record["round"]), elsewhere, summed_round(record), manifest)

    def settle(self, state_dir: Path) -> ClientState | None:
        return settle(state_dir, self.client_id, self.digest, self.round, self.elsewhere, self.summed_round)


def sync(cfg: EdgeConfig, request: CloudRequest) -> dict:
    """Answer a round's opening: settle the last round, say which profile and bundle files we hold."""
    request.settle(cfg.state)
    return {"profile": cfg.profile, "held": held_files(cfg.state / BUNDLE)}


def train_pending(cfg: EdgeConfig, request: CloudRequest, files: dict[str, bytes]) -> tuple[bytes, dict, dict]:
    """One round: rebuild and verify the bundle, train (``ciders-edge train``'s code), keep the new
    state pending; returns the packet, the training summary and the displacement the cloud would
    reconstruct from the packet (what a secure round sums instead)."""
    from ciders_edge.formats.packet import read_key_file
    from ciders_edge.training.round import RoundOptions, train_round  # transformers: only when training

    state = request.settle(cfg.state)
    bundle = install_bundle(cfg.state / BUNDLE, request.manifest, files)
    key = read_key_file(cfg.key) if cfg.key is not None else None
    options = RoundOptions(request.client_id, cfg.profile, cfg.codec, key, val_fraction=cfg.val_fraction)
    out = train_round(bundle, cfg.data, state, options)
    out.state.save(cfg.state / PENDING)
    append_jsonl(cfg.state / METRICS_LOG, [{"round": bundle.round, **s} for s in out.result.steps])
    return out.packet_bytes, out.summary, out.delta_sent


def choose_on(cfg: EdgeConfig, request: CloudRequest, files: dict[str, bytes]) -> dict:
    """A round this edge does not train: settle the last round, rebuild the new bundle and choose the deployed
    messenger again on it (``ciders-edge validate``'s code); the summary, or why there was nothing to choose."""
    from ciders_edge.formats.client_state import holds_choice
    from ciders_edge.training.rechoice import choose_again  # transformers: only when scoring

    request.settle(cfg.state)
    bundle = install_bundle(cfg.state / BUNDLE, request.manifest, files)
    if not holds_choice(cfg.state):
        return {"round": bundle.round, "skipped": "no deployed choice yet (never trained with a validation slice)"}
    return choose_again(bundle.path, cfg.data, cfg.state, cfg.profile, cfg.val_fraction)
