"""Each family as llama.cpp's ``convert_hf_to_gguf.py`` writes it: architecture, metadata, tensor conventions.

Llama and Mistral are llama.cpp's ``llama`` architecture (its rope rotates adjacent pairs, so q/k rows are
permuted; Llama 3's rope scaling is a ``rope_freqs`` tensor of per-frequency factors); Qwen2 (q/k/v biases)
and Qwen3 (q/k norms) are ``qwen2`` and ``qwen3``, and Gemma 3 is ``gemma3``, all three with transformers'
rope layout, so nothing is permuted. Gemma's RMSNorm multiplies by ``1 + w``, llama.cpp's by ``w``: its norm
weights are written plus one. Gemma 3's sliding layers are written as a per-layer pattern (llama.cpp reads
the array; the converter relies on its default of five sliding layers then a full one, which an AdapEmu's
strided layers break) with their own rope base. What llama.cpp would compute differently is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import torch
from transformers import PretrainedConfig

from ciders_edge.errors import ExportError

__all__ = ["GgufArch", "GGUF_ARCHS", "gguf_arch", "write_hparams", "extra_tensors"]


@dataclass(frozen=True)
class GgufArch:
    """How one transformers family maps onto one llama.cpp architecture."""

    arch: gguf.MODEL_ARCH
    permute_qk: bool  # llama.cpp's "normal" rope: q/k rows permuted (convert_hf_to_gguf's undo_permute)
    norm_shift: float = 0.0  # added to every norm weight (Gemma: 1 + w)

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


GGUF_ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "mistral": GgufArch(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2": GgufArch(gguf.MODEL_ARCH.QWEN2, permute_qk=False),
    "qwen3": GgufArch(gguf.MODEL_ARCH.QWEN3, permute_qk=False),
    "gemma3_text": GgufArch(gguf.MODEL_ARCH.GEMMA3, permute_qk=False, norm_shift=1.0),
}


def gguf_arch(config: PretrainedConfig, what: str) -> GgufArch:
    """The llama.cpp architecture of ``config``; refuses (one line) a model llama.cpp would compute otherwise."""
    arch = GGUF_ARCHS.get(config.model_type)
    problem = _problem(config) if arch is not None else f"architecture {config.model_type!r}"
    if problem:
        raise ExportError(
            f"{what}: llama.cpp cannot run this model as transformers does ({problem}); "
            "export --format hf or genai instead"
        )
    return arch


def _problem(config: PretrainedConfig) -> str | None:
    """What of ``config`` llama.cpp's graph for its family does not compute, or None."""
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3") or (kind == "llama3" and config.model_type != "llama"):
        return f"RoPE scaling {kind!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in attention or MLP"  # Qwen2's q/k/v biases are its architecture's own, not this flag
    if config.model_type == "gemma3_text":
        if config.query_pre_attn_scalar != config.head_dim:
            return f"query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim {config.head_dim}"
        if config.attn_logit_softcapping is not None:
            return "attention logit soft-capping"
        return None
    window = _window(config)
    if window is not None:
        return f"a {window}-token sliding window: llama.cpp's {GGUF_ARCHS[config.model_type].name} attends to all"
    return None


def _window(config: PretrainedConfig) -> int | None:
    """The sliding window a Llama-graph family applies, when it applies one within the context."""
    kinds = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return None
    if kinds is not None and "sliding_attention" not in kinds:
        return None
    return window


def write_hparams(writer: gguf.GGUFWriter, config: PretrainedConfig, arch: GgufArch) -> None:
    """The ``<arch>.*`` keys ``convert_hf_to_gguf.py`` writes for ``config``'s family."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch.arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch.arch == gguf.MODEL_ARCH.GEMMA3:
        _gemma3(writer, config)


def _gemma3(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """Gemma 3's window, which layers slide (every layer named) and their rope base."""
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_rope_freq_base_swa(config.rope_local_base_freq)


def extra_tensors(config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """Tensors llama.cpp needs beyond the weights: Llama 3's ``rope_freqs`` (convert_hf_to_gguf's factors)."""
    scaling = getattr(config, "rope_scaling", None) or {}
    if scaling.get("rope_type") != "llama3":
        return {}
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": torch.tensor(factors, dtype=torch.float32)}
