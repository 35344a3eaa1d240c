"""A round's first exchange, for a strategy that asks for one (:attr:`Strategy.needs_probe`): the edges'
gradient packets, checked as Δc packets are, turned by the strategy into what their training needs and
written beside the run (:meth:`RunFolder.probe_answer`). ``simulate`` calls it as a fleet would; the
server state does not change."""

from __future__ import annotations

from pathlib import Path

import torch

from ciders_cloud.models.device import cloud_device
from ciders_cloud.models.teacher import build_backbones
from ciders_cloud.round.intake import check_round, open_round, read_packets
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.strategies import CloudRound, strategy_for
from ciders_cloud.strategies.aggregation import participation_weights
from ciders_edge.errors import PacketError
from ciders_edge.formats.atomic import write_safetensors
from ciders_edge.formats.packet import PROBE_KIND

__all__ = ["aggregate_probes"]


def aggregate_probes(run_dir: Path, items: list[tuple[str, bytes]], device: str | torch.device = "cpu") -> dict:
    """The round's first exchange from the edges' gradient packets ``items``; the strategy's work (its
    Hessian products) runs on ``device``. Returns what it wrote and cost."""
    device = cloud_device(device)
    opened = open_round(run_dir, secure=False)
    run, state = opened.run, opened.state
    received = read_packets(items, opened.keys)
    if not received:
        raise PacketError(f"no probe packets given; {run.algorithm}'s first exchange needs at least one")
    for r in received:
        if r.header.metrics.get("kind") != PROBE_KIND:
            raise PacketError(f"{r.where}: not a probe packet ({run.algorithm}'s first exchange sends gradients)")
    hp = check_round(opened, received, expected={**state.messenger, **state.backbone})
    weights = participation_weights([r.packet.num_examples for r in received])
    cloud = CloudRound(run, state, hp, build_backbones(run, state, opened.aligned, device))
    strategy = strategy_for(run)
    h, report = strategy.aggregate_probes([r.packet.tensors for r in received], weights, cloud)
    path = RunFolder(run_dir).probe_answer(state.round, strategy.probe_answers)
    write_safetensors(path, h, {"round": str(state.round)})
    return {
        "round": state.round,
        "path": str(path),
        "bytes_up": {r.packet.client_id: r.size for r in received},
        "bytes_down": path.stat().st_size,
        **report,
    }
