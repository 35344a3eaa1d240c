"""How much memory the edge needs to train the messenger, or to run a model, from its config alone.

``prepare`` refuses a profile whose AdapEmu would not train within its ``memory_budget_gb``, ``train``
refuses a round that would not, and ``profiles --detect`` names the largest model class
(:mod:`ciders_edge.model.classes`) the device can train and run. The terms follow what the edge holds:
frozen weights in their storage format when kept quantized (:mod:`ciders_edge.model.quantized`) or in
the compute dtype; LoRA with its gradient and AdamW's two moments; the activations the trained messenger
layers keep for backward (only each layer's input with gradient checkpointing), the cached backbone
output and the logits at response positions; and the runtime itself (Python, torch, transformers, PEFT).
Checked against measured peak RSS by ``benchmarks/scaling.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ciders_edge.formats.storage import bytes_per_param
from ciders_edge.profiles import GIB, DeviceProfile

if TYPE_CHECKING:  # a type only: transformers loads when a model is built
    from transformers import PretrainedConfig

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "estimate_inference",
    "parameter_count",
    "ClassFit",
    "class_fits",
    "GIB",
    "RUNTIME_BYTES",
]

RUNTIME_BYTES = int(0.45 * GIB)  # the runtime before any model: 377 MiB of imports measured, and the tokenizer
DEQUANTIZE_BYTES = 2 * (1 << 24) * 4  # the dequantization workspace and a compute-dtype copy of it (quantized.BLOCK)


@dataclass
class MemoryEstimate:
    """Bytes needed on a device, by part (an upper-end estimate)."""

    weights: int
    lora: int  # LoRA tensors, their gradients and AdamW's two moments (float32)
    activations: int  # what backward keeps, the cached backbone output, logits; or an inference's KV cache
    budget: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.runtime

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        gb = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (
            f"needs {gb(self.total)} (weights {gb(self.weights)}, LoRA+optimizer {gb(self.lora)}, "
            f"activations {gb(self.activations)}, runtime {gb(self.runtime)}) of a {gb(self.budget)} budget"
        )


def _dims(config: PretrainedConfig) -> tuple[int, int, int, int, int, int]:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    return h, i, v, heads, kv, head_dim


def _layer_weights(config: PretrainedConfig) -> int:
    h, i, _, heads, kv, head_dim = _dims(config)
    return h * head_dim * (2 * heads + 2 * kv) + 3 * h * i


def parameter_count(config: PretrainedConfig, n_layers: int | None = None) -> int:
    """Parameters of ``config``'s model with ``n_layers`` decoder layers (default: all), a tied head once."""
    h, _, v, *_ = _dims(config)
    layers = config.num_hidden_layers if n_layers is None else n_layers
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return layers * (_layer_weights(config) + 2 * h) + embed + h


def frozen_bytes(profile: DeviceProfile, storage: str | None = None) -> float:
    """Bytes a frozen weight costs in memory: its storage format when kept quantized, else the dtype's."""
    storage = storage or profile.storage
    if profile.frozen_weights == "quantized" and storage in ("int8", "int4"):
        return bytes_per_param(f"{storage}-g32")
    return torch.finfo(profile.torch_dtype).bits // 8  # loaded into the compute dtype


def estimate_memory(
    config: PretrainedConfig,
    n_emu_layers: int,
    messenger_depth: int,
    profile: DeviceProfile,
    storage: str | None = None,
) -> MemoryEstimate:
    """Memory to train ``messenger_depth`` messenger layers of an AdapEmu of ``n_emu_layers`` layers with
    ``profile``'s dtype, frozen-weight mode, batch shape and checkpointing; ``storage`` is the bundle's
    (default: the profile's)."""
    h, i, v, heads, kv, head_dim = _dims(config)
    weights = int(parameter_count(config, n_emu_layers) * frozen_bytes(profile, storage))
    r = profile.lora_rank
    lora_per_layer = r * ((h + heads * head_dim) * 2 + (h + kv * head_dim) * 2 + 2 * (h + i) + (i + h))
    lora = lora_per_layer * messenger_depth * 4 * 4  # value, grad, two AdamW moments
    tokens = profile.batch_size * profile.seq_len
    layer = (tokens * (10 * h + 4 * i) + profile.batch_size * heads * profile.seq_len**2) * 4  # one block's kept
    if profile.gradient_checkpointing:  # each trained layer keeps its input; one recomputes at a time
        kept = messenger_depth * tokens * h * 4 + layer
    else:
        kept = messenger_depth * layer
    cached = profile.grad_accum * tokens * h * 4  # the backbone's output, for every micro-batch of a step
    logits = 2 * tokens * v * 4
    if frozen_bytes(profile, storage) < 2:  # quantized: the dequantization workspace
        transient = DEQUANTIZE_BYTES
    else:  # dequantized at load: the largest tensor (the embedding) is briefly there twice
        transient = v * h * frozen_bytes(profile, storage)
    budget = int(profile.memory_budget_gb * GIB)
    return MemoryEstimate(weights, lora, kept + cached + logits + int(transient), budget)


def estimate_inference(
    config: PretrainedConfig, n_layers: int, profile: DeviceProfile, storage: str | None = None, context: int = 2048
) -> MemoryEstimate:
    """Memory to answer with a model of ``n_layers`` layers (AdapFu: all of them) over ``context`` tokens:
    weights as :func:`estimate_memory` holds them, an fp32 KV cache and one row of logits."""
    h, _, v, _, kv, head_dim = _dims(config)
    weights = int(parameter_count(config, n_layers) * frozen_bytes(profile, storage))
    cache = 2 * n_layers * kv * head_dim * context * 4
    return MemoryEstimate(weights, 0, cache + v * 4 * 4, int(profile.memory_budget_gb * GIB))


@dataclass
class ClassFit:
    """Whether one model class trains (its AdapEmu, the profile's split) and runs (what it deploys) on a device."""

    name: str
    parameters: int
    train: MemoryEstimate
    run: MemoryEstimate

    def to_dict(self) -> dict:
        gib = lambda e: round(e.total / GIB, 2)  # noqa: E731
        return {"name": self.name, "parameters": self.parameters, "train_gib": gib(self.train),
                "trains": self.train.fits, "run_gib": gib(self.run), "runs": self.run.fits}  # fmt: skip


def class_fits(profile: DeviceProfile) -> list[ClassFit]:
    """Every model class of :mod:`ciders_edge.model.classes`, smallest first, against ``profile``: the
    AdapEmu of its split (the profile's messenger depth and drop ratio) trains; AdapFu runs when the profile
    deploys the full backbone, else the AdapEmu."""
    from ciders_edge.model.classes import MODEL_CLASSES, class_config
    from ciders_edge.model.split import SplitSpec

    out = []
    for name in MODEL_CLASSES:
        config = class_config(name)
        split = SplitSpec.from_drop_ratio(config.num_hidden_layers, profile.messenger_depth, profile.drop_ratio)
        deployed = config.num_hidden_layers if profile.backbone == "full" else split.emu_layers
        train = estimate_memory(config, split.emu_layers, split.trained, profile)
        run = estimate_inference(config, deployed, profile)
        out.append(ClassFit(name, parameter_count(config), train, run))
    return sorted(out, key=lambda f: f.parameters)
