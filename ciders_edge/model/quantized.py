"""Frozen weights kept in their bundle's 8- or 4-bit storage while the edge trains and runs.

The method exists so that a device which cannot hold the full model trains the messenger on the AdapEmu;
a frozen weight should cost it what the bundle shipped (int8: 1 byte and a 16th; int4: half that), not
the 4 bytes of an fp32 copy made at load. So the integers and fp16 scales stay in memory as the bundle
stores them (:mod:`ciders_edge.formats.storage`), and every matmul dequantizes its weight a block of rows
at a time into the compute dtype, inside forward and again inside backward (a custom autograd function
that saves nothing), so no dequantized copy of a weight outlives the matmul that used it. The blocks go
into one reused workspace of :data:`BLOCK` weights: a fresh buffer per matmul page-faults through memory
that costs more than the arithmetic, and GEMMs split finer than a layer run slower per FLOP on a CPU. The
embedding dequantizes only the rows it looks up. The result is the dequantize-at-load model's to the
bit in fp32: both dequantize with the same arithmetic.

PEFT wraps :class:`QuantizedLinear` like an ``nn.Linear`` (registered as a custom module in
:func:`ciders_edge.model.lora.peft_config`); LoRA stays in float and trains as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ciders_edge.formats.storage import Quantized, dequantize, dequantize_into

__all__ = ["QuantizedLinear", "QuantizedEmbedding", "BLOCK", "place_quantized", "is_quantized"]

BLOCK = 1 << 24  # weights dequantized at once (64 MiB in fp32): a layer, or a block of an LM head


_WORKSPACES: dict[torch.device, Tensor] = {}


def _workspace(numel: int, device: torch.device) -> Tensor:
    """One fp32 buffer per device that every quantized layer dequantizes its blocks into (at most
    :data:`BLOCK` weights): allocated once, so a step does not page-fault through fresh memory per matmul."""
    buf = _WORKSPACES.get(device)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACES[device] = torch.empty(max(numel, min(BLOCK, 1 << 20)), device=device)
    return buf[:numel]


class _Weight(nn.Module):
    """The integers and scales as non-persistent buffers: they move with ``.to(device)`` but stay out of
    ``state_dict`` (the model's float state is what the edge saves and compares). The fp16 scales are
    kept as their int16 bits, so a ``model.to(dtype)`` cannot round them."""

    def __init__(self, w: Quantized, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", w.q, persistent=False)
        self.register_buffer("scales", w.scale.view(torch.int16), persistent=False)
        self.fmt = w.fmt
        self.compute_dtype = dtype  # PEFT reads it to place the LoRA beside this layer
        self.out_features, self.in_features = w.shape

    def rows(self, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """Weight rows ``start..stop-1`` in ``dtype``, in the shared workspace: valid until the next call."""
        stop = min(stop, self.out_features)
        fp32 = _workspace((stop - start) * self.in_features, self.qweight.device).view(-1, self.in_features)
        dequantize_into(fp32, self.qweight[start:stop], self.scales[start:stop].view(torch.float16), self.fmt)
        return fp32 if dtype == torch.float32 else fp32.to(dtype)

    def stored(self) -> Quantized:
        """The weight as the bundle stores it (shared, not copied)."""
        return Quantized(self.qweight, self.scales.view(torch.float16), self.fmt)

    def blocks(self) -> range:
        return range(0, self.out_features, max(1, BLOCK // self.in_features))


class QuantizedLinear(_Weight):
    """``y = x W^T + b`` with ``W`` in int8/int4 blocks; the bias (Qwen2's q/k/v) stays float."""

    def __init__(self, w: Quantized, dtype: torch.dtype, bias: nn.Parameter | None = None) -> None:
        super().__init__(w, dtype)
        self.bias = bias  # the replaced layer's: loading the float weights assigns its values

    def forward(self, x: Tensor) -> Tensor:
        grad = torch.is_grad_enabled() and x.requires_grad  # inference and the frozen backbone need no graph
        y = _DequantizedMatmul.apply(x, self) if grad else self.matmul(x)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def matmul(self, x: Tensor) -> Tensor:
        """``x W^T`` (..., out), one row block of ``W`` at a time, each written into its columns."""
        x2 = x.reshape(-1, self.in_features)
        out = x2.new_empty(x2.shape[0], self.out_features)
        step = self.blocks().step
        for i in self.blocks():
            torch.mm(x2, self.rows(i, i + step, x.dtype).T, out=out[:, i : i + step])
        return out.view(*x.shape[:-1], self.out_features)

    def matmul_t(self, g: Tensor) -> Tensor:
        """``g W`` (..., in): the gradient with respect to the input, accumulated over row blocks."""
        g2 = g.reshape(-1, self.out_features)
        out = g2.new_zeros(g2.shape[0], self.in_features)
        step = self.blocks().step
        for i in self.blocks():
            out.addmm_(g2[:, i : i + step], self.rows(i, i + step, g.dtype))
        return out.view(*g.shape[:-1], self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


class _DequantizedMatmul(torch.autograd.Function):
    """``x W^T`` whose backward dequantizes ``W`` again instead of keeping it: only the layer (its integers,
    which live anyway) is saved. ``W`` is frozen, so the input is the only gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: QuantizedLinear) -> Tensor:
        ctx.layer = layer
        return layer.matmul(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.layer.matmul_t(grad), None


class QuantizedEmbedding(_Weight):
    """A token table in int8 (a scale per row) or int4; a looked-up row is dequantized, nothing else.
    Keeps the original's output scale where the family has one (Gemma's ``embed_scale``)."""

    def __init__(self, w: Quantized, dtype: torch.dtype, embed_scale: Tensor | None = None) -> None:
        super().__init__(w, dtype)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features
        if embed_scale is not None:
            self.register_buffer("embed_scale", embed_scale.clone(), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.qweight[flat], self.scales[flat].view(torch.float16), self.fmt, self.compute_dtype)
        out = rows.reshape(*ids.shape, self.embedding_dim)
        return out * self.embed_scale.to(out.dtype) if self.embed_scale is not None else out


def place_quantized(model: nn.Module, weights: dict[str, Quantized], dtype: torch.dtype) -> None:
    """Replace each module whose ``.weight`` is in ``weights`` by its quantized form; a tied LM head
    becomes a quantized layer over the embedding's own integers. Biases and everything else stay for
    the caller to load as float."""
    head = model.get_output_embeddings()
    tied = head is not None and model.config.tie_word_embeddings
    for name, w in weights.items():
        path = name.removesuffix(".weight")
        old = model.get_submodule(path)
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(w, dtype, getattr(old, "embed_scale", None))
        elif isinstance(old, nn.Linear):
            new = QuantizedLinear(w, dtype, old.bias)
        else:
            raise TypeError(f"{name}: a {type(old).__name__} cannot hold a quantized weight")
        model.set_submodule(path, new)
    embed = model.get_input_embeddings()
    if tied and isinstance(embed, QuantizedEmbedding):
        path = next(n for n, m in model.named_modules() if m is head)
        model.set_submodule(path, QuantizedLinear(embed.stored(), dtype))


def is_quantized(model: nn.Module) -> bool:
    """Whether any of ``model``'s frozen weights is held quantized."""
    return any(isinstance(m, _Weight) for m in model.modules())
