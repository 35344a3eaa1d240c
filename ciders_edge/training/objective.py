"""The LLM client loss for the local update: response-token CE of the AdapEmu's messenger.

The frozen learnable backbone runs once per mini-batch under ``no_grad``; every gradient the
update asks for (x_k, the look-ahead, the two FD points) re-runs only the messenger from that
cached hidden state, with the LM head on response positions only.

The messenger LoRA's parameters are views of one flat buffer (and their gradients of one flat
gradient buffer), so loading a point and reading a gradient are one op each, whatever the number of
LoRA tensors: the local update hands points over as flat tensors (:meth:`flat_gradient`).
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from ciders_edge.data.records import Example, batch_stream
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import BackboneBatch, decoder_of, messenger_loss, run_backbone
from ciders_edge.model.lora import MESSENGER_ADAPTER, bind_flat, copy_into, is_bound, lora_parameters
from ciders_edge.tensors import FlatLayout, Tensors

__all__ = ["MessengerObjective", "Batch"]


@dataclass
class Batch:
    micro: list[BackboneBatch]  # grad_accum micro-batches
    seed: int  # dropout masks are drawn from this, identically for every pass on the batch


class MessengerObjective:
    """L_i(x; xi) for the messenger LoRA ``x`` of the layers this edge trains (its profile's top
    ``a_p``), with gradient accumulation over micro-batches. The frozen messenger layers below them
    run once per mini-batch with the backbone."""

    def __init__(
        self,
        edge: EdgeModel,
        examples: list[Example],
        batch_size: int,
        grad_accum: int,
        seed: int,
        checkpoint: bool = False,
    ) -> None:
        self.edge = edge
        self.checkpoint = checkpoint  # activation checkpointing over the trained messenger layers
        self.start = edge.split.first_trained  # the cached hidden state enters the trained layers here
        self.params = {k: p for k, p in lora_parameters(edge.model, MESSENGER_ADAPTER).items() if edge.split.trains(k)}
        self.layout = FlatLayout.of(self.params)
        self.grad_accum = grad_accum
        self.device = next(edge.model.parameters()).device
        self.rng = random.Random(seed)
        self.stream = batch_stream(examples, batch_size, self.rng, edge.tokenizer.pad_token_id)
        for _name, p in edge.model.named_parameters():
            p.requires_grad_(False)
        for p in self.params.values():
            p.requires_grad_(True)
        self.flat, self.grad = bind_flat(self.params, self.layout)
        edge.model.train()
        for layer in decoder_of(edge.model).layers[edge.split.n_kept : self.start]:
            layer.eval()  # messenger layers this edge does not train are frozen: no LoRA dropout there

    def batch(self) -> Batch:
        micro = []
        for _ in range(self.grad_accum):
            with torch.no_grad():
                micro.append(run_backbone(self.edge.model, next(self.stream), self.start))
        return Batch(micro, self.rng.getrandbits(63))

    def gradient(self, x: Tensors, batch: Batch) -> tuple[float, Tensors]:
        """Loss and gradient at the point ``x`` (on ``x``'s device); the global RNG is left as it was."""
        device = next(iter(x.values())).device
        with self.rng_scope():
            loss, g = self.flat_gradient(self.layout.flatten(x, device=self.device), batch)
        return float(loss), self.layout.unflatten(g.to(device))

    def flat_gradient(self, x: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """Loss (a 0-dim tensor: no host sync) and a new flat gradient at the flat point ``x`` (in
        :attr:`layout` order, on :attr:`device`). Reseeds the global RNG for the dropout masks: call
        it inside :meth:`rng_scope`."""
        if not is_bound(self.params, self.flat, self.grad):  # the model was moved, cast, or its grads reset
            self.flat, self.grad = bind_flat(self.params, self.layout)
        with torch.no_grad():
            self.flat.copy_(x)
        self.grad.zero_()
        total = None
        torch.manual_seed(batch.seed)
        for mb in batch.micro:
            loss = self.loss(mb) / len(batch.micro)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total, self.grad.to(x.dtype, copy=True)

    def rng_scope(self) -> AbstractContextManager:
        """A fork of the global RNG: the dropout reseeding inside it leaves the caller's RNG untouched."""
        return torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device])

    def loss(self, mb: BackboneBatch) -> torch.Tensor:
        return messenger_loss(self.edge.model, mb, self.start, checkpoint=self.checkpoint)

    def load(self, x: Tensors) -> None:
        """Leave the model holding messenger ``x`` (e.g. the personalized one after training)."""
        copy_into(self.params, x)
