"""``ciders-edge train``: one round of the CIDERS edge update on a bundle, ending in a Δc packet.

:func:`train_round` is the I/O-free core that ``simulate`` and the Flower client call too;
:func:`train` adds the files: bundle, data, state folder, packet.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ciders_edge.config import RoundHyperparams
from ciders_edge.data.records import Example, load_examples
from ciders_edge.errors import ConfigError, PacketError, StateError
from ciders_edge.formats.atomic import write_bytes
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import METRICS_LOG, ClientState
from ciders_edge.formats.packet import Packet, consensus_digest
from ciders_edge.model.adapemu import EdgeModel, load_edge_model
from ciders_edge.profiles import DeviceProfile, load_profile, pick_device
from ciders_edge.training.bilevel import client_gradients
from ciders_edge.training.equations import Tensors, add, norm, reconstruct_displacement
from ciders_edge.training.local_steps import LocalResult, local_update
from ciders_edge.training.objective import MessengerObjective

PROBE_KIND = "gradients"  # metrics["kind"] of FedNest's probe packet

__all__ = [
    "RoundOutput",
    "train_round",
    "train",
    "train_files",
    "train_bundle",
    "probe_files",
    "PROBE_KIND",
    "round_hyperparams",
    "read_key",
    "append_metrics",
]


@dataclass
class RoundOutput:
    packet: Packet  # as decoded from ``packet_bytes``: what the cloud will see
    packet_bytes: bytes
    state: ClientState  # advanced by the decoded increment
    result: LocalResult
    delta_sent: dict  # the displacement the cloud reconstructs from the decoded packet (eq. 11)


def round_hyperparams(bundle: Bundle, profile: DeviceProfile | None, overrides: dict) -> RoundHyperparams:
    """The bundle's round hyperparameters, then the profile's batch shape, then explicit flags."""
    hp = RoundHyperparams.from_dict(bundle.manifest["hyperparameters"])
    if profile is not None:
        hp = hp.replace(batch_size=profile.batch_size, seq_len=profile.seq_len, grad_accum=profile.grad_accum)
    return hp.replace(**overrides)


def check_state(state: ClientState | None, bundle: Bundle) -> None:
    """Refuse a state made for another model or split, or a bundle older than the state."""
    if state is None:
        return
    state.check_model(bundle)
    state.check_run(bundle)
    if bundle.round < state.round:
        raise StateError(f"bundle round {bundle.round} is older than this state's round {state.round}")
    if bundle.round == state.round:
        raise StateError(f"this state already trained round {state.round}; wait for round {state.round + 1}'s bundle")


def train_round(
    edge: EdgeModel,
    examples: list[Example],
    state: ClientState | None,
    hp: RoundHyperparams,
    *,
    client_id: str,
    codec: str = "fp32",
    key: bytes | None = None,
    seed: int = 0,
    on_step: Callable[[dict], None] | None = None,
    control: Tensors | None = None,
) -> RoundOutput:
    """Run K local steps and encode dc_i; the state advances by the *decoded* increment.

    ``control`` is FedNest's global hypergradient for the svrg solver; with ``hp.send_grad_y``
    (LFedNest) the packet also carries grad_y f_i at the bundle's point."""
    bundle = edge.bundle
    check_state(state, bundle)
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    c = {k: t.float() for k, t in bundle.consensus().items()}
    if state is None:
        state = ClientState(
            client_id,
            bundle.manifest["base_model"]["revision"],
            bundle.manifest["split"]["kept"],
            c_i={k: torch.zeros_like(t) for k, t in v.items()},
        )
    _check_shapes(state.c_i, v)
    if state.rng is not None:
        torch.set_rng_state(state.rng)
    grad_y = {}
    if hp.send_grad_y:  # LFedNest: at the bundle's point, before training moves the messenger
        probe_seed = _seed(seed, f"probe:{client_id}", bundle.round)
        grad_y = client_gradients(edge, examples, hp, hp.probe_batches, probe_seed)[2]
    objective = MessengerObjective(edge, examples, hp.batch_size, hp.grad_accum, _seed(seed, client_id, bundle.round))
    x0 = state.personalized if hp.start_from == "personalized" and state.personalized else v
    result = local_update(v, c, state.c_i, objective, hp, on_step, x0=x0, control=control)
    _check_finite(result)
    losses = [s["loss"] for s in result.steps]
    metrics = {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "steps": hp.local_steps,
        "solver": hp.solver,
        "dc_norm": norm(result.dc),
        "delta_norm": norm(result.delta),
        "gamma": hp.gamma,  # the cloud inverts eq. (10) with these: they must be the round's
        "alpha": hp.alpha,
        "c_i_digest": consensus_digest(state.c_i),  # the cloud checks its copy of c_i is this one
    }
    tensors = {**result.dc, **grad_y}
    data = Packet(client_id, bundle.round, bundle.bundle_id, codec, len(examples), tensors, metrics).to_bytes(key)
    packet = Packet.from_bytes(data, key)
    dc = {k: packet.tensors[k] for k in v}
    new_state = ClientState(
        client_id,
        state.model_revision,
        state.kept_layers,
        bundle.round,
        bundle.bundle_id,
        bundle.frozen_digest,
        c_i=add(state.c_i, dc),  # the compression rule: advance by what the cloud decodes
        personalized=result.x_final,
        counters={
            "rounds": state.counters["rounds"] + 1,
            "steps": state.counters["steps"] + hp.local_steps,
            "examples_seen": state.counters["examples_seen"] + hp.local_steps * hp.batch_size * hp.grad_accum,
        },
        rng=torch.get_rng_state(),
        run_id=bundle.manifest.get("run_id", ""),
    )
    delta_sent = reconstruct_displacement(dc, state.c_i, c, hp.alpha, hp.gamma)
    return RoundOutput(packet, data, new_state, result, delta_sent)


def train(bundle: str | Path, data: str | Path, state_dir: str | Path, out: str | Path, **kwargs) -> dict:
    """Train one round from files and write the packet, then the state (each atomically); returns a summary."""
    return train_files(bundle, data, state_dir, out, **kwargs)[0]


def train_files(
    bundle: str | Path,
    data: str | Path,
    state_dir: str | Path,
    out: str | Path,
    *,
    client_id: str | None = None,
    **kwargs,
) -> tuple[dict, RoundOutput]:
    """:func:`train` that also returns the in-memory round output (``simulate`` reads its tensors)."""
    b = Bundle.load(bundle)
    state = ClientState.load(state_dir)
    check_state(state, b)
    if state is not None and client_id is not None and client_id != state.client_id:
        raise ConfigError(f"--client-id {client_id!r} differs from the state's {state.client_id!r}")
    cid = state.client_id if state is not None else client_id or os.uname().nodename
    summary, out_round = train_bundle(b, data, state, client_id=cid, **kwargs)
    write_bytes(out, out_round.packet_bytes)
    out_round.state.save(state_dir)
    append_metrics(Path(state_dir) / METRICS_LOG, b.round, out_round.result.steps)
    return {**summary, "packet": str(out), "state": str(state_dir)}, out_round


def train_bundle(
    b: Bundle,
    data: str | Path,
    state: ClientState | None,
    *,
    client_id: str,
    profile: str | None = None,
    codec: str = "fp32",
    key: bytes | None = None,
    overrides: dict | None = None,
    on_step: Callable[[dict], None] | None = None,
    hypergradient: Tensors | None = None,
) -> tuple[dict, RoundOutput]:
    """Load the bundle's AdapEmu and the data, run :func:`train_round`; writes nothing (the callers
    decide where the packet and the state go: files for ``ciders-edge train``, the network for a fleet)."""
    hp, edge, examples = _load(b, data, profile, overrides or {})
    out_round = train_round(
        edge, examples, state, hp, client_id=client_id, codec=codec, key=key, on_step=on_step, control=hypergradient
    )
    rfd = [m["r_fd"] for m in out_round.result.steps if "r_fd" in m]
    p = out_round.packet
    summary = {
        "client_id": client_id,
        "round": b.round,
        "bundle_id": b.bundle_id,
        "solver": hp.solver,
        "codec": codec,
        "steps": hp.local_steps,
        "examples": len(examples),
        "loss_first": p.metrics["loss_first"],
        "loss_last": p.metrics["loss_last"],
        "dc_norm": p.metrics["dc_norm"],
        "c_i_norm": norm(out_round.state.c_i),
        "r_fd": sum(rfd) / len(rfd) if rfd else None,
        "raw_bytes": p.raw_bytes,
        "packet_bytes": len(out_round.packet_bytes),
    }
    return summary, out_round


def probe_files(
    bundle: str | Path,
    data: str | Path,
    state_dir: str | Path,
    out: str | Path,
    *,
    client_id: str,
    profile: str | None = None,
    key: bytes | None = None,
) -> dict:
    """FedNest's first exchange of a round: ``grad_x f_i`` and ``grad_y f_i`` at the bundle's point,
    written as an fp32 packet (the cloud's hypergradient takes them exactly); the state is unchanged."""
    b = Bundle.load(bundle)
    check_state(ClientState.load(state_dir), b)
    hp, edge, examples = _load(b, data, profile, {}, live_backbone=True)
    seed = _seed(0, f"probe:{client_id}", b.round)
    loss, grad_x, grad_y = client_gradients(edge, examples, hp, hp.probe_batches, seed)
    metrics = {"kind": PROBE_KIND, "loss": loss}
    packet = Packet(client_id, b.round, b.bundle_id, "fp32", len(examples), {**grad_x, **grad_y}, metrics)
    size = packet.save(out, key)
    return {"client_id": client_id, "round": b.round, "loss": loss, "packet": str(out), "packet_bytes": size}


def _load(b: Bundle, data, profile: str | None, overrides: dict, live_backbone: bool = False):
    """The round's hyperparameters, the AdapEmu on the profile's device, and the tokenized data."""
    prof = load_profile(profile) if profile else None
    hp = round_hyperparams(b, prof, overrides)
    edge = load_edge_model(b, prof.torch_dtype if prof else None, live_backbone or hp.send_grad_y)
    edge.model.to(pick_device(prof))
    return hp, edge, load_examples(data, edge.tokenizer, hp.seq_len)


def read_key(path: Path) -> bytes:
    """A client key file: its bytes, stripped of surrounding whitespace; at least 16 bytes."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such key file")
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise ConfigError(f"{path}: a client key needs at least 16 bytes, got {len(key)}")
    return key


def _seed(seed: int, client_id: str, round_: int) -> int:
    """A data-order seed that is the same in every process (unlike ``hash`` of a str)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{client_id}:{round_}".encode()).digest()[:8], "little")


def _check_shapes(c_i: dict, v: dict) -> None:
    if c_i.keys() != v.keys() or any(c_i[k].shape != v[k].shape for k in v):
        raise StateError("the state's consensus c_i does not match the bundle's messenger LoRA shapes")


def _check_finite(result: LocalResult) -> None:
    for what, tensors in (("delta_c", result.dc), ("personalized messenger", result.x_final)):
        for name, t in tensors.items():
            if not torch.isfinite(t).all():
                raise PacketError(f"non-finite values in {what} tensor {name}; no packet written, state unchanged")


def append_metrics(path: Path, round_: int, steps: list[dict]) -> None:
    with path.open("a") as f:
        for s in steps:
            f.write(json.dumps({"round": round_, **s}) + "\n")
