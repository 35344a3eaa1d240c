"""What travels in a fleet round's Flower messages: record names, keys, and how bytes ride in them.

A round is two exchanges per edge:

1. ``query`` (sync): the cloud says who the node is and its copy of the node's c_i (as a digest);
   the edge settles its pending round against it and answers with its profile and the bundle
   files it holds.
2. ``train``: the cloud sends the round's bundle manifest and only the files the edge lacks; the
   edge rebuilds the bundle, verifies every checksum, trains, and answers with its Δc packet.

With ``serve --rechoose`` a closed round is followed by a sync and an ``evaluate`` exchange with every online
edge: the new bundle's files go down as in ``train``, the edge chooses its deployed messenger again on them
(``ciders-edge validate``) and answers with its scores in ``SUMMARY``.

Files and packets ride as Flower ``Array`` objects of raw bytes, which Flower streams in chunks. A secure
round (``serve --secure-aggregation``) replaces the train exchange by Flower's SecAgg+ stages
(:mod:`.secure`); its sync says ``summed_round`` instead of a c_i digest.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord

from ciders_edge.formats.packet import consensus_digest

__all__ = [
    "SYNC",
    "ROUND",
    "FILES",
    "PACKET",
    "SUMMARY",
    "consensus_digest",
    "bytes_record",
    "record_bytes",
    "summed_round",
]

SYNC = "ciders.sync"  # ConfigRecord, both ways
ROUND = "ciders.round"  # ConfigRecord: round, client id, c_i digest, bundle manifest
FILES = "ciders.files"  # ArrayRecord: bundle files the edge lacks, by relative path
PACKET = "ciders.packet"  # ArrayRecord: the Δc packet
SUMMARY = "ciders.summary"  # ConfigRecord: the edge's training summary (JSON)
RAW = "raw-bytes"  # our Array stype: ``data`` is the payload itself


def bytes_record(items: dict[str, bytes]) -> ArrayRecord:
    """Raw byte strings as an ``ArrayRecord`` (Flower chunks large arrays on the wire)."""
    return ArrayRecord({k: Array(dtype="uint8", shape=(len(v),), stype=RAW, data=v) for k, v in items.items()})


def record_bytes(record: ArrayRecord) -> dict[str, bytes]:
    return {k: bytes(a.data) for k, a in record.items()}


def summed_round(request) -> int | None:
    """A secure round's ``summed_round`` (the last round whose secure sum held this client; -1: none), or
    ``None`` for a plain round, whose cloud holds c_i."""
    return int(request["summed_round"]) if "summed_round" in request else None
