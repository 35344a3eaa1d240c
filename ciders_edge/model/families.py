"""Model-family differences in one table (after PEFT's target-module mapping).

Every supported family keeps its decoder blocks in ``model.model.layers`` with the Llama block's
projections (so LoRA targets the same names); what differs in the forward is said here: which layers
attend within a sliding window, and whether sliding layers have a rotary base of their own (Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from ciders_edge.errors import ModelError

__all__ = ["Family", "MODEL_FAMILIES", "family_of"]

_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """What the toolkit needs to know about one architecture family."""

    model_type: str
    lora_targets: tuple[str, ...] = _LLAMA_TARGETS
    sliding_window_mask: bool = False  # every layer uses the sliding-window mask when the config sets a window
    local_rope: bool = False  # sliding layers take a second rotary embedding (``rotary_emb_local``)


MODEL_FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),
        Family("mistral", sliding_window_mask=True),
        Family("gemma3_text", local_rope=True),  # sliding layers named by ``layer_types``
    )
}


def family_of(config: PretrainedConfig) -> Family:
    """Return the family of ``config`` or raise one clear error naming the architecture."""
    family = MODEL_FAMILIES.get(config.model_type)
    if family is None:
        arch = ",".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ModelError(
            f"unsupported architecture {arch!r} (model_type {config.model_type!r}); "
            f"supported: {', '.join(sorted(MODEL_FAMILIES))}"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelError(
            f"{config.model_type} with use_bidirectional_attention (an embedding model, e.g. EmbeddingGemma) "
            "is not a causal LM; use a decoder-only checkpoint such as gemma-3-270m-it"
        )
    return family
