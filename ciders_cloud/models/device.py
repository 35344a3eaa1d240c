"""Where the cloud's torch work runs (``--device auto|cpu|cuda``): TAKD, fidelity, FedNest's Hessian
products and a study's evaluation.

The device is a runtime choice, not part of a run: it is never stored in ``run.json``, the run's id or
a bundle, and everything written to disk is a CPU tensor. The CPU is the bit-exact reference (no
autocast there); CUDA computes in bf16 autocast over fp32 weights, the same results in meaning.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ciders_edge.errors import ConfigError

__all__ = ["DEVICES", "CPU", "cloud_device", "autocast", "to_cpu"]

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


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a CUDA device that has bf16 (the weights, LoRA and optimizer stay fp32); nothing
    on the CPU, so its results stay bit-identical to a run without a device."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_cpu(tensors: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """``tensors`` as CPU tensors (for the disk), detached; no copy of one already there in ``dtype``."""
    return {k: v.detach().to("cpu", dtype or v.dtype) for k, v in tensors.items()}
