"""Where the cloud's torch work runs (``--device auto|cpu|cuda``): TAKD, fidelity, a strategy's Hessian
products and a study's evaluation.

The device is a runtime choice, not part of a run: it is never stored in ``run.json``, the run's id or
a bundle, and everything written to disk is a CPU tensor. The CPU is the bit-exact reference (no
autocast there); CUDA computes in bf16 autocast over fp32 weights, the same results in meaning.
A bf16 teacher's frozen weights (``teacher_dtype``) compute in bf16 autocast on CUDA too, and in fp32
on the CPU (:class:`WidenBf16`): most CPUs multiply bf16 several times slower than fp32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ciders_edge.errors import ConfigError

__all__ = ["DEVICES", "CPU", "cloud_device", "autocast", "to_cpu", "WidenBf16"]

DEVICES = ("auto", "cpu", "cuda")
CPU = torch.device("cpu")  # the library's default: the reference the tests pin


def cloud_device(spec: str | torch.device = "cpu") -> torch.device:
    """The device ``spec`` names; ``auto`` is CUDA when torch sees one, else the CPU.

    Raises:
        ConfigError: ``spec`` is not one of :data:`DEVICES`, or it is ``cuda`` and there is no CUDA device.
    """
    if isinstance(spec, torch.device):
        spec = spec.type
    if spec not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {spec!r}")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    return torch.device(spec)


def autocast(device: torch.device, weights: torch.dtype = torch.float32) -> contextlib.AbstractContextManager:
    """bf16 autocast on a CUDA device that has bf16 (the weights, LoRA and optimizer stay fp32); nothing
    on the CPU, so its results stay bit-identical to a run without a device. Frozen ``weights`` in bf16
    (a bf16 teacher's) compute in fp32 wherever autocast does not run (:class:`WidenBf16`)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return WidenBf16() if weights == torch.bfloat16 else contextlib.nullcontext()


class WidenBf16(TorchFunctionMode):
    """fp32 compute over bf16 weights: each matmul widens its weight for that product alone, and an
    embedding its rows, so the model stays in bf16 and the activations are fp32; a frozen weight's
    backward keeps it in bf16. fp32 weights (what trains) pass untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = (*args, *kwargs.values())
            bias = rest[0] if rest else None
            if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
                if _frozen(weight) and (bias is None or _frozen(bias)):
                    return _WideLinear.apply(x, weight, bias)
                return F.linear(x, weight.float(), None if bias is None else bias.float())
        out = func(*args, **kwargs)
        if func in (F.embedding, torch.embedding) and out.dtype == torch.bfloat16:
            return out.float()
        return out


def _frozen(t: Tensor) -> bool:
    return not t.requires_grad


class _WideLinear(torch.autograd.Function):
    """``x W^T + b`` in fp32 for a frozen bf16 ``W``; backward keeps ``W`` as stored, not its fp32 copy."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.float(), None, None


def to_cpu(tensors: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """``tensors`` as CPU tensors (for the disk), detached; no copy of one already there in ``dtype``."""
    return {k: v.detach().to("cpu", dtype or v.dtype) for k, v in tensors.items()}
