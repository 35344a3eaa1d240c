"""A state folder: named safetensors files plus ``state.json``, saved as one atomic directory swap.

Client state (edge) and server state (cloud) are both this; only their fields differ. Loading checks
that every file is there and every field has its type, so damage is one line naming the file and
field, never a traceback later.
"""

from __future__ import annotations

import json
import reprlib
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ciders_edge.config import check_value
from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import recover_dir, replace_dir, staging_dir, write_json, write_safetensors
from ciders_edge.formats.checksums import sha256_file

__all__ = [
    "save_state_dir",
    "load_state_dir",
    "check_fields",
    "Field",
    "INT",
    "STR",
    "OBJECT",
    "list_of",
    "optional",
    "STATE_JSON",
]

STATE_JSON = "state.json"
CHECKSUMS = "sha256"  # state.json's digests of the tensor files


@dataclass(frozen=True)
class Field:
    """What a ``state.json`` field must hold: ``kind`` says it in words, ``check`` tests a value."""

    kind: str
    check: Callable[[object], bool]
    required: bool = True


INT = Field("an integer", lambda v: check_value(v, int))
STR = Field("a string", lambda v: isinstance(v, str))
OBJECT = Field("an object", lambda v: isinstance(v, dict))


def list_of(item: Field) -> Field:
    return Field(f"a list, each item {item.kind}", lambda v: isinstance(v, list) and all(item.check(x) for x in v))


def optional(f: Field) -> Field:
    return replace(f, required=False)


def save_state_dir(path: Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
    """Write ``tensors[name]`` to ``name`` and ``meta`` to ``state.json`` in a staging folder, then swap it in."""
    staging = staging_dir(path)
    try:
        for name, group in tensors.items():
            write_safetensors(staging / name, group)
        checksums = {name: sha256_file(staging / name) for name in tensors}
        write_json(staging / STATE_JSON, {**meta, CHECKSUMS: checksums})
        replace_dir(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_state_dir(
    path: Path, names: tuple[str, ...], version: int, what: str, fields: Mapping[str, Field] | None = None
) -> tuple[dict, dict[str, dict]]:
    """Read a folder written by :func:`save_state_dir`; any damage is a one-line :class:`StateError`.

    ``fields`` are checked in ``state.json`` beside ``format_version``."""
    recover_dir(path)
    for name in (STATE_JSON, *names):
        if not (path / name).is_file():  # safetensors' own error for a missing file names no file
            raise StateError(f"{path}: {what} incomplete ({name} missing)")
    meta = _read(path / STATE_JSON, what, lambda f: json.loads(f.read_bytes()))
    tensors = {name: _read(path / name, what, load_file) for name in names}
    if not isinstance(meta, dict):
        raise StateError(f"{path / STATE_JSON}: {what} corrupt (not a JSON object)")
    if meta.get("format_version") != version or not check_value(meta["format_version"], int):
        raise StateError(f"{path}: {what} format {reprlib.repr(meta.get('format_version'))} is not supported")
    check_fields(meta, {**(fields or {}), CHECKSUMS: optional(OBJECT)}, path / STATE_JSON, what)
    _verify(path, meta.get(CHECKSUMS), names, what)
    return meta, tensors


def _verify(path: Path, checksums: dict | None, names: tuple[str, ...], what: str) -> None:
    """Each tensor file against the SHA-256 saved with it (states saved before checksums have none):
    a flipped bit in c_i would otherwise skew every later round without a word."""
    for name in names if checksums is not None else ():
        if checksums.get(name) != sha256_file(path / name):
            raise StateError(f"{path / name}: {what} fails its checksum (damaged or edited); restore the folder")


def _read(f: Path, what: str, read: Callable[[Path], object]) -> Any:
    """``read(f)``, with any damage a StateError naming ``f``."""
    try:
        return read(f)
    except (OSError, ValueError, RecursionError, SafetensorError) as err:
        raise StateError(f"{f}: {what} corrupt ({err})") from None


def check_fields(meta: dict, fields: Mapping[str, Field], where: Path, what: str) -> None:
    """Raise a :class:`StateError` naming the first field of ``fields`` that is missing or mistyped."""
    for name, f in fields.items():
        if name not in meta:
            if f.required:
                raise StateError(f"{where}: {what} lacks the field {name!r}")
        elif not f.check(meta[name]):
            raise StateError(f"{where}: {what} field {name!r} must be {f.kind}, got {reprlib.repr(meta[name])}")
