"""The personalized model an edge runs: a backbone with the state's messenger x_K.

The backbone is the bundle's AdapEmu (what the messenger trained on) or the full backbone (AdapFu,
:mod:`.adapfu`). On the AdapEmu a messenger is only meaningful with the backbone it was trained
against, so a state is accepted with any bundle whose frozen parts (:attr:`Bundle.frozen_digest`)
equal those it trained on; AdapFu's parts are the same in every bundle of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.model.adapemu import EdgeModel, load_edge_model
from ciders_edge.model.adapfu import load_adapfu
from ciders_edge.model.quantized import is_quantized
from ciders_edge.profiles import BACKBONES
from ciders_edge.tensors import Tensors

__all__ = [
    "Source",
    "personal_messenger",
    "load_personalized",
    "load_backbone",
    "merge_messenger",
    "resolve_backbone",
    "MESSENGERS",
    "DEPLOYABLE",
]

MESSENGERS = ("personalized", "global", "base")  # base: the messenger layers as the source model has them
DEPLOYABLE = ("best", "latest", "global")  # --messenger: a device's choices (latest: its last personalized one)


@dataclass
class Source:
    """Which model is running: recorded in exports and shown by ``infer``."""

    bundle_id: str
    round: int
    frozen_digest: str  # what the messenger runs on: Bundle.frozen_digest (emu) or Bundle.full_digest (full)
    messenger: str  # "personalized", "global" or "base"
    client_id: str = ""
    state_round: int = -1  # the round whose training produced the personalized messenger
    backbone: str = "emu"
    choice: str = ""  # "best": which messenger the state's validation chose, and why
    pick: str = ""  # "best": that choice in a word or two ("global r3", "mix 0.25 r3", "latest")

    def describe(self) -> str:
        """Which messenger runs, in words (``infer``, ``export`` and ``bench`` say it)."""
        if self.messenger == "global":
            return f"round {self.round}'s global messenger"
        if self.messenger == "base":
            return "the base model's messenger layers"
        if self.messenger == "best":
            return f"client {self.client_id}'s best messenger: {self.choice}"
        return f"client {self.client_id}'s personalized messenger of round {self.state_round}" + (
            f" ({self.choice})" if self.choice else ""
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> Source:
        """A recorded source (an export's manifest, a summary); keys it does not know are left out."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def same_model(self, other: dict) -> bool:
        """Does ``other`` (an export's recorded source) run exactly this model?"""
        keys = ["frozen_digest", "messenger"]
        keys += ["client_id", "state_round"] if self.messenger in ("personalized", "best") else ["bundle_id"]
        keys += ["choice"] if self.messenger == "best" else []
        same_backbone = other.get("backbone", "emu") == self.backbone
        return same_backbone and all(other.get(k) == getattr(self, k) for k in keys)


def resolve_backbone(bundle: Bundle, backbone: str | None) -> str:
    """``backbone``, or what the bundle's profile deploys (``emu`` for bundles that predate AdapFu)."""
    backbone = backbone or bundle.manifest.get("deploy_backbone", "emu")
    if backbone not in BACKBONES:
        raise ConfigError(f"--backbone must be one of {', '.join(BACKBONES)}, got {backbone!r}")
    return backbone


def personal_messenger(
    bundle: Bundle, state_dir: str | Path | None, messenger: str = "personalized", backbone: str = "emu"
) -> tuple[Tensors, Source]:
    """The messenger LoRA to run: the state's best (what its validation chose) or latest x_K, the bundle's
    global v, or zeros (the base model's)."""
    messenger = "personalized" if messenger == "latest" else messenger
    digest = bundle.full_digest if backbone == "full" else bundle.frozen_digest
    source = Source(bundle.bundle_id, bundle.round, digest, messenger, backbone=backbone)
    if messenger not in (*MESSENGERS, "best"):
        raise ConfigError(f"--messenger must be one of {', '.join(DEPLOYABLE)}, got {messenger!r}")
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    if messenger == "global":
        return v, source
    if messenger == "base":
        return {k: torch.zeros_like(t) for k, t in v.items()}, source
    state = _trained_state(bundle, state_dir, backbone)
    source.client_id, source.state_round = state.client_id, state.round
    if messenger == "personalized":
        return state.personalized, source
    if not state.best:
        source.messenger, source.pick = "personalized", "latest"
        source.choice = (
            f"latest: round {state.round} held out no validation slice (--val-fraction 0, or under 16 records)"
        )
        return state.personalized, source
    info = state.best_info
    alpha = f" {info['alpha']:g}" if info.get("alpha") is not None else ""
    source.pick = f"{info['messenger']}{alpha}" + (f" r{info['round']}" if info["messenger"] != "base" else "")
    source.choice = _why(info, state.validation)
    if (info["messenger"], info["round"]) == ("personalized", state.round):
        source.messenger = "personalized"  # the same model as --messenger latest, said once
        source.choice = f"the best: {_evidence(info, state.validation)}"
    return state.best, source


def _trained_state(bundle: Bundle, state_dir: str | Path | None, backbone: str) -> ClientState:
    """The client state of ``state_dir``, checked to hold a personalized messenger this bundle can run."""
    if state_dir is None:
        raise StateError("no --state given: pass the client state folder, or --messenger global")
    if not Path(state_dir).is_dir():
        raise StateError(f"{state_dir}: no such state folder (pass the --state that `ciders-edge train` used)")
    state = ClientState.load(state_dir)
    if state is None or not state.personalized:
        raise StateError(
            f"{state_dir}: no personalized messenger yet (train a round first, or pass --messenger global)"
        )
    state.check_model(bundle)
    trained_on = state.frozen_digest or state.bundle_id
    if backbone == "emu" and trained_on not in (bundle.frozen_digest, bundle.bundle_id):
        raise StateError(
            f"{state_dir}: its messenger was trained on bundle {state.bundle_id[:12]} (round {state.round}), "
            f"whose backbone differs from this bundle's (round {bundle.round}); pass that bundle, "
            "--backbone full, or --messenger global"
        )
    return state


def _why(best: dict, scores: dict) -> str:
    """The best messenger in words, with the scores it won by (state.json's ``best`` and ``validation``)."""
    kind, of_round = best["messenger"], f" of round {best['round']}"
    name = {
        "base": "the base model's messenger layers",
        "mix": f"a {best.get('alpha')} mixture of the personalized and global messengers{of_round}",
    }.get(kind, f"the {kind} messenger{of_round}")
    return f"{name}, {_evidence(best, scores)}"


def _evidence(best: dict, scores: dict) -> str:
    """What made ``best`` the best: its NLL on the held-out slice beside its rivals', and the margin a rival
    of this round's personalized messenger had to win by (:func:`~ciders_edge.training.validation.validate`)."""
    rivals = ", ".join(
        f"{k} {s['nll']:.4f}" for k, s in scores.items() if k in ("personalized", "global") and k != best["messenger"]
    )
    where = f"chosen on {best.get('records', '?')} held-out records in round {best['scored_round']}"
    se = best.get("se")
    margin = f", ahead of the personalized one by more than its standard error {se:.4f}" if se else ""
    if best["messenger"] == "base" and any(s["nll"] < best["nll"] for s in scores.values()):
        margin = ", as no messenger beat it beyond the standard error of the gap"  # validation.BASE_MARGIN's test
    return f"{where}: NLL {best['nll']:.4f}" + (f", against {rivals}" if rivals else "") + margin  # inside infer's ( )


def load_backbone(
    bundle: Bundle,
    backbone: str,
    dtype: torch.dtype | None = None,
    base_model: str | Path | None = None,
    quantized: bool = False,
) -> EdgeModel:
    """The bundle's AdapEmu, or AdapFu (full backbone from the bundle or ``base_model``); ``quantized``:
    int8/int4 frozen weights stay so in memory."""
    if backbone == "full":
        return load_adapfu(bundle, dtype, base_model, quantized)
    return load_edge_model(bundle, dtype, quantized=quantized)


def load_personalized(
    bundle: Bundle,
    state_dir: str | Path | None,
    messenger: str = "best",
    dtype: torch.dtype | None = None,
    backbone: str = "emu",
    base_model: str | Path | None = None,
    quantized: bool = False,
) -> tuple[EdgeModel, Source]:
    """A backbone running the state's best (or latest, or the global, or the base) messenger, LoRA still live."""
    x, source = personal_messenger(bundle, state_dir, messenger, backbone)
    edge = load_backbone(bundle, backbone, dtype, base_model, quantized)
    edge.use_messenger(x)
    return edge, source


def merge_messenger(edge: EdgeModel) -> PreTrainedModel:
    """Fold the messenger LoRA into dense weights: a plain transformers model, no PEFT at run time.
    Weights held quantized cannot absorb it (that would requantize them): their LoRA stays live.

    Consumes ``edge.model`` (PEFT merges in place).
    """
    if is_quantized(edge.model):
        return edge.model.eval()
    model = edge.model.merge_and_unload()
    model.eval()
    return model
