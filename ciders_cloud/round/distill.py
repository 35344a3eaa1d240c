"""Eq. (13) on one learnable backbone in a round: T_L warm-started TAKD steps with the new messenger held
fixed, then the emulator's fidelity to AdapFu under that messenger; and what the distill log keeps of it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ciders_cloud.models.backbones import backbone_part, label, tagged
from ciders_cloud.models.fidelity import Fidelity, fidelity_record, measure_fidelity
from ciders_cloud.models.takd import Distiller, public_split
from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import PacketError
from ciders_edge.tensors import Tensors, non_finite

__all__ = ["Distilled", "distill_backbone", "takd_log", "check_finite"]


def check_finite(tensors: Tensors, what: str) -> None:
    if (name := non_finite(tensors)) is not None:
        raise PacketError(f"{what}: tensor {name} is not finite; nothing was written")


@dataclass
class Distilled:
    """One backbone's eq. (13) in a round: its TAKD records, moments and step count, what it cost, and
    the emulator's fidelity after it."""

    records: list[dict]
    optimizer: Tensors
    step: int
    fidelity: Fidelity | None
    seconds: float

    def summary(self) -> dict:
        return {
            "takd_steps": len(self.records),
            "takd_seconds": round(self.seconds, 3),
            "takd_last": self.records[-1] if self.records else None,
            "fidelity": self.fidelity.to_dict() if self.fidelity else None,
        }


def distill_backbone(
    models: CloudModels, v: Tensors, run: RunConfig, state: ServerState, steps: int, loss: TakdConfig
) -> Distilled:
    """Eq. (13) on one learnable backbone: T_L warm-started TAKD steps with the new messenger ``v`` held
    fixed (none for some baselines), then the emulator's fidelity to AdapFu under that messenger."""
    started = time.perf_counter()
    models.load_messenger(v)
    public, held = public_split(run, models.tokenizer)
    optimizer = backbone_part(run, state.optimizer, models.name)
    if not steps:
        return Distilled([], optimizer, state.takd_step, measure_fidelity(models, held), time.perf_counter() - started)
    distiller = Distiller(models, public, loss, optimizer, state.takd_step, run.seed)
    records = distiller.run(steps, round_=state.round, label=label(run, models.name, f"round {state.round} TAKD"))
    check_finite(models.backbone_state(), f"round {state.round}: backbone {models.name}'s LoRA after TAKD")
    fidelity = measure_fidelity(models, held)
    return Distilled(
        records, distiller.optimizer_state(), distiller.step_count, fidelity, time.perf_counter() - started
    )


def takd_log(run: RunConfig, state: ServerState, takd: dict[str, Distilled]) -> list[dict]:
    """The round's TAKD steps, then each backbone's fidelity as the next round starts."""
    steps = [rec for name, t in takd.items() for rec in tagged(run, name, t.records)]
    closing = [tagged(run, n, [fidelity_record(state.round + 1, t.step, t.fidelity)]) for n, t in takd.items()]
    return steps + [rec for recs in closing for rec in recs]
