"""The run's resolved configuration, saved as ``RUN/run.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ciders_edge.config import ConfigMixin, RoundHyperparams
from ciders_edge.errors import ConfigError
from ciders_edge.lora import LoraSettings

from .strategies import get_strategy

__all__ = ["TakdConfig", "RunConfig"]


@dataclass
class TakdConfig(ConfigMixin):
    """Task-aware KD of the learnable backbone (eq. 2)."""

    lr: float = 5e-4
    batch_size: int = 4
    seq_len: int = 256
    lambda_out: float = 0.5  # weight of KL(AdapFu || AdapEmu)
    lambda_task: float = 1.0  # weight of the response-token CE
    weight_decay: float = 0.0
    clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.batch_size <= 0 or self.seq_len <= 0:
            raise ConfigError(
                "TAKD `lr`, `batch_size` and `seq_len` must be positive, "
                f"got {self.lr}, {self.batch_size}, {self.seq_len}."
            )
        if self.lambda_out < 0 or self.lambda_task < 0:
            raise ConfigError(f"TAKD loss weights must not be negative, got {self.lambda_out}, {self.lambda_task}.")


@dataclass
class RunConfig(ConfigMixin):
    """Everything ``prepare`` decided; later commands read it back instead of re-asking."""

    model: str = "smollm2-135m"
    model_path: str = ""  # the resolved local folder
    model_revision: str = ""  # sha256 over the source config and weights
    profiles: list[str] = field(default_factory=lambda: ["cpu-laptop"])
    messenger_depth: int = 6
    drop_ratio: float = 0.2
    public_data: str = ""
    align_steps: int = 20
    seed: int = 0
    lora: dict = field(default_factory=lambda: LoraSettings().to_dict())
    backbone_lora: dict = field(default_factory=lambda: LoraSettings(rank=8, alpha=16.0, dropout=0.0).to_dict())
    takd: dict = field(default_factory=lambda: TakdConfig().to_dict())
    hyperparameters: dict = field(default_factory=lambda: RoundHyperparams().to_dict())
    algorithm: str = "ciders-fo"  # a strategy in ciders_cloud.strategies
    gamma_schedule: str = "constant"  # constant (hyperparameters.gamma) | protocol-c
    clients: list[str] = field(default_factory=list)  # accepted client ids; empty: any

    def __post_init__(self) -> None:
        if self.messenger_depth < 1:
            raise ConfigError(f"`messenger_depth` must be at least 1, got {self.messenger_depth}.")
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ConfigError(f"`drop_ratio` must be in [0, 1), got {self.drop_ratio}.")
        if self.align_steps < 0:
            raise ConfigError(f"`align_steps` must not be negative, got {self.align_steps}.")
        if not self.profiles:
            raise ConfigError("at least one device profile is needed.")
        if self.gamma_schedule not in ("constant", "protocol-c"):
            raise ConfigError(f"`gamma_schedule` must be constant or protocol-c, got {self.gamma_schedule!r}.")
        get_strategy(self.algorithm)

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
    def round_hyperparams(self) -> RoundHyperparams:
        return RoundHyperparams.from_dict(self.hyperparameters)
