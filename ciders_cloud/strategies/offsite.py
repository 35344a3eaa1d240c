"""The offsite-tuning baselines: FedOT, FedBiOT and LocalOT, FedAvg of the messenger adapter with
the emulator kept as prepared, re-aligned without task CE, or nothing aggregated at all."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.strategies.fedavg import FedAvg

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

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(eps_prox=max(hp.eps_prox, 0.01))

    def takd(self, hp):
        return hp.takd_steps, 0.0


@dataclass(frozen=True)
class LocalOT(FedAvg):
    """Each client alone: it continues its own messenger; the server aggregates nothing."""

    name: str = "localot"
    private: bool = False  # it releases nothing to protect

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(start_from="personalized")

    def server_step(self, v, c, mean, hp):
        return v, c
