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

from .atomic import write_bytes
from .errors import PacketError
from .update import Tensors

__all__ = ["Packet", "CODECS", "MAGIC"]

MAGIC = b"CIDERSPK"
FORMAT_VERSION = 1
CODECS = ("fp32", "bf16", "int8")
TAG_BYTES = 32
MAX_HEADER = 1 << 24
ZSTD_LEVEL = 10
_WIRE = {"fp32": "<f4", "bf16": "<i2", "int8": "i1"}


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
        """Parse and verify a packet; every failure is a :class:`PacketError` naming ``where``."""
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
        try:
            header = json.loads(body[start : start + hlen])
            (plen,) = struct.unpack_from("<Q", body, start + hlen)
            payload = zstandard.ZstdDecompressor().decompress(body[start + hlen + 8 :], max_output_size=1 << 34)
            tensors, offset = {}, 0
            for spec in header["tensors"]:
                n = math.prod(spec["shape"]) * np.dtype(_WIRE[header["codec"]]).itemsize
                tensors[spec["name"]] = _decode(payload[offset : offset + n], spec, header["codec"])
                offset += n
            packet = cls(
                header["client_id"],
                int(header["round"]),
                header["bundle_id"],
                header["codec"],
                int(header["num_examples"]),
                tensors,
                header.get("metrics", {}),
            )
        except (KeyError, TypeError, ValueError, zstandard.ZstdError) as err:
            raise PacketError(f"{where}: malformed packet ({type(err).__name__}: {err})") from None
        if header.get("auth") == "hmac-sha256" and key is None:
            raise PacketError(f"{where}: packet is authenticated but no client key was given to verify it")
        if offset != len(payload) or plen != len(body) - start - hlen - 8:
            raise PacketError(f"{where}: payload size does not match its header")
        return packet

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
            return str(json.loads(data[start : start + hlen])["client_id"])
        except (KeyError, TypeError, ValueError, struct.error):
            raise PacketError(f"{where}: not a CIDERS packet") from None

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
