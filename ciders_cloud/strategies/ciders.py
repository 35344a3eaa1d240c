"""CIDERS with the finite-difference Hessian term in its local steps (eq. 7); CIDERS-FO is the base strategy."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.strategies.base import Strategy

__all__ = ["CidersFD"]


@dataclass(frozen=True)
class CidersFD(Strategy):
    name: str = "ciders-fd"

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(solver="fd")
