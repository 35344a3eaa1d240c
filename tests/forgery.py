"""What a hostile client or an attacker who can write a bundle folder makes: packets with any header and a
valid tag, zstd frames that decompress to gigabytes, bundles re-signed after a change. Shared by the
packet, intake, aggregation and soak tests."""

import hashlib
import io
import json
import struct

import zstandard

from ciders_edge.formats.bundle import MANIFEST
from ciders_edge.formats.packet import MAGIC, Packet


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


def claiming_2gib(packet_file: str, out, frame: bytes | None = None) -> tuple[str, str]:
    """``packet_file`` re-signed with a header that declares its first tensor as 2 GiB of fp32, over
    ``frame`` (default: ~64 KB that do decompress to 2 GiB; issue 27's probe took aggregate to 4.5 GB)."""
    data = open(packet_file, "rb").read()
    (hlen,) = struct.unpack_from("<I", data, 9)
    header = json.loads(data[13 : 13 + hlen])
    header["tensors"] = [{**header["tensors"][0], "shape": [1 << 29]}]
    out.write_bytes(forge(header, zeros_frame(2 << 30) if frame is None else frame))
    return str(out), header["tensors"][0]["name"]


def like(p: Packet, **changes) -> Packet:
    """``p`` with some fields changed (its metrics, which name the gamma and alpha, kept)."""
    fields = {"client_id": p.client_id, "round": p.round, "bundle_id": p.bundle_id, "codec": p.codec}
    fields |= {"num_examples": p.num_examples, "tensors": p.tensors, "metrics": p.metrics} | changes
    return Packet(**fields)


def resign(bundle) -> None:
    """Recompute every file's sha256 in the manifest, as an attacker who can write the folder would."""
    m = json.loads((bundle / MANIFEST).read_text())
    m["files"] = {rel: hashlib.sha256((bundle / rel).read_bytes()).hexdigest() for rel in m["files"]}
    (bundle / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
