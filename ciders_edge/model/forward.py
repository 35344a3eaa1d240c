"""The AdapEmu's forward pass in two halves: frozen learnable backbone, then messenger.

Splitting the pass lets training run the frozen backbone once per mini-batch without a graph and
re-run only the messenger (for the look-ahead and finite-difference passes), and lets the LM head
run on response positions only. The halves compose to exactly the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ciders_edge.model.families import family_of

__all__ = [
    "Context",
    "make_context",
    "decoder_of",
    "backbone_hidden",
    "messenger_logits",
    "run_layers",
    "layer_outputs",
    "response_positions",
    "BackboneBatch",
    "run_backbone",
    "messenger_loss",
]


@dataclass
class Context:
    """Per-batch tensors every layer needs: mask, rotary embeddings, positions."""

    attention_mask: Tensor | None  # the layers' (causal) mask
    position_ids: Tensor  # (1, T)
    position_embeddings: tuple[Tensor, Tensor]
    cache_position: Tensor  # (T,)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The inner decoder (``model.model``) of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def make_context(model: torch.nn.Module, embeds: Tensor, attention_mask: Tensor) -> Context:
    decoder = decoder_of(model)
    config = decoder.config
    cache_position = torch.arange(embeds.shape[1], device=embeds.device)
    position_ids = cache_position.unsqueeze(0)
    mask_fn = create_sliding_window_causal_mask if family_of(config).sliding_window_mask else create_causal_mask
    mask = mask_fn(
        config=config,
        input_embeds=embeds,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=None,
        position_ids=position_ids,
    )
    return Context(mask, position_ids, decoder.rotary_emb(embeds, position_ids), cache_position)


def run_layers(model: torch.nn.Module, hidden: Tensor, ctx: Context, start: int, stop: int) -> Tensor:
    """Run decoder layers ``start..stop-1`` on ``hidden`` (B, T, H)."""
    for layer in decoder_of(model).layers[start:stop]:
        hidden = layer(
            hidden,
            attention_mask=ctx.attention_mask,
            position_ids=ctx.position_ids,
            past_key_values=None,
            cache_position=ctx.cache_position,
            position_embeddings=ctx.position_embeddings,
        )
        if isinstance(hidden, tuple):  # older transformers return (hidden,)
            hidden = hidden[0]
    return hidden


def backbone_hidden(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, n_layers: int
) -> tuple[Tensor, Context]:
    """Embeddings + the first ``n_layers`` layers: the hidden state entering the messenger (B, T, H)."""
    embeds = decoder_of(model).embed_tokens(input_ids)
    ctx = make_context(model, embeds, attention_mask)
    return run_layers(model, embeds, ctx, 0, n_layers), ctx


def layer_outputs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, n_layers: int
) -> tuple[list[Tensor], Context]:
    """The residual stream after each of the first ``n_layers`` layers: ``out[i]`` follows ``i`` layers
    (``out[0]`` is the embedding), for fitting one layer at a time against a teacher."""
    hidden = decoder_of(model).embed_tokens(input_ids)
    ctx = make_context(model, hidden, attention_mask)
    out = [hidden]
    for i in range(n_layers):
        out.append(run_layers(model, out[-1], ctx, i, i + 1))
    return out, ctx


def messenger_logits(
    model: torch.nn.Module, hidden: Tensor, ctx: Context, start: int, positions: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """Messenger layers from ``start``, final norm and LM head.

    Args:
        positions: ``(batch_idx, time_idx)`` to compute logits at; ``None`` for every position.

    Returns:
        Logits ``(N, V)`` at ``positions``, or ``(B, T, V)``.
    """
    decoder = decoder_of(model)
    hidden = run_layers(model, hidden, ctx, start, len(decoder.layers))
    if positions is not None:
        hidden = hidden[positions]  # (N, H)
    head = (model.get_base_model() if hasattr(model, "get_base_model") else model).lm_head
    return head(decoder.norm(hidden))


def response_positions(labels: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """Positions whose next token is a response token, and those tokens (the shifted targets)."""
    targets = labels[:, 1:]
    b, t = torch.nonzero(targets != -100, as_tuple=True)
    return (b, t), targets[b, t]


@dataclass
class BackboneBatch:
    """A batch after the frozen backbone: every messenger pass on it (the local update's several
    gradients, or scoring several messengers) starts here instead of re-running the backbone."""

    hidden: Tensor  # (B, T, H) entering the messenger
    ctx: Context
    positions: tuple[Tensor, Tensor]  # where the next token is a response token
    targets: Tensor  # (N,) those tokens


def run_backbone(model: torch.nn.Module, batch: dict[str, Tensor], start: int) -> BackboneBatch:
    """The frozen half of the AdapEmu, its first ``start`` layers (the learnable backbone, and the
    messenger layers an edge does not train), on a collated batch (``input_ids``, ``attention_mask``,
    ``labels``), moved to the model's device. Callers choose ``no_grad`` (training, scoring) or not
    (FedNest's gradient through the backbone LoRA)."""
    device = next(model.parameters()).device
    b = {k: t.to(device) for k, t in batch.items()}
    hidden, ctx = backbone_hidden(model, b["input_ids"], b["attention_mask"], start)
    positions, targets = response_positions(b["labels"])
    return BackboneBatch(hidden, ctx, positions, targets)


def messenger_loss(model: torch.nn.Module, bb: BackboneBatch, start: int, reduction: str = "mean") -> Tensor:
    """Response-token cross-entropy of the messenger now loaded, from a backbone batch made with the
    same ``start`` (eq. 4's L_i)."""
    logits = messenger_logits(model, bb.hidden, bb.ctx, start, bb.positions)
    return F.cross_entropy(logits.float(), bb.targets, reduction=reduction)
