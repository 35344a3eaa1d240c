"""Tiny random models of each supported family, with the features of the real configs users bring.

Each is 8 layers at hidden size 64 with SmolLM2's tokenizer (the ``tiny`` folder's), and keeps what makes
its family differ in the forward and in the exporters (benchmarks/model_configs.py holds the real configs):

- ``llama3``: Llama 3.2's ``llama3`` rope scaling (its original context 512 instead of 8192, within the tiny
  model's 1024) and rope base, a head_dim field.
- ``qwen2``: Qwen2.5's q/k/v biases.
- ``qwen3``: Qwen3's q/k norms and a head_dim wider than hidden / heads (128 vs 64 in Qwen3-0.6B).
- ``mistral``: a sliding window (16 tokens, so it matters at the tests' 64-96 tokens), an untied head.
- ``gemma3``: Gemma 3's scaled embedding, q/k norms, pre/post norms, head_dim 256 > hidden / heads, a
  query_pre_attn_scalar, a local rope base, and sliding and full layers (``layer_types``) among both the
  kept backbone layers and the messenger layers of a depth-2, drop-0.5 split (kept [0, 2, 5], messenger 6, 7).

Random init leaves biases at zero and norms at one (Gemma's at zero): they are drawn at random here, so a
writer that drops a bias or gets a norm convention wrong computes another model.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["FAMILIES", "build_family", "LAYER_TYPES_GEMMA3"]

_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
S, F = "sliding_attention", "full_attention"
LAYER_TYPES_GEMMA3 = [S, S, F, S, S, F, S, F]  # kept [0, 2, 5] -> S F F; messenger [6, 7] -> S F

# name -> (model_type, the config fields that make the family what it is)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": (
        "llama",
        dict(head_dim=16, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 512}),
    ),
    "qwen2": ("qwen2", dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=16, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=False)),
    "gemma3": (
        "gemma3_text",
        dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
             layer_types=LAYER_TYPES_GEMMA3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True),
    ),
}  # fmt: skip


def build_family(name: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """Write family ``name``'s tiny random model (safetensors, config, tokenizer) into ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model_type, fields = FAMILIES[name]
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), **{**_SIZES, **fields}, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and norms away from their init, so each one matters
        for key, p in model.named_parameters():
            if key.endswith(".bias") or (p.ndim == 1 and "norm" in key):
                p.add_(torch.randn_like(p) * 0.1)
    model.config.name_or_path = f"ciders/tiny-{name}"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
