"""An exported folder's model and tokenizer, loaded in the runtime its format runs in: transformers (hf),
ONNX Runtime through optimum (onnx) or ONNX Runtime GenAI's decode loop (genai)."""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ciders_edge.errors import ExportError
from ciders_edge.formats.export_folder import ONNX_FILE, Export
from ciders_edge.inference.genai import GenAIDecoder

__all__ = ["load_exported_model", "load_exported_tokenizer"]


def load_exported_model(exp: Export, providers: list[str] | None = None) -> Any:
    """The exported model, ready for ``generate``: transformers (hf), ONNX Runtime (onnx) or a
    :class:`~ciders_edge.inference.generation.TokenDecoder` (genai)."""
    if exp.format == "gguf":
        raise ExportError(f"{exp.path}: a gguf export runs in llama.cpp (--runtime llamacpp)")
    if exp.format == "peft":
        base = exp.manifest.get("peft", {}).get("base_model", "the base model")
        raise ExportError(
            f"{exp.path}: a PEFT adapter of {base}; load it over that model with "
            "PeftModel.from_pretrained (its README.md), or export --format hf, genai or gguf to run it here"
        )
    if exp.format == "genai":
        return GenAIDecoder.open(exp.path, exp.manifest["files"])
    if exp.format == "hf":
        return AutoModelForCausalLM.from_pretrained(exp.path, trust_remote_code=False).eval()
    from optimum.onnxruntime import ORTModelForCausalLM  # optimum loads for an onnx export only

    if ONNX_FILE not in exp.manifest["files"]:
        raise ExportError(f"{exp.path}: the manifest lists no {ONNX_FILE}")
    try:
        model = ORTModelForCausalLM.from_pretrained(
            exp.path, file_name=ONNX_FILE, providers=providers or ["CPUExecutionProvider"]
        )
    except Exception as err:  # onnxruntime's own exception types (bad graph, provider failing to start)
        raise ExportError(f"{exp.path / ONNX_FILE}: onnxruntime failed with providers {providers}: {err}") from None
    if getattr(model.config, "head_dim", None) and hasattr(model, "embed_size_per_head"):
        # optimum 0.1 sizes the empty KV cache as hidden / heads except for Gemma: Qwen3's wider heads
        model.embed_size_per_head = model.config.head_dim
    return model


def load_exported_tokenizer(exp: Export) -> PreTrainedTokenizerBase:
    """The export's own tokenizer (every format ships one)."""
    return AutoTokenizer.from_pretrained(exp.path, trust_remote_code=False)
