"""ONNX export of a merged decoder through optimum-onnx: one graph with KV-cache inputs and outputs."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ciders_edge.formats.export_folder import ONNX_FILE
from export.quantize import quantize_onnx

__all__ = ["save_onnx"]

TASK = "text-generation-with-past"


def save_onnx(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, quantize: str) -> None:
    """Export ``model`` (consumed) into ``folder`` as ``model.onnx`` plus config and tokenizer."""
    from optimum.exporters.onnx import onnx_export_from_model

    if quantize != "none":
        _untie_lm_head(model)
    for name in ("optimum", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow in HF modeling code
        onnx_export_from_model(model, folder, task=TASK, do_validation=False, preprocessors=[tokenizer])
    tokenizer.save_pretrained(folder)  # optimum copies it only from the config's source folder, when it has one
    if quantize != "none":
        src, tmp = folder / ONNX_FILE, folder / f".{ONNX_FILE}.quantized"
        quantize_onnx(src, tmp, quantize)
        os.replace(tmp, src)
        (folder / f"{ONNX_FILE}_data").unlink(missing_ok=True)  # external weights of the float graph


def _untie_lm_head(model: PreTrainedModel) -> None:
    """Give the LM head its own weight (SmolLM2 ties it to the embedding).

    Tied, the graph computes the head from a Transpose of the embedding: a MatMul without a constant
    weight, which no quantizer can quantize; untied, the head is quantized like every other MatMul.
    A float export stays tied: the copy would only add the embedding's size to the file.
    """
    if not model.config.tie_word_embeddings:
        return
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
