"""A run's device profiles, and how they split the model: the messenger depth ``a``, the reference drop ratio,
and each profile's own trained depth and backbone (``RunConfig.profile_splits``), from the profiles'
TOML files and the ``--messenger-depth`` / ``--drop-ratio`` flags. ``prepare`` and ``simulate`` use it."""

from __future__ import annotations

from typing import Any

from ciders_edge.errors import ConfigError
from ciders_edge.profiles import DeviceProfile, is_shipped, load_profile

__all__ = ["run_profiles", "fleet_split"]


def run_profiles(given: list[str], own: dict | None = None) -> tuple[list[DeviceProfile], dict[str, Any]]:
    """The profiles ``given`` (names, TOML paths, or names in ``own``: a run's copies), and what a run keeps
    of them: ``profiles`` by name, and ``own_profiles``, its copy of every one the toolkit does not ship, so
    that later commands find it from any folder. Two of one name, or a file that takes a shipped profile's
    name, are refused: the run's bundle folders are named by the profiles' names."""
    own = own or {}
    profiles = [
        DeviceProfile.from_dict(own[g], where=f"the run's copy of profile {g!r}") if g in own else load_profile(g)
        for g in given
    ]
    names = [p.name for p in profiles]
    for g, p in zip(given, profiles, strict=True):
        if names.count(p.name) > 1:
            raise ConfigError(f"two of the run's profiles are named {p.name!r}; give each a `name` of its own")
        if g != p.name and g not in own and is_shipped(p.name):
            raise ConfigError(f"{g}: names itself {p.name!r}, a shipped profile's name; give it a `name` of its own")
    kept = {"profiles": names, "own_profiles": {p.name: p.to_dict() for p in profiles if not is_shipped(p.name)}}
    return profiles, kept


def fleet_split(profiles: list[DeviceProfile], depth: int | None, drop: float | None) -> dict[str, Any]:
    """A run's ``messenger_depth``, ``drop_ratio`` and ``profile_splits`` for ``profiles``.

    One profile: its values, each overridden by ``depth`` or ``drop`` when given (every edge trains the
    whole messenger). Several: the messenger is ``depth`` deep (default: the deepest profile's) and
    each profile trains its own top ``messenger_depth`` layers on a backbone of its own ``drop_ratio``,
    or all of ``drop`` when given; the first profile's backbone is the reference.
    """
    first = profiles[0]
    if len(profiles) == 1:
        return {
            "messenger_depth": first.messenger_depth if depth is None else depth,
            "drop_ratio": first.drop_ratio if drop is None else drop,
        }
    a = max(p.messenger_depth for p in profiles) if depth is None else depth
    reference = first.drop_ratio if drop is None else drop
    splits = {}
    for p in profiles:
        own = {"messenger_depth": p.messenger_depth, "drop_ratio": p.drop_ratio if drop is None else drop}
        if (own["messenger_depth"], own["drop_ratio"]) != (a, reference):
            splits[p.name] = own
    return {"messenger_depth": a, "drop_ratio": reference, "profile_splits": splits}
