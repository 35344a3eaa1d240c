"""The strategies' names, as data: the CLI's help lists them without loading the strategies themselves
(``ciders_cloud.strategies`` registers one per name, in this order; a test holds the two together)."""

from __future__ import annotations

__all__ = ["ALGORITHMS"]

ALGORITHMS = ("ciders-fo", "ciders-fd", "fedavg", "scaffold", "fedot", "fedbiot", "localot", "fednest", "lfednest")
