"""FedAvg on the messenger LoRA, the base of SCAFFOLD, the offsite-tuning baselines and FedNest's rounds."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ciders_cloud.strategies.base import Strategy
from ciders_edge.hyperparams import RoundHyperparams

__all__ = ["FedAvg", "fedavg_hyperparams"]


def fedavg_hyperparams(hp: RoundHyperparams) -> RoundHyperparams:
    """Plain local steps (no consensus correction, no look-ahead, no proximal term) and tau = 1: the
    server step then sets v to the clients' weighted mean model."""
    return replace(hp.replace(gamma=0.0, eps_prox=0.0, eta_in=0.0, tau=1.0, solver="fo"), bilevel=None)


@dataclass(frozen=True)
class FedAvg(Strategy):
    """Plain local steps on the messenger LoRA, averaged models (tau = 1), no TAKD after prepare."""

    name: str = "fedavg"

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """:func:`fedavg_hyperparams`; FedAvg has no schedule."""
        return fedavg_hyperparams(hp)

    def takd(self, hp: RoundHyperparams) -> tuple[int, float]:
        """None: the learnable backbone stays as prepare aligned it."""
        return 0, hp.takd_lambda_task
