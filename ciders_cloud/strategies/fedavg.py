"""FedAvg on the messenger LoRA, the base of the offsite-tuning baselines."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ciders_cloud.strategies.base import Strategy

__all__ = ["FedAvg"]


@dataclass(frozen=True)
class FedAvg(Strategy):
    """Plain local steps on the messenger LoRA, averaged displacements (tau = 1), no TAKD after prepare."""

    name: str = "fedavg"

    def round_hyperparams(self, hp, round_, schedule):
        return replace(hp.replace(gamma=0.0, eps_prox=0.0, eta_in=0.0, tau=1.0, solver="fo"), bilevel=None)

    def takd(self, hp):
        return 0, hp.takd_lambda_task
