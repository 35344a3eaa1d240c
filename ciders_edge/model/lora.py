"""LoRA through PEFT: one adapter on the messenger, another on the learnable backbone.

Both live in one ``PeftModel`` under the names below; the flat ``dict[str, Tensor]`` views use
PEFT's own state-dict keys, so ``adapter/`` folders load in plain PEFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ciders_edge.config import ConfigMixin
from ciders_edge.errors import ConfigError
from ciders_edge.model.families import family_of
from ciders_edge.model.split import SplitSpec
from ciders_edge.tensors import FlatLayout

if TYPE_CHECKING:  # PEFT and transformers load when a model is built, not when a bundle's manifest is read
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

__all__ = [
    "LoraSettings",
    "MESSENGER_ADAPTER",
    "BACKBONE_ADAPTER",
    "attach_lora",
    "set_trainable",
    "lora_state",
    "lora_parameters",
    "copy_into",
    "bind_flat",
    "is_bound",
    "load_lora_state",
    "peft_config",
]

MESSENGER_ADAPTER = "messenger"
BACKBONE_ADAPTER = "backbone"


@dataclass
class LoraSettings(ConfigMixin):
    """LoRA hyperparameters (paper defaults)."""

    rank: int = 4
    alpha: float = 16.0
    dropout: float = 0.05
    targets: list[str] = field(default_factory=list)  # empty: the family's default targets

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"`dropout` must be in [0, 1), got {self.dropout}.")


def peft_config(model: PreTrainedModel, settings: LoraSettings, layers: list[int]) -> LoraConfig:
    """A PEFT ``LoraConfig`` restricted to the AdapEmu layers ``layers``; it also wraps frozen layers
    held quantized (:mod:`.quantized_lora`)."""
    from peft import LoraConfig

    from ciders_edge.model.quantized_lora import CUSTOM_MODULES

    targets = settings.targets or list(family_of(model.config).lora_targets)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        layers_to_transform=layers,
        layers_pattern="layers",
        bias="none",
        task_type="CAUSAL_LM",
    )
    config._register_custom_module(CUSTOM_MODULES)  # PEFT's (experimental) hook for layer types it lacks
    return config


def attach_lora(
    emu: PreTrainedModel, spec: SplitSpec, messenger: LoraSettings, backbone: LoraSettings | None = None
) -> PeftModel:
    """Wrap the AdapEmu with the messenger LoRA (and, on the cloud, the backbone LoRA).

    Both adapters stay active; which one trains is chosen with :func:`set_trainable`.
    """
    from peft import get_peft_model

    model = get_peft_model(emu, peft_config(emu, messenger, spec.emu_messenger), adapter_name=MESSENGER_ADAPTER)
    names = [MESSENGER_ADAPTER]
    if backbone is not None:
        model.add_adapter(BACKBONE_ADAPTER, peft_config(emu, backbone, list(range(spec.n_kept))))
        names.append(BACKBONE_ADAPTER)
    model.base_model.set_adapter(names)
    set_trainable(model, None)
    return model


def set_trainable(model: PeftModel, adapter: str | None) -> None:
    """Make only ``adapter``'s LoRA tensors trainable (``None``: nothing trains)."""
    for name, p in model.named_parameters():
        p.requires_grad_(adapter is not None and f".{adapter}." in name and "lora_" in name)


def lora_state(model: PeftModel, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (detached views, not copies)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()}


def lora_parameters(model: PeftModel, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The adapter's live parameters keyed like :func:`lora_state`, for optimizers and updates."""
    params = dict(model.named_parameters())
    keys = lora_state(model, adapter)
    out = {}
    for key in keys:
        live = key.replace(".lora_A.weight", f".lora_A.{adapter}.weight").replace(
            ".lora_B.weight", f".lora_B.{adapter}.weight"
        )
        out[key] = params[live]
    return out


def copy_into(params: dict[str, torch.nn.Parameter], x: dict[str, torch.Tensor]) -> None:
    """Write the point ``x`` into live LoRA parameters in place (any device, no graph)."""
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(x[name])


def bind_flat(params: dict[str, torch.nn.Parameter], layout: FlatLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-point ``params`` to views of one flat buffer, and their ``.grad`` to views of one flat
    gradient buffer, keeping their values: a point is then loaded with one copy, and backward
    accumulates every gradient into the flat gradient (zero it before each pass).

    Returns:
        ``(flat, grad)``, both in ``layout`` order. Moving or casting the model afterwards, or
        setting a ``.grad`` to ``None``, unbinds them: check with :func:`is_bound`.
    """
    dtypes = {p.dtype for p in params.values()}
    if len(dtypes) > 1:
        raise ConfigError(f"LoRA parameters of several dtypes ({sorted(map(str, dtypes))}) cannot share one buffer")
    with torch.no_grad():
        flat = layout.flatten({k: p.detach() for k, p in params.items()})
    grad = torch.zeros_like(flat)
    views, grads = layout.unflatten(flat), layout.unflatten(grad)
    for name, p in params.items():
        p.data = views[name]
        p.grad = grads[name]
    return flat, grad


def is_bound(params: dict[str, torch.nn.Parameter], flat: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether every parameter and its ``.grad`` still lie inside ``flat`` and ``grad`` (see :func:`bind_flat`)."""
    return all(_inside(p, flat) and p.grad is not None and _inside(p.grad, grad) for p in params.values())


def _inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return (
        t.dtype == buffer.dtype
        and t.device == buffer.device
        and start <= t.data_ptr()
        and t.data_ptr() + t.numel() * t.element_size() <= start + buffer.numel() * buffer.element_size()
    )


def load_lora_state(model: PeftModel, state: dict[str, torch.Tensor], adapter: str) -> None:
    """Load ``state`` into ``adapter``; every tensor must match by name and shape."""
    expected = lora_state(model, adapter)
    if set(expected) != set(state):
        missing = sorted(set(expected) - set(state))[:2]
        extra = sorted(set(state) - set(expected))[:2]
        raise ConfigError(f"{adapter} LoRA tensors do not match the model: missing {missing}, unexpected {extra}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ConfigError(
                f"{adapter} LoRA tensor {k} has shape {tuple(v.shape)}, model expects {tuple(expected[k].shape)}"
            )
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state, adapter_name=adapter)
