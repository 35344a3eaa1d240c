"""Client state under ``--state DIR``: c_i, the personalized messenger, round, counters, RNG.

Saved as one directory swapped in atomically: a crash mid-training leaves the previous state whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .atomic import replace_dir, write_json, write_safetensors
from .errors import StateError
from .update import Tensors

__all__ = ["ClientState", "METRICS_LOG"]

STATE_JSON = "state.json"
CONSENSUS = "consensus.safetensors"  # c_i
MESSENGER = "messenger.safetensors"  # x_K, the personalized messenger LoRA
RNG = "rng.safetensors"
METRICS_LOG = "metrics.jsonl"
FORMAT_VERSION = 1


@dataclass
class ClientState:
    """What an edge keeps between rounds. ``round`` is the last round it trained (-1: never)."""

    client_id: str
    model_revision: str  # content hash of the base model the run was prepared from
    kept_layers: list[int]
    round: int = -1
    bundle_id: str = ""  # the bundle the last round trained from
    c_i: Tensors = field(default_factory=dict)
    personalized: Tensors = field(default_factory=dict)
    counters: dict = field(default_factory=lambda: {"rounds": 0, "steps": 0, "examples_seen": 0})
    rng: torch.Tensor | None = None  # torch CPU generator state

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".state.", dir=path))
        try:
            write_safetensors(staging / CONSENSUS, self.c_i)
            write_safetensors(staging / MESSENGER, self.personalized)
            write_safetensors(staging / RNG, {"torch": self.rng} if self.rng is not None else {})
            write_json(
                staging / STATE_JSON,
                {
                    "format_version": FORMAT_VERSION,
                    "client_id": self.client_id,
                    "model_revision": self.model_revision,
                    "kept_layers": self.kept_layers,
                    "round": self.round,
                    "bundle_id": self.bundle_id,
                    "counters": self.counters,
                },
            )
            replace_dir(staging, path / "current")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @classmethod
    def load(cls, path: str | Path) -> ClientState | None:
        """The saved state, or ``None`` for a folder that holds none yet."""
        cur = Path(path) / "current"
        if not cur.exists():
            return None
        try:
            meta = json.loads((cur / STATE_JSON).read_text())
            rng = load_file(cur / RNG).get("torch")
            c_i, personalized = load_file(cur / CONSENSUS), load_file(cur / MESSENGER)
        except FileNotFoundError as err:
            raise StateError(f"{cur}: client state incomplete ({Path(err.filename).name} missing)") from None
        except (json.JSONDecodeError, OSError, ValueError) as err:
            raise StateError(f"{cur}: client state corrupt ({err})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise StateError(f"{cur}: client state format {meta.get('format_version')} is not supported")
        return cls(
            meta["client_id"],
            meta["model_revision"],
            meta["kept_layers"],
            meta["round"],
            meta["bundle_id"],
            c_i,
            personalized,
            meta["counters"],
            rng,
        )
