"""The strategy every algorithm varies: CIDERS with first-order look-ahead (after Flower's ``Strategy``).

A strategy decides what it asks of edges and what it does with what comes back:

- :meth:`Strategy.round_hyperparams`: what edges run in a round (their bundles' hyperparameters, the
  local steps' direction among them);
- :attr:`Strategy.needs_probe` and :meth:`Strategy.aggregate_probes`: a first exchange of gradients
  before training (FedNest);
- :meth:`Strategy.packet_tensors`: what a Δc packet carries besides Δc;
- :meth:`Strategy.adjust_displacements`: a change to the reconstructed displacements (eq. 11) before
  the server step;
- :meth:`Strategy.server_step`: the next v and c from the round's mean displacement (eq. 12);
- :attr:`Strategy.private`: whether differential privacy may wrap the round (its mean is then private);
- :meth:`Strategy.takd`: how much TAKD the learnable backbone gets after aggregation (eq. 13).

The round driver (:mod:`ciders_cloud.round.aggregate`) calls these hooks and nothing else of an algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ciders_cloud.round.aggregation import server_update
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams, gamma_schedule
from ciders_edge.tensors import Tensors

if TYPE_CHECKING:  # the cloud's models and run config import the strategies (the algorithm's name is checked)
    from ciders_cloud.models.teacher import CloudModels
    from ciders_cloud.run.config import RunConfig
    from ciders_cloud.run.server_state import ServerState

__all__ = ["Strategy", "CloudRound"]


@dataclass
class CloudRound:
    """What a strategy's hooks see of the cloud's round (after Flower's ``Context``)."""

    run: RunConfig
    state: ServerState
    hp: RoundHyperparams
    models: dict[str, CloudModels]  # one per learnable backbone, the reference first


@dataclass(frozen=True)
class Strategy:
    """CIDERS with first-order look-ahead: the reference behaviour the baselines vary."""

    name: str = "ciders-fo"
    needs_probe: bool = False  # a first exchange of gradients before training (FedNest)
    one_split: bool = False  # every profile must train the same messenger on the same backbone (FedNest's)
    private: bool = True  # differential privacy may clip and noise its mean (not: it reads a client's own values)

    def for_run(self, run: RunConfig) -> Strategy:
        """This strategy with the run's settings for it (most have none)."""
        return self

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """What edges run in ``round_``; ``schedule='protocol-c'`` applies the paper's gamma_t."""
        gamma = gamma_schedule(round_) if schedule == "protocol-c" else hp.gamma
        return replace(hp.replace(gamma=gamma, solver="fo"), bilevel=None)  # FedNest's ask is FedNest's alone

    def packet_tensors(self, state: ServerState) -> Tensors:
        """The tensors a Δc packet carries besides Δc of the layers its profile trains, by name and shape."""
        return {}

    def aggregate_probes(
        self, grads: Sequence[Tensors], weights: Sequence[float], cloud: CloudRound
    ) -> tuple[Tensors, dict]:
        """The first exchange's result, from the edges' gradient packets, and what to report of it."""
        raise ConfigError(f"{self.name} has no first exchange of gradients; send its edges' Δc packets")

    def adjust_displacements(
        self, deltas: list[Tensors], packets: Sequence[Tensors], weights: Sequence[float], cloud: CloudRound
    ) -> tuple[list[Tensors], dict]:
        """The displacements of eq. (11) as the server step takes them, and what to report of the change."""
        return deltas, {}

    def server_step(self, v: Tensors, c: Tensors, mean: Tensors, hp: RoundHyperparams) -> tuple[Tensors, Tensors]:
        """Eq. (12) from the round's mean displacement (its private mean under differential privacy)."""
        return server_update(v, c, mean, hp.tau, hp.local_steps, hp.eta, hp.alpha)

    def takd(self, hp: RoundHyperparams) -> tuple[int, float]:
        """TAKD steps after aggregation (eq. 13) and the task-CE weight of their loss (eq. 2)."""
        return hp.takd_steps, hp.takd_lambda_task
