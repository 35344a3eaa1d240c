"""The cloud's configurations: the run's (``RUN/run.json``) and its TAKD (a study's: :mod:`ciders_cloud.study.config`).

Data and their range checks, on the cloud's ground floor: what needs an algorithm (its name, its
settings, whether it can run privately) is checked by the strategy (:func:`ciders_cloud.strategies.check_run`),
and a target epsilon becomes a noise multiplier where runs are made (:func:`ciders_cloud.privacy.with_noise`).
One word, one meaning: ``clients`` is a count (simulate's), ``client_ids`` a list of ids (a run's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ciders_cloud.run.dp_settings import SAMPLINGS, PrivacySettings
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.splits import run_profiles
from ciders_edge.config import ConfigMixin, check_value
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.storage import STORAGES
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.lora import LoraSettings
from ciders_edge.profiles import DeviceProfile

__all__ = [
    "TakdConfig",
    "StrategyTables",
    "RunConfig",
    "load_run",
    "HIDDEN_LOSSES",
    "TASK_LOSSES",
    "ALIGN_PARAMS",
    "GAMMA_SCHEDULES",
    "TEACHER_DTYPES",
]

HIDDEN_LOSSES = ("relative", "mse")
TASK_LOSSES = ("excess", "ce")
ALIGN_PARAMS = ("layers", "lora")
GAMMA_SCHEDULES = ("constant", "protocol-c")
TEACHER_DTYPES = ("auto", "fp32", "bf16")  # auto: bf16 for large models (ciders_cloud.models.source)


def backbone_name(drop_ratio: float) -> str:
    """The name a learnable backbone's tensors carry on disk and in logs, e.g. ``drop0.5``."""
    return f"drop{drop_ratio:g}"


@dataclass
class TakdConfig(ConfigMixin):
    """Task-aware KD of the learnable backbone (eq. 2) and prepare's bootstrap.

    Defaults were chosen by ``benchmarks/emulator_fidelity.py`` on SmolLM2-135M; the paper's loss
    (raw hidden MSE, lambda_out 0.5, lambda_task 1) is the ``paper`` preset.
    """

    CHOICES = {"hidden_loss": HIDDEN_LOSSES, "task_loss": TASK_LOSSES, "align_params": ALIGN_PARAMS}

    lr: float = 5e-4  # per-round TAKD of the backbone LoRA (eq. 13)
    batch_size: int = 4
    seq_len: int = 256
    hidden_loss: str = "relative"  # relative: per-token ||h_L - h_F||^2 / ||h_F||^2; mse: the paper's raw form
    lambda_hidden: float = 1.0
    lambda_out: float = 1.0  # weight of KL(AdapFu || AdapEmu)
    lambda_task: float = 1.0  # weight of the response-token CE: pulls the emulator's NLL to the full model's
    task_loss: str = "excess"  # excess: only the CE beyond the full model's (per batch); ce: the paper's plain CE
    weight_decay: float = 0.0
    clip: float = 1.0
    # prepare's bootstrap: stage 1 fits each layer after a gap to the layers it replaces, stage 2 is eq. (2)
    layer_lr: float = 1e-3
    align_lr: float = 2e-4
    align_params: str = "layers"  # layers: the weights of the layers after a gap, once; lora: the backbone LoRA
    holdout: int = 40  # public records never distilled on: the emulator's fidelity is measured on them

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.lr, self.layer_lr, self.align_lr) <= 0:
            raise ConfigError(f"TAKD learning rates must be positive, got {self.lr}, {self.layer_lr}, {self.align_lr}.")
        if min(self.lambda_hidden, self.lambda_out, self.lambda_task) < 0:
            raise ConfigError(
                "TAKD loss weights must not be negative, "
                f"got {self.lambda_hidden}, {self.lambda_out}, {self.lambda_task}."
            )


@dataclass
class StrategyTables:
    """The tables of settings that belong to a strategy family, one each, in a run's config and a study's (TOML
    tables of these names): data here, checked by the strategy that reads them (its ``check``, and the study's
    file against ``ciders_cloud.strategies.SETTINGS_TABLES``). An algorithm with settings of its own adds its
    table here and there, and the round loop and ``simulate`` pass it on without naming it."""

    fednest: dict = field(default_factory=dict)  # FedNest's and LFedNest's settings (strategies/fednest/)

    def strategy_tables(self) -> dict[str, dict]:
        """Every strategy table by name, as :class:`RunConfig` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(StrategyTables)}


@dataclass
class RunConfig(StrategyTables, ConfigMixin):
    """Everything ``prepare`` decided; later commands read it back instead of re-asking."""

    CHOICES = {
        "gamma_schedule": GAMMA_SCHEDULES,
        "storage": ("", *STORAGES),
        "sampling": SAMPLINGS,
        "teacher_dtype": TEACHER_DTYPES,
    }
    TABLES = {
        "lora": LoraSettings,
        "backbone_lora": LoraSettings,
        "takd": TakdConfig,
        "hyperparameters": RoundHyperparams,
        "dp": PrivacySettings,
    }

    model: str = "smollm2-135m"
    model_path: str = ""  # the resolved local folder
    model_revision: str = ""  # sha256 over the source config and weights
    profiles: list[str] = field(default_factory=lambda: ["cpu-laptop"])  # by name (a bundle folder's)
    own_profiles: dict = field(default_factory=dict)  # {name: table}: the run's copy of each profile not shipped
    messenger_depth: int = 6  # a: the global messenger's depth
    drop_ratio: float = 0.2  # the reference learnable backbone's (the one a one-backbone run has)
    # a profile that trains fewer messenger layers or runs another learnable backbone:
    # {profile: {"messenger_depth": a_p, "drop_ratio": r_p}}; a profile not named trains (a, drop_ratio)
    profile_splits: dict = field(default_factory=dict)
    public_data: str = ""
    layer_steps: int = 200  # bootstrap stage 1: layer-wise fits of the layers after each gap
    align_steps: int = 60  # bootstrap stage 2: end-to-end TAKD steps (eq. 2)
    seed: int = 0
    lora: dict = field(default_factory=lambda: LoraSettings().to_dict())
    backbone_lora: dict = field(default_factory=lambda: LoraSettings(rank=8, alpha=16.0, dropout=0.0).to_dict())
    takd: dict = field(default_factory=lambda: TakdConfig().to_dict())
    hyperparameters: dict = field(default_factory=lambda: RoundHyperparams().to_dict())
    algorithm: str = "ciders-fo"  # a strategy in ciders_cloud.strategies (which checks the name)
    gamma_schedule: str = "constant"  # constant (hyperparameters.gamma) | protocol-c
    client_ids: list[str] = field(default_factory=list)  # the accepted clients; empty: any
    participation: float = 1.0  # q: the share of client_ids each round samples (simulate's and the fleet's)
    sampling: str = "fixed"  # fixed: round(q N) of them, without replacement; poisson: each with probability q
    dp: dict = field(default_factory=dict)  # client-level differential privacy (PrivacySettings' keys); empty: off
    storage: str = ""  # how bundles store frozen weights (fp32, bf16, int8, int4); empty: each profile's
    teacher_dtype: str = "auto"  # M* and the frozen weights the AdapEmu shares: fp32, bf16; prepare records auto's pick
    run_id: str = ""  # set by prepare (prepare.run_identity); in every bundle: an edge state is tied to its run

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "", strict: bool = False) -> RunConfig:
        """As :meth:`ConfigMixin.from_dict`; a run.json written before ``clients`` was renamed
        ``client_ids`` (``clients`` is simulate's count everywhere else), or before FedNest's settings
        left the round hyperparameters for the ``fednest`` table, still loads."""
        if not strict:
            d = _with_fednest_table(d)
        if "clients" not in d or "client_ids" in d:
            return super().from_dict(d, where, strict)
        try:
            return super().from_dict({("client_ids" if k == "clients" else k): v for k, v in d.items()}, where, strict)
        except ConfigError as err:  # name the key as the file spells it
            raise ConfigError(str(err).replace("`client_ids`", "`clients`")) from None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ConfigError(f"`drop_ratio` must be in [0, 1), got {self.drop_ratio}.")
        if not self.profiles:
            raise ConfigError("at least one device profile is needed.")
        if not 0.0 < self.participation <= 1.0:
            raise ConfigError(f"`participation` must be in (0, 1], got {self.participation}.")
        self._check_profile_splits()
        if self.dp:
            self._check_privacy()

    def _check_privacy(self) -> None:
        """DP needs the population and one split (whether the algorithm's mean can be made private is
        its strategy's check)."""
        dp = PrivacySettings.from_dict(self.dp, where="`dp`")
        if not self.client_ids:
            raise ConfigError(
                "differential privacy needs the run's clients (--client, repeatable): the accountant's population N "
                "and its delta = 1/N come from them"
            )
        if not dp.delta_for(len(self.client_ids)) < 1:
            raise ConfigError("differential privacy with one client: delta = 1/N is 1, no guarantee; set `dp.delta`")
        if self.is_mixed:
            raise ConfigError(
                "differential privacy needs one messenger depth and one learnable backbone for every profile (the "
                "clip bound and the noise are over one set of tensors); drop `profile_splits` or use one depth"
            )

    def _check_profile_splits(self) -> None:
        for name, split in self.profile_splits.items():
            where = f"`profile_splits.{name}`"
            if name not in self.profiles:
                raise ConfigError(f"{where}: {name!r} is not one of the run's profiles ({', '.join(self.profiles)}).")
            kinds = {"messenger_depth": int, "drop_ratio": float}
            if not isinstance(split, dict) or not all(
                k in kinds and check_value(v, kinds[k]) for k, v in split.items()
            ):
                raise ConfigError(
                    f"{where} takes an integer `messenger_depth` and a number `drop_ratio`, got {split!r}."
                )
            depth, drop = self.profile_split(name)
            if not 1 <= depth <= self.messenger_depth:
                raise ConfigError(
                    f"profile {name} trains {depth} messenger layers, but the run's messenger has "
                    f"{self.messenger_depth}: allowed 1..{self.messenger_depth} (raise --messenger-depth, or set "
                    f"{where}.messenger_depth)."
                )
            if not 0.0 <= drop < 1.0:
                raise ConfigError(f"{where}: `drop_ratio` must be in [0, 1), got {drop}.")
        self._check_backbones()

    def _check_backbones(self) -> None:
        """Every backbone serves a profile and has a name of its own."""
        names = self.backbone_names
        if len(set(names)) < len(names):
            raise ConfigError(f"drop ratios {self.drop_ratios} are too close to tell apart ({', '.join(names)}).")
        if all(self.profile_split(p)[1] != self.drop_ratio for p in self.profiles):
            raise ConfigError(f"no profile runs the run's backbone (`drop_ratio` {self.drop_ratio}); set it to one's.")

    def profile_split(self, profile: str) -> tuple[int, float]:
        """``(a_p, r_p)``: how many messenger layers ``profile`` trains and its backbone's drop ratio."""
        split = self.profile_splits.get(profile, {})
        return int(split.get("messenger_depth", self.messenger_depth)), float(split.get("drop_ratio", self.drop_ratio))

    def device_profiles(self) -> list[DeviceProfile]:
        """The run's profiles in order: its own copy of each one the toolkit does not ship (``own_profiles``,
        so a later command finds it from any folder), a shipped one by name."""
        return run_profiles(self.profiles, self.own_profiles)[0]

    @property
    def drop_ratios(self) -> list[float]:
        """The learnable backbones' drop ratios, one per distinct value, the reference first."""
        out = [self.drop_ratio]
        for p in self.profiles:
            drop = self.profile_split(p)[1]
            if drop not in out:
                out.append(drop)
        return out

    @property
    def backbone_names(self) -> list[str]:
        """The learnable backbones' names (:func:`backbone_name`), the reference first."""
        return [backbone_name(r) for r in self.drop_ratios]

    @property
    def is_mixed(self) -> bool:
        """Whether some profile trains another depth or backbone than the run's."""
        return any(self.profile_split(p) != (self.messenger_depth, self.drop_ratio) for p in self.profiles)

    @property
    def lora_settings(self) -> LoraSettings:
        return LoraSettings.from_dict(self.lora)

    @property
    def backbone_lora_settings(self) -> LoraSettings:
        return LoraSettings.from_dict(self.backbone_lora)

    @property
    def takd_config(self) -> TakdConfig:
        return TakdConfig.from_dict(self.takd)

    @property
    def privacy(self) -> PrivacySettings | None:
        """The run's differential privacy (``None``: off)."""
        return PrivacySettings.from_dict(self.dp) if self.dp else None


# the keys an old run.json kept among its hyperparameters: that format's, fixed, whatever the table grows
_FEDNEST_KEYS_BEFORE_THE_TABLE = ("probe_batches", "neumann_terms", "neumann_l", "hvp", "hvp_batch_size")


def _with_fednest_table(d: dict[str, Any]) -> dict[str, Any]:
    """A saved run's FedNest settings moved from its hyperparameters to the ``fednest`` table."""
    hp = d.get("hyperparameters")
    if not isinstance(hp, dict) or "fednest" in d:
        return d
    moved = {k: hp[k] for k in _FEDNEST_KEYS_BEFORE_THE_TABLE if k in hp}
    return {**d, "fednest": moved} if moved else d


def _with_round_task_ce(d: dict[str, Any]) -> dict[str, Any]:
    """A run.json from before the round's TAKD dropped the task CE by default (it then named no
    ``takd_lambda_task``) ran it at ``takd.lambda_task``, and goes on so when resumed."""
    hp, takd = d.get("hyperparameters"), d.get("takd", {})
    if not isinstance(hp, dict) or not isinstance(takd, dict) or "takd_lambda_task" in hp:
        return d  # up to date, or malformed: RunConfig's checks name what is wrong
    return {**d, "hyperparameters": {**hp, "takd_lambda_task": takd.get("lambda_task", TakdConfig.lambda_task)}}


def _with_fp32_teacher(d: dict[str, Any]) -> dict[str, Any]:
    """A run.json from before the teacher had a dtype to choose held it in fp32, and goes on so."""
    return d if not isinstance(d, dict) or "teacher_dtype" in d else {**d, "teacher_dtype": "fp32"}


def load_run(run_dir: Path) -> RunConfig:
    path = RunFolder(run_dir).config
    if not path.is_file():
        raise StateError(f"{run_dir}: not a run folder (no {path.name}); create one with `ciders-cloud prepare`")
    d = _with_fp32_teacher(_with_round_task_ce(json.loads(path.read_text())))
    return RunConfig.from_dict(d, where=str(path))
