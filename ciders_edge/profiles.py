"""Device profiles: what a class of device trains and runs, and whether a model fits it.

Profiles are TOML files whose keys equal :class:`DeviceProfile`'s fields. The shipped ones live
in the ``device_profiles`` package, your own in ``$CIDERS_HOME/profiles`` (by name, as the shipped ones:
what a simulation names bundles by); a path to any ``.toml`` file works too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.markup import escape

from ciders_edge.config import ConfigMixin, read_toml
from ciders_edge.errors import ConfigError
from ciders_edge.formats.storage import STORAGES
from ciders_edge.progress import console

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "DeviceProfile",
    "MemoryEstimate",
    "list_profiles",
    "load_profile",
    "detect_profile",
    "estimate_memory",
    "pick_device",
    "BACKBONES",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGETS = ("cpu", "cuda", "jetson")
BACKBONES = ("full", "emu")  # AdapFu: the messenger on the full backbone; AdapEmu: on the learnable one
GIB = 1024**3


@dataclass
class DeviceProfile(ConfigMixin):
    """One class of edge device."""

    CHOICES = {
        "target": TARGETS,
        "dtype": tuple(DTYPES),
        "storage": STORAGES,
        "runtime": ("torch", "onnx"),
        "backbone": BACKBONES,
        "quantization": ("none", "int8"),
    }

    name: str = "custom"
    description: str = ""
    target: str = "cpu"  # cpu | cuda | jetson
    dtype: str = "float32"  # compute dtype of the frozen parts; LoRA always trains in float32
    storage: str = "int8"  # how a bundle ships the frozen weights: fp32 | bf16 | int8 | int4 (dequantized at load)
    memory_budget_gb: float = 8.0  # memory the toolkit may use on the device
    messenger_depth: int = 6
    drop_ratio: float = 0.2
    lora_rank: int = 4
    seq_len: int = 256
    batch_size: int = 2
    grad_accum: int = 1
    runtime: str = "torch"  # torch | onnx
    execution_providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    quantization: str = "none"  # none | int8
    backbone: str = "full"  # what the device deploys: full (AdapFu) when the full model fits the budget, else emu

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        try:
            super().__post_init__()
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ConfigError(f"{where}: `drop_ratio` must be in [0, 1), got {self.drop_ratio}.")
        if self.memory_budget_gb <= 0:
            raise ConfigError(f"{where}: `memory_budget_gb` must be positive, got {self.memory_budget_gb}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _shipped() -> dict[str, Path]:
    root = files("device_profiles")
    return {p.name.removesuffix(".toml"): Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def _own() -> dict[str, Path]:
    """The user's profiles: ``$CIDERS_HOME/profiles/<name>.toml``."""
    from ciders_edge.model.sources import ciders_home

    return {p.stem: p for p in sorted((ciders_home() / "profiles").glob("*.toml"))}


def _named() -> dict[str, Path]:
    return _own() | _shipped()  # a shipped name is never shadowed


def list_profiles() -> list[DeviceProfile]:
    """Every shipped profile and the user's own, by name."""
    return [load_profile(name) for name in sorted(_named())]


def load_profile(name_or_path: str) -> DeviceProfile:
    """A shipped or own profile by name, ``auto`` for the detected device, or a path to a TOML file."""
    if name_or_path == "auto":
        return detect_profile()
    path = _named().get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"unknown profile {name_or_path!r}; known: {', '.join(sorted(_named()))}, or a .toml path")
    return DeviceProfile.from_dict(read_toml(path), where=str(path))


def detect_profile() -> DeviceProfile:
    """Pick the shipped profile for this device: Jetson, then CUDA by memory, then CPU by memory."""
    if Path("/etc/nv_tegra_release").exists():
        total = _system_memory_gb()
        return load_profile("jetson-agx-orin-64gb" if total > 24 else "jetson-orin-nano-8gb")
    if torch.cuda.is_available():
        return load_profile("cuda-24gb")
    return load_profile("cpu-laptop" if _system_memory_gb() >= 12 else "rpi5-8gb")


def pick_device(profile: DeviceProfile | None) -> torch.device:
    """Where a profile runs torch: its GPU when it targets one and one is there, else the CPU (with
    one notice per profile: a GPU profile on the CPU is slow and should not be so without a word)."""
    if profile is None or profile.target not in ("cuda", "jetson"):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if profile.name not in _NOTED_CPU:
        _NOTED_CPU.add(profile.name)
        console.print(
            f"[yellow]notice:[/] profile {escape(profile.name)} targets {profile.target}, but torch sees no CUDA "
            "device here; running on the CPU",
            highlight=False,
            soft_wrap=True,
        )
    return torch.device("cpu")


_NOTED_CPU: set[str] = set()  # GPU profiles already noted as running on the CPU


def _system_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


@dataclass
class MemoryEstimate:
    """Bytes needed to train the messenger on a device, by part (an upper-end estimate)."""

    weights: int
    lora: int  # LoRA tensors, their gradients and AdamW's two moments (float32)
    activations: int  # messenger activations kept for backward, plus response logits
    budget: int

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        gb = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (
            f"needs {gb(self.total)} (weights {gb(self.weights)}, LoRA+optimizer {gb(self.lora)}, "
            f"activations {gb(self.activations)}) of a {gb(self.budget)} budget"
        )


def estimate_memory(
    config: PretrainedConfig, n_emu_layers: int, messenger_depth: int, profile: DeviceProfile
) -> MemoryEstimate:
    """Estimate training memory of an AdapEmu from its config alone (no weights loaded)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn = h * head_dim * (2 * heads + 2 * kv)
    per_layer = attn + 3 * h * i + 2 * h
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    itemsize = torch.finfo(profile.torch_dtype).bits // 8
    weights = (per_layer * n_emu_layers + embed + h) * itemsize
    r = profile.lora_rank
    lora_per_layer = r * ((h + heads * head_dim) * 2 + (h + kv * head_dim) * 2 + 2 * (h + i) + (i + h))
    lora = lora_per_layer * messenger_depth * 4 * 4  # value, grad, two AdamW moments
    tokens = profile.batch_size * profile.seq_len
    per_token_layer = 10 * h + 4 * i  # kept tensors of one decoder block for backward
    attn_scores = profile.batch_size * heads * profile.seq_len**2
    acts = messenger_depth * (tokens * per_token_layer + attn_scores) * 4 + 2 * tokens * v * 4
    return MemoryEstimate(weights, lora, acts, int(profile.memory_budget_gb * GIB))
