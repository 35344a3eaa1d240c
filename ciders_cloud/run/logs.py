"""The run's TAKD and fidelity log (``distill.jsonl``), written before each state commit."""

from __future__ import annotations

import json
from pathlib import Path

from ciders_cloud.run.server_state import ServerState
from ciders_edge.formats.atomic import write_jsonl

__all__ = ["write_round_log"]


def write_round_log(path: Path, committed: ServerState, records: list[dict]) -> None:
    """Add ``records`` to the log *before* the state commit, replacing whatever an interrupted attempt
    left: a TAKD or fidelity record past ``committed``'s round or TAKD step is from an attempt that
    never committed. So a rerun after a kill logs each step exactly once."""
    logged = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    write_jsonl(path, [rec for rec in logged if _committed(rec, committed)] + records)


def _committed(rec: dict, state: ServerState) -> bool:
    step = {"takd": rec.get("step"), "fidelity": rec.get("takd_step")}.get(rec.get("type"))
    return step is None or (rec.get("round", 0) <= state.round and step <= state.takd_step)
