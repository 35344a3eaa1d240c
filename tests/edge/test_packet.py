import hashlib
import io
import json
import random
import resource
import struct

import pytest
import torch
import zstandard
from forgery import forge, zeros_frame

from ciders_edge.errors import PacketError
from ciders_edge.formats.packet import MAGIC, Packet


def _packet(codec="fp32", **tensors):
    tensors = tensors or {"a": torch.tensor([1.0, -2.0])}
    return Packet("edge-7", 3, "ab" * 32, codec, 120, tensors, {"loss_last": 0.5})


def test_exact_bytes_of_a_small_packet():
    data = _packet().to_bytes()
    header = (
        b'{"auth":"sha256","bundle_id":"' + b"ab" * 32 + b'","client_id":"edge-7","codec":"fp32",'
        b'"metrics":{"loss_last":0.5},"num_examples":120,"round":3,'
        b'"tensors":[{"name":"a","scale":null,"shape":[2]}]}'
    )
    assert data[:8] == MAGIC == b"CIDERSPK"
    assert data[8:13] == b"\x01" + struct.pack("<I", len(header))
    assert data[13 : 13 + len(header)] == header
    (plen,) = struct.unpack_from("<Q", data, 13 + len(header))
    payload = data[21 + len(header) : 21 + len(header) + plen]
    assert zstandard.ZstdDecompressor().decompress(payload) == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"
    assert len(data) == 21 + len(header) + plen + 32
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()


@pytest.mark.parametrize(("codec", "tol"), [("fp32", 0.0), ("bf16", 2**-8), ("int8", 1 / 254)])
def test_round_trip_per_codec(codec, tol):
    torch.manual_seed(0)
    t = {"x.lora_A.weight": torch.randn(4, 64), "x.lora_B.weight": torch.randn(64, 4) * 1e-3}
    back = Packet.from_bytes(_packet(codec, **t).to_bytes())
    assert (back.client_id, back.round, back.codec, back.num_examples) == ("edge-7", 3, codec, 120)
    for k, v in t.items():
        err = (back.tensors[k] - v).abs().max() / v.abs().max()
        assert err <= tol + 1e-7, (k, float(err))
        assert back.tensors[k].dtype == torch.float32 and back.tensors[k].shape == v.shape


def test_lossy_codecs_are_smaller():
    t = {"w": torch.randn(256, 256)}
    sizes = {c: len(_packet(c, **t).to_bytes()) for c in ("fp32", "bf16", "int8")}
    assert sizes["int8"] < sizes["bf16"] < sizes["fp32"]
    assert sizes["int8"] < 0.3 * 256 * 256 * 4


def test_corruption_and_truncation_are_refused():
    data = bytearray(_packet().to_bytes())
    data[40] ^= 0x10
    with pytest.raises(PacketError, match="integrity check failed"):
        Packet.from_bytes(bytes(data), where="p.pkt")
    with pytest.raises(PacketError, match="integrity check failed"):
        Packet.from_bytes(_packet().to_bytes()[:-1])
    with pytest.raises(PacketError, match="not a CIDERS packet"):
        Packet.from_bytes(b"hello world" * 10)


def test_authentication_with_a_client_key():
    key = b"k" * 32
    data = _packet().to_bytes(key)
    assert Packet.from_bytes(data, key).client_id == "edge-7"
    with pytest.raises(PacketError, match="authentication tag failed"):
        Packet.from_bytes(data, b"x" * 32)
    with pytest.raises(PacketError, match="integrity check failed"):
        Packet.from_bytes(data)  # keyed packet, no key: the plain sha256 tag does not match


def test_non_finite_values_are_named():
    p = _packet(w=torch.tensor([1.0, float("nan")]))
    with pytest.raises(PacketError, match="tensor w has non-finite"):
        p.check_finite()


def test_save_and_load(tmp_path):
    p = _packet()
    n = p.save(tmp_path / "p.pkt")
    assert n == (tmp_path / "p.pkt").stat().st_size
    q = Packet.load(tmp_path / "p.pkt")
    assert torch.equal(q.tensors["a"], p.tensors["a"]) and q.metrics == {"loss_last": 0.5}
    with pytest.raises(PacketError, match="no such packet"):
        Packet.load(tmp_path / "missing.pkt")
    json.dumps(q.metrics)


def _header(**changes) -> dict:
    """The header of :func:`_packet`'s packet (one fp32 tensor ``a`` of shape [2]), with changes."""
    data = _packet().to_bytes()
    (hlen,) = struct.unpack_from("<I", data, 9)
    return json.loads(data[13 : 13 + hlen]) | changes


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_decompression_bomb_stops_at_the_size_the_header_implies():
    """1 GiB of zeros in a ~40 KB frame, for a header that declares 8 bytes: refused without
    decompressing more than 9 bytes; and a frame claiming 1 TiB in its header is refused up front."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as w:
        zeros = bytes(1 << 24)
        for _ in range(64):
            w.write(zeros)
    bomb = out.getvalue()
    assert len(bomb) < 200_000
    before = _peak_rss_mb()
    with pytest.raises(PacketError, match="decompresses to more than the 8 bytes"):
        Packet.from_bytes(forge(_header(), bomb), where="bomb.pkt")
    assert _peak_rss_mb() - before < 100
    huge = _header(tensors=[{"name": "a", "shape": [1 << 20, 1 << 20], "scale": None}])
    with pytest.raises(PacketError, match="claims 1099511627776 elements"):
        Packet.from_bytes(forge(huge, bomb))
    short = zstandard.ZstdCompressor().compress(b"\0" * 4)
    with pytest.raises(PacketError, match="4 bytes, not the 8 bytes"):
        Packet.from_bytes(forge(_header(), short))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "malformed packet header"),  # RecursionError in the JSON parser
        (b'{"round": 1e400}', "malformed packet header"),  # Infinity
        (b'{"round": NaN}', "malformed packet header"),
        (b'{"round": ' + b"9" * 5000 + b"}", "malformed packet header"),  # past int's digit limit
        (_header(client_id=5), "'client_id' must be a string"),
        (_header(round=1.5), "'round' must be an integer"),
        (_header(round=True), "'round' must be an integer"),
        (_header(round=-1), "out of range"),
        (_header(num_examples=10**12), "out of range"),
        (_header(num_examples=0), "out of range"),
        (_header(metrics=[1]), "'metrics' must be an object"),
        (_header(codec="fp64"), "unknown codec"),
        (_header(tensors=[{"name": "a", "shape": [-2], "scale": None}]), "bad shape"),
        (_header(tensors=[{"name": "a", "shape": [2.0], "scale": None}]), "bad shape"),
        (_header(tensors=[{"name": "a", "shape": "2"}]), "malformed tensor entry"),
        (_header(tensors=[{"name": "a", "shape": [1]}] * 2), "appears twice"),
        (_header(codec="int8", tensors=[{"name": "a", "shape": [2], "scale": -0.5}]), "no valid int8 scale"),
    ],
)
def test_every_header_field_is_type_checked(header, message):
    payload = zstandard.ZstdCompressor().compress(b"\0" * 8)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with pytest.raises(PacketError, match=message):
        Packet.from_bytes(forge(raw, payload), where="h.pkt")


def test_fuzzed_packets_fail_with_one_packet_error_and_bounded_memory():
    """Random bytes, and random bit flips, truncations and splices of a valid packet re-signed with a
    valid tag, so that the parser behind the tag check is reached: nothing but a PacketError escapes."""
    rng = random.Random(0)
    valid = _packet("int8", w=torch.randn(16, 8), b=torch.randn(8)).to_bytes()
    body = valid[:-32]
    before = _peak_rss_mb()
    for i in range(3000):
        kind = i % 4
        if kind == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        else:
            b = bytearray(body)
            if kind == 1:
                for _ in range(rng.randrange(1, 8)):
                    b[rng.randrange(8, len(b))] ^= 1 << rng.randrange(8)
            elif kind == 2:
                b = b[: rng.randrange(len(b))]
            else:
                at = rng.randrange(13, len(b))
                b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
            data = bytes(b) + hashlib.sha256(bytes(b)).digest()
        try:
            Packet.from_bytes(data)
        except PacketError:
            pass
    assert _peak_rss_mb() - before < 200  # memory, not time: a slow machine must not fail it


def test_a_header_is_checked_against_the_expected_tensors_before_decompressing(monkeypatch):
    """A receiver that knows what it expects refuses a header that declares anything else, naming the
    tensor, without decompressing a byte: here a 2 GiB tensor over a ~64 KB frame that really holds 2 GiB."""
    from ciders_edge.formats import packet as packet_module

    calls = []
    monkeypatch.setattr(packet_module, "_decompress", lambda *a: calls.append(a[1]) or pytest.fail("decompressed"))
    huge = forge(_header(tensors=[{"name": "a", "shape": [1 << 29], "scale": None}]), zeros_frame(2 << 30))
    assert len(huge) < 100_000 and Packet.read_header(huge, where="h.pkt").shapes == {"a": (1 << 29,)}
    cases = [
        ({"a": (2,)}, r"h.pkt: tensor a has shape \(536870912,\), expected \(2,\)"),
        ({"a": (1 << 29,), "b": (3,)}, r"h.pkt: tensor b is missing \(expected shape \(3,\)\)"),
        ({}, r"h.pkt: unexpected tensors \['a'\]"),
    ]
    for expected, message in cases:
        with pytest.raises(PacketError, match=message):
            Packet.from_bytes(huge, where="h.pkt", expected=expected)
    assert calls == []
    monkeypatch.undo()
    good = _packet().to_bytes()
    assert Packet.from_bytes(good, expected={"a": [2]}).tensors["a"].tolist() == [1.0, -2.0]
