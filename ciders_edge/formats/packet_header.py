"""A Δc packet's header, read and checked before its payload is touched.

The header says which tensors a packet holds and their shapes; the payload is only their bytes. A
receiver that knows what it expects (the cloud knows the LoRA shapes of the layers each profile trains)
checks the header against that first, so a small packet that declares gigabytes is refused before one
byte of it is decompressed (:meth:`PacketHeader.check_tensors`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ciders_edge.errors import PacketError

__all__ = ["PacketHeader", "parse_header", "CODECS", "MAX_EXAMPLES", "MAX_ELEMENTS"]

CODECS = ("fp32", "bf16", "int8")
MAX_EXAMPLES = 1 << 24  # |D_i| beyond this is a lie: it would let one client outweigh the whole fleet
MAX_ELEMENTS = 1 << 31
_HEADER_FIELDS = {
    "client_id": str,
    "round": int,
    "bundle_id": str,
    "codec": str,
    "num_examples": int,
    "metrics": dict,
    "tensors": list,
    "auth": str,
}
_KIND_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "a list"}


@dataclass(frozen=True)
class PacketHeader:
    """A verified packet's header and its still-compressed payload (``frame``)."""

    client_id: str
    round: int
    bundle_id: str
    codec: str
    num_examples: int
    metrics: dict
    specs: tuple[dict, ...]  # {"name", "shape", "scale"} per tensor, in payload order
    auth: str
    where: str
    frame: bytes | memoryview

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {spec["name"]: tuple(spec["shape"]) for spec in self.specs}

    def check_tensors(self, expected: Mapping[str, Sequence[int]]) -> None:
        """Refuse, naming the tensor, a header whose names and shapes are not exactly ``expected``:
        the receiver's own idea of the payload, so what it then decompresses is no more than that."""
        shapes = self.shapes
        for name, want in expected.items():
            got = shapes.get(name)
            if got is None:
                raise PacketError(f"{self.where}: tensor {name} is missing (expected shape {tuple(want)})")
            if got != tuple(want):
                raise PacketError(f"{self.where}: tensor {name} has shape {got}, expected {tuple(want)}")
        extra = sorted(set(shapes) - set(expected))
        if extra:
            raise PacketError(f"{self.where}: unexpected tensors {extra[:2]} (shape {shapes[extra[0]]})")


def parse_header(raw: bytes, where: str) -> dict:
    """The header as a dict whose every field has the type and range the format says."""
    try:
        header = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError, MemoryError, OverflowError) as err:
        raise PacketError(f"{where}: malformed packet header ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise PacketError(f"{where}: malformed packet header (not a JSON object)")
    for name, kind in _HEADER_FIELDS.items():
        value = header.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PacketError(f"{where}: header field {name!r} must be {_KIND_NAMES[kind]}, got {value!r:.60}")
    if header["codec"] not in CODECS or header["auth"] not in ("sha256", "hmac-sha256"):
        raise PacketError(f"{where}: unknown codec {header['codec']!r:.20} or auth {header['auth']!r:.20}")
    if not 0 <= header["round"] < 1 << 31 or not 0 < header["num_examples"] <= MAX_EXAMPLES:
        raise PacketError(
            f"{where}: round {header['round']} or num_examples {header['num_examples']} out of range "
            f"(num_examples 1..{MAX_EXAMPLES})"
        )
    names = set()
    for spec in header["tensors"]:
        _check_spec(spec, header["codec"], where)
        if spec["name"] in names:
            raise PacketError(f"{where}: tensor {spec['name']!r} appears twice")
        names.add(spec["name"])
    return header


def _check_spec(spec: object, codec: str, where: str) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("shape"), list):
        raise PacketError(f"{where}: malformed tensor entry {spec!r:.80}")
    shape = spec["shape"]
    if len(shape) > 8 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape):
        raise PacketError(f"{where}: tensor {spec['name']!r:.60} has a bad shape {shape!r:.60}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise PacketError(f"{where}: tensor {spec['name']!r:.60} claims {math.prod(shape)} elements")
    scale = spec.get("scale")
    if codec == "int8" and not (isinstance(scale, float | int) and math.isfinite(scale) and scale > 0):
        raise PacketError(f"{where}: tensor {spec['name']!r:.60} has no valid int8 scale")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value
