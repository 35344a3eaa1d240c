"""CIDERS: the consensus-corrected look-ahead local steps (eq. 4-10), first-order or with the
finite-difference Hessian term (eq. 7); the cloud's step is eq. (12) as written."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ciders_cloud.strategies.base import Strategy
from ciders_edge.hyperparams import RoundHyperparams, gamma_schedule

__all__ = ["CidersFO", "CidersFD"]


@dataclass(frozen=True)
class CidersFO(Strategy):
    """CIDERS with first-order look-ahead: the reference the baselines are measured against."""

    name: str = "ciders-fo"

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """The run's hyperparameters, gamma_t from protocol C when asked, first-order local steps."""
        gamma = gamma_schedule(round_) if schedule == "protocol-c" else hp.gamma
        return replace(hp.replace(gamma=gamma, solver="fo"), bilevel=None)  # FedNest's ask is FedNest's alone


@dataclass(frozen=True)
class CidersFD(CidersFO):
    """CIDERS with the finite-difference Hessian-vector term in its local steps (eq. 7)."""

    name: str = "ciders-fd"

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """CIDERS-FO's round with the ``fd`` direction."""
        return super().round_hyperparams(hp, round_, schedule).replace(solver="fd")
