"""One round's private release of a DP run: the budget check before anything is written, the
uniform weights, and the noisy mean that eq. (12) then takes (docs/privacy.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciders_cloud.privacy.accountant import PrivacySpent, privacy_spent, sampled_count
from ciders_cloud.privacy.mechanism import GaussianMechanism
from ciders_cloud.privacy.settings import PrivacySettings
from ciders_edge.errors import PacketError
from ciders_edge.tensors import Tensors

if TYPE_CHECKING:
    from ciders_cloud.run.config import RunConfig

__all__ = ["PrivateRelease"]


@dataclass(frozen=True)
class PrivateRelease:
    """A DP run's aggregate: who may be sampled (N clients, each round q of them, ``sampling``) and the
    mechanism's settings. Round t is release t + 1: prepare's bundles spend nothing."""

    dp: PrivacySettings
    sampling: str
    participation: float
    population: int

    @classmethod
    def of(cls, run: RunConfig) -> PrivateRelease | None:
        """The run's release, or ``None`` when the run has no ``[dp]``."""
        dp = run.privacy
        return None if dp is None else cls(dp, run.sampling, run.participation, len(run.client_ids))

    @property
    def denominator(self) -> float:
        """D, the mean's fixed divisor: the clients a round samples (qN expected under Poisson sampling)."""
        if self.sampling == "poisson":
            return self.participation * self.population
        return float(sampled_count(self.participation, self.population))

    def weights(self, n: int) -> list[float]:
        """Each participant's weight: 1/D, whatever its data size (a weight by |D_i| would scale past C)."""
        return [1.0 / self.denominator] * n

    def spent(self, releases: int) -> PrivacySpent:
        return privacy_spent(self.dp, releases, self.sampling, self.participation, self.population)

    def check_budget(self, round_: int) -> PrivacySpent:
        """What round ``round_``'s release brings the spend to; refused past the budget, nothing written."""
        after = self.spent(round_ + 1)
        budget = self.dp.budget
        if budget is not None and after.epsilon > budget:
            raise PacketError(
                f"round {round_} would spend epsilon {after.epsilon:.3f} at delta {after.delta:.3g}, over the run's "
                f"budget {budget:g} (`dp.max_epsilon`); the run has released all it may; nothing was written"
            )
        return after

    @property
    def mechanism(self) -> GaussianMechanism:
        return GaussianMechanism(self.dp.clip, self.dp.noise_multiplier or 0.0, self.denominator)

    def mean(self, deltas: Sequence[Tensors], like: Tensors) -> tuple[Tensors, dict]:
        """Eq. (12)'s mean as the Gaussian mechanism releases it: clipped at the cloud (idempotent on what an
        edge already clipped, up to its codec's rounding), summed, noised, divided by D."""
        return self.mechanism.mean(deltas, like)

    def noised(self, total: Tensors, like: Tensors) -> tuple[Tensors, dict]:
        """The release from the secure sum of displacements each edge clipped to C (``clip_on = "edge"``)."""
        return self.mechanism.release(total, like)
