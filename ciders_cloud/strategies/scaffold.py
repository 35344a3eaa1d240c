"""SCAFFOLD, as CIDERS' update with other constants."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.strategies.fedavg import FedAvg
from ciders_edge.hyperparams import RoundHyperparams

__all__ = ["Scaffold"]


@dataclass(frozen=True)
class Scaffold(FedAvg):
    """SCAFFOLD (option II control variates) is CIDERS' update with gamma = alpha = 1 and no look-ahead:
    ``g - c_i + c`` on the edge, ``c_i <- c_i + Delta_i - c``, ``c <- mean Delta_i``."""

    name: str = "scaffold"

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """FedAvg's round with the control variates on: gamma = alpha = 1."""
        return super().round_hyperparams(hp, round_, schedule).replace(gamma=1.0, alpha=1.0)
