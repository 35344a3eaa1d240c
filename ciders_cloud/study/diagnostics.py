"""Per client-round diagnostics of how the consensus correction mixes local and global directions.

Our operationalization of the paper's measures (docs/design.md §3, Prop. 2):
- ``g_i``: client i's first FO direction of the round (at x_0 = v); ``G``: their |D_i|-weighted mean,
  per layer as eq. (12) averages (in a mixed fleet a client is compared with G on the layers it trains).
- PPR, DR: the shares ``a / (a + b)`` and ``b / (a + b)`` of the least-squares fit
  ``Delta_i ≈ a g_i + b G``. Shares, because with AdamW and K > 1 ``Delta_i`` is not in gradient
  units; under Prop. 2's conditions (SGD, K = 1) a + b = 1 and they are the coefficients themselves.
- S-PPR, S-DR: what Prop. 2 predicts for the round's gamma_t and alpha: ``psi_t`` and ``1 - psi_t``.
- E-RAE: ``|| Delta_i/|Delta_i| - P/|P| ||`` with ``P = S-PPR g_i + S-DR G``: the relative alignment
  error between the measured direction and the predicted one (0: same direction, 2: opposite).
"""

from __future__ import annotations

import torch

from ciders_cloud.strategies.aggregation import layer_means
from ciders_edge.tensors import Tensors

__all__ = ["psi", "flatten", "decompose", "client_diagnostics"]


def psi(round_: int, gamma: float, alpha: float) -> float:
    """Prop. 2: ``psi_t = (1 - gamma) + gamma (1 - alpha)^t``."""
    return (1.0 - gamma) + gamma * (1.0 - alpha) ** round_


def flatten(t: Tensors) -> torch.Tensor:
    return torch.cat([t[k].flatten().double() for k in sorted(t)])


def decompose(delta: torch.Tensor, g_i: torch.Tensor, g_mean: torch.Tensor) -> tuple[float, float]:
    """(PPR, DR): shares of the least-squares fit ``delta ≈ a g_i + b G`` (NaN if g_i ∥ G)."""
    m = torch.stack([g_i, g_mean], 1)
    if torch.linalg.matrix_rank(m) < 2:
        return float("nan"), float("nan")
    a, b = torch.linalg.lstsq(m, delta.unsqueeze(1)).solution.squeeze(1).tolist()
    return (a / (a + b), b / (a + b)) if a + b != 0 else (float("nan"), float("nan"))


def client_diagnostics(
    deltas: dict[str, Tensors],
    directions: dict[str, Tensors],
    weights: dict[str, float],
    round_: int,
    gamma: float,
    alpha: float,
) -> dict[str, dict[str, float]]:
    """DR, PPR, S-DR, S-PPR and E-RAE for every participant of one round (tensors named as v is)."""
    ids = list(directions)
    double = [{k: t.double() for k, t in directions[cid].items()} for cid in ids]
    mean = layer_means(double, [weights[cid] for cid in ids], {k: None for d in double for k in d})
    g = {cid: flatten(d) for cid, d in directions.items()}
    s_ppr = psi(round_, gamma, alpha)
    out = {}
    for cid, delta in deltas.items():
        d = flatten(delta)
        g_mean = flatten({k: mean[k] for k in directions[cid]})
        ppr, dr = decompose(d, g[cid], g_mean)
        predicted = s_ppr * g[cid] + (1.0 - s_ppr) * g_mean
        e_rae = float(torch.linalg.norm(_unit(d) - _unit(predicted)))
        out[cid] = {"PPR": ppr, "DR": dr, "S-PPR": s_ppr, "S-DR": 1.0 - s_ppr, "E-RAE": e_rae}
    return out


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.norm(x).clamp_min(1e-30)
