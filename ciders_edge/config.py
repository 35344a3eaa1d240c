"""Configuration dataclasses shared by edge and cloud, and the round hyperparameters.

TOML and JSON keys equal the field names; unknown keys are warned about and dropped.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = ["ConfigMixin", "RoundHyperparams", "gamma_schedule"]

T = TypeVar("T", bound="ConfigMixin")


class ConfigMixin:
    """``to_dict`` / ``from_dict`` for config dataclasses (after PEFT's ``PeftConfigMixin``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any], where: str = "") -> T:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            warnings.warn(f"{where or cls.__name__}: unknown keys ignored: {', '.join(unknown)}", stacklevel=2)
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self: T, **changes: Any) -> T:
        """A copy with ``changes`` applied (``None`` values are ignored, as unset CLI flags)."""
        return type(self).from_dict({**self.to_dict(), **{k: v for k, v in changes.items() if v is not None}})


@dataclass
class RoundHyperparams(ConfigMixin):
    """Hyperparameters of one round of the edge update and the cloud aggregation (DESIGN §2).

    eta, K and tau personalize in a few rounds (``benchmarks/defaults_sweep.py``); the paper's
    1e-4, 10 and 0.02 assume 150 rounds and are the ``paper`` preset. The rest are the paper's
    (Qwen2.5-3B, protocol A); ``eta_in`` defaults to ``eta``.
    """

    local_steps: int = 20  # K
    eta: float = 3e-3  # base learning rate of the messenger LoRA
    eta_in: float | None = None  # look-ahead step; None: equal to eta
    optimizer: str = "adamw"  # adamw | sgd
    weight_decay: float = 0.01
    clip: float = 1.0  # global-norm gradient clipping (0: off)
    warmup_steps: int = 1
    grad_accum: int = 1
    batch_size: int = 2
    seq_len: int = 256
    solver: str = "fo"  # fo | fd | svrg (FedNest's variance-reduced outer steps)
    gamma: float = 0.01  # consensus-correction weight gamma_t for this round
    alpha: float = 0.002  # consensus EMA rate alpha_c
    eps_prox: float = 0.01
    eps_fd: float = 1e-4
    eta_hvp: float = 1e-3
    tau: float = 1.0  # server step on the aggregated displacement
    takd_steps: int = 5  # T_L warm-started TAKD steps per round on the cloud
    start_from: str = "global"  # x_0: the global messenger v, or this client's own (local-only baselines)
    # FedNest / LFedNest (DESIGN's bilevel problem: x = messenger LoRA, y = backbone LoRA, g = TAKD)
    send_grad_y: bool = False  # LFedNest: the packet also carries grad_y f_i at the bundle's point
    probe_batches: int = 4  # FedNest: batches behind a client's grad f_i(x) for the global hypergradient
    neumann_terms: int = 5  # N: terms of the Neumann series for [grad_yy g]^-1 grad_y f
    neumann_l: float = 0.0  # l: the series' step is 1/l; 0 estimates l from grad_yy g's top eigenvalue
    hvp: str = "auto"  # autograd | fd | auto (autograd double-backward, central differences if it fails)
    hvp_batch_size: int = 1  # public sequences in the cloud's Hessian-vector products (a stochastic Hessian)

    def __post_init__(self) -> None:
        for name in ("local_steps", "grad_accum", "batch_size", "seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"`{name}` must be positive, got {getattr(self, name)}.")
        if self.eta <= 0:
            raise ConfigError(f"`eta` must be positive, got {self.eta}.")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"`optimizer` must be adamw or sgd, got {self.optimizer!r}.")
        if self.start_from not in ("global", "personalized"):
            raise ConfigError(f"`start_from` must be global or personalized, got {self.start_from!r}.")
        if self.solver not in ("fo", "fd", "svrg"):
            raise ConfigError(f"`solver` must be fo, fd or svrg, got {self.solver!r}.")
        if self.hvp not in ("auto", "autograd", "fd"):
            raise ConfigError(f"`hvp` must be auto, autograd or fd, got {self.hvp!r}.")
        if min(self.neumann_terms, self.probe_batches, self.hvp_batch_size) < 1:
            raise ConfigError("`neumann_terms`, `probe_batches` and `hvp_batch_size` must be at least 1.")
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"`alpha` must be in (0, 1], got {self.alpha}.")
        if self.eps_fd <= 0:
            raise ConfigError(f"`eps_fd` must be positive, got {self.eps_fd}.")
        nonnegative = ("gamma", "eps_prox", "tau", "weight_decay", "clip", "eta_hvp", "warmup_steps", "takd_steps")
        for name in (*nonnegative, "neumann_l"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must not be negative, got {getattr(self, name)}.")

    @property
    def look_ahead(self) -> float:
        return self.eta if self.eta_in is None else self.eta_in


def gamma_schedule(t: int, gamma_0: float = 0.9, decay: float = 0.86, floor: float = 0.01) -> float:
    """Protocol C's schedule: gamma_0 = gamma_1 = 0.9, gamma_t = max(0.01, 0.9 * 0.86^(t-1))."""
    return gamma_0 if t <= 1 else max(floor, gamma_0 * math.pow(decay, t - 1))
