"""The local steps' learning-rate schedule (eq. (8)'s warmup-cosine), where both sides read it: the edge's
K steps follow it, a cloud correction added to every local step's displacement scales by its mean, and the
bootstrap warms up the same way."""

from __future__ import annotations

import math

from ciders_edge.hyperparams import RoundHyperparams

__all__ = ["warmup_cosine", "lr_multiplier", "mean_lr_multiplier"]


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_multiplier(step: int, hp: RoundHyperparams) -> float:
    """Local step ``step``'s multiplier of the base learning rate ``eta``."""
    return warmup_cosine(step, hp.local_steps, min(hp.warmup_steps, hp.local_steps - 1))


def mean_lr_multiplier(hp: RoundHyperparams) -> float:
    """The schedule's mean over the K steps: a constant term added to every local gradient moves
    Delta_i by this times the term (exactly so with SGD)."""
    return sum(lr_multiplier(k, hp) for k in range(hp.local_steps)) / hp.local_steps
