"""The CIDERS cloud aggregation, DESIGN §2, eq. (11)–(12): pure functions over ``dict[str, Tensor]``.

(13), the warm-started TAKD of the learnable backbone with the new messenger held fixed, is
:class:`ciders_cloud.takd.Distiller`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ciders_edge.tensors import Tensors, add
from ciders_edge.training.equations import reconstruct_displacement  # eq. (11), shared with the edge

__all__ = ["reconstruct_displacement", "participation_weights", "weighted_sum", "aggregate"]


def participation_weights(num_examples: Sequence[int]) -> list[float]:
    """``p_i = |D_i| / sum_j |D_j|`` over this round's participants."""
    total = float(sum(num_examples))
    return [n / total for n in num_examples]


def weighted_sum(items: Sequence[Tensors], weights: Sequence[float], like: Tensors) -> Tensors:
    """``sum_i p_i t_i`` over the tensors named in ``like``."""
    return {k: sum(p * t[k] for p, t in zip(weights, items, strict=True)) for k in like}


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
    """Eq. (12): ``v <- v - tau K eta sum p_i Delta_i`` and ``c <- (1 - alpha) c + alpha sum p_i Delta_i``."""
    mean = weighted_sum(deltas, weights, v)
    v_new = add(v, mean, -tau * local_steps * eta)
    c_new = {k: (1.0 - alpha) * c[k] + alpha * mean[k] for k in c}
    return v_new, c_new
