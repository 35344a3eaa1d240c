"""Client state under ``--state DIR``: c_i, the personalized messenger, round, counters, RNG, and the
messenger the device deploys (the best its validation slice has scored, :mod:`ciders_edge.training.validation`).

Saved as one directory swapped in atomically: a crash mid-training leaves the previous state whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import recover_dir
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.statedir import INT, OBJECT, STR, Field, list_of, load_state_dir, optional, save_state_dir
from ciders_edge.tensors import Tensors

__all__ = ["ClientState", "METRICS_LOG", "BEST_FILE", "holds_choice"]

CURRENT = "current"
CONSENSUS = "consensus.safetensors"  # c_i
PERSONALIZED_FILE = "messenger.safetensors"  # x_K, the personalized messenger LoRA
RNG = "rng.safetensors"
BEST_FILE = "best.safetensors"  # the best deployable messenger seen so far (states before validation: none)
METRICS_LOG = "metrics.jsonl"
FORMAT_VERSION = 1
COUNTERS = ("rounds", "steps", "examples_seen")
FIELDS = {  # state.json, checked on load
    "client_id": STR,
    "model_revision": STR,
    "kept_layers": list_of(INT),
    "round": INT,
    "bundle_id": STR,
    "frozen_digest": optional(STR),
    "run_id": optional(STR),
    "counters": Field(
        "an object of integer " + ", ".join(COUNTERS),
        lambda v: isinstance(v, dict) and all(INT.check(v.get(k)) for k in COUNTERS),
    ),
    "best": optional(OBJECT),  # what BEST_FILE holds: messenger, alpha, round, its scores
    "validation": optional(OBJECT),  # the last round's validation scores
    "round_log": optional(list_of(OBJECT)),  # the last round's lines of METRICS_LOG, until they are there
}


@dataclass
class ClientState:
    """What an edge keeps between rounds. ``round`` is the last round it trained (-1: never)."""

    client_id: str
    model_revision: str  # content hash of the base model the run was prepared from
    kept_layers: list[int]
    round: int = -1
    bundle_id: str = ""  # the bundle the last round trained from
    frozen_digest: str = ""  # that bundle's frozen parts (Bundle.frozen_digest): what `personalized` runs on
    c_i: Tensors = field(default_factory=dict)
    personalized: Tensors = field(default_factory=dict)
    counters: dict = field(default_factory=lambda: {"rounds": 0, "steps": 0, "examples_seen": 0})
    rng: torch.Tensor | None = None  # torch CPU generator state
    run_id: str = ""  # the run (bundle manifest's run_id) this state's c_i belongs to
    best: Tensors = field(default_factory=dict)  # the best deployable messenger so far (empty: none scored)
    best_info: dict = field(default_factory=dict)  # which one it is and its score (validation.Choice.to_dict)
    validation: dict = field(default_factory=dict)  # the last round's scores on the validation slice
    round_log: list[dict] = field(default_factory=list)  # the last round's METRICS_LOG lines (train.sync_log)

    def check_run(self, bundle: Bundle) -> None:
        """Refuse a bundle of another run: this c_i is a share of that run's consensus, not this one's."""
        theirs = bundle.manifest.get("run_id", "")
        if self.run_id and theirs and self.run_id != theirs:
            raise StateError(
                f"this state belongs to run {self.run_id[:12]}, the bundle to run {theirs[:12]}; "
                "use this run's state folder, or a new --state (a new client)"
            )

    def check_model(self, bundle: Bundle) -> None:
        """Refuse a bundle of another base model or split: nothing of this state applies to it."""
        m = bundle.manifest
        model, revision, kept = m["base_model"]["id"], m["base_model"]["revision"], m["split"]["kept"]
        if self.model_revision != revision or self.kept_layers != kept:
            raise StateError(
                f"this state was made for another model or split (model {self.model_revision[:12]}, "
                f"{len(self.kept_layers)} kept layers); the bundle is {model} {revision[:12]} with {len(kept)} "
                "kept layers; use a new --state folder"
            )

    def save(self, path: str | Path) -> None:
        meta = {
            "format_version": FORMAT_VERSION,
            "client_id": self.client_id,
            "model_revision": self.model_revision,
            "kept_layers": self.kept_layers,
            "round": self.round,
            "bundle_id": self.bundle_id,
            "frozen_digest": self.frozen_digest,
            "counters": self.counters,
            "run_id": self.run_id,
            **({"best": self.best_info} if self.best else {}),
            **({"validation": self.validation} if self.validation else {}),
            **({"round_log": self.round_log} if self.round_log else {}),
        }
        rng = {"torch": self.rng} if self.rng is not None else {}
        files = {CONSENSUS: self.c_i, PERSONALIZED_FILE: self.personalized, RNG: rng}
        save_state_dir(Path(path) / CURRENT, {**files, **({BEST_FILE: self.best} if self.best else {})}, meta)

    @classmethod
    def load(cls, path: str | Path) -> ClientState | None:
        """The saved state, or ``None`` for a folder that holds none yet."""
        cur = Path(path) / CURRENT
        recover_dir(cur)
        if not cur.exists():
            return None
        names = (CONSENSUS, PERSONALIZED_FILE, RNG) + ((BEST_FILE,) if (cur / BEST_FILE).exists() else ())
        meta, t = load_state_dir(cur, names, FORMAT_VERSION, "client state", FIELDS)
        c_i, personalized, rng = t[CONSENSUS], t[PERSONALIZED_FILE], t[RNG].get("torch")
        if rng is not None and (rng.dtype != torch.uint8 or rng.dim() != 1):
            raise StateError(f"{cur / RNG}: client state corrupt (`torch` is not a generator state: {rng.dtype})")
        if ("best" in meta) != (BEST_FILE in t):
            raise StateError(f"{cur}: client state incomplete ({BEST_FILE} and state.json's `best` go together)")
        return cls(
            meta["client_id"],
            meta["model_revision"],
            meta["kept_layers"],
            meta["round"],
            meta["bundle_id"],
            meta.get("frozen_digest", ""),
            c_i,
            personalized,
            meta["counters"],
            rng,
            meta.get("run_id", ""),
            t.get(BEST_FILE, {}),
            meta.get("best", {}),
            meta.get("validation", {}),
            meta.get("round_log", []),
        )


def holds_choice(path: str | Path) -> bool:
    """Whether the state folder ``path`` holds a deployed choice (it validated), without loading its tensors."""
    return (Path(path) / CURRENT / BEST_FILE).is_file()
