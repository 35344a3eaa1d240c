"""``ciders-edge validate`` from Python: choose the deployed messenger again on a newer bundle, without training.

Under partial participation a device trains once in several rounds, and between them the federation's
global messenger improves: issue 58's study found the devices not sampled for 5 to 12 rounds deploying
messengers 0.05 nats worse than the newest global one. When a newer bundle arrives and the device is not
sampled, it scores its kept best against the bundle's global messenger, its latest personalized one and
their mixtures on its validation slice (:func:`ciders_edge.training.validation.rechoose`) and keeps the
best. The state's round, consensus and personalized messenger are untouched: only what it deploys changes.
"""

from __future__ import annotations

import time
from pathlib import Path

from ciders_edge.data.holdout import VAL_FRACTION, hold_out
from ciders_edge.data.records import load_examples
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.lock import folder_lock
from ciders_edge.profiles import keeps_quantized, load_profile
from ciders_edge.training.fleet_evidence import FleetEvidence
from ciders_edge.training.round import deployed_backbone, round_hyperparams
from ciders_edge.training.validation import rechoose

__all__ = ["choose_again"]


def choose_again(
    bundle: str | Path,
    data: str | Path,
    state_dir: str | Path,
    profile: str | None = None,
    val_fraction: float = VAL_FRACTION,
    frozen_weights: str | None = None,
) -> dict:
    """Score the state's messengers and ``bundle``'s global one on the validation slice of ``data`` and save
    the best as the state's deployed messenger; the summary ``ciders-edge validate --json`` prints."""
    b = Bundle.load(bundle)
    if not Path(state_dir).is_dir():
        _check(None, b, state_dir)
    with folder_lock(state_dir, "ciders-edge validate"):
        state = ClientState.load(state_dir)
        _check(state, b, state_dir)
        started = time.perf_counter()
        prof = load_profile(profile) if profile else None
        edge = deployed_backbone(b, profile, keeps_quantized(frozen_weights, prof, b.manifest["profile"]))
        seq_len = round_hyperparams(b, prof, {}).seq_len
        _, val = hold_out(load_examples(data, edge.tokenizer, seq_len), val_fraction, f"{data}: ")
        if not val:
            raise ConfigError(f"{data}: no validation slice to choose on (--val-fraction {val_fraction:g})")
        v = {k: t.float() for k, t in b.messenger_lora().items()}
        x = {k: t.float() for k, t in state.personalized.items()}
        result = rechoose(edge, val, v, x, _kept(state), (b.round, state.round), FleetEvidence.of(b.manifest))
        result.keep_in(state)
        state.save(state_dir)
    seconds = round(time.perf_counter() - started, 3)
    return {
        "client_id": state.client_id,
        "round": b.round,
        "bundle_id": b.bundle_id,
        "trained_round": state.round,
        **result.summary(),
        "val_seconds": seconds,
        "state": str(state_dir),
    }


def _check(state: ClientState | None, b: Bundle, state_dir: str | Path) -> None:
    if state is None:
        raise StateError(f"{state_dir}: no client state; a device that never trained deploys the bundle's global")
    state.check_model(b)
    state.check_run(b)
    if b.round <= state.round:
        raise StateError(
            f"bundle round {b.round} is not newer than the round this state trained ({state.round}); "
            "validate chooses again on a later bundle"
        )


def _kept(state: ClientState) -> tuple[dict, dict]:
    """The state's best, or its latest personalized messenger for a state that never validated."""
    if state.best:
        return {k: t.float() for k, t in state.best.items()}, state.best_info
    return state.personalized, {"messenger": "personalized", "round": state.round, "alpha": None}
