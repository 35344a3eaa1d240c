"""Who takes part in a round: ``simulate`` and the fleet sample the run's clients the same way.

``fixed`` takes ``round(q N)`` clients without replacement (at least one); ``poisson`` takes each client
with probability q, independently, which is what differential privacy's amplification by sampling
accounts (:mod:`ciders_cloud.privacy.accountant`). A Poisson round can sample no one: a private run
still releases its noise then; a run without DP takes one client at random instead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["sample_clients", "sampled_count"]


def sampled_count(q: float, population: int) -> int:
    """Clients per round under ``fixed`` sampling (at least one): simulate's and the fleet's m."""
    return max(1, round(q * population))


def sample_clients(
    ids: Sequence[str], participation: float, sampling: str, rng: random.Random, private: bool = False
) -> list[str]:
    """This round's participants among ``ids``, sorted (the order packets are aggregated in)."""
    if sampling == "fixed":
        return sorted(rng.sample(list(ids), sampled_count(participation, len(ids))))
    chosen = [cid for cid in ids if rng.random() < participation]
    if not chosen and not private:
        chosen = [rng.choice(list(ids))]
    return sorted(chosen)
