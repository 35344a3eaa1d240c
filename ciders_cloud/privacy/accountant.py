"""The privacy accountant: epsilon(delta) spent by a run's rounds, from Google's ``dp-accounting`` (the
library Flower's own ``RdpAccountant`` wraps), by Renyi DP of the sampled Gaussian mechanism.

Each round is one release: the noisy mean of the clipped displacements of the round's sampled clients.

- ``poisson`` sampling (each client with probability q): ``PoissonSampledDpEvent(q, Gaussian(z))``,
  neighbours differ by adding or removing one client;
- ``fixed`` (m of the N clients, without replacement): ``SampledWithoutReplacementDpEvent(N, m,
  Gaussian(z / 2))``, neighbours replace one client, whose clipped displacement can move the sum by 2C;
- every client every round (q = 1): ``Gaussian(z)``, no amplification.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import dp_accounting
from dp_accounting import rdp

from ciders_cloud.run.dp_settings import MAX_NOISE, MIN_NOISE, PrivacySettings
from ciders_cloud.run.sampling import sampled_count
from ciders_edge.errors import ConfigError

__all__ = ["PrivacySpent", "privacy_spent", "solve_noise_multiplier", "epsilon", "dp_event", "max_rounds", "MAX_NOISE"]

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting warns for every RDP order it drops


@dataclass(frozen=True)
class PrivacySpent:
    """What a run's aggregate has spent after ``rounds`` releases, as rounds, manifests and reports say it."""

    epsilon: float
    delta: float
    rounds: int
    noise_multiplier: float
    clip: float
    sampling: str
    participation: float
    population: int
    accountant: str = "rdp (dp-accounting)"

    def to_dict(self) -> dict:
        return {**asdict(self), "epsilon": self.epsilon if math.isfinite(self.epsilon) else "inf"}


def dp_event(z: float, sampling: str, q: float, population: int) -> tuple[dp_accounting.DpEvent, object]:
    """One round's DP event and the neighbouring relation it is accounted under."""
    add_remove = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if q >= 1.0:
        return dp_accounting.GaussianDpEvent(z), add_remove
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), add_remove
    m = sampled_count(q, population)
    event = dp_accounting.SampledWithoutReplacementDpEvent(population, m, dp_accounting.GaussianDpEvent(z / 2))
    return event, dp_accounting.NeighboringRelation.REPLACE_ONE


def epsilon(z: float, rounds: int, delta: float, sampling: str, q: float, population: int) -> float:
    """Epsilon at ``delta`` after ``rounds`` releases (0 rounds: 0; no noise: infinity)."""
    if rounds == 0:
        return 0.0
    if z == 0:
        return math.inf
    event, relation = dp_event(z, sampling, q, population)
    accountant = rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(delta))


def privacy_spent(dp: PrivacySettings, rounds: int, sampling: str, q: float, population: int) -> PrivacySpent:
    """Epsilon at the run's delta after ``rounds`` releases of its aggregate."""
    z = dp.noise_multiplier
    assert z is not None, "prepare solves the noise multiplier"
    delta = dp.delta_for(population)
    eps = epsilon(z, rounds, delta, sampling, q, population)
    return PrivacySpent(eps, delta, rounds, z, dp.clip, sampling, q, population)


def solve_noise_multiplier(dp: PrivacySettings, sampling: str, q: float, population: int) -> float:
    """The smallest z with which ``dp.rounds`` rounds spend at most ``dp.target_epsilon`` at the run's delta."""
    target, rounds, delta = dp.target_epsilon, dp.rounds, dp.delta_for(population)
    assert target is not None and rounds is not None
    if epsilon(MAX_NOISE, rounds, delta, sampling, q, population) > target:
        raise ConfigError(
            f"`dp.target_epsilon` {target:g} is unreachable in {rounds} rounds at delta {delta:.3g}: it needs a "
            f"noise multiplier above {MAX_NOISE:g}; allow a larger epsilon, fewer rounds or a lower participation"
        )

    def release(z: float) -> dp_accounting.DpEvent:
        event, _ = dp_event(z, sampling, q, population)
        return dp_accounting.SelfComposedDpEvent(event, rounds)

    relation = dp_event(1.0, sampling, q, population)[1]
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=relation),
        release,
        target,
        delta,
        dp_accounting.ExplicitBracketInterval(MIN_NOISE, MAX_NOISE),
        tol=1e-4,
    )
    return float(z)


def max_rounds(
    dp: PrivacySettings, sampling: str, q: float, population: int, budget: float, limit: int = 100_000
) -> int:
    """The most rounds whose releases spend at most ``budget`` (epsilon grows with the rounds: a bisection)."""
    delta, z = dp.delta_for(population), dp.noise_multiplier or 0.0
    low, high = 0, limit  # epsilon(low) <= budget; find the last such count
    while low < high:
        mid = (low + high + 1) // 2
        if epsilon(z, mid, delta, sampling, q, population) <= budget:
            low = mid
        else:
            high = mid - 1
    return low
