"""The export ``infer`` runs when a user names neither a runtime nor an export: GenAI int8, made once.

From a bundle and a state, torch decodes through transformers' ``generate`` (15 tokens/s for
SmolLM2-135M on 2 cores); the same model exported for ONNX Runtime GenAI decodes in GenAI's own loop
at 92 tokens/s, 1.5x llama.cpp's Q8_0 (benchmarks/RESULTS.md), whether or not llama.cpp is installed.
So the fastest runtime installed is always GenAI: the first ``infer`` exports the model (int8, the
precision llama.cpp users run), later ones open the export at once. Each export is kept under
:func:`exports_root`, named by what it was made from (the bundle, the messenger's bytes, the
backbone), so a state that trains again gets a new one; the least recently used beyond :data:`KEEP`
are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.checksums import sha256_file
from ciders_edge.formats.client_state import BEST_FILE, CURRENT, PERSONALIZED_FILE
from ciders_edge.formats.export_folder import MANIFEST
from ciders_edge.inference.personalize import resolve_backbone
from ciders_edge.model.sources import ciders_home
from ciders_edge.progress import console
from export.api import Stage, export_model

__all__ = ["DEFAULT_FORMAT", "DEFAULT_QUANTIZE", "KEEP", "default_export", "exports_root"]

DEFAULT_FORMAT, DEFAULT_QUANTIZE = "genai", "int8"
KEEP = 4  # exports kept (a SmolLM2 AdapFu in int8 is about 260 MB)
KEY_VERSION = 1  # bump when an export made by an older toolkit should not be reused


def exports_root() -> Path:
    """``$CIDERS_EXPORTS``, or ``$CIDERS_HOME/exports``."""
    return Path(os.environ.get("CIDERS_EXPORTS") or ciders_home() / "exports").expanduser()


def default_export(
    bundle: str | Path,
    state: str | Path | None,
    messenger: str,
    backbone: str | None,
    base_model: str | Path | None,
    stage: Stage,
    rebuild: bool = False,
) -> tuple[Path, bool]:
    """The cached GenAI int8 export of this model, made now if missing (or ``rebuild``: it failed its
    check); ``(folder, made_now)``. An entry without its manifest (a deleted or half-removed one) is made again."""
    b = Bundle.load(bundle)
    backbone = resolve_backbone(b, backbone)
    folder = exports_root() / _key(b, state, messenger, backbone, base_model)
    if (folder / MANIFEST).is_file() and not rebuild:
        os.utime(folder)  # most recently used
        return folder, False
    if folder.exists():  # the cache's own entry, damaged: never a user's folder
        if not rebuild:
            console.print(f"[yellow]notice:[/] {folder}: a cached export without its {MANIFEST}; made again")
        shutil.rmtree(folder)
    export_model(b.path, state, DEFAULT_FORMAT, folder, DEFAULT_QUANTIZE, messenger, stage, backbone, base_model)
    _prune(folder)
    return folder, True


def _key(b: Bundle, state: str | Path | None, messenger: str, backbone: str, base_model) -> str:
    """A name for the model: what the export is made from, hashed (the best messenger by its file's
    digest: it changes when a round's validation chooses another)."""
    if messenger != "global" and state is not None:
        best = Path(state) / CURRENT / BEST_FILE
        chosen = best if messenger == "best" and best.is_file() else Path(state) / CURRENT / PERSONALIZED_FILE
        messenger = f"{messenger}:{_file_digest(chosen)}"
    what = {
        "v": KEY_VERSION,
        "bundle": b.bundle_id,
        "messenger": messenger,
        "backbone": backbone,
        "base_model": str(Path(base_model).resolve()) if base_model else None,
        "format": [DEFAULT_FORMAT, DEFAULT_QUANTIZE],
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return f"{DEFAULT_FORMAT}-{DEFAULT_QUANTIZE}-{backbone}-{digest}"


def _file_digest(path: Path) -> str:
    return sha256_file(path) if path.is_file() else "none"  # no messenger yet: open_runtime says so, with the path


def _prune(keep: Path) -> None:
    """Remove the least recently used exports beyond :data:`KEEP` (never ``keep``, just made)."""
    others = [p for p in keep.parent.iterdir() if p.is_dir() and p != keep and (p / MANIFEST).is_file()]
    for old in sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)[KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
