"""A run's ``fednest`` table: the edges' gradient batches and the cloud's inverse-Hessian product."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError

__all__ = ["FedNestSettings"]


@dataclass
class FedNestSettings(ConfigMixin):
    """FedNest's and LFedNest's settings; edges receive only ``probe_batches``."""

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
