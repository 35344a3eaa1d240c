"""Exported model folders: a personalized model as plain Hugging Face files, ONNX or GGUF, with a manifest.

The folder is what a user deploys: ``hf`` loads in plain ``AutoModelForCausalLM.from_pretrained``,
``onnx`` in optimum's ``ORTModelForCausalLM``, ``genai`` in ONNX Runtime GenAI (``og.Model``), whose
own decode loop is the fast on-device runtime (:mod:`ciders_edge.inference.genai`), ``gguf`` in
llama.cpp and ollama (a LoRA adapter for a base GGUF the manifest names by sha256, or one merged GGUF:
:meth:`Export.gguf_files`). ``manifest.json`` records where the model came from (bundle, client,
round) and the sha256 of every file; :meth:`Export.load` verifies them all.
Writing lives in the ``export`` package; the edge runtime only reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ciders_edge.errors import ExportError
from ciders_edge.formats.atomic import recover_dir
from ciders_edge.formats.bundle import producer_versions
from ciders_edge.formats.checksums import hash_folder, sha256_file, verify_files

__all__ = ["Export", "export_manifest", "FORMAT", "MANIFEST", "ONNX_FILE", "GENAI_CONFIG", "FORMATS", "QUANTIZATIONS"]

FORMAT = "ciders-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ONNX_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
FORMATS = ("hf", "onnx", "genai", "gguf", "peft")
QUANTIZATIONS = {
    "hf": ("none",),
    "onnx": ("none", "int8", "int8-dynamic"),
    "genai": ("none", "int8", "int4"),
    "gguf": ("none", "f16", "q8_0", "q4_0"),  # none: an adapter for an existing base GGUF
    "peft": ("none",),  # a LoRA adapter of the base model, in fp32
}
GGUF_KINDS = ("adapter", "merged")


def export_manifest(folder: Path, fmt: str, quantize: str, source: dict, extra: dict | None = None) -> dict:
    """The manifest of a fully written export folder (every file hashed)."""
    files = hash_folder(folder, exclude=MANIFEST)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_format": fmt,
        "quantize": quantize,
        "source": source,
        "producer": producer_versions(),
        **(extra or {}),
        "files": files,
    }


@dataclass
class Export:
    """A verified export folder."""

    path: Path
    manifest: dict

    @property
    def format(self) -> str:
        return self.manifest["model_format"]

    @property
    def quantize(self) -> str:
        return self.manifest["quantize"]

    @property
    def source(self) -> dict:
        return self.manifest["source"]

    @property
    def runtime(self) -> str:
        """The runtime name ``bench`` and ``infer`` report: torch, onnx, onnx-int8, genai-int8, ..."""
        if self.format == "hf":
            return "torch"
        if self.format == "gguf":  # the adapter on its base GGUF, or a merged model at its precision
            return "llamacpp-lora" if self.manifest["gguf"]["kind"] == "adapter" else f"llamacpp-{self.quantize}"
        return self.format if self.quantize == "none" else f"{self.format}-{self.quantize}"

    @classmethod
    def load(cls, path: str | Path) -> Export:
        path = Path(path)
        recover_dir(path)
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise ExportError(f"{path}: not an export folder (no {MANIFEST}); create one with `ciders-edge export`")
        try:
            m = json.loads(mpath.read_text())
        except json.JSONDecodeError as err:
            raise ExportError(f"{mpath}: corrupt manifest ({err.msg})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ExportError(f"{mpath}: not a CIDERS export manifest")
        if m.get("format_version") != FORMAT_VERSION:
            raise ExportError(f"{mpath}: export format version {m.get('format_version')} is not supported")
        missing = [k for k in ("model_format", "quantize", "source", "files") if k not in m]
        if missing or m["model_format"] not in FORMATS:
            raise ExportError(f"{mpath}: manifest lacks {missing or ['a known model_format']}")
        if m["quantize"] not in QUANTIZATIONS[m["model_format"]]:
            raise ExportError(f"{mpath}: unknown quantize {m['quantize']!r} for a {m['model_format']} export")
        if m["model_format"] == "gguf" and (
            not isinstance(m.get("gguf"), dict) or m["gguf"].get("kind") not in GGUF_KINDS
        ):
            raise ExportError(f"{mpath}: a gguf export's manifest lacks its gguf entry (kind {GGUF_KINDS})")
        verify_files(path, m["files"], ExportError, "export", advice="; export again")
        return cls(path, m)

    def gguf_files(self) -> tuple[Path, Path | None]:
        """``(model GGUF, adapter GGUF or None)`` for llama.cpp: a merged model, or the base GGUF the
        adapter was exported for (which may lie outside the folder: its sha256 is checked here)."""
        if self.format != "gguf":
            raise ExportError(f"{self.path}: a {self.format} export, not gguf")
        g = self.manifest["gguf"]
        if g["kind"] == "merged":
            return self.path / g["model"], None
        base = self.path / g["base"]["path"]  # relative: written beside the adapter; absolute: elsewhere
        if not base.is_file():
            raise ExportError(
                f"{base}: the base GGUF of {self.path} is missing ({g['base']['name']}, sha256 {g['base']['sha256']})"
            )
        if "model" not in g and sha256_file(base) != g["base"]["sha256"]:
            raise ExportError(f"{base}: sha256 differs from the base GGUF {self.path} was exported for; export again")
        return base, self.path / g["adapter"]
