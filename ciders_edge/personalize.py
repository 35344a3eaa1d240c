"""The personalized model an edge runs: its bundle's frozen parts with the state's messenger x_K.

A messenger is only meaningful on the backbone it was trained against, so a state is accepted with
any bundle whose frozen parts (:attr:`Bundle.frozen_digest`) equal those it trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .bundle import Bundle
from .emu import EdgeModel, load_edge_model
from .errors import StateError
from .evaluate import use_messenger
from .state import ClientState
from .update import Tensors

__all__ = ["Source", "personal_messenger", "load_personalized", "merge_messenger"]


@dataclass
class Source:
    """Which model is running: recorded in exports and shown by ``infer``."""

    bundle_id: str
    round: int
    frozen_digest: str
    messenger: str  # "personalized" or "global"
    client_id: str = ""
    state_round: int = -1  # the round whose training produced the personalized messenger

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def same_model(self, other: dict) -> bool:
        """Does ``other`` (an export's recorded source) run exactly this model?"""
        keys = ["frozen_digest", "messenger"]
        keys += ["client_id", "state_round"] if self.messenger == "personalized" else ["bundle_id"]
        return all(other.get(k) == getattr(self, k) for k in keys)


def personal_messenger(bundle: Bundle, state_dir: str | Path | None, use_global: bool) -> tuple[Tensors, Source]:
    """The messenger LoRA to run: the state's x_K, or the bundle's global v with ``use_global``."""
    source = Source(bundle.bundle_id, bundle.round, bundle.frozen_digest, "global")
    if use_global:
        return {k: t.float() for k, t in bundle.messenger_lora().items()}, source
    if state_dir is None:
        raise StateError("no --state given: pass the client state folder, or --global for the bundle's messenger")
    if not Path(state_dir).is_dir():
        raise StateError(f"{state_dir}: no such state folder (pass the --state that `ciders-edge train` used)")
    state = ClientState.load(state_dir)
    if state is None or not state.personalized:
        raise StateError(f"{state_dir}: no personalized messenger yet (train a round first, or pass --global)")
    state.check_model(bundle)
    trained_on = state.frozen_digest or state.bundle_id
    if trained_on not in (bundle.frozen_digest, bundle.bundle_id):
        raise StateError(
            f"{state_dir}: its messenger was trained on bundle {state.bundle_id[:12]} (round {state.round}), "
            f"whose backbone differs from this bundle's (round {bundle.round}); pass that bundle, or --global"
        )
    source.messenger, source.client_id, source.state_round = "personalized", state.client_id, state.round
    return state.personalized, source


def load_personalized(
    bundle: Bundle, state_dir: str | Path | None, use_global: bool = False, dtype: torch.dtype | None = None
) -> tuple[EdgeModel, Source]:
    """The AdapEmu of ``bundle`` running the personalized (or global) messenger, LoRA still live."""
    x, source = personal_messenger(bundle, state_dir, use_global)
    edge = load_edge_model(bundle, dtype)
    use_messenger(edge, x)
    return edge, source


def merge_messenger(edge: EdgeModel) -> PreTrainedModel:
    """Fold the messenger LoRA into dense weights: a plain transformers model, no PEFT at run time.

    Consumes ``edge.model`` (PEFT merges in place).
    """
    model = edge.model.merge_and_unload()
    model.eval()
    return model
