"""The edge's part in FedNest and LFedNest: the client loss's gradients at the bundle's point.

In the bilevel view of CIDERS the outer variable x is the messenger LoRA (the clients' loss
f_i) and the inner one y is the learnable-backbone LoRA (the cloud's TAKD loss g). The
hypergradient ``grad_x f - grad_xy g [grad_yy g]^-1 grad_y f`` needs ``grad_y f_i``, which only
the edge can compute: it back-propagates through the backbone, which therefore stays a live
adapter here instead of being merged. FedNest uploads ``grad_x f_i`` and ``grad_y f_i`` in a
*probe* packet before the round's training (:func:`ciders_edge.training.train.probe`), and its local
steps take the ``svrg`` direction (:mod:`.directions`) towards the global hypergradient h the cloud forms
from them (the round's control); LFedNest appends ``grad_y f_i`` to its Δc packet. The rest of the edge speaks
of what it does (a probe, the svrg direction, a bilevel ask): this module is its one home for the bilevel view.
"""

from __future__ import annotations

import random

from ciders_edge.data.records import Example, batch_stream
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import messenger_loss, run_backbone
from ciders_edge.model.lora import BACKBONE_ADAPTER, MESSENGER_ADAPTER, lora_parameters
from ciders_edge.tensors import Tensors

__all__ = ["client_gradients"]


def client_gradients(
    edge: EdgeModel, examples: list[Example], hp: RoundHyperparams, batches: int, seed: int
) -> tuple[float, Tensors, Tensors]:
    """Mean loss, ``grad_x f_i`` and ``grad_y f_i`` over ``batches`` mini-batches, without dropout."""
    x, y = lora_parameters(edge.model, MESSENGER_ADAPTER), lora_parameters(edge.model, BACKBONE_ADAPTER)
    for p in edge.model.parameters():
        p.requires_grad_(False)
    for p in (*x.values(), *y.values()):
        p.requires_grad_(True)
        p.grad = None
    edge.model.eval()
    stream = batch_stream(examples, hp.batch_size, random.Random(seed), edge.tokenizer.pad_token_id)
    total, n = 0.0, batches * hp.grad_accum
    for _ in range(n):
        bb = run_backbone(edge.model, next(stream), edge.split.n_kept)  # with a graph: grad_y flows through it
        loss = messenger_loss(edge.model, bb, edge.split.n_kept) / n
        loss.backward()
        total += float(loss.detach())
    grads = [{k: p.grad.detach().float().cpu().clone() for k, p in d.items()} for d in (x, y)]
    for p in (*x.values(), *y.values()):
        p.requires_grad_(False)
        p.grad = None
    return total, grads[0], grads[1]
