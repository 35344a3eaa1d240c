"""The fleet's evidence for the deployed choice: what the round's clients' validation slices say together,
pooled by the cloud and sent back in the next bundle.

A device chooses on a slice of 8 or so records, whose noise (0.01 to 0.03 nats) is as large as the gaps it
must tell apart. Issue 58's study found two ways a device alone goes wrong. At Dirichlet 0.1 the global
messenger beat every personalized one by 0.01 to 0.04 nats, yet clients kept theirs, or deployed the base
model, on a lead that was noise. Under partial participation a general-domain client's messengers trail the
base model, and only a test against it keeps the device off them. The fleet tells the two apart:

- **Which messenger is the reference** a rival must beat. Pooled over the round's clients, the gap
  personalized − global has a standard error √(Σ seᵢ²)/n. When personalization lost by more than that, the
  federation's messenger comes first; otherwise the device's own rule stands.
- **The base model's test, shrunk toward the fleet.** Each client's gap dᵢ = NLL(deployed) − NLL(base) is
  one draw of a normal whose mean μ and spread τ² the fleet estimates (τ² = Var(d) − mean(seᵢ²), at least 0).
  A device tests the posterior of its own gap d (se s) under that prior:
  mean (τ²·d + s²·μ) / (τ² + s²), sd √(τ²s² / (τ² + s²)). With no prior it is the device's own d and s.

The reports are the edges' claims, numbers only. A liar moves μ by its gap over n and widens τ²; a wider
τ² leaves each device more to its own slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import fmean, pvariance

from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError

__all__ = ["FleetEvidence", "MANIFEST_KEY", "MIN_REPORTS", "REPORT_KEYS"]

MANIFEST_KEY = "fleet_choice"  # the bundle's field: round t+1's bundle carries round t's evidence
MIN_REPORTS = 3  # fewer clients give no estimate of the spread between them
# a validation summary's evidence (ciders_edge.training.validation.Validation.summary)
REPORT_KEYS = {
    "personalized": ("val_gap_personalized_global", "val_se_personalized_global"),
    "base": ("val_gap_deployed_base", "val_se_deployed_base"),
}


@dataclass
class FleetEvidence(ConfigMixin):
    """Round ``round``'s validation summaries pooled: the gap personalized − global with its standard
    error, and the prior (μ, τ²) of a client's deployed-minus-base gap."""

    round: int
    reports: int  # the summaries that carried the gap personalized − global
    personalized_gap: float
    personalized_se: float
    base_mean: float
    base_var: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.personalized_se < 0 or self.base_var < 0:
            raise ConfigError("`personalized_se` and `base_var` must not be negative.")

    @property
    def global_first(self) -> bool:
        """Whether the federation's messenger is the reference: personalization lost beyond its error."""
        return self.personalized_gap > self.personalized_se

    def posterior(self, gap: float, se: float) -> tuple[float, float]:
        """A client's deployed-minus-base ``gap`` (standard error ``se``) shrunk toward the fleet's μ."""
        total = self.base_var + se * se
        if total == 0:
            return self.base_mean, 0.0
        return (self.base_var * gap + se * se * self.base_mean) / total, math.sqrt(self.base_var * se * se / total)

    @classmethod
    def of(cls, manifest: dict) -> FleetEvidence | None:
        """A bundle's evidence (manifest field ``fleet_choice``, checked when the bundle loaded), if any."""
        d = manifest.get(MANIFEST_KEY)
        return cls.from_dict(d) if d else None

    @classmethod
    def pool(cls, reports: Iterable[dict], round_: int) -> FleetEvidence | None:
        """The evidence of a round's validation summaries; ``None`` under :data:`MIN_REPORTS` that carry it.
        A client that deployed the base model has no gap to it and is left out of the prior."""
        reports = list(reports)
        personalized = _pairs(reports, "personalized")
        base = _pairs(reports, "base")
        if len(personalized) < MIN_REPORTS or len(base) < MIN_REPORTS:
            return None
        gaps = [d for d, _ in base]
        return cls(
            round=round_,
            reports=len(personalized),
            personalized_gap=fmean(d for d, _ in personalized),
            personalized_se=math.sqrt(sum(s * s for _, s in personalized)) / len(personalized),
            base_mean=fmean(gaps),
            base_var=max(0.0, pvariance(gaps) - fmean(s * s for _, s in base)),
        )


def _pairs(reports: list[dict], which: str) -> list[tuple[float, float]]:
    """(gap, se) of every report that has both as finite numbers."""
    gap_key, se_key = REPORT_KEYS[which]
    out = []
    for r in reports:
        gap, se = r.get(gap_key), r.get(se_key)
        if all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (gap, se)):
            out.append((float(gap), float(se)))
    return out
