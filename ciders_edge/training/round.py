"""One round of the CIDERS edge update, in memory: K local steps on the AdapEmu, then the Δc packet.

:func:`train_round` loads the bundle's AdapEmu and the data on the profile's device and runs
:func:`local_round`, the algorithm's round (docs/design.md §3) on a loaded model. Neither writes a
file: :func:`ciders_edge.training.train.train` writes the packet and the state, the Flower edge
sends the packet over the network. :class:`RoundOptions` carries the caller's choices through all three.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ciders_edge.allocator import return_freed_memory
from ciders_edge.data.holdout import VAL_FRACTION, check_val_fraction, hold_out
from ciders_edge.data.records import Example, load_examples
from ciders_edge.errors import ConfigError, PacketError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.packet import Packet, consensus_digest
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.inference.personalize import load_backbone
from ciders_edge.memory import estimate_memory
from ciders_edge.model.adapemu import EdgeModel, EmulatorCache, load_edge_model
from ciders_edge.model.quantized import is_quantized
from ciders_edge.model.split import SplitSpec
from ciders_edge.profiles import (
    DeviceProfile,
    check_frozen_weights,
    keeps_quantized,
    load_profile,
    pick_device,
    profile_for,
)
from ciders_edge.tensors import Tensors, add, non_finite, norm
from ciders_edge.training.bilevel import client_gradients
from ciders_edge.training.equations import clip_displacement, reconstruct_displacement
from ciders_edge.training.fleet_evidence import FleetEvidence
from ciders_edge.training.local_steps import LocalResult, local_update
from ciders_edge.training.objective import MessengerObjective
from ciders_edge.training.validation import Validation, validate

__all__ = [
    "RoundOptions",
    "RoundOutput",
    "train_round",
    "local_round",
    "load_round",
    "check_state",
    "round_hyperparams",
    "EMULATORS",
    "deployed_backbone",
    "deploys_full",
]

EMULATORS = EmulatorCache()  # the AdapEmu a study's jobs share (RoundOptions.reuse_model)


@dataclass(frozen=True)
class RoundOptions:
    """What a caller chooses about a round besides the bundle, the data and the state."""

    client_id: str | None = None  # needed on first use (``train``'s default: the host name)
    profile: str | None = None  # device profile name or .toml path (dtype, device, batch shape)
    codec: str = "fp32"  # the packet's codec (fp32, bf16, int8, ...)
    key: bytes | None = None  # the client key that authenticates the packet (None: unsigned)
    overrides: dict = field(default_factory=dict)  # round hyperparameters to override (local_steps, eta, ...)
    on_step: Callable[[dict], None] | None = None  # called with each local step's metrics
    control: Tensors | None = None  # the svrg direction's global h (the cloud's answer to the round's probes)
    seed: int = 0  # of the data order, with the client id and round
    frozen_weights: str | None = None  # quantized | dequantized (None: the profile's)
    gradient_checkpointing: bool | None = None  # None: the profile's
    val_fraction: float = VAL_FRACTION  # of the records held out to choose the deployed messenger (0: none)
    reuse_model: bool = False  # keep the AdapEmu for the next round on the same bundle (a study's jobs)

    def __post_init__(self) -> None:
        check_frozen_weights(self.frozen_weights)  # before any file is touched
        check_val_fraction(self.val_fraction)


@dataclass
class RoundOutput:
    packet: Packet  # as decoded from ``packet_bytes``: what the cloud will see
    packet_bytes: bytes
    state: ClientState  # advanced by the decoded increment
    result: LocalResult
    delta_sent: dict  # the displacement the cloud aggregates: eq. (11) of the decoded packet (clipped when edges clip)
    summary: dict = field(default_factory=dict)  # what ``ciders-edge train --json`` prints


def round_hyperparams(bundle: Bundle, profile: DeviceProfile | None, overrides: dict) -> RoundHyperparams:
    """The bundle's round hyperparameters, then the profile's batch shape, then explicit flags."""
    hp = RoundHyperparams.from_dict(bundle.manifest["hyperparameters"])
    if profile is not None:
        hp = hp.replace(batch_size=profile.batch_size, seq_len=profile.seq_len, grad_accum=profile.grad_accum)
    flags = {k: v for k, v in overrides.items() if v is not None}
    return RoundHyperparams.from_dict({**hp.to_dict(), **flags}, where="flags") if flags else hp


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


def local_round(
    edge: EdgeModel, examples: list[Example], state: ClientState | None, hp: RoundHyperparams, options: RoundOptions
) -> RoundOutput:
    """Run K local steps and encode dc_i; the state advances by the *decoded* increment. When the round
    asks for ``grad_y_in_packet`` (a bilevel ask) the packet also carries grad_y f_i at the bundle's point."""
    bundle = edge.bundle
    client_id, seed = options.client_id or "", options.seed
    v_all = {k: t.float() for k, t in bundle.messenger_lora().items()}
    v = {k: t for k, t in v_all.items() if edge.split.trains(k)}  # the layers this profile trains; the rest stay v
    c = {k: t.float() for k, t in bundle.consensus().items()}
    _check_shapes(c, v, "the bundle's consensus c")
    if state is None:
        state = ClientState(
            client_id,
            bundle.manifest["base_model"]["revision"],
            bundle.manifest["split"]["kept"],
            c_i={k: torch.zeros_like(t) for k, t in v.items()},
        )
    _check_shapes(state.c_i, v, "the state's consensus c_i")
    if state.rng is not None:
        torch.set_rng_state(state.rng)
    else:  # a new client's RNG is its own, not whatever this process drew before (a study's actor, a reused model)
        torch.manual_seed(round_seed(seed, f"rng:{client_id}", bundle.round))
    grad_y = {}
    if (ask := hp.ask) is not None and ask.grad_y_in_packet:  # at the bundle's point, before training
        probe_seed = round_seed(seed, f"probe:{client_id}", bundle.round)
        grad_y = client_gradients(edge, examples, hp, ask.probe_batches, probe_seed)[2]
    objective = MessengerObjective(
        edge, examples, hp.batch_size, hp.grad_accum, round_seed(seed, client_id, bundle.round), edge.checkpoint
    )
    x0 = {k: state.personalized[k] for k in v} if hp.start_from == "personalized" and state.personalized else v
    result = local_update(v, c, state.c_i, objective, hp, options.on_step, x0=x0, control=options.control)
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
    packet = Packet(client_id, bundle.round, bundle.bundle_id, options.codec, len(examples), tensors, metrics)
    data = packet.to_bytes(options.key)
    packet = Packet.from_bytes(data, options.key)
    dc = {k: packet.tensors[k] for k in v}
    new_state = ClientState(
        client_id,
        state.model_revision,
        state.kept_layers,
        bundle.round,
        bundle.bundle_id,
        bundle.frozen_digest,
        c_i=add(state.c_i, dc),  # the compression rule: advance by what the cloud decodes
        personalized={**v_all, **result.x_final},  # the whole messenger this edge answers with
        counters={
            "rounds": state.counters["rounds"] + 1,
            "steps": state.counters["steps"] + hp.local_steps,
            "examples_seen": state.counters["examples_seen"] + hp.local_steps * hp.batch_size * hp.grad_accum,
        },
        rng=torch.get_rng_state(),
        run_id=bundle.manifest.get("run_id", ""),
    )
    delta_sent = reconstruct_displacement(dc, state.c_i, c, hp.alpha, hp.gamma)
    if (
        hp.displacement_clip is not None
    ):  # as the cloud clips it: a lossy codec's rounding, divided by alpha, can exceed C
        delta_sent = clip_displacement(delta_sent, hp.displacement_clip)
    return RoundOutput(packet, data, new_state, result, delta_sent)


def train_round(b: Bundle, data: str | Path, state: ClientState | None, options: RoundOptions) -> RoundOutput:
    """Check the state against the bundle, load the bundle's AdapEmu and the data, run :func:`local_round`
    and fill its summary."""
    check_state(state, b)
    hp, edge, examples = load_round(b, data, options.profile, options.overrides, memory=options)
    examples, val = hold_out(examples, options.val_fraction, f"{data}: ")
    started = time.perf_counter()
    output = local_round(edge, examples, state, hp, options)
    trained = time.perf_counter()
    seconds = {"train_seconds": round(trained - started, 3)}  # what validation costs, beside it
    validation = None
    if val:
        if deploys_full(b):
            quantized = is_quantized(edge.model)
            del edge  # the AdapEmu's memory before AdapFu's
            EMULATORS.clear()
            gc.collect()
            edge = deployed_backbone(b, options.profile, quantized)
        validation = _validate(edge, val, state, output)
        seconds["val_seconds"] = round(time.perf_counter() - trained, 3)
    rfd = [m["r_fd"] for m in output.result.steps if "r_fd" in m]
    p = output.packet
    output.summary = {
        "client_id": p.client_id,
        "round": b.round,
        "bundle_id": b.bundle_id,
        "solver": hp.solver,
        "codec": options.codec,
        "steps": hp.local_steps,
        "examples": len(examples),
        "loss_first": p.metrics["loss_first"],
        "loss_last": p.metrics["loss_last"],
        "dc_norm": p.metrics["dc_norm"],
        "c_i_norm": norm(output.state.c_i),
        "r_fd": sum(rfd) / len(rfd) if rfd else None,
        "raw_bytes": p.raw_bytes,
        "packet_bytes": len(output.packet_bytes),
        **(validation.summary() if validation else {}),
        **seconds,
    }
    return output


def deploys_full(b: Bundle) -> bool:
    """Whether the device deploys AdapFu (the full backbone) rather than the AdapEmu it trains on."""
    return b.manifest.get("deploy_backbone", "emu") == "full"


def deployed_backbone(b: Bundle, profile: str | None, quantized: bool) -> EdgeModel:
    """The backbone the device deploys, on the profile's device and dtype: the messengers are chosen on it."""
    prof = load_profile(profile) if profile else None
    edge = load_backbone(
        b, "full" if deploys_full(b) else "emu", prof.torch_dtype if prof else None, quantized=quantized
    )
    edge.model.to(pick_device(prof))
    return edge


def _validate(edge: EdgeModel, val: list[Example], before: ClientState | None, output: RoundOutput) -> Validation:
    """Score the round's candidates on the deployed backbone; the new state keeps the best and the scores."""
    new, bundle = output.state, edge.bundle
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    kept = (before.best, before.best_info) if before is not None and before.best else None
    result = validate(
        edge, val, v, new.personalized, kept, (bundle.round, new.round), FleetEvidence.of(bundle.manifest)
    )
    result.keep_in(new)
    return result


def load_round(
    b: Bundle, data, profile: str | None, overrides: dict, live_backbone: bool = False, memory: RoundOptions = None
):
    """The round's hyperparameters, the AdapEmu on the profile's device, and the tokenized data. How the
    frozen weights are held and whether the messenger checkpoints come from ``memory``'s flags, else the
    profile named, else the bundle's."""
    prof = load_profile(profile) if profile else None
    hp = round_hyperparams(b, prof, overrides)
    memory = memory or RoundOptions()
    quantized = keeps_quantized(memory.frozen_weights, prof, b.manifest["profile"])
    own = prof or profile_for(None, b.manifest["profile"])
    checkpoint = own.gradient_checkpointing if memory.gradient_checkpointing is None else memory.gradient_checkpointing
    _check_fits(b, own, hp, quantized, checkpoint)
    if own.return_freed_memory:
        return_freed_memory()
    load = EMULATORS.get if memory.reuse_model else load_edge_model
    edge = load(b, prof.torch_dtype if prof else None, live_backbone or hp.grad_y_in_packet, quantized)
    edge.checkpoint = checkpoint
    edge.model.to(pick_device(prof))
    return hp, edge, load_examples(data, edge.tokenizer, hp.seq_len)


def _check_fits(b: Bundle, profile: DeviceProfile, hp: RoundHyperparams, quantized: bool, checkpoint: bool) -> None:
    """Refuse, before the model loads, a round the memory model says cannot train within the profile's budget."""
    from transformers import AutoConfig

    split = SplitSpec.from_dict(b.manifest["split"])
    shape = {"batch_size": hp.batch_size, "seq_len": hp.seq_len, "grad_accum": hp.grad_accum}
    mode = {"frozen_weights": "quantized" if quantized else "dequantized", "gradient_checkpointing": checkpoint}
    fitted = replace(profile, **shape, **mode)
    storage = b.manifest.get("storage", {}).get("format", "fp32")
    est = estimate_memory(AutoConfig.from_pretrained(b.path), split.emu_layers, split.trained, fitted, storage)
    if not est.fits:
        raise ConfigError(
            f"{b.path}: training here {est.describe()} (profile {profile.name}); use a profile with more memory, "
            "--gradient-checkpointing, --frozen-weights quantized or a smaller --batch-size"
        )


def round_seed(seed: int, client_id: str, round_: int) -> int:
    """A data-order seed that is the same in every process (unlike ``hash`` of a str)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{client_id}:{round_}".encode()).digest()[:8], "little")


def _check_shapes(c_i: dict, v: dict, what: str) -> None:
    if c_i.keys() != v.keys() or any(c_i[k].shape != v[k].shape for k in v):
        raise StateError(f"{what} does not match the messenger LoRA layers this bundle trains")


def _check_finite(result: LocalResult) -> None:
    for what, tensors in (("delta_c", result.dc), ("personalized messenger", result.x_final)):
        if (name := non_finite(tensors)) is not None:
            raise PacketError(f"non-finite values in {what} tensor {name}; no packet written, state unchanged")
