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
    """How many distinct records the slice holds: ``fraction`` of them, at least 8 and at most 128; none
    below 16 distinct records (or at fraction 0)."""
    if fraction <= 0 or records < VAL_FLOOR:
        return 0
    return min(max(round(fraction * records), VAL_MIN), VAL_MAX)


def hold_out(examples: list[Example], fraction: float, where: str = "") -> tuple[list[Example], list[Example]]:
    """(train, validation): the distinct records with the smallest content hashes form the slice, the same
    every round. Each counts once, however often the data repeats it: generated data can hold a record a
    dozen times, and a slice of its copies would score a few records and choose by them. Every copy of a
    held-out record stays out of training (none is trained on and scored)."""
    first: dict[str, Example] = {}
    for e in examples:
        first.setdefault(e.key, e)
    n = validation_size(len(first), check_val_fraction(fraction))
    if fraction > 0 and n == 0:
        console.print(
            f"[yellow]notice:[/] {where}{len(first)} distinct records, fewer than {VAL_FLOOR}: no validation "
            "slice; the device deploys its latest personalized messenger",
            highlight=False,
            soft_wrap=True,
        )
    val = [first[k] for k in sorted(first)[:n]]
    keys = {e.key for e in val}
    return [e for e in examples if e.key not in keys], val
