"""Server state (v, c, every c_i, backbone LoRA, TAKD optimizer, RNG, round), saved per round.

Written as one directory swapped in atomically, so a crash leaves the previous round whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ciders_edge.statedir import load_state_dir, save_state_dir

__all__ = ["ServerState", "optimizer_to_tensors", "optimizer_from_tensors"]

MESSENGER = "messenger_lora.safetensors"
BACKBONE = "backbone_lora.safetensors"
CONSENSUS = "consensus.safetensors"
CLIENTS = "client_consensus.safetensors"
OPTIM = "takd_optimizer.safetensors"
FORMAT_VERSION = 1


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

    def save(self, path: str | Path) -> None:
        flat = {f"{cid}/{k}": v for cid, st in self.clients.items() for k, v in st.items()}
        tensors = {
            MESSENGER: self.messenger,
            BACKBONE: self.backbone,
            CONSENSUS: self.consensus,
            CLIENTS: flat,
            OPTIM: self.optimizer,
        }
        meta = {
            "format_version": FORMAT_VERSION,
            "round": self.round,
            "takd_step": self.takd_step,
            "clients": sorted(self.clients),
            "rng": self.rng,
            "last_round_digests": self.last_round_digests,
            "last_summary": self.last_summary,
        }
        save_state_dir(Path(path), tensors, meta)

    @classmethod
    def load(cls, path: str | Path) -> ServerState:
        names = (MESSENGER, BACKBONE, CONSENSUS, CLIENTS, OPTIM)
        meta, tensors = load_state_dir(Path(path), names, FORMAT_VERSION, "server state")
        clients: dict[str, dict[str, torch.Tensor]] = {cid: {} for cid in meta["clients"]}
        for key, v in tensors[CLIENTS].items():
            cid, name = key.split("/", 1)
            clients[cid][name] = v
        return cls(
            meta["round"],
            tensors[MESSENGER],
            tensors[BACKBONE],
            tensors[CONSENSUS],
            clients,
            tensors[OPTIM],
            meta["takd_step"],
            meta.get("rng", {}),
            meta.get("last_round_digests", []),
            meta.get("last_summary", {}),
        )


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter moments as ``"{index}.{name}"`` tensors (no pickling)."""
    out = {}
    for idx, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            out[f"{idx}.{name}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Restore moments saved by :func:`optimizer_to_tensors` into ``opt`` (same parameter order)."""
    if not tensors:
        return
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    sd["state"] = state
    opt.load_state_dict(sd)
