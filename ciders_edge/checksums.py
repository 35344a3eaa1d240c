"""sha256 manifests of folders: what bundles and export folders both record and verify."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .errors import CidersError

__all__ = ["sha256_file", "hash_folder", "verify_files"]


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_folder(folder: Path, exclude: str) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` but ``exclude`` (its manifest)."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != exclude]
    return {str(p.relative_to(folder)): sha256_file(p) for p in paths}


def verify_files(folder: Path, files: dict[str, str], error: type[CidersError], what: str, advice: str = "") -> None:
    """Raise ``error`` naming the first file of ``files`` that is missing or differs from its sha256."""
    for rel, digest in files.items():
        f = folder / rel
        if not f.is_file():
            raise error(f"{f}: missing from the {what}")
        if sha256_file(f) != digest:
            raise error(f"{f}: checksum mismatch (the file is corrupt or was changed){advice}")
