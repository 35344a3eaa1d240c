"""The differential-privacy and sampling flags ``prepare`` and ``simulate`` share (a run's ``[dp]`` table)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = [
    "DpClipOpt",
    "DpNoiseOpt",
    "DpEpsilonOpt",
    "DpDeltaOpt",
    "DpClipOnOpt",
    "SamplingOpt",
    "dp_table",
    "epsilon_text",
]

_PANEL = "Differential privacy"
DpClipOpt = Annotated[
    float | None,
    typer.Option(help="DP: clip each client's displacement to this L2 norm C (turns DP on).", rich_help_panel=_PANEL),
]
DpNoiseOpt = Annotated[
    float | None,
    typer.Option(help="DP: noise multiplier z (the sum's noise std is z C).", rich_help_panel=_PANEL),
]
DpEpsilonOpt = Annotated[
    float | None,
    typer.Option(
        help="DP: the epsilon the planned rounds may spend; z is solved from it, and no round may exceed it.",
        rich_help_panel=_PANEL,
    ),
]
DpDeltaOpt = Annotated[float | None, typer.Option(help="DP: delta (default 1/N).", rich_help_panel=_PANEL)]
DpClipOnOpt = Annotated[
    str | None,
    typer.Option(help="DP: where displacements are clipped: cloud (default) or edge.", rich_help_panel=_PANEL),
]
SamplingOpt = Annotated[
    str | None,
    typer.Option(help="How a round samples clients: fixed (round(qN) of them) or poisson (each with probability q)."),
]


def dp_table(clip: float | None, noise: float | None, epsilon: float | None, delta: float | None, clip_on: str | None):
    """The flags as the ``[dp]`` table's keys (unset ones left out, so a config file's stand)."""
    return {
        "clip": clip,
        "noise_multiplier": noise,
        "target_epsilon": epsilon,
        "delta": delta,
        "clip_on": clip_on,
    }


def epsilon_text(spent: dict) -> str:
    """``epsilon 1.23 at delta 0.02 after 5 rounds`` (``inf`` without noise)."""
    eps = spent["epsilon"]
    shown = f"{eps:.3g}" if isinstance(eps, float | int) else str(eps)
    return f"epsilon {shown} at delta {spent['delta']:.3g} after {spent['rounds']} rounds"
