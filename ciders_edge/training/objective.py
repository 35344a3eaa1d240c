"""The LLM client loss for the local update: response-token CE of the AdapEmu's messenger.

The frozen learnable backbone runs once per mini-batch under ``no_grad``; every gradient the
update asks for (x_k, the look-ahead, the two FD points) re-runs only the messenger from that
cached hidden state, with the LM head on response positions only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ciders_edge.data.records import Example, batch_stream
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import BackboneBatch, messenger_loss, run_backbone
from ciders_edge.model.lora import MESSENGER_ADAPTER, copy_into, lora_parameters
from ciders_edge.tensors import Tensors

__all__ = ["MessengerObjective", "Batch"]


@dataclass
class Batch:
    micro: list[BackboneBatch]  # grad_accum micro-batches
    seed: int  # dropout masks are drawn from this, identically for every pass on the batch


class MessengerObjective:
    """L_i(x; xi) for the messenger LoRA ``x``, with gradient accumulation over micro-batches."""

    def __init__(self, edge: EdgeModel, examples: list[Example], batch_size: int, grad_accum: int, seed: int) -> None:
        self.edge = edge
        self.params = lora_parameters(edge.model, MESSENGER_ADAPTER)
        self.grad_accum = grad_accum
        self.device = next(edge.model.parameters()).device
        self.rng = random.Random(seed)
        self.stream = batch_stream(examples, batch_size, self.rng, edge.tokenizer.pad_token_id)
        for _name, p in edge.model.named_parameters():
            p.requires_grad_(False)
        for p in self.params.values():
            p.requires_grad_(True)
        edge.model.train()

    def batch(self) -> Batch:
        micro = []
        for _ in range(self.grad_accum):
            with torch.no_grad():
                micro.append(run_backbone(self.edge.model, next(self.stream), self.edge.split.n_kept))
        return Batch(micro, self.rng.getrandbits(63))

    def gradient(self, x: Tensors, batch: Batch) -> tuple[float, Tensors]:
        copy_into(self.params, x)
        for p in self.params.values():
            p.grad = None
        total = 0.0
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(batch.seed)
            for mb in batch.micro:
                loss = self.loss(mb) / len(batch.micro)
                loss.backward()
                total += float(loss.detach())
        return total, {name: p.grad.detach().to(x[name].device, copy=True) for name, p in self.params.items()}

    def loss(self, mb: BackboneBatch) -> torch.Tensor:
        return messenger_loss(self.edge.model, mb, self.edge.split.n_kept)

    def load(self, x: Tensors) -> None:
        """Leave the model holding messenger ``x`` (e.g. the personalized one after training)."""
        copy_into(self.params, x)
