"""How a bundle stores frozen weights: ``fp32``, ``bf16``, ``int8`` or ``int4``, apart from how the edge computes.

An AdapEmu exists to be small, so its frozen weights (learnable backbone, messenger layers, the full
backbone for AdapFu) may ship in 8 or 4 bits; the edge keeps them so in memory and dequantizes per matmul
(:mod:`ciders_edge.model.quantized`), or dequantizes them once, at load, into its profile's compute dtype
(``decode(..., keep=False)``). LoRA, consensus and Δc packets keep their own formats.

Quantization is weight-only, symmetric and blockwise along the input axis (``GROUP`` weights share one
fp16 scale; the embedding table in ``int8`` has one scale per row), through torch's own groupwise ops
(``quantized_decomposed.quantize_per_channel_group``, what ExecuTorch's 4-bit path emits). Each scale is
rounded *up* to fp16, so no weight clips and every element is within half a step of its value:
``|w - w_hat| <= scale / 2`` (the documented bound the tests check). Small blocks follow the few large
channels of small LLMs such as SmolLM2 (see ``export/quantize.py``).

A stored tensor ``name`` is its integers under ``name`` (int4: two per byte, low nibble first) and its
scales under ``name + SCALE_SUFFIX``; the manifest records each tensor's format (:data:`FORMATS`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
from torch import Tensor

from ciders_edge.errors import BundleError

__all__ = [
    "STORAGES",
    "FORMATS",
    "GROUP",
    "SCALE_SUFFIX",
    "Quantized",
    "encode",
    "decode",
    "dequantize",
    "dequantize_into",
    "bytes_per_param",
]

STORAGES = ("fp32", "bf16", "int8", "int4")  # what a profile or `prepare --storage` may name
GROUP = 32  # weights per scale
SCALE_SUFFIX = ".qscale"
# per-tensor formats a manifest may record: (integer bits or None, float dtype of stored values)
FORMATS = {"fp32": None, "bf16": None, "int8-g32": 8, "int8-row": 8, "int4-g32": 4}
_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16}
_OPS = torch.ops.quantized_decomposed
_ROWS = 4096  # rows dequantized at once


def tensor_format(name: str, t: Tensor, storage: str) -> str:
    """The format ``storage`` gives one tensor: 2-D weights whose rows split into whole groups are
    quantized (the embedding per row in int8: a token's vector keeps one scale); 1-D tensors (norms)
    and odd shapes stay fp32 under int8/int4 (a few KiB), or follow a float storage."""
    if storage in _FLOAT:
        return storage
    if t.dim() != 2 or t.shape[1] % GROUP or t.numel() < GROUP * GROUP:
        return "fp32"
    if storage == "int8" and "embed_tokens" in name:
        return "int8-row"
    return f"{storage}-g{GROUP}"


def encode(tensors: dict[str, Tensor], storage: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors to write for ``storage`` and each one's format (keyed by the original names)."""
    stored, formats = {}, {}
    for name, t in tensors.items():
        fmt = formats[name] = tensor_format(name, t, storage)
        if FORMATS[fmt] is None:
            stored[name] = t.detach().to(_FLOAT[fmt])
        else:
            stored[name], stored[name + SCALE_SUFFIX] = _quantize(t.detach().float(), fmt)
    return stored, formats


@dataclass
class Quantized:
    """One weight as a bundle stores it: integers (int4: two per byte), fp16 scales, and its format."""

    q: Tensor
    scale: Tensor
    fmt: str

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's (rows, columns)."""
        return self.q.shape[0], self.q.shape[1] * (2 if FORMATS[self.fmt] == 4 else 1)


class Stored(Protocol):
    """What :func:`decode` reads: a dict, or a safetensors file opened lazily (one tensor at a time)."""

    def __contains__(self, name: object) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def pop(self, name: str) -> Tensor: ...


def decode(
    stored: Stored, formats: dict[str, str], dtype: torch.dtype, where: str, keep: bool = False
) -> dict[str, Tensor | Quantized]:
    """The weights in compute ``dtype``; ``formats`` is the manifest's record for this file. Consumes
    ``stored`` one tensor at a time, so the stored integers never sit beside all of the float weights.
    With ``keep``, 8- and 4-bit weights come back as they are stored (:class:`Quantized`), checked.

    Raises:
        BundleError: a tensor the record names is missing, one is not in the record, or integers and
            scales do not fit the format.
    """
    out = {}
    for name, fmt in formats.items():
        if fmt not in FORMATS:
            raise BundleError(f"{where}: tensor {name}: unknown storage format {fmt!r}")
        if name not in stored or (FORMATS[fmt] and name + SCALE_SUFFIX not in stored):
            raise BundleError(f"{where}: tensor {name} ({fmt}) is missing")
        if FORMATS[fmt] is None:
            out[name] = stored.pop(name).to(dtype)
            continue
        q, scale = stored.pop(name), stored.pop(name + SCALE_SUFFIX)
        _check_pair(q, scale, fmt, f"{where}: tensor {name}")
        out[name] = Quantized(q, scale, fmt) if keep else dequantize(q, scale, fmt, dtype)
    extra = next(iter(stored), None)
    if extra is not None:
        raise BundleError(f"{where}: tensor {extra} is not in the manifest's storage record")
    return out


def _check_pair(q: Tensor, scale: Tensor, fmt: str, where: str) -> None:
    packing = 2 if FORMATS[fmt] == 4 else 1
    ok = q.dim() == 2 and q.dtype == (torch.uint8 if packing == 2 else torch.int8) and scale.dtype == torch.float16
    cols = q.shape[1] * packing if q.dim() == 2 else 0
    row = fmt.endswith("-row")
    ok = ok and scale.shape == (q.shape[0], 1 if row else cols // GROUP) and (row or cols % GROUP == 0)
    if not ok:
        raise BundleError(
            f"{where}: integers {tuple(q.shape)} {q.dtype} and scales {tuple(scale.shape)} {scale.dtype} are not {fmt}"
        )


def bytes_per_param(fmt: str) -> float:
    """Stored bytes per weight (scales included), for size estimates and benchmarks."""
    bits = FORMATS[fmt]
    if bits is None:
        return _FLOAT[fmt].itemsize
    return bits / 8 + (0 if fmt.endswith("-row") else 2 / GROUP)


def _group(fmt: str, t: Tensor) -> int:
    return t.shape[1] if fmt.endswith("-row") else GROUP


def _qmax(fmt: str) -> int:
    return (1 << (FORMATS[fmt] - 1)) - 1  # 127 or 7; the symmetric grid leaves -128 / -8 unused


def _quantize(w: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    group, qmax = _group(fmt, w), _qmax(fmt)
    amax = w.reshape(-1, group).abs().amax(dim=1)
    scale = (amax / qmax * (1 + 2**-10)).clamp_min(2**-24).half()  # up to fp16: |w| / scale <= qmax
    zero = torch.zeros_like(scale, dtype=torch.int32)
    q = _OPS.quantize_per_channel_group(w, scale.float(), zero, -qmax, qmax, torch.int8, group)
    if FORMATS[fmt] == 4:
        q = _pack_int4(q)
    return q, scale.reshape(w.shape[0], -1)


def dequantize(q: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """The float rows of stored integers ``q`` (R, C) and scales: ``q * scale`` in fp32, then ``dtype``
    (what ``quantized_decomposed.dequantize_per_channel_group`` computes, in fewer passes). Row blocks
    at a time, so the float temporaries stay small next to the result (the embedding alone is 113 MB in
    fp32 for SmolLM2); on ``q``'s device."""
    rows, cols = q.shape[0], q.shape[1] * (2 if FORMATS[fmt] == 4 else 1)
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    work = out if dtype == torch.float32 else None
    for i in range(0, rows, _ROWS):
        r = min(_ROWS, rows - i)
        block = work[i : i + r] if work is not None else torch.empty(r, cols, device=q.device)
        dequantize_into(block, q[i : i + r], scale[i : i + r], fmt)
        if work is None:
            out[i : i + r] = block
    return out


def dequantize_into(out: Tensor, q: Tensor, scale: Tensor, fmt: str) -> Tensor:
    """Write ``q * scale`` into the fp32 rows ``out`` (R, C) in place, allocating nothing of ``out``'s size
    (int8 rows; int4 unpacks first): an edge that dequantizes per matmul reuses one buffer, and a fresh
    buffer's page faults cost more than the arithmetic on a small device."""
    r, cols = out.shape
    group = cols if fmt.endswith("-row") else GROUP
    if FORMATS[fmt] == 4:  # each nibble straight into its column: no int8 copy of the whole block first
        signed, pairs = q.view(torch.int8), out.view(r, cols // 2, 2)
        pairs[..., 0].copy_((signed << 4) >> 4)
        pairs[..., 1].copy_(signed >> 4)
    else:
        out.copy_(q)
    out.view(r, cols // group, group).mul_(scale.float().unsqueeze(-1))
    return out


# torch has no int4 storage dtype to save; two values per byte is what every int4 format does.
def _pack_int4(q: Tensor) -> Tensor:
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack_int4(packed: Tensor) -> Tensor:
    """Two's-complement nibbles, low one first: arithmetic shifts of the byte as int8 sign-extend them."""
    signed = packed.view(torch.int8)
    return torch.stack(((signed << 4) >> 4, signed >> 4), dim=-1).reshape(packed.shape[0], -1)
