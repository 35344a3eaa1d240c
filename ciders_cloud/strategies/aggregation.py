"""The CIDERS cloud aggregation, docs/design.md §3, eq. (11)–(12): pure functions over ``dict[str, Tensor]``.

Eq. (12) holds layer by layer: in a fleet whose profiles train messengers of different depths, each
messenger LoRA tensor is averaged over the clients that train it, their weights renormalized over
them, and a tensor no participant trained keeps its ``v`` and ``c``. When every client trains every
layer this is the paper's eq. (12), to the bit.

(13), the warm-started TAKD of the learnable backbone with the new messenger held fixed, is
:class:`ciders_cloud.models.takd.Distiller`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ciders_edge.tensors import Tensors, add
from ciders_edge.training.equations import reconstruct_displacement  # eq. (11), shared with the edge

__all__ = [
    "reconstruct_displacement",
    "participation_weights",
    "weighted_sum",
    "layer_means",
    "server_update",
    "aggregate",
]


def participation_weights(num_examples: Sequence[int]) -> list[float]:
    """Eq. (12)'s weights: ``p_i = |D_i| / sum_j |D_j|`` over this round's participants."""
    total = float(sum(num_examples))
    return [n / total for n in num_examples]


def weighted_sum(items: Sequence[Tensors], weights: Sequence[float], like: Tensors) -> Tensors:
    """Eq. (12)'s ``sum_i p_i t_i`` over the tensors named in ``like``."""
    return {k: sum(p * t[k] for p, t in zip(weights, items, strict=True)) for k in like}


def layer_means(items: Sequence[Tensors], weights: Sequence[float], like: Tensors) -> Tensors:
    """Eq. (12) per layer: ``sum_{i in S_k} p_i^k t_i[k]`` for every tensor ``k`` of ``like`` that some item
    holds, where ``S_k`` are the items holding ``k`` and ``p_i^k = p_i / sum_{j in S_k} p_j`` (= |D_i| /
    sum_{j in S_k} |D_j|); a tensor every item holds keeps the weights as given."""
    holders: dict[tuple[int, ...], list[str]] = {}
    for k in like:
        who = tuple(i for i, t in enumerate(items) if k in t)
        if who:
            holders.setdefault(who, []).append(k)
    out: Tensors = {}
    for who, keys in holders.items():
        p = [weights[i] for i in who]
        if len(who) < len(items):
            p = [w / sum(p) for w in p]
        out.update(weighted_sum([items[i] for i in who], p, dict.fromkeys(keys)))
    return {k: out[k] for k in like if k in out}


def server_update(
    v: Tensors, c: Tensors, mean: Tensors, tau: float, local_steps: int, eta: float, alpha: float
) -> tuple[Tensors, Tensors]:
    """Eq. (12) from the round's mean displacement ``mean = sum p_i Delta_i``: ``v <- v - tau K eta mean`` and
    ``c <- (1 - alpha) c + alpha mean`` on the tensors ``mean`` holds; the others keep their v and c."""
    v_new = {**v, **add({k: v[k] for k in mean}, mean, -tau * local_steps * eta)}
    c_new = {k: (1.0 - alpha) * c[k] + alpha * mean[k] if k in mean else c[k] for k in c}
    return v_new, c_new


def aggregate(
    v: Tensors,
    c: Tensors,
    deltas: Sequence[Tensors],
    weights: Sequence[float],
    tau: float,
    local_steps: int,
    eta: float,
    alpha: float,
) -> tuple[Tensors, Tensors]:
    """Eq. (12), per layer: :func:`server_update` with the mean over the clients that train each tensor
    (:func:`layer_means`)."""
    return server_update(v, c, layer_means(deltas, weights, v), tau, local_steps, eta, alpha)
