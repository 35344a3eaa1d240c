"""Algorithm 1: split a decoder-only LLM into full backbone, learnable backbone and messenger.

The AdapEmu (``P_M ∘ B_L``) is built as an ordinary Hugging Face model of ``n' + a`` layers —
the kept backbone layers followed by the messenger layers — so every tool that loads a causal
LM (generation, PEFT, export) works on it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ciders_edge.errors import ConfigError
from ciders_edge.model.families import family_of

if TYPE_CHECKING:  # transformers loads when a model is split, not when a manifest's split is read
    from transformers import PreTrainedModel

__all__ = ["SplitSpec", "kept_indices", "build_adapemu", "shift_layers", "rename_layer", "layer_of"]


def kept_indices(n_backbone: int, beta: float) -> list[int]:
    """Indices of the learnable backbone's layers: ``floor(j*(n-a-1)/(n'-1))``, j = 0..n'-1."""
    n_kept = math.floor(beta * n_backbone + 1e-9)
    if n_kept < 2:
        raise ConfigError(
            f"the learnable backbone needs at least 2 layers, got floor({beta}*{n_backbone}) = {n_kept}; "
            "use a smaller drop ratio or a shallower messenger"
        )
    return [math.floor(j * (n_backbone - 1) / (n_kept - 1)) for j in range(n_kept)]


@dataclass(frozen=True)
class SplitSpec:
    """How a model of ``n`` layers is split.

    Attributes:
        n: number of transformer layers of the original model.
        a: messenger depth (top layers that carry the messenger LoRA).
        beta: fraction of the ``n - a`` backbone layers kept; ``drop_ratio = 1 - beta``.
        trained: how many of the messenger's layers, from the top, this edge trains (its profile's
            messenger depth ``a_p``; 0: all ``a``). The lower ``a - a_p`` stay at the global messenger.
    """

    n: int
    a: int
    beta: float
    trained: int = 0
    kept: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.a < self.n:
            raise ConfigError(f"messenger depth must be in 1..{self.n - 1} for a {self.n}-layer model, got {self.a}")
        if not 0.0 < self.beta <= 1.0:
            raise ConfigError(f"beta must be in (0, 1] (drop ratio in [0, 1)), got beta={self.beta}")
        if not 0 <= self.trained <= self.a:
            raise ConfigError(f"a profile trains 1..{self.a} of the messenger's {self.a} layers, got {self.trained}")
        object.__setattr__(self, "trained", self.trained or self.a)
        object.__setattr__(self, "kept", kept_indices(self.n - self.a, self.beta))

    @classmethod
    def from_drop_ratio(cls, n: int, a: int, drop_ratio: float, trained: int = 0) -> SplitSpec:
        if not 0.0 <= drop_ratio < 1.0:
            raise ConfigError(f"drop ratio must be in [0, 1), got {drop_ratio}")
        return cls(n=n, a=a, beta=1.0 - drop_ratio, trained=trained)

    @property
    def n_kept(self) -> int:
        return len(self.kept)

    @property
    def emu_layers(self) -> int:
        """Layers of the AdapEmu: kept backbone layers, then the messenger."""
        return self.n_kept + self.a

    @property
    def messenger_source(self) -> list[int]:
        """Original indices of the messenger layers."""
        return list(range(self.n - self.a, self.n))

    @property
    def emu_messenger(self) -> list[int]:
        """AdapEmu indices of the messenger layers."""
        return list(range(self.n_kept, self.emu_layers))

    @property
    def first_trained(self) -> int:
        """AdapEmu index of the lowest messenger layer this edge trains: everything below is frozen."""
        return self.emu_layers - self.trained

    def trains(self, key: str) -> bool:
        """Whether messenger LoRA tensor ``key`` (AdapEmu naming) is of a layer this edge trains."""
        return (layer_of(key) or 0) >= self.first_trained

    def to_dict(self) -> dict:
        """As a manifest writes it; ``trained`` only when it is not the whole messenger."""
        d = asdict(self)
        if self.trained == self.a:
            del d["trained"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SplitSpec:
        spec = cls(n=int(d["n"]), a=int(d["a"]), beta=float(d["beta"]), trained=int(d.get("trained", 0)))
        if "kept" in d and list(d["kept"]) != spec.kept:
            raise ConfigError(f"kept layer indices {d['kept']} do not match n={spec.n}, a={spec.a}, beta={spec.beta}")
        return spec


def emu_layer_source(spec: SplitSpec) -> list[int]:
    """For each AdapEmu layer, the index of the original layer it copies."""
    return spec.kept + spec.messenger_source


def build_adapemu(model: PreTrainedModel, spec: SplitSpec, own: Collection[int] | None = None) -> PreTrainedModel:
    """Return the AdapEmu ``P_M ∘ B_L`` of ``model`` as a new model (the original is untouched).

    Args:
        own: ``None`` (the default): every tensor is a copy. Otherwise the AdapEmu layers (its indices)
            that get their own copy; every other tensor is ``model``'s own, shared, for a caller that
            keeps ``model`` and never changes those (the cloud's teacher), so the weights are in memory once.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    family_of(model.config)
    if model.config.num_hidden_layers != spec.n:
        raise ConfigError(f"split is for {spec.n} layers but the model has {model.config.num_hidden_layers}")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = spec.emu_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [model.config.layer_types[i] for i in emu_layer_source(spec)]
    with no_init_weights():  # every weight is overwritten below, or replaced (``own``: its memory is never touched)
        if own is None:
            emu = AutoModelForCausalLM.from_config(config).to(model.dtype)
        else:  # built in the model's dtype, as the model was: its buffers too (a bf16 config's would be rounded)
            emu = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    state = _remap(model.state_dict(), emu_layer_source(spec), own)
    missing, unexpected = emu.load_state_dict(state, strict=False, assign=own is not None)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"AdapEmu assembly mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    emu.tie_weights()
    emu.generation_config = model.generation_config
    return emu.eval()


def _remap(
    state: dict[str, torch.Tensor], source: list[int], own: Collection[int] | None = None
) -> dict[str, torch.Tensor]:
    """Rename ``layers.{src}.`` keys to ``layers.{dst}.``; tensors are cloned (with ``own``: those of
    the layers ``dst`` in it) so nothing is shared that may change."""
    out = {k: v if own is not None else v.clone() for k, v in state.items() if ".layers." not in k}
    for dst, src in enumerate(source):
        prefix = f"model.layers.{src}."
        for k, v in state.items():
            if k.startswith(prefix):
                out[f"model.layers.{dst}.{k[len(prefix) :]}"] = v.clone() if own is None or dst in own else v
    return out


def layer_of(key: str) -> int | None:
    """The decoder layer index in a tensor name (``...layers.{i}....``), or ``None``."""
    _, sep, rest = key.partition("layers.")
    index = rest.partition(".")[0]
    return int(index) if sep and index.isdigit() else None


def rename_layer(key: str, offset: int, first: int = 0) -> str:
    """``key`` with ``layers.{i}.`` renamed ``layers.{i + offset}.`` when ``i >= first``."""
    index = layer_of(key)
    if index is None or index < first:
        return key
    head, _, rest = key.partition("layers.")
    return f"{head}layers.{index + offset}{rest[len(str(index)) :]}"


def shift_layers(tensors: dict[str, torch.Tensor], offset: int, first: int = 0) -> dict[str, torch.Tensor]:
    """Rename ``layers.{i}.`` to ``layers.{i + offset}.`` for every ``i >= first``: the messenger's
    layers sit at ``n'..n'+a-1`` in the AdapEmu and at ``n-a..n-1`` in AdapFu, and a learnable
    backbone of another drop ratio moves them by the difference of the two ``n'``."""
    return {rename_layer(k, offset, first): v for k, v in tensors.items()}
