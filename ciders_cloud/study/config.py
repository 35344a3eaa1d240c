"""``simulate``'s config: a study's clients, rounds, partition, evaluation and the run it prepares."""

from __future__ import annotations

from dataclasses import dataclass, field

from ciders_cloud.run.config import GAMMA_SCHEDULES, StrategyTables, TakdConfig
from ciders_cloud.run.dp_settings import SAMPLINGS, PrivacySettings
from ciders_cloud.strategies import SETTINGS_TABLES, STRATEGIES
from ciders_edge.config import ConfigMixin, check_limit
from ciders_edge.data.holdout import check_val_fraction
from ciders_edge.errors import ConfigError
from ciders_edge.formats.packet import CODECS
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.profiles import FROZEN_WEIGHTS

__all__ = ["SimConfig", "parse_profile_mix"]


def parse_profile_mix(text: str) -> dict[str, int]:
    """``"cpu-laptop:3,rpi5-8gb:2"`` as ``{"cpu-laptop": 3, "rpi5-8gb": 2}`` (order kept)."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.rpartition(":")
        digits = count.isascii() and count.isdigit() and len(count) < 19  # no '²', no 5,000-digit count
        if not (sep and name and digits and int(count) > 0) or name in out:
            raise ConfigError(
                f"--profile-mix takes PROFILE:COUNT,... with each profile once and counts >= 1, got {item!r}"
            )
        check_limit("clients", int(count), f"--profile-mix {name}'s count")
        out[name] = int(count)
    return out


@dataclass
class SimConfig(StrategyTables, ConfigMixin):
    """Everything ``simulate`` takes; TOML keys equal these names, CLI flags override them.

    ``clients`` is the number of simulated edges, as the ``--clients`` flag, a config file's key and
    every study's ``config.json`` say; a list of client ids is always ``client_ids`` (RunConfig's). A strategy's
    own settings are its table (:class:`StrategyTables`), passed to the run as they are.
    """

    CHOICES = {
        "algorithm": tuple(STRATEGIES),
        "gamma_schedule": GAMMA_SCHEDULES,
        "codec": CODECS,
        "sampling": SAMPLINGS,
        "frozen_weights": ("", *FROZEN_WEIGHTS),
    }
    TABLES = {
        "hyperparameters": RoundHyperparams,
        "takd": TakdConfig,
        "dp": PrivacySettings,
        **SETTINGS_TABLES,
    }

    model: str = "tiny"
    data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)  # per-file: each client's own evaluation file
    clients: int = 3
    rounds: int = 3
    local_steps: int = 20  # K, as RoundHyperparams
    algorithm: str = "ciders-fo"
    partition: str = "iid"  # iid | dirichlet:ALPHA[:FIELD] | by-field:FIELD | per-file
    participation: float = 1.0  # q: the share of clients each round samples
    sampling: str = "fixed"  # fixed: round(q N) clients a round; poisson: each client with probability q
    seed: int = 0
    eval_every: int = 1
    eval_examples: int = 16  # held-out records per client scored for NLL
    eval_generate: int = 4  # held-out records per client answered for ROUGE-L / exact match
    holdout: float = 0.1
    max_records: int = 0  # cap per client (0: all)
    public_data: str = ""  # TAKD data; default: a sample of the clients' training data
    profile: str = "cpu-laptop"
    profile_mix: str = ""  # "cpu-laptop:3,rpi5-8gb:2": a mixed fleet, clients taken in order (overrides profile)
    profile_splits: dict = field(default_factory=dict)  # RunConfig's: a profile's own depth and drop ratio
    messenger_depth: int | None = None
    drop_ratio: float | None = None
    layer_steps: int | None = None  # prepare's bootstrap (None: the defaults of `prepare`)
    align_steps: int | None = None
    codec: str = "fp32"
    # how simulated edges hold int8/int4 frozen weights: empty, as their profiles say (as a fleet's devices
    # do, so the two agree to the bit); `dequantized` is a little faster on one machine (the same to 1e-7)
    frozen_weights: str = ""
    # of each client's training records held out to choose the messenger it deploys, as `train --val-fraction`
    # (0: none, every record trains and the device deploys its latest messenger: the studies published so far)
    val_fraction: float = 0.0
    # clients not training choose their deployed messenger again on each new bundle (`ciders-edge validate`):
    # a pass over the validation slice of every client that holds a choice, each round
    rechoose: bool = False
    gamma_schedule: str = "constant"
    hyperparameters: dict = field(default_factory=dict)  # RoundHyperparams overrides
    takd: dict = field(default_factory=dict)  # TakdConfig overrides
    dp: dict = field(default_factory=dict)  # client-level differential privacy (PrivacySettings' keys); empty: off

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data:
            raise ConfigError("simulate needs at least one --data file")
        if not 0.0 < self.participation <= 1.0:
            raise ConfigError(f"`participation` must be in (0, 1], got {self.participation}")
        check_val_fraction(self.val_fraction)
        if self.rechoose and not self.val_fraction:
            raise ConfigError("`rechoose` needs `val_fraction`: a client chooses again on its validation slice")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"`holdout` must be in (0, 1), got {self.holdout}")
        if self.eval_data and (self.partition != "per-file" or len(self.eval_data) != len(self.data)):
            raise ConfigError("`eval_data` takes one evaluation file per --data file, with the per-file partition")
        mix = self.mix
        if mix and sum(mix.values()) != self.clients:
            raise ConfigError(
                f"--profile-mix {self.profile_mix} makes {sum(mix.values())} clients, but `clients` is {self.clients}"
            )

    @property
    def mix(self) -> dict[str, int]:
        """``profile_mix`` parsed: clients per profile, in order (empty: every client on ``profile``)."""
        return parse_profile_mix(self.profile_mix)

    def client_profiles(self, ids: list[str]) -> dict[str, str]:
        """Each client's profile: the mix's, clients taken in order, or ``profile`` for all."""
        names = [name for name, count in self.mix.items() for _ in range(count)] or [self.profile] * len(ids)
        return dict(zip(ids, names, strict=True))
