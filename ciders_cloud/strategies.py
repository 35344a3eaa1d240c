"""CIDERS and its baselines as small strategy objects over one round loop (after Flower's ``Strategy``).

A strategy decides three things: the hyperparameters it ships to edges in each round's bundle,
how the server turns the reconstructed displacements into the next ``v`` and ``c`` (eq. 12),
and how much TAKD the learnable backbone gets after aggregation (eq. 13). Edges run the same
update code for every strategy; the bundle's hyperparameters select the variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ciders_cloud.aggregation import aggregate
from ciders_edge.config import RoundHyperparams, gamma_schedule
from ciders_edge.errors import ConfigError
from ciders_edge.tensors import Tensors

__all__ = ["Strategy", "STRATEGIES", "get_strategy", "round_hyperparams_for"]


@dataclass(frozen=True)
class Strategy:
    """CIDERS with first-order look-ahead: the reference behaviour the baselines vary."""

    name: str = "ciders-fo"
    probes: bool = False  # a first exchange of gradients before training (FedNest)
    one_split: bool = False  # every profile must train the same messenger on the same backbone (FedNest's)

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """What edges run in ``round_``; ``schedule='protocol-c'`` applies the paper's gamma_t."""
        gamma = gamma_schedule(round_) if schedule == "protocol-c" else hp.gamma
        return hp.replace(gamma=gamma, solver="fo")

    def server_step(
        self, v: Tensors, c: Tensors, deltas: Sequence[Tensors], weights: Sequence[float], hp: RoundHyperparams
    ) -> tuple[Tensors, Tensors]:
        """Eq. (12)."""
        return aggregate(v, c, deltas, weights, hp.tau, hp.local_steps, hp.eta, hp.alpha)

    def takd(self, hp: RoundHyperparams) -> tuple[int, float | None]:
        """TAKD steps after aggregation and the task-CE weight to use (``None``: the run's)."""
        return hp.takd_steps, None


@dataclass(frozen=True)
class CidersFD(Strategy):
    name: str = "ciders-fd"

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(solver="fd")


@dataclass(frozen=True)
class FedAvg(Strategy):
    """Plain local steps on the messenger LoRA, averaged displacements (tau = 1), no TAKD after prepare."""

    name: str = "fedavg"

    def round_hyperparams(self, hp, round_, schedule):
        return hp.replace(gamma=0.0, eps_prox=0.0, eta_in=0.0, tau=1.0, solver="fo")

    def takd(self, hp):
        return 0, None


@dataclass(frozen=True)
class Scaffold(FedAvg):
    """SCAFFOLD (option II control variates) is CIDERS' update with gamma = alpha = 1 and no look-ahead:
    ``g - c_i + c`` on the edge, ``c_i <- c_i + Delta_i - c``, ``c <- mean Delta_i``."""

    name: str = "scaffold"

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(gamma=1.0, alpha=1.0)


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

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(start_from="personalized")

    def server_step(self, v, c, deltas, weights, hp):
        return v, c


@dataclass(frozen=True)
class FedNest(FedAvg):
    """FedNest on the messenger (outer x) / backbone (inner y, TAKD) bilevel problem. Each round:
    edges send grad_x f_i, grad_y f_i at (x, y); the cloud forms the global hypergradient h with
    FedIHGP's Neumann series; edges take svrg steps ``grad f_i(x_i,nu) - grad f_i(x) + h``; the
    cloud averages (tau = 1) and runs T_L TAKD steps on y (FedInn: the inner problem is the cloud's)."""

    name: str = "fednest"
    probes: bool = True
    one_split: bool = True

    def round_hyperparams(self, hp, round_, schedule):
        return super().round_hyperparams(hp, round_, schedule).replace(solver="svrg")

    def takd(self, hp):
        return hp.takd_steps, None


@dataclass(frozen=True)
class LFedNest(FedNest):
    """LFedNest: one exchange per round. Edges take plain local steps and append grad_y f_i at
    (x, y) to their packet; the cloud adds the indirect term -grad_xy g p_N to every displacement
    (the inner problem's Hessian is the cloud's, so computing it there costs no communication)."""

    name: str = "lfednest"
    probes: bool = False

    def round_hyperparams(self, hp, round_, schedule):
        return FedAvg.round_hyperparams(self, hp, round_, schedule).replace(send_grad_y=True)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (Strategy(), CidersFD(), FedAvg(), Scaffold(), FedOT(), FedBiOT(), LocalOT(), FedNest(), LFedNest())
}


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def round_hyperparams_for(run, round_: int) -> RoundHyperparams:
    """What round ``round_``'s bundles carry: the run's hyperparameters as its strategy varies them."""
    hp = RoundHyperparams.from_dict(run.hyperparameters)
    return get_strategy(run.algorithm).round_hyperparams(hp, round_, run.gamma_schedule)
