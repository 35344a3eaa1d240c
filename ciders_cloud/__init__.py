"""CIDERS cloud side, grouped by job: ``preparation`` (``prepare``: split, bootstrap, round-0 bundles; and
``distill``); ``round/`` (packet intake, eq. 11–13, the next bundles); ``strategies/`` (CIDERS and its
baselines); ``models/`` (teacher, learnable backbones, TAKD, fidelity); ``run/`` (the run folder, its config
and server state); ``study/`` (simulate, report); ``fleet/`` (Flower). A run folder's layout:
:mod:`ciders_cloud.run.folder`.

The names below load on first use: a command imports only the modules it runs (``ciders-cloud --help``
loads no model stack).
"""

from importlib import import_module
from typing import Any

__all__ = ["RunConfig", "TakdConfig", "prepare", "distill"]

_HOMES = {
    "RunConfig": "ciders_cloud.run.config",
    "TakdConfig": "ciders_cloud.run.config",
    "prepare": "ciders_cloud.preparation",
    "distill": "ciders_cloud.preparation",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'ciders_cloud' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
