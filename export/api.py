"""``ciders-edge export``: the personalized model as a deployable folder (hf or onnx, optionally int8).

The model is the AdapEmu or AdapFu (the messenger on the full backbone). The messenger LoRA (the
state's x_K) and, on the AdapEmu, the learnable backbone's LoRA are merged into dense weights, so the
folder needs neither PEFT nor this toolkit. Before the folder is published, the exported model is run
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

from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.atomic import fsync_tree, named_errors, replace_dir, staging_dir, write_json
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import FORMAT as EXPORT_FORMAT
from ciders_edge.formats.export_folder import FORMATS, MANIFEST, QUANTIZATIONS, Export, export_manifest
from ciders_edge.inference.personalize import load_personalized, merge_messenger, resolve_backbone
from export.check import all_logits, check_inputs, compare_logits
from export.onnx import save_onnx

__all__ = ["export_model"]

Stage = Callable[[str], AbstractContextManager]


def export_model(
    bundle: str | Path,
    state: str | Path | None,
    fmt: str,
    out: str | Path,
    quantize: str = "none",
    use_global: bool = False,
    stage: Stage = lambda _: nullcontext(),
    backbone: str | None = None,
    base_model: str | Path | None = None,
) -> dict:
    """Write the export folder ``out`` atomically and return a summary (sizes, agreement, source).

    ``backbone``: ``emu`` (the AdapEmu) or ``full`` (AdapFu); default, what the bundle deploys."""
    out = Path(out)
    _check_args(fmt, quantize, out)
    start = time.perf_counter()
    with stage("loading the bundle and the personalized messenger"):
        b = Bundle.load(bundle)
        backbone = resolve_backbone(b, backbone)
        edge, source = load_personalized(b, state, use_global, torch.float32, backbone, base_model)
        inputs = check_inputs(edge.tokenizer)
        reference = all_logits(edge.model, inputs)  # the unmerged model, LoRA live
        model, tokenizer = merge_messenger(edge), edge.tokenizer
        del edge  # the merged model is all that is left of it
    with named_errors(out):
        staging = staging_dir(out)
    try:
        with named_errors(out), stage(f"writing the {fmt} model" + (f" ({quantize})" if quantize != "none" else "")):
            if fmt == "hf":
                model.save_pretrained(staging, safe_serialization=True)
                tokenizer.save_pretrained(staging)
            else:
                save_onnx(model, tokenizer, staging, quantize)
        del model
        manifest = export_manifest(staging, fmt, quantize, source.to_dict())
        with stage(f"checking the export against the unmerged {'AdapFu' if backbone == 'full' else 'AdapEmu'}"):
            check = compare_logits(inputs, reference, all_logits(Export(staging, manifest).load_model(), inputs))
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


def _check_args(fmt: str, quantize: str, out: Path) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if fmt == "hf" and quantize != "none":
        raise ConfigError("--quantize applies to --format onnx only")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: is a file; --out must be a folder")
    if out.exists() and any(out.iterdir()) and not _is_export(out):
        raise ExportError(f"{out}: exists and is not an export folder; refusing to replace it (choose another --out)")


def _is_export(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
