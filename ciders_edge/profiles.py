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

import torch
from rich.markup import escape

from ciders_edge.config import ConfigMixin, read_toml
from ciders_edge.errors import ConfigError
from ciders_edge.formats.storage import STORAGES
from ciders_edge.progress import console

__all__ = [
    "DeviceProfile",
    "list_profiles",
    "load_profile",
    "is_shipped",
    "detect_profile",
    "pick_device",
    "profile_for",
    "keeps_quantized",
    "check_frozen_weights",
    "BACKBONES",
    "FROZEN_WEIGHTS",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGETS = ("cpu", "cuda", "jetson")
BACKBONES = ("full", "emu")  # AdapFu: the messenger on the full backbone; AdapEmu: on the learnable one
FROZEN_WEIGHTS = ("quantized", "dequantized")  # int8/int4 frozen weights in memory: as stored, or float from load
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
        "frozen_weights": FROZEN_WEIGHTS,
    }

    name: str = "custom"
    description: str = ""
    target: str = "cpu"  # cpu | cuda | jetson
    dtype: str = "float32"  # compute dtype of the frozen parts; LoRA always trains in float32
    storage: str = "int8"  # how a bundle ships the frozen weights: fp32 | bf16 | int8 | int4
    # int8/int4 frozen weights while training and running: quantized (kept as stored, dequantized block by
    # block inside each matmul) | dequantized (into `dtype` once, at load: 4 or 2 bytes a weight, a little faster)
    frozen_weights: str = "quantized"
    gradient_checkpointing: bool = False  # keep only each trained messenger layer's input; recompute in backward
    return_freed_memory: bool = False  # glibc gives freed blocks back (ciders_edge/allocator.py): less memory, more CPU
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


def profile_for(profile: str | None, bundle_profile: dict) -> DeviceProfile:
    """The profile a command runs with: the one named (``auto``, a name or a path), else the one the
    bundle was made for (its manifest's copy; keys it predates take their defaults)."""
    return load_profile(profile) if profile else DeviceProfile.from_dict(bundle_profile, where="the bundle's profile")


def keeps_quantized(flag: str | None, profile: DeviceProfile | None, bundle_profile: dict) -> bool:
    """Whether int8/int4 frozen weights stay quantized in memory: ``--frozen-weights``, else the profile
    named, else the bundle's."""
    check_frozen_weights(flag)
    return (flag or (profile or profile_for(None, bundle_profile)).frozen_weights) == "quantized"


def check_frozen_weights(flag: str | None) -> None:
    """Refuse a ``--frozen-weights`` that is not one of :data:`FROZEN_WEIGHTS`."""
    if flag not in (None, *FROZEN_WEIGHTS):
        raise ConfigError(f"--frozen-weights must be one of {', '.join(FROZEN_WEIGHTS)}, got {flag!r}")


def _shipped() -> dict[str, Path]:
    root = files("device_profiles")
    return {p.name.removesuffix(".toml"): Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def _own() -> dict[str, Path]:
    """The user's profiles: ``$CIDERS_HOME/profiles/<name>.toml``."""
    from ciders_edge.model.sources import ciders_home

    return {p.stem: p for p in sorted((ciders_home() / "profiles").glob("*.toml"))}


def is_shipped(name: str) -> bool:
    """Whether ``name`` is a profile the toolkit ships (every install has it)."""
    return name in _shipped()


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
