"""The round hyperparameters an edge runs (a bundle's ``hyperparameters``) and the paper's gamma schedule.

The strategy (``ciders_cloud.strategies``) chooses them for each round; the bundle carries them to the
edge, and the cloud reads them back to invert the edge's eq. (10) in eq. (11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ciders_edge.config import ConfigMixin, dotted
from ciders_edge.errors import ConfigError

__all__ = ["BilevelAsk", "RoundHyperparams", "gamma_schedule"]


@dataclass
class BilevelAsk(ConfigMixin):
    """What a bilevel strategy asks an edge for besides K local steps: the client loss's gradients at the
    bundle's point (docs/design.md §2, eq. 3; :mod:`ciders_edge.training.bilevel`), which only the edge can
    compute. Other algorithms ask nothing."""

    probe_batches: int = 4  # mini-batches behind grad f_i at the bundle's point
    grad_y_in_packet: bool = False  # grad_y f_i rides in the Δc packet (False: in a probe packet before training)


@dataclass
class RoundHyperparams(ConfigMixin):
    """Hyperparameters of one round of the edge update and the cloud aggregation (docs/design.md §3).

    eta, K and tau personalize in a few rounds (``benchmarks/defaults_sweep.py``); the paper's
    1e-4, 10 and 0.02 assume 150 rounds and are the ``paper`` preset. The round's TAKD drops eq. (2)'s
    task CE (``takd_lambda_task = 0``): with it, the messengers transfer worse to the full backbone a
    device deploys (docs/models.md, *The task term*); the paper's 1 is the ``paper`` preset. The rest are
    the paper's (Qwen2.5-3B, protocol A); ``eta_in`` defaults to ``eta``.
    """

    CHOICES = {
        "optimizer": ("adamw", "sgd"),
        "solver": ("fo", "fd", "svrg"),
        "start_from": ("global", "personalized"),
    }
    TABLES = {"bilevel": BilevelAsk}
    # FedNest's settings before they moved to the strategy (the run's `fednest` table): an old bundle's
    # manifest still names them, and loads without them
    RETIRED: ClassVar[tuple[str, ...]] = (
        "send_grad_y", "probe_batches", "neumann_terms", "neumann_l", "hvp", "hvp_batch_size"
    )  # fmt: skip

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
    solver: str = "fo"  # the local steps' direction: fo | fd | svrg (training/directions.py)
    gamma: float = 0.01  # consensus-correction weight gamma_t for this round
    alpha: float = 0.002  # consensus EMA rate alpha_c
    eps_prox: float = 0.01
    eps_fd: float = 1e-4
    eta_hvp: float = 1e-3
    tau: float = 1.0  # server step on the aggregated displacement
    takd_steps: int = 5  # T_L warm-started TAKD steps per round on the cloud
    takd_lambda_task: float = 0.0  # their task-CE weight (prepare's bootstrap uses the run's `takd.lambda_task`)
    start_from: str = "global"  # x_0: the global messenger v, or this client's own (local-only baselines)
    bilevel: dict | None = None  # BilevelAsk's keys, set by bilevel strategies only (absent from other bundles)
    # differential privacy clipped on the edge: the L2 bound C of Delta_i before eq. (10) (absent from other bundles)
    displacement_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta <= 0:
            raise ConfigError(f"`eta` must be positive, got {self.eta}.")
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"`alpha` must be in (0, 1], got {self.alpha}.")
        if self.eps_fd <= 0:
            raise ConfigError(f"`eps_fd` must be positive, got {self.eps_fd}.")
        for name in ("gamma", "eps_prox", "tau", "weight_decay", "clip", "eta_hvp"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must not be negative, got {getattr(self, name)}.")
        if not 0 <= self.takd_lambda_task < math.inf:
            raise ConfigError(f"`takd_lambda_task` must be a non-negative number, got {self.takd_lambda_task}.")
        if self.displacement_clip is not None and not 0 < self.displacement_clip < math.inf:
            raise ConfigError(f"`displacement_clip` must be a positive number, got {self.displacement_clip}.")

    @classmethod
    def check(cls, d: dict[str, Any], where: str = "", table: str = "", strict: bool = True) -> dict[str, Any]:
        """As :meth:`ConfigMixin.check`; a retired key is an error in a file a user writes, dropped in saved JSON."""
        retired = sorted(set(d) & set(cls.RETIRED))
        if retired and strict:
            raise ConfigError(
                f"{where or cls.__name__}: `{dotted(table, retired[0])}` is now a key of the `fednest` table"
            )
        return super().check({k: v for k, v in d.items() if k not in cls.RETIRED}, where, table, strict)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("bilevel", "displacement_clip"):  # of some runs only: others hold no such key
            if out[key] is None:
                del out[key]
        return out

    @property
    def look_ahead(self) -> float:
        return self.eta if self.eta_in is None else self.eta_in

    @property
    def ask(self) -> BilevelAsk | None:
        """The bilevel gradients this round asks for (``None``: none)."""
        return None if self.bilevel is None else BilevelAsk.from_dict(self.bilevel)

    @property
    def grad_y_in_packet(self) -> bool:
        return self.ask is not None and self.ask.grad_y_in_packet


def gamma_schedule(t: int, gamma_0: float = 0.9, decay: float = 0.86, floor: float = 0.01) -> float:
    """Protocol C's schedule: gamma_0 = gamma_1 = 0.9, gamma_t = max(0.01, 0.9 * 0.86^(t-1))."""
    return gamma_0 if t <= 1 else max(floor, gamma_0 * math.pow(decay, t - 1))
