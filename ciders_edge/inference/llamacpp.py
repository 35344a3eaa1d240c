"""llama.cpp as an on-device runtime (``--runtime llamacpp``), through llama-cpp-python.

It runs what edge users run: a GGUF, either the base model's with the personalized messenger as a
LoRA adapter (what ``llama-cli --lora`` and ollama's ``ADAPTER`` apply) or one merged GGUF. The
decode loop is llama.cpp's own (C++, one call per token), so nothing of transformers runs per token;
the Hugging Face tokenizer still builds the chat prompt and turns the ids into text, as for every
other runtime. llama-cpp-python is an optional extra (``pip install '.[llamacpp]'``): it builds
llama.cpp from source.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.inference.generation import GenerationSettings

__all__ = ["LlamaCppDecoder", "llamacpp_available", "GGUF_MAGIC", "check_gguf"]

GGUF_MAGIC = b"GGUF"
MAX_CONTEXT = 4096  # the KV cache llama.cpp allocates up front (f32: 190 MB for SmolLM2; its 8192 would double it)
GGML_TYPE_F32 = 0  # ggml_type, as llama_cpp.GGML_TYPE_F32 (this module imports llama_cpp only to decode)


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def check_gguf(path: Path) -> None:
    """Refuse a file that is not GGUF before llama.cpp reads it (it aborts the process on some)."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ExportError(f"{path}: cannot be read ({err.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ExportError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")


class LlamaCppDecoder:
    """A :class:`~ciders_edge.inference.generation.TokenDecoder` over one llama.cpp context.

    Args:
        model: the GGUF to run (the base model, or a merged personalized model).
        adapter: a LoRA adapter GGUF applied on ``model`` (``None``: a merged model).
        stop_ids: end-of-turn token ids (the tokenizer's EOS).
        threads: CPU threads (default: every core this process may use, as ``llama-bench -t`` does).
    """

    def __init__(self, model: Path, adapter: Path | None, stop_ids: set[int], threads: int | None = None) -> None:
        if not llamacpp_available():
            raise ConfigError(
                "--runtime llamacpp needs llama-cpp-python: pip install '.[llamacpp]' (builds llama.cpp, ~5 min)"
            )
        from llama_cpp import Llama

        for f in (model, adapter):
            if f is not None:
                check_gguf(f)
        threads = threads or len(os.sched_getaffinity(0))
        self.context = min(_context_of(model), MAX_CONTEXT)
        self._llm = Llama(
            str(model),
            lora_path=str(adapter) if adapter is not None else None,
            n_ctx=self.context,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=GGML_TYPE_F32,  # the KV cache in float32, as torch keeps it: llama.cpp's default f16 cache
            type_v=GGML_TYPE_F32,  # scored 43/50 against torch's 46/50 on the demo's dates edge, f32 44/50
            verbose=False,
        )
        self.stop_ids = set(stop_ids)
        self.threads = threads

    def stream_tokens(self, prompt_ids: list[int], settings: GenerationSettings) -> Iterator[int]:
        self._llm.reset()  # a fresh prefill every time: no reuse of the last prompt's KV cache
        self._llm.set_seed(settings.seed)
        greedy = settings.temperature == 0
        tokens = self._llm.generate(
            prompt_ids,
            top_k=1 if greedy else 0,
            top_p=1.0 if greedy else settings.top_p,
            min_p=0.0,
            temp=0.0 if greedy else settings.temperature,
            repeat_penalty=1.0,
            # only when asked: a processor copies every step's logits out to numpy
            logits_processor=[self._hold_stop(len(prompt_ids), settings.min_new_tokens)]
            if settings.min_new_tokens
            else None,
        )
        for n, token in enumerate(tokens, 1):
            yield token
            if token in self.stop_ids or n >= settings.max_new_tokens:
                return

    def _hold_stop(self, prompt: int, min_new: int):
        """A logits processor that keeps the end-of-turn tokens out until ``min_new`` tokens are out."""
        stops = np.fromiter(self.stop_ids, dtype=np.int64)

        def process(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
            if len(input_ids) - prompt < min_new:
                scores[stops] = -np.inf
            return scores

        return process


def _context_of(model: Path) -> int:
    """The context length the GGUF says its model was trained for."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(model)
    except (ValueError, OSError) as err:
        raise ExportError(f"{model}: not a readable GGUF ({err})") from None
    arch = _field(reader, "general.architecture")
    length = _field(reader, f"{arch}.context_length") if arch is not None else None
    return int(length) if length is not None else 2048


def _field(reader, key: str):
    f = reader.fields.get(key)
    return f.contents() if f is not None else None
