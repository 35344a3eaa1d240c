"""The CIDERS cloud aggregation, DESIGN §2, eq. (11)–(12): pure functions over ``dict[str, Tensor]``.

(13), the warm-started TAKD of the learnable backbone with the new messenger held fixed, is
:class:`ciders_cloud.takd.Distiller`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ciders_edge.update import (
    Tensors,
    add,
    reconstruct_displacement,  # eq. (11), shared with the edge
)

__all__ = ["reconstruct_displacement", "participation_weights", "aggregate"]


def participation_weights(num_examples: Sequence[int]) -> list[float]:
    """``p_i = |D_i| / sum_j |D_j|`` over this round's participants."""
    total = float(sum(num_examples))
    return [n / total for n in num_examples]


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
    mean = {k: sum(p * d[k] for p, d in zip(weights, deltas, strict=False)) for k in v}
    v_new = add(v, mean, -tau * local_steps * eta)
    c_new = {k: (1.0 - alpha) * c[k] + alpha * mean[k] for k in c}
    return v_new, c_new
