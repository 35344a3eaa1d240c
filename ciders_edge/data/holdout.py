"""The validation slice a device holds out of its own records: chosen by record hash, the same every round.

``train`` scores the messengers it could deploy on this slice (:mod:`ciders_edge.training.validation`);
no record in it is ever trained on. Pure Python: the cloud's study config checks the fraction with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciders_edge.errors import ConfigError
from ciders_edge.progress import console

if TYPE_CHECKING:  # torch: this module is read by configs that load no model
    from ciders_edge.data.records import Example

__all__ = ["VAL_FRACTION", "check_val_fraction", "validation_size", "hold_out"]

VAL_FRACTION = 0.1  # of the edge's records, held out
VAL_MIN, VAL_MAX = 8, 128  # records in the slice
VAL_FLOOR = 16  # below this many records no slice is held out: every record trains


def check_val_fraction(fraction: float) -> float:
    if not 0.0 <= fraction <= 0.5:
        raise ConfigError(f"--val-fraction must be between 0 and 0.5, got {fraction}")
    return fraction


def validation_size(records: int, fraction: float) -> int:
    """How many records the slice holds: ``fraction`` of them, at least 8 and at most 128; none
    below 16 records (or at fraction 0)."""
    if fraction <= 0 or records < VAL_FLOOR:
        return 0
    return min(max(round(fraction * records), VAL_MIN), VAL_MAX)


def hold_out(examples: list[Example], fraction: float, where: str = "") -> tuple[list[Example], list[Example]]:
    """(train, validation): the records with the smallest content hashes form the slice, so it is the
    same every round; copies of one record land on the same side (none is trained on and scored)."""
    n = validation_size(len(examples), check_val_fraction(fraction))
    if fraction > 0 and n == 0:
        console.print(
            f"[yellow]notice:[/] {where}{len(examples)} records, fewer than {VAL_FLOOR}: no validation slice; "
            "the device deploys its latest personalized messenger",
            highlight=False,
            soft_wrap=True,
        )
    ranked = sorted(examples, key=lambda e: e.key)
    cut = ranked[n - 1].key if n else None
    val = [e for e in ranked if cut is not None and e.key <= cut]
    keys = {e.key for e in val}
    return [e for e in examples if e.key not in keys], val
