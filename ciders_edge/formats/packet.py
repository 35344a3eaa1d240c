"""Δc packets (docs/design.md §5): the only tensor payload an edge uploads.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard

from ciders_edge.errors import ConfigError, PacketError
from ciders_edge.formats.atomic import write_bytes
from ciders_edge.formats.packet_header import CODECS, PacketHeader, parse_header
from ciders_edge.tensors import Tensors, non_finite

__all__ = ["Packet", "PacketHeader", "CODECS", "MAGIC", "PROBE_KIND", "consensus_digest"]

MAGIC = b"CIDERSPK"
PROBE_KIND = "gradients"  # metrics["kind"] of a probe packet, a strategy's first exchange (a Δc packet has none)
FORMAT_VERSION = 1
TAG_BYTES = 32
MAX_HEADER = 1 << 24
ZSTD_LEVEL = 10
_WIRE = {"fp32": "<f4", "bf16": "<i2", "int8": "i1"}
MAX_PAYLOAD = 1 << 32  # 4 GiB decoded: far above any messenger LoRA, far below a bomb
Expected = Mapping[str, Sequence[int]]  # tensor name: shape


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
    def from_bytes(
        cls, data: bytes, key: bytes | None = None, where: str = "packet", expected: Expected | None = None
    ) -> Packet:
        """Parse and verify a packet; every failure is a :class:`PacketError` naming ``where``.

        :meth:`read_header`, then :meth:`from_header`: with ``expected`` (tensor name: shape), a header
        that declares anything else is refused before the payload is decompressed.
        """
        return cls.from_header(cls.read_header(data, key, where), expected)

    @staticmethod
    def read_header(data: bytes, key: bytes | None = None, where: str = "packet") -> PacketHeader:
        """The tag checked, then the header type-checked; the payload is left compressed."""
        if len(data) < len(MAGIC) + 5 + 8 + TAG_BYTES or data[: len(MAGIC)] != MAGIC:
            raise PacketError(f"{where}: not a CIDERS packet")
        version, hlen = struct.unpack_from("<BI", data, len(MAGIC))
        if version != FORMAT_VERSION:
            raise PacketError(f"{where}: packet format version {version} is not supported (expected {FORMAT_VERSION})")
        view = memoryview(data)
        body, tag = view[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(body, key)):
            what = "authentication tag" if key else "integrity check"
            raise PacketError(f"{where}: {what} failed (corrupt, truncated, or signed with another key)")
        start = len(MAGIC) + 5
        if hlen > MAX_HEADER or start + hlen + 8 > len(body):
            raise PacketError(f"{where}: header length {hlen} is out of bounds")
        h = parse_header(bytes(body[start : start + hlen]), where)
        if h["auth"] == "hmac-sha256" and key is None:
            raise PacketError(f"{where}: packet is authenticated but no client key was given to verify it")
        (plen,) = struct.unpack_from("<Q", body, start + hlen)
        if plen != len(body) - start - hlen - 8:
            raise PacketError(f"{where}: payload size does not match its header")
        fields = [h["client_id"], h["round"], h["bundle_id"], h["codec"], h["num_examples"], h["metrics"]]
        return PacketHeader(*fields, tuple(h["tensors"]), h["auth"], where, body[start + hlen + 8 :])

    @classmethod
    def from_header(cls, header: PacketHeader, expected: Expected | None = None) -> Packet:
        """Decode the payload of a verified header: to exactly ``expected``'s names and shapes when
        given (checked first), and never to more bytes than the header declares."""
        if expected is not None:
            header.check_tensors(expected)
        itemsize = np.dtype(_WIRE[header.codec]).itemsize
        sizes = [math.prod(spec["shape"]) * itemsize for spec in header.specs]
        payload = _decompress(header.frame, sum(sizes), header.where)
        tensors, offset = {}, 0
        for spec, n in zip(header.specs, sizes, strict=True):
            tensors[spec["name"]] = _decode(payload[offset : offset + n], spec, header.codec)
            offset += n
        h = header
        return cls(h.client_id, h.round, h.bundle_id, h.codec, h.num_examples, tensors, h.metrics)

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
        if (name := non_finite(self.tensors)) is not None:
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


def _decompress(frame: bytes | memoryview, expected: int, where: str) -> memoryview:
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
    return memoryview(out)  # no copy: the tensors are decoded from it


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


def _decode(buf: bytes | memoryview, spec: dict, codec: str) -> torch.Tensor:
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
