"""Shipping a round's bundle over the network: only the files the edge lacks, verified on arrival.

The cloud compares the new bundle's manifest with the files the edge says it holds
(:func:`files_to_ship`); the edge rebuilds the bundle from its local copy plus the received files
and swaps it in only once every checksum in the manifest verifies (:func:`install_bundle`).
Round 0 ships everything; later rounds ship the messenger LoRA, consensus, backbone LoRA and
the manifest (hyperparameters), as ``Bundle.save`` already hard-links unchanged files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path, PurePosixPath

from ciders_edge.errors import BundleError
from ciders_edge.formats.atomic import replace_dir, staging_dir, write_bytes
from ciders_edge.formats.bundle import MANIFEST, Bundle

__all__ = ["held_files", "files_to_ship", "install_bundle"]


def held_files(path: Path) -> dict[str, str]:
    """``{relative path: sha256}`` as listed by the local bundle's manifest (empty when there is none).

    Not verified here: :func:`install_bundle` verifies every file it keeps."""
    try:
        return dict(json.loads((path / MANIFEST).read_bytes())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def files_to_ship(bundle: Bundle, held: dict[str, str]) -> list[str]:
    """The bundle's files whose content the edge does not hold."""
    return [rel for rel, digest in bundle.manifest["files"].items() if held.get(rel) != digest]


def install_bundle(target: Path, manifest_raw: bytes, files: dict[str, bytes]) -> Bundle:
    """Rebuild the bundle described by ``manifest_raw`` at ``target`` from ``files`` and the bundle
    already there, verify it whole, then swap it in. On a checksum failure the local copy is
    dropped, so the next round's sync asks for every file."""
    try:
        listed = json.loads(manifest_raw)["files"]
    except (ValueError, KeyError, TypeError):
        raise BundleError("the cloud sent a bundle manifest that cannot be read") from None
    held = held_files(target)
    staging = staging_dir(target)
    try:
        for rel, digest in listed.items():
            dst = staging / _safe(rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel in files:
                write_bytes(dst, files[rel])
            elif held.get(rel) == digest:
                _link_held(target, rel, dst)
            else:
                raise BundleError(f"{rel}: neither sent by the cloud nor held in {target}")
        write_bytes(staging / MANIFEST, manifest_raw)
        try:
            bundle = Bundle.load(staging)
        except BundleError:
            shutil.rmtree(target, ignore_errors=True)
            raise
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Bundle(target, bundle.manifest, bundle.bundle_id)


def _link_held(target: Path, rel: str, dst: Path) -> None:
    try:
        os.link(target / rel, dst)
    except OSError as err:  # listed by the local manifest but gone: the copy cannot be trusted
        shutil.rmtree(target, ignore_errors=True)
        raise BundleError(f"{target / rel}: held file unreadable ({err.strerror}); the next round ships all") from None


def _safe(rel: str) -> PurePosixPath:
    """A manifest path must stay inside the bundle folder."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise BundleError(f"bundle manifest names an unsafe path {rel!r}")
    return p
