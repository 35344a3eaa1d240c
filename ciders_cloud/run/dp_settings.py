"""A run's ``[dp]`` table: the clip bound, the noise, the budget, and where displacements are clipped."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError

__all__ = ["PrivacySettings", "SAMPLINGS", "CLIP_SITES", "MAX_NOISE", "MIN_NOISE", "MAX_EPSILON"]

SAMPLINGS = ("fixed", "poisson")  # a fixed number of clients per round, or each client with probability q
CLIP_SITES = ("cloud", "edge")
MAX_NOISE = 100.0  # beyond z = 100 the noise drowns any displacement: a target needing more is unreachable
MIN_NOISE = 1e-3  # the least z the accountant solves for: one round at it spends epsilon > 5e5, past any target
MAX_EPSILON = 1000.0  # an epsilon this large protects nothing: a run that wants it runs without dp


@dataclass
class PrivacySettings(ConfigMixin):
    """Client-level DP of the aggregate: every displacement clipped to ``clip`` (C), Gaussian noise of std
    ``noise_multiplier * clip`` added to their sum. ``noise_multiplier`` (z) is given, or solved from
    ``target_epsilon`` at ``delta`` over the planned ``rounds`` when the run is made (run.json keeps both);
    ``max_epsilon`` (default: the target) is the budget ``aggregate`` refuses to exceed."""

    CHOICES = {"clip_on": CLIP_SITES}

    clip: float = 0.0  # C, the L2 bound on one client's displacement over every messenger tensor
    noise_multiplier: float | None = None  # z: the noise's std is z C on the sum
    target_epsilon: float | None = None  # solve z so that `rounds` rounds spend this epsilon at `delta`
    delta: float | None = None  # None: 1 / N, N the run's clients
    rounds: int | None = None  # the planned rounds (with target_epsilon)
    max_epsilon: float | None = None  # the budget; None: target_epsilon (or none, with z given)
    clip_on: str = "cloud"  # cloud: the cloud clips each reconstructed displacement; edge: the edge does

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.clip < math.inf:
            raise ConfigError(f"`dp.clip` must be a positive number (the L2 bound C), got {self.clip}.")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ConfigError("`dp` needs `noise_multiplier`, or `target_epsilon` with `rounds` to solve it from.")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier <= MAX_NOISE:
            raise ConfigError(
                f"`dp.noise_multiplier` must be in [0, {MAX_NOISE:g}] (beyond, the noise drowns every update), "
                f"got {self.noise_multiplier:g}."
            )
        for name in ("target_epsilon", "max_epsilon"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_EPSILON:
                raise ConfigError(
                    f"`dp.{name}` must be in (0, {MAX_EPSILON:g}] (an epsilon beyond protects nothing: run without "
                    f"dp), got {value:g}."
                )
        if self.delta is not None and not 0 < self.delta < 1:
            raise ConfigError(f"`dp.delta` must be in (0, 1), got {self.delta}.")
        if self.target_epsilon is not None and self.rounds is None:
            raise ConfigError("`dp.target_epsilon` needs `dp.rounds`, the rounds it must last.")

    @property
    def budget(self) -> float | None:
        """The epsilon no round may exceed (``None``: none set)."""
        return self.max_epsilon if self.max_epsilon is not None else self.target_epsilon

    def delta_for(self, population: int) -> float:
        return self.delta if self.delta is not None else 1.0 / population
