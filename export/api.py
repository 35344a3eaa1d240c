"""``ciders-edge export``: the personalized model as a deployable folder (hf, onnx, genai, gguf or peft).

The model is the AdapEmu or AdapFu (the messenger on the full backbone). The messenger LoRA (the
state's x_K) and, on the AdapEmu, the learnable backbone's LoRA are merged into dense weights, so the
folder needs neither PEFT nor this toolkit; ``gguf`` (:mod:`export.gguf`) is for llama.cpp and ollama,
by default a LoRA adapter for the base GGUF; ``peft`` (:mod:`export.peft`) is AdapFu's messenger as a PEFT
LoRA adapter of the base Hugging Face model. Before the folder is published, the exported model is run
on fixed chats against the unmerged model; the manifest records how closely they agree.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from transformers import AutoConfig

from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.atomic import fsync_tree, named_errors, replace_dir, staging_dir, write_json
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import FORMAT as EXPORT_FORMAT
from ciders_edge.formats.export_folder import FORMATS, MANIFEST, QUANTIZATIONS, Export, export_manifest
from ciders_edge.inference.exported import load_exported_model
from ciders_edge.inference.personalize import load_personalized, merge_messenger, resolve_backbone
from export.check import all_logits, check_inputs, compare_logits
from export.genai import check_genai, save_genai
from export.gguf import gguf_torch_model, plan_gguf, save_gguf
from export.onnx import save_onnx
from export.peft import check_peft, peft_model, save_peft

__all__ = ["export_model"]

Stage = Callable[[str], AbstractContextManager]


def export_model(
    bundle: str | Path,
    state: str | Path | None,
    fmt: str,
    out: str | Path,
    quantize: str = "none",
    messenger: str = "best",
    stage: Stage = lambda _: nullcontext(),
    backbone: str | None = None,
    base_model: str | Path | None = None,
    merged: bool = False,
    base_gguf: str | Path | None = None,
) -> dict:
    """Write the export folder ``out`` atomically and return a summary (sizes, agreement, source).

    ``messenger``: the state's ``best`` (its validation's choice), ``latest``, or the bundle's ``global``.
    ``backbone``: ``emu`` (the AdapEmu) or ``full`` (AdapFu); default, what the bundle deploys.
    ``merged``, ``base_gguf``: gguf only (:func:`export.gguf.plan_gguf`)."""
    out = Path(out)
    _check_args(fmt, quantize, out, merged or base_gguf is not None)
    start = time.perf_counter()
    with stage("loading the bundle and the personalized messenger"):
        b = Bundle.load(bundle)
        backbone = resolve_backbone(b, backbone)
        plan = plan_gguf(b, backbone, merged, quantize, base_gguf) if fmt == "gguf" else None
        if fmt == "peft":
            check_peft(backbone)
        if fmt == "genai":
            check_genai(AutoConfig.from_pretrained(b.path), f"{b.path} ({b.manifest['base_model']['id']})")
        quantize = plan.quantize if plan else quantize
        edge, source = load_personalized(b, state, messenger, torch.float32, backbone, base_model)
        inputs = check_inputs(edge.tokenizer)
        reference = all_logits(edge.model, inputs)  # the unmerged model, LoRA live
        config = edge.model.get_base_model().config  # what a GGUF is read back as
    with named_errors(out):
        staging = staging_dir(out)
    try:
        with named_errors(out), stage(f"writing the {fmt} model" + (f" ({quantize})" if quantize != "none" else "")):
            if plan:
                extra = {"gguf": save_gguf(edge, plan, staging, source.to_dict(), out.name)}
            elif fmt == "peft":
                extra, base = save_peft(edge, staging, b.manifest["base_model"]), edge.model.unload()
            else:
                extra = _save(edge, fmt, quantize, staging)
        del edge
        manifest = export_manifest(staging, fmt, quantize, source.to_dict(), extra)
        with stage(f"checking the export against the unmerged {'AdapFu' if backbone == 'full' else 'AdapEmu'}"):
            if plan:
                exported = gguf_torch_model(staging, extra["gguf"], config)
            elif fmt == "peft":  # the adapter, read back by PEFT, over the very base weights it ran on
                exported = peft_model(staging, base)
            else:
                exported = load_exported_model(Export(staging, manifest))
            check = compare_logits(inputs, reference, all_logits(exported, inputs))
        manifest["check"] = check
        with named_errors(out):
            write_json(staging / MANIFEST, manifest)
            fsync_tree(staging)
            replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "out": str(out),
        "format": fmt,
        "quantize": quantize,
        "runtime": Export(out, manifest).runtime,
        "bytes": size,
        "files": len(manifest["files"]),
        "check": check,
        "source": source.to_dict(),
        "seconds": time.perf_counter() - start,
    }


def _save(edge, fmt: str, quantize: str, folder: Path) -> dict:
    """The merged model as a transformers folder, ONNX or an ONNX Runtime GenAI folder; consumes ``edge``."""
    model, tokenizer = merge_messenger(edge), edge.tokenizer
    if fmt == "hf":
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    elif fmt == "genai":
        save_genai(model, tokenizer, folder, quantize)
    else:
        save_onnx(model, tokenizer, folder, quantize)
    return {}


def _check_args(fmt: str, quantize: str, out: Path, gguf_options: bool) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt in ("hf", "peft") and quantize != "none":
        raise ConfigError("--quantize applies to --format onnx, genai and gguf only")
    if fmt != "gguf" and quantize not in QUANTIZATIONS[fmt]:  # gguf's: export.gguf.plan_gguf
        raise ConfigError(
            f"--quantize for --format {fmt} must be one of {', '.join(QUANTIZATIONS[fmt])}, got {quantize!r}"
        )
    if fmt != "gguf" and gguf_options:
        raise ConfigError("--merged and --base-gguf apply to --format gguf only")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: is a file; --out must be a folder")
    if out.exists() and any(out.iterdir()) and not _is_export(out):
        raise ExportError(f"{out}: exists and is not an export folder; refusing to replace it (choose another --out)")


def _is_export(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
