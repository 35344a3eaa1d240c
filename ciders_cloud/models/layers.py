"""Where a profile's layers sit: the split of each learnable backbone, and the one renamer between the
reference AdapEmu's messenger names (v's, the server state's) and a profile's own.

A profile on another learnable backbone keeps fewer or more backbone layers, so its messenger layers
sit at other AdapEmu indices (``offset``); one that trains fewer messenger layers trains a subset of v.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from transformers import AutoConfig

from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.server_state import ServerState
from ciders_edge.model.families import family_of
from ciders_edge.model.split import SplitSpec, rename_layer, shift_layers
from ciders_edge.tensors import Tensors

__all__ = ["ProfileLayers", "split_for", "profile_spec", "messenger_offset", "gap_layers"]


def split_for(run: RunConfig, drop_ratio: float | None = None) -> SplitSpec:
    """The split of the run's learnable backbone of ``drop_ratio`` (default: the reference), from the
    model's config alone."""
    drop = run.drop_ratio if drop_ratio is None else drop_ratio
    return SplitSpec.from_drop_ratio(_num_layers(run.model_path), run.messenger_depth, drop)


@functools.cache
def _num_layers(model_path: str) -> int:
    """The model's layer count, its family checked; read once (intake asks per packet and profile)."""
    config = AutoConfig.from_pretrained(model_path)
    family_of(config)
    return config.num_hidden_layers


def profile_spec(run: RunConfig, profile: str) -> SplitSpec:
    """The split ``profile`` trains: its backbone's, with its own number of messenger layers."""
    trained, drop = run.profile_split(profile)
    return dataclasses.replace(split_for(run, drop), trained=trained)


def gap_layers(split: SplitSpec) -> list[int]:
    """AdapEmu indices of the learnable-backbone layers that follow one or more dropped layers: those
    prepare's bootstrap trains (:mod:`.bootstrap`)."""
    return [j for j in range(1, split.n_kept) if split.kept[j] - split.kept[j - 1] > 1]


def messenger_offset(run: RunConfig, split: SplitSpec) -> int:
    """Where ``split``'s messenger layers sit in its AdapEmu, relative to the reference backbone's."""
    return split.n_kept - split_for(run).n_kept


@dataclass(frozen=True)
class ProfileLayers:
    """What a profile's packets hold: Δc of the messenger layers it trains, named by its AdapEmu,
    whose messenger layers sit ``offset`` indices above the reference backbone's (v's names)."""

    offset: int
    trained: tuple[str, ...]  # v's names of the tensors it trains

    @classmethod
    def of(cls, run: RunConfig, state: ServerState | None = None) -> dict[str, ProfileLayers]:
        """Each profile's layers; without a server state, only the offsets (``trained`` empty)."""
        out = {}
        for profile in run.profiles:
            split = profile_spec(run, profile)
            offset = messenger_offset(run, split)
            names = state.messenger if state is not None else ()
            out[profile] = cls(offset, tuple(k for k in names if split.trains(rename_layer(k, offset))))
        return out

    def to_own(self, tensors: Tensors) -> Tensors:
        return shift_layers(tensors, self.offset)

    def to_global(self, tensors: Tensors) -> Tensors:
        return shift_layers(tensors, -self.offset)
