"""The offsite-tuning baselines: FedOT, FedBiOT and LocalOT, FedAvg of the messenger adapter with
the emulator kept as prepared, re-aligned without task CE, or nothing aggregated at all."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.run.config import RunConfig
from ciders_cloud.strategies.fedavg import FedAvg
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.tensors import Tensors

__all__ = ["FedOT", "FedBiOT", "LocalOT"]


@dataclass(frozen=True)
class FedOT(FedAvg):
    """Offsite-tuning, federated: the emulator stays as prepared; FedAvg of the messenger adapter."""

    name: str = "fedot"


@dataclass(frozen=True)
class FedBiOT(FedAvg):
    """FedBiOT: server re-aligns the backbone every round with MSE + KL only (no task CE);
    clients keep a proximal anchor to the received adapter; FedAvg."""

    name: str = "fedbiot"

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """FedAvg's round with a proximal anchor of at least 0.01."""
        return super().round_hyperparams(hp, round_, schedule).replace(eps_prox=max(hp.eps_prox, 0.01))

    def takd(self, hp: RoundHyperparams) -> tuple[int, float]:
        """The round's TAKD steps, without the task CE (FedBiOT's re-alignment)."""
        return hp.takd_steps, 0.0


@dataclass(frozen=True)
class LocalOT(FedAvg):
    """Each client alone: it continues its own messenger; the server aggregates nothing."""

    name: str = "localot"

    def check(self, run: RunConfig, fleet: bool = False, secure: bool = False) -> None:
        """Nothing is released or summed, so neither privacy nor secure aggregation has anything to protect."""
        if run.privacy is not None:
            raise ConfigError(
                "localot cannot run with differential privacy: it releases nothing; use ciders-fo, ciders-fd, "
                "fedavg, scaffold, fedot or fedbiot"
            )
        if secure:
            raise ConfigError("--secure-aggregation cannot serve localot (it sums nothing)")

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """FedAvg's round, each edge starting from its own last messenger."""
        return super().round_hyperparams(hp, round_, schedule).replace(start_from="personalized")

    def server_step(self, v: Tensors, c: Tensors, mean: Tensors, hp: RoundHyperparams) -> tuple[Tensors, Tensors]:
        """None: v and c stay as they are."""
        return v, c
