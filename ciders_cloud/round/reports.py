"""What the edges say about their rounds: their ``train --json`` summaries, numbers and short strings only.

They are claims, not facts the cloud relies on: the fleet's log shows them, and the next bundles pool their
validation into the evidence for the deployed choice (:mod:`ciders_edge.training.fleet_evidence`), which
bounds what a false one can move. A malformed one is refused like a bad packet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ciders_edge.errors import PacketError

__all__ = ["MAX_REPORT", "edge_report", "read_reports"]

MAX_REPORT = 1 << 16  # bytes of an edge's summary JSON
_SCALARS = (str, int, float, bool, type(None))


def edge_report(raw: object, where: str = "the edge's summary") -> dict:
    """A JSON object of at most ``MAX_REPORT`` bytes, keeping only its scalar fields (finite numbers,
    strings up to 200 characters, 64 keys)."""
    if not isinstance(raw, str) or len(raw) > MAX_REPORT:
        raise PacketError(f"{where} is not a JSON text of at most {MAX_REPORT} bytes")
    try:
        report = json.loads(raw)
    except (ValueError, RecursionError):
        raise PacketError(f"{where} is not valid JSON") from None
    if not isinstance(report, dict):
        raise PacketError(f"{where} is not a JSON object")
    return {
        str(k)[:64]: v
        for k, v in list(report.items())[:64]
        if isinstance(v, _SCALARS)
        and not (isinstance(v, float) and not math.isfinite(v))
        and not (isinstance(v, str) and len(v) > 200)
    }


def read_reports(paths: list[Path]) -> dict[str, dict]:
    """``ciders-cloud aggregate --reports``: each file the last line of an edge's ``train --json``, by its
    ``client_id``; a file that is none, or a client named twice, is one line naming the file."""
    out: dict[str, dict] = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_REPORT + 1)
        except OSError as err:
            raise PacketError(f"{path}: unreadable report ({err.strerror or err})") from None
        lines = raw.decode("utf-8", errors="replace").strip().splitlines()
        report = edge_report(lines[-1] if lines else "", f"{path}: the report")
        client = report.get("client_id")
        if not isinstance(client, str):
            raise PacketError(f"{path}: the report names no client_id (the last line of `ciders-edge train --json`)")
        if client in out:
            raise PacketError(f"{path}: a second report of client {client!r}")
        out[client] = report
    return out
