"""How a run's device profiles split the model: the messenger depth ``a``, the reference drop ratio,
and each profile's own trained depth and backbone (``RunConfig.profile_splits``), from the profiles'
TOML files and the ``--messenger-depth`` / ``--drop-ratio`` flags. ``prepare`` and ``simulate`` use it."""

from __future__ import annotations

from typing import Any

from ciders_edge.profiles import DeviceProfile

__all__ = ["fleet_split"]


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
