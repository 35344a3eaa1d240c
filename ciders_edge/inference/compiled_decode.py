"""GPU decode without Python overhead: a static KV cache and ``torch.compile`` (CUDA graphs).

Eager decoding of a small model on a GPU is bound by Python and kernel launches, not by the GPU
(31.6 tok/s for the SmolLM2 shape on an H200, issue 19). With a static KV cache every decode step has
the same shapes, so transformers' ``generate`` runs it through ``torch.compile(mode="reduce-overhead")``:
one CUDA graph replay per token. Prefill stays eager. The first call compiles (tens of seconds on a
GPU); later calls replay. Where compile cannot run, decoding stays eager, as on a CPU.
"""

from __future__ import annotations

import importlib.util
import weakref

import torch
from rich.markup import escape
from transformers import CompileConfig, StaticCache

from ciders_edge.errors import ConfigError
from ciders_edge.progress import console

__all__ = [
    "DECODE_MODES",
    "compile_problem",
    "decode_mode",
    "use_compiled_decode",
    "decodes_compiled",
    "static_cache",
    "fall_back",
]

DECODE_MODES = ("auto", "eager", "compiled")
GPU_TARGETS = ("cuda", "jetson")
CACHE_BLOCK = 256  # static cache lengths round up to this: prompts of similar length share one compiled graph

# model -> (batch, length, cache) of its last compiled decode; absent: the model decodes eagerly
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run a decode on ``device`` here, or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if torch._dynamo.config.disable:
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "triton is not installed (torch.compile needs it on a GPU)"
    return None


def decode_mode(
    device: torch.device, target: str | None, problem: str | None, requested: str = "auto"
) -> tuple[str, str | None]:
    """The decode the torch runtime uses (``eager`` or ``compiled``) and, when it cannot use the one it
    wants, the notice that says why.

    Args:
        device: where the model runs.
        target: the profile's target (``cpu``, ``cuda``, ``jetson``); None without a profile.
        problem: :func:`compile_problem` for ``device``.
        requested: ``auto`` compiles on a CUDA device unless a ``cpu`` profile asks for CPU behaviour;
            a CPU keeps eager decoding (compiling costs more there than it saves at batch 1).
            ``eager`` or ``compiled`` force one (tests force ``compiled`` on a CPU).

    Raises:
        ConfigError: ``requested`` is not one of :data:`DECODE_MODES`.
    """
    if requested not in DECODE_MODES:
        raise ConfigError(f"decode must be one of {', '.join(DECODE_MODES)}, got {requested!r}")
    gpu = device.type == "cuda" and (target is None or target in GPU_TARGETS)
    if requested == "eager" or (requested == "auto" and not gpu):
        return "eager", None
    if problem is not None:
        return "eager", f"torch decodes eagerly on {device.type}: {problem}"
    return "compiled", None


def use_compiled_decode(model, backend: str = "inductor") -> None:
    """Decode ``model`` with a static KV cache through ``torch.compile`` from its next ``generate``.

    ``backend="eager"`` runs the same path through dynamo without inductor: seconds to compile, no
    speed-up; a quick check of the static-cache path on a CPU.
    """
    # fullgraph off: a graph break slows a step, never fails it
    cfg = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
    cfg._compile_all_devices = model.device.type != "cuda"  # transformers compiles on CUDA only unless told
    model.generation_config.compile_config = cfg
    _CACHES[model] = None


def decodes_compiled(model) -> bool:
    try:
        return model in _CACHES
    except TypeError:  # an unhashable model object was never set to compiled decode
        return False


def static_cache(model, batch: int, length: int, context: int) -> StaticCache:
    """An empty static KV cache for ``batch`` sequences of up to ``length`` tokens: the model's last one
    when it fits (same shapes, so the compiled graph replays), else a new one of ``length`` rounded up."""
    held = _CACHES.get(model)
    if held is not None and held[0] == batch and held[1] >= length:
        held[2].reset()
        return held[2]
    length = min(-(-length // CACHE_BLOCK) * CACHE_BLOCK, max(context, length))
    cache = StaticCache(config=model.config, max_cache_len=length)
    _CACHES[model] = (batch, length, cache)
    return cache


def fall_back(model, err: Exception) -> None:
    """Decode ``model`` eagerly from now on, after one notice line naming the failure."""
    _CACHES.pop(model, None)
    model.generation_config.compile_config = None
    first = (str(err).strip().splitlines() or [""])[0][:200]
    console.print(
        f"[yellow]notice:[/] compiled decode failed ({escape(type(err).__name__)}: {escape(first)}); decoding eagerly",
        soft_wrap=True,
    )
