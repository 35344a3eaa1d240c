"""FedNest and LFedNest on the messenger (outer x) / learnable-backbone (inner y, TAKD) bilevel problem."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies.aggregation import weighted_sum
from ciders_cloud.strategies.base import CloudRound, Strategy
from ciders_cloud.strategies.fedavg import fedavg_hyperparams
from ciders_cloud.strategies.fednest.settings import FedNestSettings
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.schedule import mean_lr_multiplier
from ciders_edge.tensors import Tensors, add, norm

__all__ = ["FedNest", "LFedNest"]


@dataclass(frozen=True)
class FedNest(Strategy):
    """FedNest: each round, edges first send grad_x f_i, grad_y f_i at (x, y) in a probe packet; the cloud
    forms the global hypergradient h; edges take svrg steps ``grad f_i(x_i,nu) - grad f_i(x) + h``; the
    cloud averages (tau = 1) and runs T_L TAKD steps on y (FedInn: the inner problem is the cloud's)."""

    name: str = "fednest"
    needs_probe: bool = True
    probe_answers: str = "hypergradients"  # h, one file a round
    settings: FedNestSettings = field(default_factory=FedNestSettings)

    def for_run(self, run: RunConfig) -> FedNest:
        """With the run's ``fednest`` table."""
        return replace(self, settings=FedNestSettings.from_dict(run.fednest, where="the run's fednest table"))

    def check(self, run: RunConfig, fleet: bool = False, secure: bool = False) -> None:
        """The hypergradient reads every client's own gradients, unclipped and in the clear, on one messenger
        and one learnable backbone: no privacy, no secure sum, one split; and a valid ``fednest`` table.
        FedNest's first exchange runs in ``simulate``; a fleet serves one exchange a round (LFedNest's)."""
        self.for_run(run)
        if run.privacy is not None:
            raise ConfigError(
                f"{self.name} cannot run with differential privacy: its cloud step reads each client's own values "
                "(the hypergradient); use ciders-fo, ciders-fd, fedavg, scaffold, fedot or fedbiot"
            )
        if secure:
            raise ConfigError(
                f"--secure-aggregation cannot serve {self.name} (its cloud step reads each client's own values)"
            )
        if fleet and self.needs_probe:
            raise ConfigError(
                f"{self.name}'s first exchange (every edge's gradients before training) runs in `ciders-cloud "
                "simulate`; a fleet serves one exchange a round: use lfednest, ciders-fo or a FedAvg kind"
            )
        if run.is_mixed:
            splits = ", ".join(f"{p} {a}/{r:g}" for p in run.profiles for a, r in [run.profile_split(p)])
            raise ConfigError(
                f"{self.name} needs one messenger depth and one learnable backbone for every profile, got "
                f"{splits} (depth/drop); pass --drop-ratio and profiles of one depth, or use CIDERS or a FedAvg kind."
            )

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """FedAvg's plain round with svrg steps towards h, and the probe's batch count for the edges."""
        ask = {"probe_batches": self.settings.probe_batches}
        return fedavg_hyperparams(hp).replace(solver="svrg", bilevel=ask)

    def aggregate_probes(
        self, grads: Sequence[Tensors], weights: Sequence[float], cloud: CloudRound
    ) -> tuple[Tensors, dict]:
        """``h = sum p_i grad_x f_i - grad_xy g [grad_yy g]^-1 sum p_i grad_y f_i``, for the edges' svrg steps."""
        grad_x = weighted_sum(grads, weights, cloud.state.messenger)
        q, info = self._indirect(weighted_sum(grads, weights, cloud.state.backbone), cloud)
        h = add(grad_x, q)
        return h, {"grad_x_norm": norm(grad_x), "hypergradient_norm": norm(h), "bilevel": info}

    def _indirect(self, grad_y: Tensors, cloud: CloudRound) -> tuple[Tensors, dict]:
        """``-grad_xy g p_N`` at the round's (x, y), on the one learnable backbone FedNest runs."""
        from ciders_cloud.strategies.fednest.bilevel import cloud_indirect_term  # torch work: loads with a round

        (models,) = cloud.models.values()
        return cloud_indirect_term(models, cloud.run, cloud.state, self.settings, grad_y)


@dataclass(frozen=True)
class LFedNest(FedNest):
    """LFedNest: one exchange per round. Edges take plain local steps and append grad_y f_i at (x, y) to
    their packet; the cloud adds the indirect term -grad_xy g p_N to every displacement (the inner
    problem's Hessian is the cloud's, so computing it there costs no communication)."""

    name: str = "lfednest"
    needs_probe: bool = False

    def round_hyperparams(self, hp: RoundHyperparams, round_: int, schedule: str) -> RoundHyperparams:
        """FedAvg's plain round; edges append grad_y f_i to their Δc packet."""
        ask = {"probe_batches": self.settings.probe_batches, "grad_y_in_packet": True}
        return fedavg_hyperparams(hp).replace(bilevel=ask)

    def packet_tensors(self, state: ServerState) -> Tensors:
        """grad_y f_i, shaped as the backbone LoRA."""
        return state.backbone

    def adjust_displacements(
        self, deltas: list[Tensors], packets: Sequence[Tensors], weights: Sequence[float], cloud: CloudRound
    ) -> tuple[list[Tensors], dict]:
        """Every displacement plus the indirect term, as if added to each local step."""
        q, info = self._indirect(weighted_sum(packets, weights, cloud.state.backbone), cloud)
        return [add(d, q, mean_lr_multiplier(cloud.hp)) for d in deltas], info
