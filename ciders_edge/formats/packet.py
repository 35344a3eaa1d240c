"""Δc packets (DESIGN §3): the only tensor payload an edge uploads.

Layout (little-endian)::

    b"CIDERSPK" | u8 format_version | u32 header_len | header (JSON, UTF-8)
    | u64 payload_len | payload (zstd of the tensors, in header order) | 32-byte tag

The tag is SHA-256 of everything before it, or HMAC-SHA256 under the client's key when one is
configured. Codecs: ``fp32`` (lossless), ``bf16`` and ``int8`` (symmetric, one scale per tensor).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard

from ciders_edge.errors import ConfigError, PacketError
from ciders_edge.formats.atomic import write_bytes
from ciders_edge.tensors import Tensors

__all__ = ["Packet", "CODECS", "MAGIC", "consensus_digest"]

MAGIC = b"CIDERSPK"
FORMAT_VERSION = 1
CODECS = ("fp32", "bf16", "int8")
TAG_BYTES = 32
MAX_HEADER = 1 << 24
ZSTD_LEVEL = 10
_WIRE = {"fp32": "<f4", "bf16": "<i2", "int8": "i1"}
MAX_EXAMPLES = 1 << 24  # |D_i| beyond this is a lie: it would let one client outweigh the whole fleet
MAX_ELEMENTS = 1 << 31
MAX_PAYLOAD = 1 << 32  # 4 GiB decoded: far above any messenger LoRA, far below a bomb
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


@dataclass
class Packet:
    """One client's upload for one round. ``tensors`` hold the *decoded* values after a round trip."""

    client_id: str
    round: int
    bundle_id: str
    codec: str
    num_examples: int
    tensors: Tensors
    metrics: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise PacketError(f"unknown codec {self.codec!r}; use one of {', '.join(CODECS)}")

    @property
    def raw_bytes(self) -> int:
        """Size of the tensors as float32, the reference for the compression ratio."""
        return sum(t.numel() * 4 for t in self.tensors.values())

    def to_bytes(self, key: bytes | None = None) -> bytes:
        names = sorted(self.tensors)
        specs, chunks = [], []
        for name in names:
            data, scale = _encode(self.tensors[name], self.codec)
            specs.append({"name": name, "shape": list(self.tensors[name].shape), "scale": scale})
            chunks.append(data)
        header = {
            "client_id": self.client_id,
            "round": self.round,
            "bundle_id": self.bundle_id,
            "codec": self.codec,
            "num_examples": self.num_examples,
            "metrics": self.metrics,
            "tensors": specs,
            "auth": "hmac-sha256" if key else "sha256",
        }
        hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(chunks))
        body = (
            MAGIC + struct.pack("<BI", FORMAT_VERSION, len(hbytes)) + hbytes + struct.pack("<Q", len(payload)) + payload
        )
        return body + _tag(body, key)

    @classmethod
    def from_bytes(cls, data: bytes, key: bytes | None = None, where: str = "packet") -> Packet:
        """Parse and verify a packet; every failure is a :class:`PacketError` naming ``where``.

        The tag is checked first; the header is then type-checked, and the payload is decompressed to at
        most the size its shapes imply, so a small packet cannot claim gigabytes.
        """
        if len(data) < len(MAGIC) + 5 + 8 + TAG_BYTES or data[: len(MAGIC)] != MAGIC:
            raise PacketError(f"{where}: not a CIDERS packet")
        version, hlen = struct.unpack_from("<BI", data, len(MAGIC))
        if version != FORMAT_VERSION:
            raise PacketError(f"{where}: packet format version {version} is not supported (expected {FORMAT_VERSION})")
        body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(body, key)):
            what = "authentication tag" if key else "integrity check"
            raise PacketError(f"{where}: {what} failed (corrupt, truncated, or signed with another key)")
        start = len(MAGIC) + 5
        if hlen > MAX_HEADER or start + hlen + 8 > len(body):
            raise PacketError(f"{where}: header length {hlen} is out of bounds")
        header = _parse_header(body[start : start + hlen], where)
        if header["auth"] == "hmac-sha256" and key is None:
            raise PacketError(f"{where}: packet is authenticated but no client key was given to verify it")
        (plen,) = struct.unpack_from("<Q", body, start + hlen)
        if plen != len(body) - start - hlen - 8:
            raise PacketError(f"{where}: payload size does not match its header")
        itemsize = np.dtype(_WIRE[header["codec"]]).itemsize
        sizes = [math.prod(spec["shape"]) * itemsize for spec in header["tensors"]]
        payload = _decompress(body[start + hlen + 8 :], sum(sizes), where)
        tensors, offset = {}, 0
        for spec, n in zip(header["tensors"], sizes, strict=True):
            tensors[spec["name"]] = _decode(payload[offset : offset + n], spec, header["codec"])
            offset += n
        return cls(
            header["client_id"],
            header["round"],
            header["bundle_id"],
            header["codec"],
            header["num_examples"],
            tensors,
            header["metrics"],
        )

    @staticmethod
    def peek_client_id(data: bytes, where: str = "packet") -> str:
        """The sender named in the header, read *before* verification, to pick the key to verify with."""
        try:
            if data[: len(MAGIC)] != MAGIC:
                raise ValueError("bad magic")
            _, hlen = struct.unpack_from("<BI", data, len(MAGIC))
            start = len(MAGIC) + 5
            if hlen > MAX_HEADER:
                raise ValueError("header too long")
            client = json.loads(data[start : start + hlen])["client_id"]
        except (KeyError, TypeError, ValueError, struct.error, RecursionError, MemoryError):
            raise PacketError(f"{where}: not a CIDERS packet") from None
        if not isinstance(client, str):
            raise PacketError(f"{where}: header field 'client_id' must be a string, got {client!r:.60}")
        return client

    def save(self, path: str | Path, key: bytes | None = None) -> int:
        """Write atomically; returns the packet's size in bytes."""
        data = self.to_bytes(key)
        write_bytes(path, data)
        return len(data)

    @classmethod
    def load(cls, path: str | Path, key: bytes | None = None) -> Packet:
        path = Path(path)
        if not path.is_file():
            raise PacketError(f"{path}: no such packet file")
        return cls.from_bytes(path.read_bytes(), key, where=str(path))

    def check_finite(self, where: str = "packet") -> None:
        """Refuse NaN or Inf, naming the first bad tensor."""
        for name, t in self.tensors.items():
            if not torch.isfinite(t).all():
                raise PacketError(f"{where}: tensor {name} has non-finite values")


def consensus_digest(c_i: Tensors | None) -> str:
    """SHA-256 of a client's c_i (names, dtypes, shapes, bytes) that both ends compute bit-for-bit alike;
    ``""`` when there is none yet. A packet carries the digest of the c_i its edge started from, and the
    cloud compares it with its own copy before eq. (11) uses that copy: a lost, damaged or foreign edge
    state is caught instead of silently skewing the consensus. The fleet's sync uses it too."""
    if not c_i:
        return ""
    h = hashlib.sha256()
    for name in sorted(c_i):
        t = c_i[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _parse_header(raw: bytes, where: str) -> dict:
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


def _decompress(frame: bytes, expected: int, where: str) -> bytes:
    """Decompress at most ``expected + 1`` bytes: anything that is not exactly ``expected`` is refused
    without ever holding more than that in memory (a decompression bomb stops at the bound)."""
    if expected > MAX_PAYLOAD:
        raise PacketError(f"{where}: header claims {expected:,} payload bytes (at most {MAX_PAYLOAD:,})")
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            out = bytearray()
            while len(out) <= expected:
                chunk = reader.read(min(expected + 1 - len(out), 1 << 22))
                if not chunk:
                    break
                out += chunk
    except (zstandard.ZstdError, MemoryError) as err:
        raise PacketError(f"{where}: malformed packet payload ({type(err).__name__}: {err})") from None
    if len(out) != expected:
        more = "more than" if len(out) > expected else f"{len(out):,} bytes, not"
        raise PacketError(f"{where}: payload decompresses to {more} the {expected:,} bytes its header implies")
    return bytes(out)


def _tag(body: bytes, key: bytes | None) -> bytes:
    if key:
        return hmac.new(key, body, hashlib.sha256).digest()
    return hashlib.sha256(body).digest()


def _encode(t: torch.Tensor, codec: str) -> tuple[bytes, float | None]:
    t = t.detach().to("cpu", torch.float32).contiguous()
    if codec == "fp32":
        return t.numpy().astype("<f4").tobytes(), None
    if codec == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes(), None
    amax = float(t.abs().max()) if t.numel() else 0.0
    scale = float(np.float32(amax / 127.0)) if amax > 0 else 1.0
    q = torch.round(t / scale).clamp_(-127, 127).to(torch.int8)
    return q.numpy().tobytes(), scale


def _decode(buf: bytes, spec: dict, codec: str) -> torch.Tensor:
    shape = spec["shape"]
    arr = np.frombuffer(buf, dtype=_WIRE[codec]).reshape(shape)
    if codec == "fp32":
        return torch.from_numpy(arr.astype(np.float32))
    if codec == "bf16":
        return torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(arr.astype(np.float32)) * float(spec["scale"])


def read_key_file(path: Path) -> bytes:
    """A client key file: its bytes, stripped of surrounding whitespace; at least 16 bytes."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such key file")
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise ConfigError(f"{path}: a client key needs at least 16 bytes, got {len(key)}")
    return key
