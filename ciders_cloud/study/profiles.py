"""Which device profile each simulated client runs (``simulate --profile-mix``), and what that changes
for the study: the bundle a client trains and is scored on, how its edge names the messenger's
tensors (a profile on another learnable backbone holds them at other layer indices), and the
``profile`` its records carry when the fleet mixes profiles."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.models.layers import ProfileLayers
from ciders_cloud.run.config import RunConfig
from ciders_cloud.study.config import SimConfig
from ciders_edge.tensors import Tensors

__all__ = ["StudyProfiles"]


@dataclass(frozen=True)
class StudyProfiles:
    profile_of: dict[str, str]  # client id -> profile, by the run's name for it
    layers: dict[str, ProfileLayers]  # profile -> where its messenger layers sit, in the study's order
    own: frozenset[str] = frozenset()  # the run's own profiles (not shipped): an edge reads its bundle's copy

    @classmethod
    def of(cls, cfg: SimConfig, ids: list[str], run: RunConfig) -> StudyProfiles:
        """The study's profiles as the run names them (a profile given as a TOML path goes by its ``name``)."""
        named = dict(zip(list(cfg.mix) or [cfg.profile], run.profiles, strict=True))
        profile_of = {cid: named[given] for cid, given in cfg.client_profiles(ids).items()}
        layers = ProfileLayers.of(run)
        return cls(profile_of, {p: layers[p] for p in dict.fromkeys(profile_of.values())}, frozenset(run.own_profiles))

    def edge_profile(self, client: str) -> str | None:
        """The profile ``client``'s edge is told to run: none for one of the run's own (the bundle holds it)."""
        profile = self.profile_of[client]
        return None if profile in self.own else profile

    @property
    def groups(self) -> dict[str, list[str]]:
        """Each profile's clients, in the study's order."""
        return {p: [c for c, q in self.profile_of.items() if q == p] for p in self.layers}

    @property
    def mixed(self) -> bool:
        return len(self.layers) > 1

    def to_v_names(self, client: str, tensors: Tensors) -> Tensors:
        """A client's messenger tensors (Δ_i, its directions) named as v is."""
        return self.layers[self.profile_of[client]].to_global(tensors)

    def label(self, client: str) -> str:
        return f", {self.profile_of[client]}" if self.mixed else ""

    def tag(self, records: list[dict]) -> list[dict]:
        """In a mixed fleet, each client record with its profile, and a cross matrix with its clients'."""
        if not self.mixed:
            return records
        out = []
        for rec in records:
            client = rec.get("client") or (rec.get("clients") or [None])[0]
            out.append({**rec, "profile": self.profile_of[client]} if client in self.profile_of else rec)
        return out
