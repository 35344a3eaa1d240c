"""The default on-device runtime: ONNX Runtime GenAI's own decode loop over a ``genai`` export.

transformers' ``generate`` over optimum's session pays Python, a KV cache copied in and out of
numpy, and a full-vocabulary logits copy for every token; GenAI keeps the KV cache in a buffer it
preallocates for the whole generation and samples in C++, so a step costs what the graph costs.
GenAI's own default runs ONNX Runtime on one thread; the decoder asks for every core this process
may use, as llama.cpp does: on the 2-core CPU that doubles its speed, to llama.cpp's at the same
weight precision (benchmarks/results/studies/runtimes.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ciders_edge.errors import ExportError
from ciders_edge.formats.export_folder import GENAI_CONFIG, ONNX_FILE
from ciders_edge.inference.generation import GenerationSettings

__all__ = ["GenAIDecoder"]


class GenAIDecoder:
    """A :class:`~ciders_edge.inference.generation.TokenDecoder` over ``og.Model``, batch 1."""

    def __init__(self, model, context: int, vocab_size: int) -> None:
        self.model = model
        self.context = context
        self.vocab_size = vocab_size

    @classmethod
    def open(cls, folder: Path, files: dict[str, str]) -> GenAIDecoder:
        """Load a verified ``genai`` export (``files``: its manifest's file list); CPU, one intra-op
        thread per core this process may run on."""
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise ExportError(
                f"{folder}: a genai export runs in ONNX Runtime GenAI: pip install onnxruntime-genai"
            ) from None
        for name in (GENAI_CONFIG, ONNX_FILE):
            if name not in files:
                raise ExportError(f"{folder}: the manifest lists no {name}")
        cfg = json.loads((folder / GENAI_CONFIG).read_text())["model"]
        try:
            config = og.Config(str(folder))
            config.clear_providers()  # the CPU; this package's wheel has no other provider
            threads = {"intra_op_num_threads": len(os.sched_getaffinity(0))}
            config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
            model = og.Model(config)
        except Exception as err:  # onnxruntime-genai raises plain RuntimeError for a bad graph or config
            raise ExportError(f"{folder / ONNX_FILE}: onnxruntime-genai failed: {err}") from None
        return cls(model, int(cfg["context_length"]), int(cfg["vocab_size"]))

    def stream_tokens(self, prompt_ids: list[int], settings: GenerationSettings) -> Iterator[int]:
        """New token ids, the end-of-turn token (if reached) last."""
        generator = self._generator(len(prompt_ids), settings)
        generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
            yield int(generator.get_next_tokens()[0])

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Float32 logits (T, V) of every position of ``ids``: what export checks compare."""
        generator = self._generator(len(ids), GenerationSettings(max_new_tokens=1))
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        return torch.from_numpy(np.asarray(generator.get_output("logits"), dtype=np.float32)[0].copy())

    def _generator(self, prompt_len: int, settings: GenerationSettings):
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        opts = {
            "max_length": prompt_len + settings.max_new_tokens,
            "min_length": prompt_len + settings.min_new_tokens,
            "batch_size": 1,
        }
        if settings.temperature == 0:
            opts.update(do_sample=False)
        else:  # top_k = the vocabulary: no top-k cut, as transformers' generate here (top_k=None)
            opts.update(
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=self.vocab_size,
                random_seed=settings.seed,
            )
        params.set_search_options(**opts)
        return og.Generator(self.model, params)
