"""The CIDERS edge update, docs/design.md §3, eq. (4)–(10): pure functions over ``dict[str, Tensor]``.

``v`` is the global messenger LoRA, ``c`` the global consensus, ``c_i`` this client's consensus;
all share one set of tensor names. Nothing here mutates its inputs, moves devices or does I/O.
"""

from __future__ import annotations

from ciders_edge.tensors import Tensors, add, norm, scale, sub

__all__ = [
    "look_ahead",
    "fd_hessian_vector",
    "fd_surrogate",
    "trajectory_gradient",
    "displacement",
    "clip_displacement",
    "consensus_update",
    "delta_c",
    "reconstruct_displacement",
]


def look_ahead(x: Tensors, g0: Tensors, eta_in: float) -> Tensors:
    """Eq. (5), the one-step look-ahead: ``x_look = x_k - eta_in * g0``."""
    return add(x, g0, -eta_in)


def fd_hessian_vector(grad_plus: Tensors, grad_minus: Tensors, eps_fd: float) -> Tensors:
    """Eq. (7), the central difference ``Hu = (grad L(x + eps u) - grad L(x - eps u)) / (2 eps)``."""
    return scale(sub(grad_plus, grad_minus), 1.0 / (2.0 * eps_fd))


def fd_surrogate(u: Tensors, hu: Tensors, eta_hvp: float) -> Tensors:
    """Eq. (7), the FD solver's curvature-aware surrogate ``g = u - eta_hvp * Hu``."""
    return add(u, hu, -eta_hvp)


def trajectory_gradient(
    g: Tensors, x: Tensors, v: Tensors, c: Tensors, c_i: Tensors, gamma: float, eps_prox: float
) -> Tensors:
    """Eq. (8): ``g_traj = g + gamma (c - c_i) + eps_prox (x_k - v)``, consensus correction and proximal pull."""
    return {k: g[k] + gamma * (c[k] - c_i[k]) + eps_prox * (x[k] - v[k]) for k in g}


def displacement(v: Tensors, x_final: Tensors, local_steps: int, eta: float) -> Tensors:
    """Eq. (9): ``Delta_i = (v - x_K) / (K eta)``: the round's average step, in gradient units."""
    return scale(sub(v, x_final), 1.0 / (local_steps * eta))


def clip_displacement(delta: Tensors, bound: float) -> Tensors:
    """DP-FedAvg's clipping of eq. (9)'s displacement: ``Delta_i * min(1, C / ||Delta_i||)``, the L2 norm over
    every tensor, so one client's contribution to eq. (12)'s sum is at most ``C`` (docs/privacy.md)."""
    total = norm(delta)
    return delta if total <= bound else scale(delta, bound / total)


def consensus_update(c_i: Tensors, delta: Tensors, c: Tensors, alpha: float, gamma: float) -> Tensors:
    """Eq. (10): ``c_i_new = (1 + alpha (gamma - 1)) c_i + alpha Delta_i - alpha gamma c``."""
    keep = 1.0 + alpha * (gamma - 1.0)
    return {k: keep * c_i[k] + alpha * delta[k] - alpha * gamma * c[k] for k in c_i}


def delta_c(c_i_new: Tensors, c_i: Tensors) -> Tensors:
    """Eq. (10): ``dc_i = c_i_new - c_i``: the only tensor payload an edge uploads."""
    return sub(c_i_new, c_i)


def reconstruct_displacement(dc_i: Tensors, c_i: Tensors, c: Tensors, alpha: float, gamma: float) -> Tensors:
    """Eq. (11), the inverse of the consensus update: ``Delta_i = dc_i / alpha - (gamma - 1) c_i + gamma c``.

    ``c_i`` is the value *before* the increment. The cloud applies it to every packet; an edge applies
    it to its own decoded packet to know the displacement the cloud will aggregate.
    """
    return {k: dc_i[k] / alpha - (gamma - 1.0) * c_i[k] + gamma * c[k] for k in dc_i}
