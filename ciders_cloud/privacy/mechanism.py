"""The Gaussian mechanism on eq. (12)'s mean (DP-FedAvg, McMahan et al. 2018):

    mean = ( sum_i clip_C(Delta_i) + N(0, (z C)^2 I) ) / D

with uniform weights (a client's data size would otherwise scale its contribution past C) and a fixed
denominator D (the expected clients per round), so neither the sum's sensitivity nor the divisor
depends on who took part. The noise is drawn from a fresh OS seed every round: it cannot be redrawn
from the run's config, and no two rounds share it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from ciders_edge.tensors import Tensors, norm
from ciders_edge.training.equations import clip_displacement

__all__ = ["private_mean", "gaussian_mechanism", "fresh_generator"]


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded from the OS: a round's noise is never repeated nor recomputable."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def private_mean(
    deltas: Sequence[Tensors],
    like: Tensors,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensors, dict]:
    """The noisy mean of the clipped displacements over the tensors of ``like`` (v), and what to report of it:
    how many were clipped, their norms before clipping, and the noise's std on the mean."""
    norms = [norm(d) for d in deltas]
    clipped = [clip_displacement(d, clip) for d in deltas]
    total = {
        k: sum((d[k].double() for d in clipped), torch.zeros(t.shape, dtype=torch.float64)) for k, t in like.items()
    }
    mean, report = gaussian_mechanism(total, like, clip, noise_multiplier, denominator, generator)
    return mean, {"clipped": sum(n > clip for n in norms), "norms_before_clip": norms, **report}


def gaussian_mechanism(
    total: Tensors,
    like: Tensors,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensors, dict]:
    """``(total + N(0, (z C)^2 I)) / D`` in ``like``'s dtypes: the release, from a sum of displacements each
    already within C (clipped here, or on the edges when only their secure sum reaches the cloud)."""
    generator = generator or fresh_generator()
    std = noise_multiplier * clip
    mean = {}
    for k, t in like.items():
        noise = torch.normal(0.0, std, t.shape, generator=generator, dtype=torch.float64) if std else 0.0
        mean[k] = ((total[k].double() + noise) / denominator).to(t.dtype)
    return mean, {"noise_std_of_mean": std / denominator}
