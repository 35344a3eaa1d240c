"""The Gaussian mechanism on eq. (12)'s mean (DP-FedAvg, McMahan et al. 2018):

    mean = ( sum_i clip_C(Delta_i) + N(0, (z C)^2 I) ) / D

with uniform weights (a client's data size would otherwise scale its contribution past C) and a fixed
denominator D (the expected clients per round), so neither the sum's sensitivity nor the divisor
depends on who took part. A run's noise is drawn from a fresh OS seed every round: it cannot be redrawn
from the run's config, and no two rounds share it. A study (``simulate``), which releases nothing, draws
it from its seed and the round instead, so that it repeats, whichever engine trained its clients.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ciders_edge.tensors import Tensors, norm
from ciders_edge.training.equations import clip_displacement

__all__ = ["GaussianMechanism", "fresh_generator", "study_generator"]


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded from the OS: a round's noise is never repeated nor recomputable."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def study_generator(seed: int, round_: int) -> torch.Generator:
    """A study's round noise: the same for the same seed and round, different for every round."""
    digest = hashlib.sha256(f"ciders-dp-noise:{seed}:{round_}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


@dataclass(frozen=True)
class GaussianMechanism:
    """Clip to ``clip`` (C), sum, add N(0, (z C)^2 I), divide by ``denominator`` (D)."""

    clip: float
    noise_multiplier: float  # z
    denominator: float

    def mean(self, deltas: Sequence[Tensors], like: Tensors, generator: torch.Generator | None = None):
        """The noisy mean of the clipped displacements over the tensors of ``like`` (v), and what to report of
        it: how many were clipped, their norms before clipping, and the noise's std on the mean."""
        norms = [norm(d) for d in deltas]
        clipped = [clip_displacement(d, self.clip) for d in deltas]
        zero = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in like.items()}
        total = {k: sum((d[k].double() for d in clipped), zero[k]) for k in like}
        mean, report = self.release(total, like, generator)
        return mean, {"clipped": sum(n > self.clip for n in norms), "norms_before_clip": norms, **report}

    def release(self, total: Tensors, like: Tensors, generator: torch.Generator | None = None):
        """``(total + N(0, (z C)^2 I)) / D`` in ``like``'s dtypes, from a sum of displacements each already
        within C (clipped by :meth:`mean`, or on the edges when only their secure sum reaches the cloud)."""
        generator = generator or fresh_generator()
        std = self.noise_multiplier * self.clip
        out = {}
        for k, t in like.items():
            noise = torch.normal(0.0, std, t.shape, generator=generator, dtype=torch.float64) if std else 0.0
            out[k] = ((total[k].double() + noise) / self.denominator).to(t.dtype)
        return out, {"noise_std_of_mean": std / self.denominator}
