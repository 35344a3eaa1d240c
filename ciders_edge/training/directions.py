"""The local steps' directions, by the name a bundle's ``solver`` gives (docs/design.md §3).

A direction is the gradient estimate at x_k that eq. (8) corrects with the proximal and consensus
terms. CIDERS' is first-order (``fo``, eq. 4–6) or adds a finite-difference Hessian term (``fd``,
eq. 7); ``svrg`` reduces the variance of each local gradient towards a global control h the cloud sends
(the outer steps of the bilevel problem, :mod:`ciders_edge.training.bilevel`).
Every direction works on flat tensors (:mod:`ciders_edge.training.local_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.tensors import Tensors, add, sub
from ciders_edge.training.equations import fd_hessian_vector, fd_surrogate, look_ahead

__all__ = ["DIRECTIONS", "Direction", "on_flat"]


class Direction(Protocol):
    def __call__(
        self, x: Tensor, obj, hp: RoundHyperparams, metrics: dict, v: Tensor, control: Tensor | None
    ) -> Tensor:
        """The direction at ``x`` on one mini-batch; ``v`` is the round's messenger, ``control`` the round's h."""


_FLAT = "flat"


def on_flat(equation: Callable[..., Tensors], *args: Tensor | float) -> Tensor:
    """Evaluate a ``dict`` equation (eq. 4–10, ``add``, ``sub``) on flat tensors, as one-entry dicts:
    the same arithmetic as on the LoRA's tensors, one op per term."""
    return equation(*({_FLAT: a} if isinstance(a, Tensor) else a for a in args))[_FLAT]


def first_order(x, obj, hp, metrics, v, control, *, batch=None) -> Tensor:
    """Eq. (4)–(6): the gradient at the look-ahead point."""
    batch = obj.batch() if batch is None else batch
    loss, g0 = obj.flat_gradient(x, batch)  # eq. (4)
    metrics["loss"] = loss
    if hp.look_ahead == 0.0:  # x_look = x_k: the look-ahead gradient is g0 itself
        return g0
    x_look = on_flat(look_ahead, x, g0, hp.look_ahead)  # eq. (5)
    return obj.flat_gradient(x_look, batch)[1]  # eq. (6)


def finite_difference(x, obj, hp, metrics, v, control) -> Tensor:
    """Eq. (7): the FO direction minus eta_hvp times a central-difference Hessian-vector product, on its batch."""
    batch = obj.batch()
    u = first_order(x, obj, hp, metrics, v, control, batch=batch)
    _, g_plus = obj.flat_gradient(on_flat(add, x, u, hp.eps_fd), batch)
    _, g_minus = obj.flat_gradient(on_flat(add, x, u, -hp.eps_fd), batch)
    hu = on_flat(fd_hessian_vector, g_plus, g_minus, hp.eps_fd)  # eq. (7)
    u_norm = torch.linalg.vector_norm(u, dtype=torch.float64).clamp(min=1e-12)
    metrics["r_fd"] = hp.eta_hvp * torch.linalg.vector_norm(hu, dtype=torch.float64) / u_norm  # curvature share
    return on_flat(fd_surrogate, u, hu, hp.eta_hvp)


def svrg(x, obj, hp, metrics, v, control) -> Tensor:
    """``h_i,nu = grad f_i(x_i,nu) - grad f_i(x) + h``, both gradients on one batch: the local gradient, less
    its value at the round's messenger, plus the global control h."""
    batch = obj.batch()
    loss, g0 = obj.flat_gradient(x, batch)
    metrics["loss"] = loss
    _, g_anchor = obj.flat_gradient(v, batch)
    return on_flat(add, on_flat(sub, g0, g_anchor), control)


DIRECTIONS: dict[str, Direction] = {"fo": first_order, "fd": finite_difference, "svrg": svrg}
