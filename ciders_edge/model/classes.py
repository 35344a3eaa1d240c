"""The model classes edge users fine-tune, 135M to 1.7B, by their published Hugging Face configs.

``ciders-edge profiles --detect`` sizes a device by them (the largest class it can train and run, from
:mod:`ciders_edge.memory`), and ``benchmarks/scaling.py`` builds each with random weights to measure what
the toolkit costs at that size. Only the fields that change cost or the forward pass are kept.
"""

from __future__ import annotations

__all__ = ["MODEL_CLASSES", "class_config"]

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}
_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6}
_GEMMA3 = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "vocab_size": 262_144,
    "tie_word_embeddings": True,
}

# name -> the real config's fields (Hugging Face ids in the comments), smallest first
MODEL_CLASSES: dict[str, dict] = {
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded model)
        **_LLAMA,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100_000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "smollm2-360m": {  # HuggingFaceTB/SmolLM2-360M-Instruct
        **_LLAMA,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100_000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct
        **_QWEN2,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151_936,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B-Instruct
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128_256,
        "max_position_embeddings": 131_072,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B-Instruct
        **_QWEN2,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151_936,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "smollm2-1.7b": {  # HuggingFaceTB/SmolLM2-1.7B-Instruct
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 130_000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "gemma-3-270m": {  # google/gemma-3-270m-it
        **_GEMMA3,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    },
    "gemma-3-1b": {  # google/gemma-3-1b-it
        **_GEMMA3,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "layer_types": ((["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 2)[:26],
    },
}


def class_config(name: str):
    """The transformers config of model class ``name`` (no weights)."""
    from transformers import AutoConfig

    fields = dict(MODEL_CLASSES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
