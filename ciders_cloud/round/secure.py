"""A secure round (``serve --secure-aggregation``): Flower's SecAgg+ summed the displacements, so the cloud
sees only their mean, never one of them (docs/privacy.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ciders_cloud.models.device import cloud_device
from ciders_cloud.models.teacher import build_backbones
from ciders_cloud.privacy import PrivateRelease
from ciders_cloud.round.commit import commit_round
from ciders_cloud.round.intake import open_round
from ciders_cloud.strategies import round_hyperparams_for
from ciders_edge.errors import PacketError
from ciders_edge.tensors import Tensors, non_finite

__all__ = ["aggregate_secure"]


def aggregate_secure(
    run_dir: Path,
    mean: Tensors,
    clients: list[str],
    device: str | torch.device = "cpu",
    sampled: list[str] | None = None,
) -> dict:
    """A secure round (``serve --secure-aggregation``): eq. (12)–(13) from the mean of the displacements of
    ``clients``, which Flower's SecAgg+ summed without the cloud seeing one of them (docs/privacy.md).

    The cloud keeps no c_i: it notes for each client the round it was summed in (the edge commits that
    round on it). Under DP each edge clipped its own displacement (``dp.clip_on = "edge"``) and the noise
    goes on their sum here."""
    device = cloud_device(device)
    opened = open_round(run_dir, secure=True)
    run, state = opened.run, opened.state
    release = PrivateRelease.of(run)
    spent = release.check_budget(state.round) if release else None
    if release:
        release.check_sample(sampled, clients, state.round)
    if not clients and not release:
        raise PacketError(f"round {state.round}: the secure sum holds no client")
    if (name := non_finite(mean)) is not None:
        raise PacketError(f"round {state.round}: the secure sum's tensor {name} is not finite; nothing was written")
    hp = round_hyperparams_for(run, state.round)
    privacy = None
    if release:  # each edge clipped to C; the sum is the survivors' mean times their count
        mean, privacy = release.mechanism.release({k: t * len(clients) for k, t in mean.items()}, state.messenger)
        privacy = {**privacy, **spent.to_dict()}
    backbones = build_backbones(run, state, opened.aligned, device)
    weights = release.weights(len(clients)) if release else [1.0 / len(clients)] * len(clients)
    round_ = {"clients": list(clients), "weights": weights, "secure": True}
    closing = {"dropped": {}, **({"privacy": privacy} if privacy is not None else {})}
    summed = {**state.summed, **dict.fromkeys(clients, state.round)}
    new = replace(state, summed=summed, last_round_digests=[], fleet_choice=None)  # a secure round reports nothing
    return commit_round(run_dir, run, state, new, hp, backbones, mean, round_, closing)
