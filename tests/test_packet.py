import hashlib
import json
import struct

import pytest
import torch
import zstandard

from ciders_edge.errors import PacketError
from ciders_edge.packet import MAGIC, Packet


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
