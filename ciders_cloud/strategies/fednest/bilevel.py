"""The cloud's part in FedNest and LFedNest: TAKD (eq. 2) as the inner problem g(x, y).

The inner problem lives on the cloud alone (its public data and teacher), so FedIHGP's products
with ``grad_yy g`` and ``grad_xy g`` need no communication here; the clients contribute only
``grad_y f_i`` (see :mod:`ciders_edge.training.bilevel`); :mod:`.fednest` holds the strategies.
"""

from __future__ import annotations

import contextlib
import random

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ciders_cloud.models.device import WidenBf16, to_cpu
from ciders_cloud.models.takd import takd_terms
from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies.fednest.hypergradient import indirect_term, second_order
from ciders_cloud.strategies.fednest.settings import FedNestSettings
from ciders_edge.data.records import batch_stream, load_examples
from ciders_edge.model.lora import BACKBONE_ADAPTER, MESSENGER_ADAPTER, copy_into, lora_parameters, set_trainable
from ciders_edge.tensors import Tensors

__all__ = ["TakdInner", "cloud_indirect_term"]


class TakdInner:
    """g(x, y) = the TAKD loss on one fixed public batch, x and y written into the live LoRAs."""

    def __init__(self, models: CloudModels, batch: dict[str, Tensor], cfg: TakdConfig) -> None:
        self.models, self.batch, self.cfg = models, batch, cfg
        self.x = lora_parameters(models.emu, MESSENGER_ADAPTER)
        self.y = lora_parameters(models.emu, BACKBONE_ADAPTER)

    def loss_at(self, x: Tensors, y: Tensors) -> tuple[Tensor, Tensors, Tensors]:
        copy_into(self.x, x)
        copy_into(self.y, y)
        for p in (*self.x.values(), *self.y.values()):
            p.requires_grad_(True)
        with sdpa_kernel(SDPBackend.MATH), self._precision():  # the fused kernels have no double-backward
            return takd_terms(self.models, self.batch, self.cfg)["loss"], self.x, self.y

    def _precision(self) -> contextlib.AbstractContextManager:
        """fp32 (see :func:`cloud_indirect_term`), over a bf16 teacher's weights too, widened at each use."""
        return WidenBf16() if self.models.teacher.dtype == torch.bfloat16 else contextlib.nullcontext()


def cloud_indirect_term(
    models: CloudModels, run: RunConfig, state: ServerState, settings: FedNestSettings, grad_y_f: Tensors
) -> tuple[Tensors, dict]:
    """``-grad_xy g [grad_yy g]^-1 grad_y f`` at the round's (v, backbone), on a public batch
    drawn for this round; the models hold the round's LoRAs again afterwards.

    The products run on the models' device in fp32, with no autocast: central differences at
    ``eps = 1e-3`` (the fallback) over bf16 gradients would be rounding noise. ``q`` is a CPU tensor.
    """
    cfg = run.takd_config
    examples = load_examples(run.public_data, models.tokenizer, cfg.seq_len)
    rng = random.Random(f"{run.seed}:ihgp:{state.round}")
    batch = models.on_device(next(batch_stream(examples, settings.hvp_batch_size, rng, models.tokenizer.pad_token_id)))
    inner = TakdInner(models, batch, cfg)
    x, y, b = (_on(t, models.device) for t in (state.messenger, state.backbone, grad_y_f))
    try:
        second = second_order(inner, x, y, settings.hvp)
        q, info = indirect_term(second, b, settings.neumann_terms, settings.neumann_l)
    finally:
        set_trainable(models.emu, None)
        copy_into(inner.x, state.messenger)
        copy_into(inner.y, state.backbone)
    return to_cpu(q), {**info, "hvp": second.method}


def _on(tensors: Tensors, device: torch.device) -> Tensors:
    return {k: v.to(device) for k, v in tensors.items()}
