"""A state folder: named safetensors files plus ``state.json``, saved as one atomic directory swap.

Client state (edge) and server state (cloud) are both this; only their fields differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .atomic import recover_dir, replace_dir, staging_dir, write_json, write_safetensors
from .errors import StateError

__all__ = ["save_state_dir", "load_state_dir", "STATE_JSON"]

STATE_JSON = "state.json"


def save_state_dir(path: Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
    """Write ``tensors[name]`` to ``name`` and ``meta`` to ``state.json`` in a staging folder, then swap it in."""
    staging = staging_dir(path)
    try:
        for name, group in tensors.items():
            write_safetensors(staging / name, group)
        write_json(staging / STATE_JSON, meta)
        replace_dir(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_state_dir(path: Path, names: tuple[str, ...], version: int, what: str) -> tuple[dict, dict[str, dict]]:
    """Read a folder written by :func:`save_state_dir`; any damage is a one-line :class:`StateError`."""
    recover_dir(path)
    try:
        meta = json.loads((path / STATE_JSON).read_text())
        tensors = {name: load_file(path / name) for name in names}
    except FileNotFoundError as err:
        raise StateError(f"{path}: {what} incomplete ({Path(err.filename).name} missing)") from None
    except (json.JSONDecodeError, OSError, ValueError, SafetensorError) as err:
        raise StateError(f"{path}: {what} corrupt ({err})") from None
    if meta.get("format_version") != version:
        raise StateError(f"{path}: {what} format {meta.get('format_version')} is not supported")
    return meta, tensors
