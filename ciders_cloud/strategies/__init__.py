"""CIDERS and its baselines as strategy objects over one round loop (after Flower's ``server/strategy/``).

:class:`~.base.Strategy` names every hook; CIDERS (:mod:`.ciders`) and each baseline is a small file
that implements some of them, FedNest's family a subpackage of its own. Edges run the same update code
for every strategy: the bundle's hyperparameters (the local steps' direction among them) select the variant.
"""

from __future__ import annotations

from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.strategies.base import CloudRound, Strategy
from ciders_cloud.strategies.ciders import CidersFD, CidersFO
from ciders_cloud.strategies.fedavg import FedAvg
from ciders_cloud.strategies.fednest import FedNest, FedNestSettings, LFedNest
from ciders_cloud.strategies.offsite import FedBiOT, FedOT, LocalOT
from ciders_cloud.strategies.scaffold import Scaffold
from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams

__all__ = [
    "Strategy",
    "CloudRound",
    "FedNestSettings",
    "STRATEGIES",
    "SETTINGS_TABLES",
    "get_strategy",
    "strategy_for",
    "check_run",
    "round_hyperparams_for",
    "round_takd",
]

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (CidersFO(), CidersFD(), FedAvg(), Scaffold(), FedOT(), FedBiOT(), LocalOT(), FedNest(), LFedNest())
}

# each strategy family's table of settings in a run's and a study's config (the fields of run.config.StrategyTables)
SETTINGS_TABLES: dict[str, type[ConfigMixin]] = {"fednest": FedNestSettings}


def get_strategy(name: str) -> Strategy:
    """The strategy of that name, with its default settings."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def strategy_for(run: RunConfig) -> Strategy:
    """The run's strategy with the run's settings for it."""
    return get_strategy(run.algorithm).for_run(run)


def check_run(run: RunConfig, fleet: bool = False, secure: bool = False) -> RunConfig:
    """``run``, refused in one line if its algorithm is unknown or cannot serve it (``fleet``: over Flower,
    ``secure``: under its SecAgg+ sum); called where a run is made (prepare) and where a fleet is served."""
    get_strategy(run.algorithm).check(run, fleet, secure)
    return run


def round_hyperparams_for(run: RunConfig, round_: int) -> RoundHyperparams:
    """What round ``round_``'s bundles carry: the run's hyperparameters as its strategy varies them."""
    hp = RoundHyperparams.from_dict(run.hyperparameters)
    hp = strategy_for(run).round_hyperparams(hp, round_, run.gamma_schedule)
    dp = run.privacy
    return hp.replace(displacement_clip=dp.clip) if dp is not None and dp.clip_on == "edge" else hp


def round_takd(run: RunConfig, round_: int) -> tuple[int, TakdConfig]:
    """Round ``round_``'s eq. (13) as its strategy runs it: TAKD steps, and the run's TAKD loss with the
    round's task-CE weight (FedBiOT's 0, or ``takd_lambda_task``)."""
    steps, lambda_task = strategy_for(run).takd(round_hyperparams_for(run, round_))
    return steps, run.takd_config.replace(lambda_task=lambda_task)
