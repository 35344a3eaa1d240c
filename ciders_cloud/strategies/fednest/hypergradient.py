"""FedNest's hypergradient (Tarzanagh et al., 2022) for the messenger/backbone bilevel problem.

Outer variable x = the messenger LoRA, with the clients' loss f = sum_i p_i f_i; inner variable
y = the learnable-backbone LoRA, with the TAKD loss g (eq. 2) on the cloud's public data:

    grad F(x) = grad_x f(x, y) - grad_xy g(x, y) [grad_yy g(x, y)]^-1 grad_y f(x, y)

FedIHGP approximates the inverse-Hessian-gradient product with N terms of a Neumann series:

    p_N = (1/l) sum_{n=0}^{N-1} (I - grad_yy g / l)^n grad_y f

Second derivatives come from autograd double-backward, or from central differences of first
derivatives where double-backward is not possible (memory, or an op without a second derivative).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ciders_edge.tensors import Tensors, add, norm, scale, sub

__all__ = [
    "InnerProblem",
    "SecondOrder",
    "autograd_second_order",
    "fd_second_order",
    "second_order",
    "neumann_ihgp",
    "top_eigenvalue",
    "indirect_term",
]


class InnerProblem(Protocol):
    """g(x, y) at any point, as a graph over leaf tensors that hold x and y."""

    def loss_at(self, x: Tensors, y: Tensors) -> tuple[Tensor, Tensors, Tensors]:
        """``g(x, y)`` and the leaves (``requires_grad``) that hold x and y in its graph."""


@dataclass
class SecondOrder:
    hvp_yy: Callable[[Tensors], Tensors]  # v -> grad_yy g v
    cross_xy: Callable[[Tensors], Tensors]  # p -> grad_xy g p, a vector shaped like x
    method: str


def _grad(out: Tensor, leaves: Tensors, **kw) -> Tensors:
    grads = torch.autograd.grad(out, list(leaves.values()), allow_unused=True, **kw)
    return {k: torch.zeros_like(t) if g is None else g for (k, t), g in zip(leaves.items(), grads, strict=True)}


def _dot(a: Tensors, b: Tensors) -> Tensor:
    return sum((a[k] * b[k]).sum() for k in a)


def autograd_second_order(inner: InnerProblem, x: Tensors, y: Tensors) -> SecondOrder:
    """One graph of ``grad_y g`` at (x, y); each product is one more backward through it."""
    loss, xs, ys = inner.loss_at(x, y)
    grad_y = _grad(loss, ys, create_graph=True)

    def hvp(v: Tensors) -> Tensors:
        return {k: t.detach() for k, t in _grad(_dot(grad_y, v), ys, retain_graph=True).items()}

    def cross(p: Tensors) -> Tensors:
        return {k: t.detach() for k, t in _grad(_dot(grad_y, p), xs, retain_graph=True).items()}

    return SecondOrder(hvp, cross, "autograd")


def fd_second_order(inner: InnerProblem, x: Tensors, y: Tensors, eps: float = 1e-3) -> SecondOrder:
    """Central differences of first derivatives along ``v / |v|``: two gradients per product."""

    def grads_at(y_point: Tensors) -> tuple[Tensors, Tensors]:
        loss, xs, ys = inner.loss_at(x, y_point)
        both = _grad(loss, {**{("x", k): t for k, t in xs.items()}, **{("y", k): t for k, t in ys.items()}})
        return {k: both["x", k] for k in xs}, {k: both["y", k] for k in ys}

    def along(v: Tensors, part: int) -> Tensors:
        size = norm(v)
        if size == 0.0:
            return {k: torch.zeros_like(t) for k, t in grads_at(y)[part].items()}
        h = eps / size
        plus, minus = grads_at(add(y, v, h))[part], grads_at(add(y, v, -h))[part]
        return scale(sub(plus, minus), 1.0 / (2.0 * h))

    return SecondOrder(lambda v: along(v, 1), lambda p: along(p, 0), "fd")


def second_order(inner: InnerProblem, x: Tensors, y: Tensors, method: str = "auto") -> SecondOrder:
    """``auto``: autograd double-backward, or central differences when that fails."""
    if method == "fd":
        return fd_second_order(inner, x, y)
    try:
        second = autograd_second_order(inner, x, y)
        second.hvp_yy({k: torch.zeros_like(t) for k, t in y.items()})  # a missing double-backward fails here
        return second
    except (torch.OutOfMemoryError, RuntimeError):
        if method == "autograd":
            raise
        return fd_second_order(inner, x, y)


def neumann_ihgp(hvp: Callable[[Tensors], Tensors], b: Tensors, terms: int, lipschitz: float) -> Tensors:
    """FedIHGP: ``p_N = (1/l) sum_{n<N} (I - H/l)^n b``, which tends to ``H^-1 b`` when 0 < H <= l."""
    term, total = b, b
    for _ in range(terms - 1):
        term = sub(term, scale(hvp(term), 1.0 / lipschitz))  # (I - H/l)^n b
        total = add(total, term)
    return scale(total, 1.0 / lipschitz)


def top_eigenvalue(hvp: Callable[[Tensors], Tensors], like: Tensors, iters: int = 5, seed: int = 0) -> float:
    """|largest eigenvalue| of the Hessian by power iteration: a step 1/l with l above it keeps
    the Neumann series from diverging along the sharpest direction."""
    gen = torch.Generator().manual_seed(seed)
    v = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for k, t in like.items()}
    value = 0.0
    for _ in range(iters):
        v = scale(v, 1.0 / max(norm(v), 1e-30))
        hv = hvp(v)
        value = norm(hv)
        v = hv
    return value


def indirect_term(second: SecondOrder, grad_y_f: Tensors, terms: int, lipschitz: float = 0.0) -> tuple[Tensors, dict]:
    """``-grad_xy g p_N``: what the inner problem adds to the hypergradient; ``lipschitz`` 0 takes
    l = 1.5 x the Hessian's top eigenvalue (estimated)."""
    if lipschitz <= 0.0:
        lipschitz = 1.5 * top_eigenvalue(second.hvp_yy, grad_y_f) or 1.0
    p = neumann_ihgp(second.hvp_yy, grad_y_f, terms, lipschitz)
    q = scale(second.cross_xy(p), -1.0)
    return q, {"neumann_terms": terms, "neumann_l": lipschitz, "ihgp_norm": norm(p), "indirect_norm": norm(q)}
