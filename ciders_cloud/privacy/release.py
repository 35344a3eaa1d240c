"""One round's private release of a DP run: the budget check before anything is written, the
uniform weights, and the noisy mean that eq. (12) then takes (docs/privacy.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ciders_cloud.privacy.accountant import PrivacySpent, max_rounds, privacy_spent, solve_noise_multiplier
from ciders_cloud.privacy.mechanism import GaussianMechanism
from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.dp_settings import PrivacySettings
from ciders_cloud.run.sampling import sampled_count
from ciders_edge.errors import CidersError, ConfigError, PacketError

__all__ = ["PrivateRelease", "BudgetError", "with_noise"]


def with_noise(run: RunConfig) -> RunConfig:
    """``run`` with a target epsilon turned into the noise multiplier that spends it over the planned
    rounds: solved once, where a run is made, and kept in run.json."""
    dp = run.privacy
    if dp is None or dp.noise_multiplier is not None:
        return run
    z = solve_noise_multiplier(dp, run.sampling, run.participation, len(run.client_ids))
    return run.replace(dp={**run.dp, "noise_multiplier": z})


class BudgetError(CidersError, ValueError):
    """A round would spend more privacy than the run's budget."""


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
            raise BudgetError(
                f"round {round_} would spend epsilon {after.epsilon:.3f} at delta {after.delta:.3g}, over the run's "
                f"budget {budget:g} (`dp.max_epsilon`); the run has released all it may; nothing was written"
            )
        return after

    def check_rounds(self, rounds: int, flag: str = "--rounds") -> None:
        """Refuse, before any training, a total of ``rounds`` that the budget does not allow."""
        budget = self.dp.budget
        if budget is None or self.spent(rounds).epsilon <= budget:
            return
        allowed = max_rounds(self.dp, self.sampling, self.participation, self.population, budget, rounds)
        raise BudgetError(
            f"{flag} {rounds}: the run's privacy budget epsilon {budget:g} allows {allowed} rounds "
            f"(epsilon {self.spent(allowed).epsilon:.3f} after them)"
        )

    def check_sample(self, sampled: list[str] | None, clients: list[str], round_: int) -> None:
        """The accountant credits sampling: a round with q < 1 takes only the clients its draw named
        (simulate's and serve's), so a round aggregated by hand cannot claim an amplification it did not earn."""
        if self.participation >= 1.0:
            return
        if sampled is None:
            raise ConfigError(
                f"round {round_}: this private run samples q = {self.participation:g} of its clients a round, and its "
                "epsilon counts on that draw; run its rounds with `simulate` or `serve`, which draw it"
            )
        if strays := sorted(set(clients) - set(sampled)):
            raise PacketError(f"round {round_}: client {strays[0]!r} was not sampled this round; nothing was written")

    @property
    def mechanism(self) -> GaussianMechanism:
        """Eq. (12)'s mean as the Gaussian mechanism releases it: clipped at the cloud (idempotent on what an edge
        already clipped), summed, noised, divided by D; or noised from the secure sum of what the edges clipped."""
        return GaussianMechanism(self.dp.clip, self.dp.noise_multiplier or 0.0, self.denominator)
