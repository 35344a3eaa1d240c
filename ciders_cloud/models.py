"""The cloud's models: the frozen full model M* (teacher) and the AdapEmu with both LoRAs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from ciders_edge.architectures import family_of
from ciders_edge.lora import BACKBONE, MESSENGER, attach_lora, load_lora_state, lora_state
from ciders_edge.models import load_model, load_tokenizer
from ciders_edge.split import SplitSpec, build_adapemu

from .config import RunConfig
from .state import ServerState

__all__ = ["CloudModels", "build_cloud_models", "split_for"]


@dataclass
class CloudModels:
    teacher: PreTrainedModel  # M*: B_F followed by the original top layers; frozen
    emu: PeftModel  # AdapEmu = P_M ∘ B_L with adapters `messenger` (v) and `backbone`
    base_weights: dict[str, torch.Tensor]  # AdapEmu weights without LoRA, for bundles
    split: SplitSpec
    tokenizer: PreTrainedTokenizerBase

    def messenger_state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in lora_state(self.emu, MESSENGER).items()}

    def load_messenger(self, v: dict[str, torch.Tensor]) -> None:
        """Hold ``v`` as the messenger LoRA (for TAKD after aggregation)."""
        load_lora_state(self.emu, v, MESSENGER)

    def backbone_state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in lora_state(self.emu, BACKBONE).items()}


def split_for(run: RunConfig) -> SplitSpec:
    """The run's split, from the model's config alone."""
    config = AutoConfig.from_pretrained(run.model_path)
    family_of(config)
    return SplitSpec.from_drop_ratio(config.num_hidden_layers, run.messenger_depth, run.drop_ratio)


def build_cloud_models(run: RunConfig, state: ServerState | None = None) -> CloudModels:
    """Load M*, build its AdapEmu, attach the LoRAs (seeded) and, if given, load their state."""
    path = Path(run.model_path)
    split = split_for(run)
    teacher = load_model(path).eval().requires_grad_(False)
    emu = build_adapemu(teacher, split)
    base = {k: v for k, v in emu.state_dict().items()}
    if emu.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    torch.manual_seed(run.seed)
    model = attach_lora(emu, split, run.lora_settings, run.backbone_lora_settings).eval()
    if state is not None:
        load_lora_state(model, state.messenger, MESSENGER)
        load_lora_state(model, state.backbone, BACKBONE)
    return CloudModels(teacher, model, base, split, load_tokenizer(path))
