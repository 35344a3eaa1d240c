"""``Tensors``: a set of named tensors (a LoRA, a consensus, a Δc) and the few operations on them.

Every algorithmic step of CIDERS works on ``dict[str, Tensor]`` keyed by the LoRA's parameter names;
these helpers keep that arithmetic in one place. None mutates its inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Tensors", "add", "sub", "scale", "norm"]

Tensors = dict[str, Tensor]


def add(a: Tensors, b: Tensors, alpha: float = 1.0) -> Tensors:
    """``a + alpha * b``."""
    return {k: a[k] + alpha * b[k] for k in a}


def sub(a: Tensors, b: Tensors) -> Tensors:
    return {k: a[k] - b[k] for k in a}


def scale(a: Tensors, s: float) -> Tensors:
    return {k: s * a[k] for k in a}


def norm(a: Tensors) -> float:
    """Global L2 norm over every tensor (computed in float64)."""
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in a.values())))
