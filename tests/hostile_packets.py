"""Packets a hostile client can send: any header and payload under a valid tag, and zstd frames that
decompress to far more than they weigh (shared by the packet and the aggregate tests)."""

import hashlib
import io
import json
import struct

import zstandard

from ciders_edge.formats.packet import MAGIC


def forge(header: dict | bytes, payload: bytes) -> bytes:
    """A packet with any header and payload and a *valid* tag: what a hostile client can send."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + struct.pack("<BI", 1, len(raw)) + raw + struct.pack("<Q", len(payload)) + payload
    return body + hashlib.sha256(body).digest()


def zeros_frame(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes: 2 GiB take about 64 KB."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as w:
        for i in range(0, n, 1 << 24):
            w.write(bytes(min(1 << 24, n - i)))
    return out.getvalue()
