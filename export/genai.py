"""ONNX Runtime GenAI export: onnxruntime-genai's model builder on the merged model.

The builder writes a Llama graph made for decoding on a CPU (fused QKV projections, rotary and
RMSNorm kernels, ``GroupQueryAttention`` over a KV cache the runtime preallocates and updates in
place) plus ``genai_config.json``; the runtime (:mod:`ciders_edge.inference.genai`) runs its own C++
decode loop over it. Weights are symmetric ``MatMulNBits`` blocks of 32 (llama.cpp's Q8_0 and
Q4_0 layout) with int8 compute (``accuracy_level`` 4): on the 2-core CPU, int8 in blocks of 32 decodes
1.4x faster than in blocks of 16 with zero points, at the same greedy agreement within noise
(benchmarks/RESULTS.md); with ``int4`` the embedding is quantized too and shared with the tied LM
head (``GatherBlockQuantized``, which the builder has for symmetric 4 bits only); with ``int8`` the LM
head is int8 and the embedding stays a float
table (a Gather: memory, not compute).

The builder (0.18) imports names of transformers 5 and reads its config layout; under this project's
transformers 4.x it runs in a child process (``python -m export.genai``) that supplies both
(:func:`_transformers_compat`), so the exporting process is left untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ciders_edge.errors import ExportError
from ciders_edge.formats.export_folder import GENAI_CONFIG

__all__ = ["save_genai", "check_genai", "GENAI_QUANTIZATIONS"]

GENAI_QUANTIZATIONS = {"none": "fp32", "int8": "int8", "int4": "int4"}
BLOCK_SIZE = 32
SOURCE = ".hf-source"  # the merged model the builder reads, removed once it has written the graph
# what builder 0.18 builds of the toolkit's families, and the rope scalings it computes (its make_rope_init)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
ROPE_TYPES = {"default", "linear", "yarn", "llama3"}


def check_genai(config: PretrainedConfig, what: str) -> None:
    """Refuse, in one line and before anything loads, a model the builder cannot build as transformers runs it."""
    arch = (config.architectures or ["?"])[0]
    scaling = getattr(config, "rope_scaling", None) or {}
    rope = scaling.get("rope_type", scaling.get("type", "default"))
    problem = None
    if arch not in ARCHITECTURES:
        problem = f"architecture {arch}"
    elif rope not in ROPE_TYPES or (rope == "llama3" and arch != "LlamaForCausalLM"):
        problem = f"RoPE scaling {rope!r}"
    if problem:
        raise ExportError(
            f"{what}: onnxruntime-genai's model builder cannot build {problem}; export --format onnx or hf instead"
        )


def save_genai(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, quantize: str) -> None:
    """Export ``model`` into ``folder`` as ``model.onnx`` (+ ``model.onnx.data``), ``genai_config.json``
    and the tokenizer."""
    src, cache = folder / SOURCE, folder / ".builder-cache"
    model.save_pretrained(src, safe_serialization=True)
    tokenizer.save_pretrained(src)
    try:
        _run_builder(src, folder, cache, quantize, tied=bool(model.config.tie_word_embeddings))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    tokenizer.save_pretrained(folder)  # the tokenizer ciders-edge encodes with (the builder copies its own)
    _set_stop_tokens(folder / GENAI_CONFIG, tokenizer, model)


def builder_options(quantize: str, tied: bool) -> list[str]:
    """The builder's ``--extra_options`` for ``quantize``."""
    if quantize == "none":
        return []
    opts = [f"block_size={BLOCK_SIZE}", "is_symmetric=true", "accuracy_level=4"]
    if tied and quantize == "int4":  # one 4-bit table serves the embedding (Gather) and the LM head (MatMul)
        opts += ["op_types_to_quantize=MatMul/Gather", "shared_embeddings=true"]
    return opts


def _run_builder(src: Path, out: Path, cache: Path, quantize: str, tied: bool) -> None:
    args = [sys.executable, "-m", "export.genai", str(src), str(out), GENAI_QUANTIZATIONS[quantize], str(cache)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [*args, *builder_options(quantize, tied)], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        raise ExportError(f"onnxruntime-genai's model builder failed: {lines[-1] if lines else proc.returncode}")


def _set_stop_tokens(path: Path, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Stop where ``generate`` stops: the tokenizer's end of turn and the model's eos ids."""
    cfg = json.loads(path.read_text())
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = [tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])]
    cfg["model"]["eos_token_id"] = sorted({int(i) for i in ids if i is not None})
    if tokenizer.pad_token_id is not None:
        cfg["model"]["pad_token_id"] = int(tokenizer.pad_token_id)
    path.write_text(json.dumps(cfg, indent=2))


def _transformers_compat() -> None:
    """What builder 0.18 expects of transformers 5: two model classes it imports (Qwen 3.5, unused
    for Llama), ``config.rope_parameters`` instead of a ``rope_scaling`` of None, and a Mistral's
    sliding layers named in ``layer_types`` (without them it sizes a windowed cache for no layer and
    the runtime fails on the first prompt longer than the window)."""
    import transformers  # noqa: F401  (loads the lazy module the next import replaces)
    from transformers import (  # noqa: F401  (these lazy imports swap sys.modules["transformers"])
        Gemma3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    module = sys.modules["transformers"]
    for name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        if name not in module.__dict__:
            setattr(module, name, type(name, (), {}))
    from transformers import AutoConfig

    load = AutoConfig.from_pretrained

    def from_pretrained(*args, **kwargs):
        loaded = load(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded  # (config, unused kwargs) when asked
        if getattr(config, "rope_scaling", 0) is None:
            del config.rope_scaling
            config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.model_type == "mistral" and config.sliding_window is not None:  # every layer slides
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        return loaded

    AutoConfig.from_pretrained = from_pretrained


def _main(src: str, out: str, precision: str, cache: str, *options: str) -> None:
    _transformers_compat()
    import onnxruntime_genai.models  # noqa: F401  (puts the builder's own folder on sys.path)
    from builder import create_model, parse_extra_options

    extra = parse_extra_options(None, src, out, precision, "cpu", cache, list(options))
    create_model(None, src, out, precision, "cpu", cache, **extra)


if __name__ == "__main__":
    _main(*sys.argv[1:])
