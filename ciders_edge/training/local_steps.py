"""K local steps of the CIDERS edge update (DESIGN §2) over any differentiable objective.

The loop sees the messenger LoRA only as ``dict[str, Tensor]`` and asks an :class:`Objective` for
gradients, so the same code runs on the LLM messenger and on the quadratic losses of the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ciders_edge.config import RoundHyperparams
from ciders_edge.errors import ConfigError
from ciders_edge.tensors import Tensors, add, norm, sub
from ciders_edge.training.equations import (
    consensus_update,
    delta_c,
    displacement,
    fd_hessian_vector,
    fd_surrogate,
    look_ahead,
    trajectory_gradient,
)

__all__ = ["Objective", "LocalResult", "local_update", "warmup_cosine", "mean_lr_multiplier"]


class Objective(Protocol):
    """A client's loss L_i: draws mini-batches and evaluates gradients at any messenger point."""

    def batch(self) -> Any:
        """The next mini-batch xi_k, with whatever frozen features it can reuse across passes."""

    def gradient(self, x: Tensors, batch: Any) -> tuple[float, Tensors]:
        """Loss and gradient of L_i at ``x`` on ``batch`` (``x`` is not modified)."""


@dataclass
class LocalResult:
    x_final: Tensors  # x_K: the personalized messenger
    delta: Tensors  # Delta_i
    c_i_new: Tensors
    dc: Tensors  # c_i_new - c_i, before any compression
    steps: list[dict] = field(default_factory=list)  # per-step metrics
    first_direction: Tensors = field(default_factory=dict)  # the FO/FD direction at x_0, for diagnostics


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def mean_lr_multiplier(hp: RoundHyperparams) -> float:
    """The schedule's mean over the K steps: a constant term added to every local gradient moves
    Delta_i by this times the term (exactly so with SGD)."""
    return sum(_lr_multiplier(k, hp) for k in range(hp.local_steps)) / hp.local_steps


def _lr_multiplier(step: int, hp: RoundHyperparams) -> float:
    return warmup_cosine(step, hp.local_steps, min(hp.warmup_steps, hp.local_steps - 1))


def local_update(
    v: Tensors,
    c: Tensors,
    c_i: Tensors,
    objective: Objective,
    hp: RoundHyperparams,
    on_step: Callable[[dict], None] | None = None,
    x0: Tensors | None = None,
    control: Tensors | None = None,
) -> LocalResult:
    """Run K steps from ``x_0 = v`` and return x_K, Delta_i, the new c_i and dc_i (eq. 4–10).

    ``x0`` starts elsewhere (a local-only baseline continuing its own messenger); the proximal
    term and Delta_i still refer to ``v``. ``control`` is the global hypergradient ``h`` that
    the ``svrg`` solver (FedNest's outer steps) corrects every local gradient towards.
    """
    if hp.solver == "svrg" and control is None:
        raise ConfigError("the svrg solver needs the round's global hypergradient (FedNest's h)")
    params = {k: torch.nn.Parameter(t.detach().clone()) for k, t in (x0 or v).items()}
    opt = _optimizer(list(params.values()), hp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_multiplier(s, hp))
    steps, first = [], {}
    consensus_gap = norm(sub(c, c_i))  # |c - c_i|, fixed within a round
    for k in range(hp.local_steps):
        x = {name: p.detach() for name, p in params.items()}
        metrics = {
            "step": k + 1,
            "steps": hp.local_steps,
            "lr": opt.param_groups[0]["lr"],
            "consensus_gap": consensus_gap,
        }
        g = _direction(x, objective, hp, metrics, v, control)
        first = first or g
        g_traj = trajectory_gradient(g, x, v, c, c_i, hp.gamma, hp.eps_prox)  # eq. (8)
        for name, p in params.items():
            p.grad = g_traj[name].clone()
        metrics["grad_norm"] = norm(g_traj)
        if hp.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), hp.clip)
        opt.step()
        sched.step()
        steps.append(metrics)
        if on_step is not None:
            on_step(metrics)
    x_final = {name: p.detach().clone() for name, p in params.items()}
    delta = displacement(v, x_final, hp.local_steps, hp.eta)  # eq. (9)
    c_i_new = consensus_update(c_i, delta, c, hp.alpha, hp.gamma)  # eq. (10)
    return LocalResult(x_final, delta, c_i_new, delta_c(c_i_new, c_i), steps, first)


def _direction(
    x: Tensors, objective: Objective, hp: RoundHyperparams, metrics: dict, v: Tensors, control: Tensors | None
) -> Tensors:
    """FO: grad at the look-ahead point; FD: that minus eta_hvp times a central-difference HVP;
    SVRG: FedNest's ``h_i,nu = grad f_i(x_i,nu) - grad f_i(x) + h``, both gradients on one batch."""
    batch = objective.batch()
    loss, g0 = objective.gradient(x, batch)  # eq. (4)
    metrics["loss"] = loss
    if hp.solver == "svrg":
        _, g_anchor = objective.gradient(v, batch)
        return add(sub(g0, g_anchor), control)
    if hp.look_ahead == 0.0:  # x_look = x_k: the look-ahead gradient is g0 itself
        u = g0
    else:
        x_look = look_ahead(x, g0, hp.look_ahead)  # eq. (5)
        _, u = objective.gradient(x_look, batch)  # eq. (6): FO direction
    if hp.solver == "fo":
        return u
    _, g_plus = objective.gradient(add(x, u, hp.eps_fd), batch)
    _, g_minus = objective.gradient(add(x, u, -hp.eps_fd), batch)
    hu = fd_hessian_vector(g_plus, g_minus, hp.eps_fd)  # eq. (7)
    g = fd_surrogate(u, hu, hp.eta_hvp)
    metrics["r_fd"] = hp.eta_hvp * norm(hu) / max(norm(u), 1e-12)  # size of the curvature correction
    return g


def _optimizer(params: list[torch.nn.Parameter], hp: RoundHyperparams) -> torch.optim.Optimizer:
    if hp.optimizer == "sgd":
        return torch.optim.SGD(params, lr=hp.eta)
    return torch.optim.AdamW(params, lr=hp.eta, weight_decay=hp.weight_decay)
