"""``Tensors``: a set of named tensors (a LoRA, a consensus, a Δc) and the few operations on them.

Every algorithmic step of CIDERS works on ``dict[str, Tensor]`` keyed by the LoRA's parameter names;
these helpers keep that arithmetic in one place. None mutates its inputs.

:class:`FlatLayout` packs such a set into one flat tensor, so a loop over the whole LoRA (the edge's
local steps) costs one op per equation term instead of one per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Tensors", "FlatLayout", "add", "sub", "scale", "norm", "non_finite"]

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


@dataclass(frozen=True)
class FlatLayout:
    """Where each named tensor sits in one flat buffer.

    Tensors of one shape lie back to back as one ``(n, *shape)`` block (a LoRA has a handful of
    shapes over dozens of tensors), so packing costs one stack per shape and unpacking one unbind
    per shape, however many tensors there are.
    """

    names: tuple[str, ...]  # the dict's order
    blocks: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]  # (shape, names) per block, in buffer order

    @classmethod
    def of(cls, tensors: Tensors) -> FlatLayout:
        """The layout of ``tensors`` (the same names and shapes always give the same layout)."""
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for name, t in tensors.items():
            by_shape.setdefault(tuple(t.shape), []).append(name)
        return cls(tuple(tensors), tuple((shape, tuple(names)) for shape, names in by_shape.items()))

    @property
    def numel(self) -> int:
        return sum(len(names) * math.prod(shape) for shape, names in self.blocks)

    def matches(self, tensors: Tensors) -> bool:
        """Whether ``tensors`` has exactly this layout's names and shapes (in any order)."""
        shapes = {n: shape for shape, names in self.blocks for n in names}
        return tensors.keys() == shapes.keys() and all(tuple(t.shape) == shapes[n] for n, t in tensors.items())

    def flatten(self, tensors: Tensors, dtype: torch.dtype | None = None, device=None) -> Tensor:
        """A new 1-D tensor holding ``tensors`` (on their device and dtype unless given)."""
        parts = [torch.stack([tensors[n] for n in names]).reshape(-1) for _, names in self.blocks]
        if not parts:
            return torch.zeros(0, dtype=dtype, device=device)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        return flat.to(device=device, dtype=dtype)

    def unflatten(self, flat: Tensor) -> Tensors:
        """Views of ``flat`` under their names and shapes (no copy; the views do not overlap)."""
        chunks = flat.split([len(names) * math.prod(shape) for shape, names in self.blocks])
        out = {}
        for chunk, (shape, names) in zip(chunks, self.blocks, strict=True):
            out.update(zip(names, chunk.view(len(names), *shape).unbind(0), strict=True))
        return {n: out[n] for n in self.names}


def non_finite(tensors: Tensors | dict) -> str | None:
    """The name of the first tensor with a NaN or an Inf (a nested dict's as ``outer inner``), or ``None``:
    every check that refuses non-finite values (a packet, an update, the server's v and c) asks this."""
    for name, t in tensors.items():
        inner = non_finite(t) if isinstance(t, dict) else (None if torch.isfinite(t).all() else "")
        if inner is not None:
            return f"{name} {inner}".strip()
    return None
