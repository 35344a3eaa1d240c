"""sha256 manifests of folders: what bundles and export folders both record and verify.

A manifest is data from elsewhere: every path it lists must be a plain relative path that stays
inside the folder, and every digest a sha256, before any file is opened.
"""

from __future__ import annotations

import hashlib
import re
import reprlib
from pathlib import Path

from ciders_edge.errors import CidersError

__all__ = ["sha256_file", "hash_folder", "verify_files", "check_relpath"]

SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_folder(folder: Path, exclude: str) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` but ``exclude`` (its manifest)."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != exclude]
    return {str(p.relative_to(folder)): sha256_file(p) for p in paths}


def check_relpath(rel: object, error: type[CidersError], where: str) -> str:
    """``rel`` if it is a plain relative POSIX path (no absolute path, ``..``, ``.``, empty part,
    backslash or control character), else ``error``: a manifest must not reach outside its folder."""
    plain = isinstance(rel, str) and "\\" not in rel and rel.isprintable()
    if not plain or any(p in ("", ".", "..") for p in rel.split("/")):
        raise error(f"{where} lists an unsafe path {reprlib.repr(rel)} (not a plain relative path)")
    return rel


def verify_files(folder: Path, files: dict[str, str], error: type[CidersError], what: str, advice: str = "") -> None:
    """Raise ``error`` naming the first file of ``files`` that is unsafe, missing or differs from its sha256."""
    where = f"{folder}: the {what}'s manifest"
    if not isinstance(files, dict):
        raise error(f"{where} has no `files` object")
    root = folder.resolve()
    for rel, digest in files.items():
        f = folder / check_relpath(rel, error, where)
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise error(f"{where} has no sha256 for {rel!r} (got {reprlib.repr(digest)})")
        problem = _file_problem(f, root, digest, what, advice)
        if problem:
            raise error(f"{f}: {problem}")


def _file_problem(f: Path, root: Path, digest: str, what: str, advice: str) -> str | None:
    """Why ``f`` does not verify, or None. A link that leads out of the folder does not count as in it."""
    try:
        if not f.is_file():
            return f"missing from the {what}"
        if not f.resolve().is_relative_to(root):
            return f"a link out of the {what}; refusing it"
        if sha256_file(f) != digest:
            return f"checksum mismatch (the file is corrupt or was changed){advice}"
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    return None
