"""The AdapEmu's forward pass in two halves: frozen learnable backbone, then messenger.

Splitting the pass lets training run the frozen backbone once per mini-batch without a graph and
re-run only the messenger (for the look-ahead and finite-difference passes), and lets the LM head
run on response positions only. The halves compose to exactly the model's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor
from torch.utils.checkpoint import noop_context_fn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ciders_edge.model.families import family_of

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types
Recompute = bool | Callable[[], contextlib.AbstractContextManager]  # run_layers' checkpoint

__all__ = [
    "Context",
    "Recompute",
    "make_context",
    "attention_kinds",
    "decoder_of",
    "embed",
    "backbone_hidden",
    "messenger_logits",
    "run_layers",
    "layer_outputs",
    "response_positions",
    "BackboneBatch",
    "run_backbone",
    "messenger_loss",
    "HEAD_ROWS",
    "response_logits",
]

HEAD_ROWS = 128  # response positions a scoring pass runs the LM head on at once


@dataclass
class Context:
    """Per-batch tensors every layer needs: a mask per attention kind, rotary embeddings, positions.

    Layers find their mask by their own ``attention_type`` (Qwen2/3, Gemma 3), so a context made on
    the full model serves the AdapEmu's layers too (the bootstrap feeds them the teacher's stream)."""

    masks: dict[str, Tensor | None]  # by attention kind: "full_attention", "sliding_attention"
    position_ids: Tensor  # (1, T)
    position_embeddings: tuple[Tensor, Tensor]  # the (global) rotary cos, sin
    cache_position: Tensor  # (T,)
    local_embeddings: tuple[Tensor, Tensor] | None = None  # Gemma 3's sliding layers' own rotary base
    default_kind: str = FULL  # the kind of a layer that names none (Llama: full; Mistral: sliding)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The inner decoder (``model.model``) of a causal LM, PEFT-wrapped or not."""
    return _base(model).model


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def embed(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    """The input embeddings (B, T, H): the module's own forward, which applies a family's scale
    (Gemma 3 multiplies by sqrt(hidden)); its weight may be held quantized, so it is never read here."""
    return decoder_of(model).embed_tokens(input_ids)


def make_context(model: torch.nn.Module, embeds: Tensor, attention_mask: Tensor) -> Context:
    """The masks and rotary embeddings of a batch, built as the model's own forward builds them."""
    decoder = decoder_of(model)
    config = decoder.config
    family = family_of(config)
    cache_position = torch.arange(embeds.shape[1], device=embeds.device)
    position_ids = cache_position.unsqueeze(0)
    kw = dict(config=config, input_embeds=embeds, attention_mask=attention_mask, cache_position=cache_position,
              past_key_values=None, position_ids=position_ids)  # fmt: skip
    kinds = attention_kinds(config)
    masks = {FULL: create_causal_mask(**kw)}
    if SLIDING in kinds:
        masks[SLIDING] = create_sliding_window_causal_mask(**kw)
    local = decoder.rotary_emb_local(embeds, position_ids) if family.local_rope else None
    default = SLIDING if family.sliding_window_mask and SLIDING in kinds else FULL
    return Context(masks, position_ids, decoder.rotary_emb(embeds, position_ids), cache_position, local, default)


def attention_kinds(config) -> set[str]:
    """The attention kinds of ``config``'s layers: its ``layer_types``, or every layer sliding for a
    Mistral with a window (its forward masks every layer so), or every layer full."""
    if getattr(config, "layer_types", None) is not None:
        return set(config.layer_types)
    windowed = family_of(config).sliding_window_mask and getattr(config, "sliding_window", None) is not None
    return {SLIDING if windowed else FULL}


def run_layers(
    model: torch.nn.Module, hidden: Tensor, ctx: Context, start: int, stop: int, checkpoint: Recompute = False
) -> Tensor:
    """Run decoder layers ``start..stop-1`` on ``hidden`` (B, T, H).

    Args:
        checkpoint: when grad is enabled, keep only each layer's input and recompute its activations in
            backward (activation checkpointing: memory for one layer's activations instead of all);
            the recomputation replays the RNG, so LoRA dropout draws the same mask. A context manager
            factory instead of True: the recomputation runs in it (the forward's precision, where
            checkpointing does not restore it by itself).
    """
    recompute = bool(checkpoint) and torch.is_grad_enabled()
    contexts = (lambda: (contextlib.nullcontext(), checkpoint())) if callable(checkpoint) else noop_context_fn
    for layer in decoder_of(model).layers[start:stop]:
        if recompute:
            hidden = torch.utils.checkpoint.checkpoint(
                _run_layer, layer, hidden, ctx, use_reentrant=False, context_fn=contexts
            )
        else:
            hidden = _run_layer(layer, hidden, ctx)
    return hidden


def _run_layer(layer: torch.nn.Module, hidden: Tensor, ctx: Context) -> Tensor:
    """One decoder layer with the mask of its attention kind and its family's rotary arguments."""
    kind = getattr(layer, "attention_type", ctx.default_kind)
    if ctx.local_embeddings is None:
        rotary = {"position_embeddings": ctx.position_embeddings}
    else:  # Gemma 3: each layer picks the global or the local rotary embedding itself
        rotary = {
            "position_embeddings_global": ctx.position_embeddings,
            "position_embeddings_local": ctx.local_embeddings,
        }
    out = layer(
        hidden,
        attention_mask=ctx.masks[kind],
        position_ids=ctx.position_ids,
        past_key_values=None,
        cache_position=ctx.cache_position,
        **rotary,
    )
    return out[0] if isinstance(out, tuple) else out  # Gemma 3 (and older transformers) return (hidden,)


def backbone_hidden(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, n_layers: int, checkpoint: Recompute = False
) -> tuple[Tensor, Context]:
    """Embeddings + the first ``n_layers`` layers: the hidden state entering the messenger (B, T, H);
    ``checkpoint``: see :func:`run_layers`."""
    embeds = embed(model, input_ids)
    ctx = make_context(model, embeds, attention_mask)
    return run_layers(model, embeds, ctx, 0, n_layers, checkpoint), ctx


def layer_outputs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, n_layers: int
) -> tuple[list[Tensor], Context]:
    """The residual stream after each of the first ``n_layers`` layers: ``out[i]`` follows ``i`` layers
    (``out[0]`` is the embedding), for fitting one layer at a time against a teacher."""
    hidden = embed(model, input_ids)
    ctx = make_context(model, hidden, attention_mask)
    out = [hidden]
    for i in range(n_layers):
        out.append(run_layers(model, out[-1], ctx, i, i + 1))
    return out, ctx


def messenger_logits(
    model: torch.nn.Module,
    hidden: Tensor,
    ctx: Context,
    start: int,
    positions: tuple[Tensor, Tensor] | None = None,
    checkpoint: Recompute = False,
) -> Tensor:
    """Messenger layers from ``start``, final norm and LM head (and a family's logit soft-cap).

    Args:
        positions: ``(batch_idx, time_idx)`` to compute logits at; ``None`` for every position.
        checkpoint: recompute each layer's activations in backward (:func:`run_layers`).

    Returns:
        Logits ``(N, V)`` at ``positions``, or ``(B, T, V)``.
    """
    decoder = decoder_of(model)
    hidden = run_layers(model, hidden, ctx, start, len(decoder.layers), checkpoint)
    if positions is not None:
        hidden = hidden[positions]  # (N, H)
    return _head(model, decoder.norm(hidden))


def _head(model: torch.nn.Module, normed: Tensor) -> Tensor:
    """The LM head on final-normed hidden states (and a family's logit soft-cap)."""
    logits = _base(model).lm_head(normed)
    cap = getattr(decoder_of(model).config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


@torch.no_grad()
def response_logits(model: torch.nn.Module, bb: BackboneBatch, start: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The messenger now loaded's fp32 logits at the response positions and their targets, :data:`HEAD_ROWS`
    positions at a time: scoring never holds more than (HEAD_ROWS, vocab) logits, where all of a slice's at
    once (8 records of 256 tokens, Qwen's 152k vocabulary) would be 1.2 GB, and as much again for their
    softmax, on a device that trains in 2."""
    decoder = decoder_of(model)
    normed = decoder.norm(run_layers(model, bb.hidden, bb.ctx, start, len(decoder.layers))[bb.positions])
    for rows, targets in zip(normed.split(HEAD_ROWS), bb.targets.split(HEAD_ROWS), strict=True):
        yield _head(model, rows).float(), targets


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
    (the bilevel ask's gradient through the backbone LoRA, :mod:`ciders_edge.training.bilevel`)."""
    device = next(model.parameters()).device
    b = {k: t.to(device) for k, t in batch.items()}
    hidden, ctx = backbone_hidden(model, b["input_ids"], b["attention_mask"], start)
    positions, targets = response_positions(b["labels"])
    return BackboneBatch(hidden, ctx, positions, targets)


def messenger_loss(
    model: torch.nn.Module, bb: BackboneBatch, start: int, reduction: str = "mean", checkpoint: bool = False
) -> Tensor:
    """Response-token cross-entropy of the messenger now loaded, from a backbone batch made with the
    same ``start`` (eq. 4's L_i); ``checkpoint``: see :func:`run_layers`."""
    logits = messenger_logits(model, bb.hidden, bb.ctx, start, bb.positions, checkpoint)
    return F.cross_entropy(logits.float(), bb.targets, reduction=reduction)
