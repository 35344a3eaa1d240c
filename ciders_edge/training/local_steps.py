"""K local steps of the CIDERS edge update (docs/design.md §3) over any differentiable objective.

The loop keeps the messenger LoRA as one flat tensor (x_k, v, c, c_i and every gradient): each
term of eq. (4)–(10) is one op whatever the number of LoRA tensors, the optimizer steps a single
parameter, and the step's metrics stay on the device until they are read, once per step (once per
call when no one watches the steps). The objective takes flat points too (:class:`FlatObjective`:
the LLM messenger's, or a test's quadratic loss).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.schedule import lr_multiplier
from ciders_edge.tensors import FlatLayout, Tensors
from ciders_edge.training.directions import DIRECTIONS, on_flat
from ciders_edge.training.equations import (
    clip_displacement,
    consensus_update,
    delta_c,
    displacement,
    trajectory_gradient,
)

__all__ = ["FlatObjective", "LocalResult", "local_update"]


class FlatObjective(Protocol):
    """A client's loss L_i over messenger points given as one flat tensor in ``layout`` order, on ``device``:
    it draws mini-batches and evaluates gradients at any point."""

    layout: FlatLayout
    device: torch.device

    def batch(self) -> Any:
        """The next mini-batch xi_k."""

    def flat_gradient(self, x: Tensor, batch: Any) -> tuple[Tensor | float, Tensor]:
        """Loss (a tensor is read later, avoiding a host sync) and a new flat gradient at ``x``."""

    def rng_scope(self) -> AbstractContextManager:
        """The context :meth:`flat_gradient` runs in (e.g. a fork of the RNG it reseeds)."""


@dataclass
class LocalResult:
    x_final: Tensors  # x_K: the personalized messenger
    delta: Tensors  # Delta_i
    c_i_new: Tensors
    dc: Tensors  # c_i_new - c_i, before any compression
    steps: list[dict] = field(default_factory=list)  # per-step metrics
    first_direction: Tensors = field(default_factory=dict)  # the FO/FD direction at x_0, for diagnostics


def local_update(
    v: Tensors,
    c: Tensors,
    c_i: Tensors,
    objective: FlatObjective,
    hp: RoundHyperparams,
    on_step: Callable[[dict], None] | None = None,
    x0: Tensors | None = None,
    control: Tensors | None = None,
) -> LocalResult:
    """Run K steps from ``x_0 = v`` and return x_K, Delta_i, the new c_i and dc_i (eq. 4–10).

    ``x0`` starts elsewhere (a local-only baseline continuing its own messenger); the proximal
    term and Delta_i still refer to ``v``. ``control`` is the global ``h`` that the ``svrg`` solver
    corrects every local gradient towards (the cloud's answer to the round's probes). The work
    runs on the objective's device, in ``v``'s dtype; the results come back on ``v``'s device
    (each result's tensors are views of one buffer of its own).
    """
    if hp.solver == "svrg" and control is None:
        raise ConfigError("the svrg solver needs the round's control h (the cloud's answer to the round's probes)")
    direction = DIRECTIONS[hp.solver]
    packer = _Packer.of(objective, v)
    fixed = packer.pack(v), packer.pack(c), packer.pack(c_i)  # v, c, c_i: one flat tensor each
    fv, fc, fci = fixed
    h = packer.pack(control) if control is not None else None
    x = torch.nn.Parameter(packer.pack(x0) if x0 else fv.clone())
    opt = _optimizer(x, hp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, hp))
    consensus_gap = torch.linalg.vector_norm(fc - fci, dtype=torch.float64)  # |c - c_i|, fixed within a round
    steps, first = [], None
    with objective.rng_scope():
        for k in range(hp.local_steps):
            metrics = {"step": k + 1, "steps": hp.local_steps, "lr": opt.param_groups[0]["lr"]}
            metrics["consensus_gap"] = consensus_gap
            g = direction(x.detach(), objective, hp, metrics, fv, h)
            first = g if first is None else first
            _step(x, g, fixed, hp, metrics, opt)
            sched.step()
            steps.append(metrics)
            if on_step is not None:
                _read_metrics([metrics])
                on_step(metrics)
    _read_metrics(steps)
    delta = on_flat(displacement, fv, x.detach(), hp.local_steps, hp.eta)  # eq. (9)
    if hp.displacement_clip is not None:  # differential privacy clipped on the edge (SecAgg's fleets)
        delta = on_flat(clip_displacement, delta, hp.displacement_clip)
    c_i_new = on_flat(consensus_update, fci, delta, fc, hp.alpha, hp.gamma)  # eq. (10)
    dc = on_flat(delta_c, c_i_new, fci)
    out = packer.unpack
    first_direction = out(first) if first is not None else {}
    return LocalResult(out(x.detach()), out(delta), out(c_i_new), out(dc), steps, first_direction)


@dataclass(frozen=True)
class _Packer:
    """Moves named tensors into the loop (one flat tensor on the objective's device, in v's dtype) and back."""

    layout: FlatLayout
    device: torch.device  # where the loop works
    dtype: torch.dtype
    names: tuple[str, ...]  # v's names, in v's order
    home: torch.device  # v's device, where the results go

    @classmethod
    def of(cls, obj: FlatObjective, v: Tensors) -> _Packer:
        if not obj.layout.matches(v):
            raise ConfigError("the messenger LoRA's tensor names or shapes do not match the objective's model")
        first = next(iter(v.values()))
        return cls(obj.layout, obj.device, first.dtype, tuple(v), first.device)

    def pack(self, tensors: Tensors) -> Tensor:
        return self.layout.flatten(tensors, dtype=self.dtype, device=self.device)

    def unpack(self, t: Tensor) -> Tensors:
        views = self.layout.unflatten(t.to(self.home))
        return {k: views[k] for k in self.names}


def _step(
    x: torch.nn.Parameter,
    g: Tensor,
    fixed: tuple[Tensor, Tensor, Tensor],
    hp: RoundHyperparams,
    metrics: dict,
    opt: torch.optim.Optimizer,
) -> None:
    """Eq. (8)'s trajectory gradient from the direction ``g``, global-norm clipping, one optimizer step."""
    v, c, c_i = fixed
    x.grad = on_flat(trajectory_gradient, g, x.detach(), v, c, c_i, hp.gamma, hp.eps_prox)
    metrics["grad_norm"] = torch.linalg.vector_norm(x.grad, dtype=torch.float64)
    if hp.clip > 0:  # as clip_grad_norm_ (min(1, clip / (norm + 1e-6))), reusing the logged norm
        x.grad.mul_((hp.clip / (metrics["grad_norm"] + 1e-6)).clamp(max=1.0))
    opt.step()


def _read_metrics(steps: list[dict]) -> None:
    """Replace the tensor-valued metrics in ``steps`` by floats, with one host transfer for all."""
    slots = [(m, k) for m in steps for k, val in m.items() if isinstance(val, Tensor)]
    if not slots:
        return
    values = torch.stack([m[k] if m[k].dtype == torch.float64 else m[k].double() for m, k in slots]).tolist()
    for (m, k), value in zip(slots, values, strict=True):
        m[k] = value


def _optimizer(x: torch.nn.Parameter, hp: RoundHyperparams) -> torch.optim.Optimizer:
    if hp.optimizer == "sgd":
        return torch.optim.SGD([x], lr=hp.eta)
    return torch.optim.AdamW([x], lr=hp.eta, weight_decay=hp.weight_decay)
