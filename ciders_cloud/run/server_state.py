"""Server state (v, c, every c_i, backbone LoRA, TAKD optimizer, RNG, round), saved per round.

Written as one directory swapped in atomically, so a crash leaves the previous round whole. Its
file names are the run folder's (:mod:`ciders_cloud.run.folder`); ``state.json`` is the statedir's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ciders_cloud.run.folder import BACKBONE_LORA, CLIENT_CONSENSUS, CONSENSUS, MESSENGER_LORA, TAKD_OPTIMIZER
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.statedir import INT, OBJECT, STR, Field, list_of, load_state_dir, optional, save_state_dir

__all__ = ["ServerState", "AggregationModeError", "optimizer_to_tensors", "optimizer_from_tensors"]

FORMAT_VERSION = 1
FIELDS = {  # state.json, checked on load
    "round": INT,
    "takd_step": INT,
    "clients": list_of(STR),
    "rng": optional(OBJECT),
    "last_round_digests": optional(list_of(STR)),
    "last_summary": optional(Field("an object or null", lambda v: v is None or isinstance(v, dict))),
    "fleet_choice": optional(Field("an object or null", lambda v: v is None or isinstance(v, dict))),
    "summed": optional(
        Field(
            "an object of rounds",
            lambda v: isinstance(v, dict) and all(isinstance(r, int) and not isinstance(r, bool) for r in v.values()),
        )
    ),
}


class AggregationModeError(StateError, ConfigError):
    """A run's rounds so far were of the other kind (plain or secure) than the one asked for."""


@dataclass
class ServerState:
    """The cloud's view of the federation after ``round`` completed rounds."""

    round: int
    messenger: dict[str, torch.Tensor]  # v, the global messenger LoRA
    backbone: dict[str, torch.Tensor]  # learnable-backbone LoRA (TAKD)
    consensus: dict[str, torch.Tensor]  # c
    clients: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # c_i by client id
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)  # TAKD AdamW moments
    takd_step: int = 0
    rng: dict = field(default_factory=dict)  # torch/python RNG states, JSON-able
    last_round_digests: list[str] = field(default_factory=list)  # sha256 of the packets that made this state
    last_summary: dict = field(default_factory=dict)  # what that aggregation reported
    # secure aggregation: the last round whose secure sum held each client (the cloud holds no c_i then)
    summed: dict[str, int] = field(default_factory=dict)
    # the last round's validation summaries pooled (ciders_edge.training.fleet_evidence), for the next bundles
    fleet_choice: dict | None = None

    def check_mode(self, secure: bool, run_dir: str | Path) -> None:
        """A run stays plain (the cloud's c_i copies reconstruct each packet) or secure (the cloud holds no c_i):
        refuse the other kind, in one line, for ``aggregate`` and ``serve`` alike."""
        if secure and self.clients:
            raise AggregationModeError(
                f"{run_dir}: this run's earlier rounds were aggregated in the clear, and the cloud's copies of c_i "
                "would go stale under secure aggregation; serve it without --secure-aggregation"
            )
        if not secure and self.summed:
            raise AggregationModeError(
                f"{run_dir}: this run's rounds were securely aggregated, so the cloud holds no c_i to reconstruct a "
                "Δc packet with; go on with `ciders-cloud serve --secure-aggregation`"
            )

    def save(self, path: str | Path) -> None:
        flat = {f"{cid}/{k}": v for cid, st in self.clients.items() for k, v in st.items()}
        tensors = {
            MESSENGER_LORA: self.messenger,
            BACKBONE_LORA: self.backbone,
            CONSENSUS: self.consensus,
            CLIENT_CONSENSUS: flat,
            TAKD_OPTIMIZER: self.optimizer,
        }
        meta = {
            "format_version": FORMAT_VERSION,
            "round": self.round,
            "takd_step": self.takd_step,
            "clients": sorted(self.clients),
            "rng": self.rng,
            "last_round_digests": self.last_round_digests,
            "last_summary": self.last_summary,
            **({"summed": self.summed} if self.summed else {}),  # a plain run's state.json is as it was
            **({"fleet_choice": self.fleet_choice} if self.fleet_choice is not None else {}),
        }
        save_state_dir(Path(path), tensors, meta)

    @classmethod
    def load(cls, path: str | Path) -> ServerState:
        """The saved state; a missing file, a mistyped field or a stray client tensor is a StateError."""
        path = Path(path)
        names = (MESSENGER_LORA, BACKBONE_LORA, CONSENSUS, CLIENT_CONSENSUS, TAKD_OPTIMIZER)
        meta, tensors = load_state_dir(path, names, FORMAT_VERSION, "server state", FIELDS)
        return cls(
            meta["round"],
            tensors[MESSENGER_LORA],
            tensors[BACKBONE_LORA],
            tensors[CONSENSUS],
            _clients(meta["clients"], tensors[CLIENT_CONSENSUS], path / CLIENT_CONSENSUS),
            _optimizer(tensors[TAKD_OPTIMIZER], path / TAKD_OPTIMIZER),
            meta["takd_step"],
            meta.get("rng", {}),
            meta.get("last_round_digests", []),
            meta.get("last_summary", {}),
            meta.get("summed") or {},
            meta.get("fleet_choice"),
        )


def _clients(ids: list[str], flat: dict[str, torch.Tensor], where: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every c_i by client id from ``"{client}/{tensor}"`` keys; each client must be one state.json lists."""
    clients: dict[str, dict[str, torch.Tensor]] = {cid: {} for cid in ids}
    for key, v in flat.items():
        cid, sep, name = key.partition("/")
        if not sep or cid not in clients:
            raise StateError(f"{where}: server state corrupt (tensor {key!r} is not of a client state.json lists)")
        clients[cid][name] = v
    return clients


def _optimizer(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """TAKD's moments, keyed as :func:`optimizer_to_tensors` writes them (checked now, not at the next TAKD)."""
    for key in tensors:
        idx, sep, name = key.rpartition("/")[2].partition(".")  # "<backbone>/" first for a second backbone
        if not (sep and name and idx.isascii() and idx.isdigit()):
            raise StateError(f"{where}: server state corrupt (tensor {key!r} is not an optimizer moment)")
    return tensors


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter moments as ``"{index}.{name}"`` CPU tensors (no pickling; the optimizer
    may run on a GPU, the state file holds CPU tensors)."""
    out = {}
    for idx, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            out[f"{idx}.{name}"] = v.to("cpu") if torch.is_tensor(v) else torch.tensor(v)
    return out


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Restore moments saved by :func:`optimizer_to_tensors` into ``opt`` (same parameter order; torch
    moves each moment to its parameter's device)."""
    if not tensors:
        return
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    sd["state"] = state
    opt.load_state_dict(sd)
