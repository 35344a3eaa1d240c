"""What every algorithm decides, as hooks (after Flower's ``Strategy``): CIDERS and each baseline implement them.

A strategy decides what it asks of edges and what it does with what comes back:

- :meth:`Strategy.check`: refuse, in one line, a run it cannot serve, or cannot serve in a fleet (before any work);
- :meth:`Strategy.round_hyperparams`: what edges run in a round (their bundles' hyperparameters, the
  local steps' direction among them);
- :attr:`Strategy.needs_probe` and :meth:`Strategy.aggregate_probes`: a first exchange of gradients
  before training (:mod:`ciders_cloud.round.probes` drives it);
- :meth:`Strategy.packet_tensors`: what a Δc packet carries besides Δc;
- :meth:`Strategy.adjust_displacements`: a change to the reconstructed displacements (eq. 11) before
  the server step;
- :meth:`Strategy.server_step`: the next v and c from the round's mean displacement (eq. 12);
- :meth:`Strategy.takd`: how much TAKD the learnable backbone gets after aggregation (eq. 13).

The round driver (:mod:`ciders_cloud.round.aggregate`) calls these hooks and nothing else of an algorithm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies.aggregation import server_update
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.tensors import Tensors

if TYPE_CHECKING:  # a type only: the model stack (transformers, PEFT) loads when a round runs, not for a name
    from ciders_cloud.models.teacher import CloudModels

__all__ = ["Strategy", "CloudRound"]


@dataclass
class CloudRound:
    """What a strategy's hooks see of the cloud's round (after Flower's ``Context``)."""

    run: RunConfig
    state: ServerState
    hp: RoundHyperparams
    models: dict[str, CloudModels]  # one per learnable backbone, the reference first


@dataclass(frozen=True)
class Strategy(ABC):
    """One federated algorithm on the messenger LoRA: a subclass names itself and says what its edges run;
    the other hooks default to a plain round of eq. (11)-(13)."""

    name: str = ""
    needs_probe: bool = False  # a first exchange of gradients before training
    probe_answers: str = "probe-answers"  # the run folder's folder of its answers to them (RunFolder.probe_answer)

    def for_run(self, run: RunConfig) -> Strategy:
        """This strategy with the run's settings for it (most have none)."""
        return self

    def check(self, run: RunConfig, fleet: bool = False, secure: bool = False) -> None:
        """Refuse a run this strategy cannot serve, in one line: ``run``'s privacy and profile splits;
        ``fleet``: served to edges over Flower (one exchange a round); ``secure``: Flower's SecAgg+ sums the
        displacements, so the cloud never sees one. By default every run is served."""
        return None

    @abstractmethod
    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """What edges run in ``round_``: the run's hyperparameters ``hp`` as this algorithm sets them;
        ``schedule='protocol-c'`` applies the paper's gamma_t."""

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
        """The next v and c from the round's mean displacement (its private mean under differential privacy)."""
        return server_update(v, c, mean, hp.tau, hp.local_steps, hp.eta, hp.alpha)

    def takd(self, hp: RoundHyperparams) -> tuple[int, float]:
        """TAKD steps after aggregation (eq. 13) and the task-CE weight of their loss (eq. 2)."""
        return hp.takd_steps, hp.takd_lambda_task
