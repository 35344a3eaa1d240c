"""A run's learnable backbones: one per distinct drop ratio among its profiles.

Each backbone has its own strided layers, bootstrap-aligned layers, TAKD LoRA and TAKD optimizer;
all share the teacher, the public data, the TAKD step count and the global messenger. A run keeps
them in the files a one-backbone run has: the reference backbone's (the run's ``drop_ratio``) tensors
under their own names, another's as ``"<backbone>/<name>"``, so a one-backbone run's files are
exactly what they were before there could be several.
"""

from __future__ import annotations

from ciders_cloud.run.config import RunConfig
from ciders_edge.errors import StateError
from ciders_edge.tensors import Tensors

__all__ = ["pack", "unpack", "backbone_part", "tagged", "label"]


def pack(parts: dict[str, Tensors], reference: str) -> Tensors:
    """One flat dict of every backbone's tensors: the reference's unprefixed, the others' prefixed."""
    return {(k if name == reference else f"{name}/{k}"): t for name, part in parts.items() for k, t in part.items()}


def unpack(flat: Tensors, names: list[str], reference: str, where: str = "") -> dict[str, Tensors]:
    """The inverse of :func:`pack` for the backbones ``names``; a prefix of no such backbone is a StateError."""
    parts: dict[str, Tensors] = {name: {} for name in names}
    for key, t in flat.items():
        name, sep, rest = key.partition("/")
        if not sep:
            name, rest = reference, key
        if name not in parts:
            raise StateError(f"{where}: tensor {key!r} is of backbone {name!r}, which this run does not have")
        parts[name][rest] = t
    return parts


def backbone_part(run: RunConfig, flat: Tensors, name: str) -> Tensors:
    """Backbone ``name``'s tensors of a server-state file holding every backbone's (LoRA, TAKD moments)."""
    return unpack(flat, run.backbone_names, run.backbone_names[0], "server state")[name]


def tagged(run: RunConfig, name: str, records: list[dict]) -> list[dict]:
    """``records`` with their backbone's name when the run has several."""
    return records if len(run.drop_ratios) == 1 else [{**r, "backbone": name} for r in records]


def label(run: RunConfig, name: str, text: str) -> str:
    """A progress bar's ``text``, naming the backbone when the run has several."""
    return text if len(run.drop_ratios) == 1 else f"{text} ({name})"
