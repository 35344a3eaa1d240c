"""FedNest and LFedNest on the messenger (outer x) / learnable-backbone (inner y, TAKD) bilevel problem.

Both need the hypergradient ``grad_x f - grad_xy g [grad_yy g]^-1 grad_y f`` (docs/design.md §2, eq. 3;
the write-up: §6). The inner problem g is the cloud's own (its public data and teacher, :mod:`.bilevel`),
so the cloud computes the indirect term with FedIHGP's Neumann series (:mod:`.hypergradient`); the edges
contribute only the client loss's gradients at the bundle's point (``ciders_edge.training.bilevel``).
Their settings are the run's ``fednest`` table; edges receive only ``probe_batches`` (and, from
LFedNest, ``grad_y_in_packet``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ciders_cloud.round.aggregation import weighted_sum
from ciders_cloud.strategies.base import CloudRound, Strategy
from ciders_cloud.strategies.bilevel import cloud_indirect_term
from ciders_cloud.strategies.fedavg import FedAvg
from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError
from ciders_edge.schedule import mean_lr_multiplier
from ciders_edge.tensors import Tensors, add, norm

if TYPE_CHECKING:
    from ciders_cloud.run.config import RunConfig
    from ciders_cloud.run.server_state import ServerState

__all__ = ["FedNestSettings", "FedNest", "LFedNest"]


@dataclass
class FedNestSettings(ConfigMixin):
    """A run's ``fednest`` table: the edges' gradient batches and the cloud's inverse-Hessian product."""

    CHOICES = {"hvp": ("auto", "autograd", "fd")}

    probe_batches: int = 4  # batches behind a client's grad f_i(x) for the global hypergradient
    neumann_terms: int = 5  # N: terms of the Neumann series for [grad_yy g]^-1 grad_y f
    neumann_l: float = 0.0  # l: the series' step is 1/l; 0 estimates l from grad_yy g's top eigenvalue
    hvp: str = "auto"  # autograd | fd | auto (autograd double-backward, central differences if it fails)
    hvp_batch_size: int = 1  # public sequences in the cloud's Hessian-vector products (a stochastic Hessian)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.neumann_l < 0:
            raise ConfigError(f"`fednest.neumann_l` must not be negative, got {self.neumann_l}.")


@dataclass(frozen=True)
class FedNest(FedAvg):
    """FedNest: each round, edges first send grad_x f_i, grad_y f_i at (x, y) in a probe packet; the cloud
    forms the global hypergradient h; edges take svrg steps ``grad f_i(x_i,nu) - grad f_i(x) + h``; the
    cloud averages (tau = 1) and runs T_L TAKD steps on y (FedInn: the inner problem is the cloud's)."""

    name: str = "fednest"
    needs_probe: bool = True
    one_split: bool = True
    private: bool = False  # the hypergradient reads every client's own gradients, unclipped
    settings: FedNestSettings = field(default_factory=FedNestSettings)

    def for_run(self, run: RunConfig) -> FedNest:
        return replace(self, settings=FedNestSettings.from_dict(run.fednest, where="the run's fednest table"))

    def round_hyperparams(self, hp, round_, schedule):
        ask = {"probe_batches": self.settings.probe_batches}
        return super().round_hyperparams(hp, round_, schedule).replace(solver="svrg", bilevel=ask)

    def aggregate_probes(
        self, grads: Sequence[Tensors], weights: Sequence[float], cloud: CloudRound
    ) -> tuple[Tensors, dict]:
        """``h = sum p_i grad_x f_i - grad_xy g [grad_yy g]^-1 sum p_i grad_y f_i``, for the edges' svrg steps."""
        grad_x = weighted_sum(grads, weights, cloud.state.messenger)
        q, info = self._indirect(weighted_sum(grads, weights, cloud.state.backbone), cloud)
        h = add(grad_x, q)
        return h, {"grad_x_norm": norm(grad_x), "hypergradient_norm": norm(h), "bilevel": info}

    takd = Strategy.takd  # the reference's per-round TAKD, which FedAvg turns off

    def _indirect(self, grad_y: Tensors, cloud: CloudRound) -> tuple[Tensors, dict]:
        """``-grad_xy g p_N`` at the round's (x, y), on the one learnable backbone FedNest runs."""
        (models,) = cloud.models.values()
        return cloud_indirect_term(models, cloud.run, cloud.state, self.settings, grad_y)


@dataclass(frozen=True)
class LFedNest(FedNest):
    """LFedNest: one exchange per round. Edges take plain local steps and append grad_y f_i at (x, y) to
    their packet; the cloud adds the indirect term -grad_xy g p_N to every displacement (the inner
    problem's Hessian is the cloud's, so computing it there costs no communication)."""

    name: str = "lfednest"
    needs_probe: bool = False

    def round_hyperparams(self, hp, round_, schedule):
        ask = {"probe_batches": self.settings.probe_batches, "grad_y_in_packet": True}
        return FedAvg.round_hyperparams(self, hp, round_, schedule).replace(bilevel=ask)

    def packet_tensors(self, state: ServerState) -> Tensors:
        return state.backbone  # grad_y f_i, shaped as the backbone LoRA

    def adjust_displacements(self, deltas, packets, weights, cloud):
        q, info = self._indirect(weighted_sum(packets, weights, cloud.state.backbone), cloud)
        return [add(d, q, mean_lr_multiplier(cloud.hp)) for d in deltas], info  # as if added to every local step
