"""``--format peft``: the personalized messenger as a standard PEFT LoRA adapter of the base model.

On AdapFu the backbone is the base model's own first ``n - a`` layers, unchanged, and the messenger is
its top ``a`` layers with a LoRA: that is an ordinary LoRA adapter of the base model, restricted to those
layers (``layers_to_transform``). Written with PEFT's own config and tensor names, it loads where Hugging
Face users carry LoRA: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)``,
vLLM's ``--lora-modules``, TGI, ollama's safetensors ``ADAPTER``, llama.cpp's ``convert_lora_to_gguf.py``.

The AdapEmu drops layers, so no released model is its base: that export is refused (``--format hf``
writes the AdapEmu whole).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ciders_edge.errors import ConfigError
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.lora import MESSENGER_ADAPTER

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "check_peft", "save_peft", "peft_model"]

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names (peft.utils.CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def check_peft(backbone: str) -> None:
    """Refuse what no base model runs: the messenger trained on the AdapEmu, exported on the AdapEmu."""
    if backbone != "full":
        raise ConfigError(
            "--format peft is a LoRA adapter of the base model, so it needs --backbone full (AdapFu); the AdapEmu "
            "drops layers and no released model is its base: export it whole with --format hf"
        )


def save_peft(edge: EdgeModel, folder: Path, base_model: dict) -> dict:
    """Write AdapFu's messenger LoRA into ``folder`` as PEFT writes an adapter, with the tokenizer and a
    README; returns the manifest's ``peft`` entry. ``edge`` is left as it was (LoRA live)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    live = edge.model.peft_config[MESSENGER_ADAPTER]
    base = _base_name(base_model)
    config = LoraConfig(
        r=live.r,
        lora_alpha=live.lora_alpha,
        lora_dropout=live.lora_dropout,
        target_modules=sorted(live.target_modules),
        layers_to_transform=list(live.layers_to_transform),
        layers_pattern=live.layers_pattern,
        bias=live.bias,
        task_type=live.task_type,
        base_model_name_or_path=base,
        inference_mode=True,
    )
    config.save_pretrained(str(folder))
    state = get_peft_model_state_dict(edge.model, adapter_name=MESSENGER_ADAPTER)
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}, folder / ADAPTER_WEIGHTS)
    edge.tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(_readme(base, base_model, config))
    return {
        "peft": {
            "base_model": base,
            "base_revision": base_model.get("revision", ""),
            "layers": config.layers_to_transform,
            "r": config.r,
            "alpha": config.lora_alpha,
            "target_modules": sorted(config.target_modules),
        }
    }


def peft_model(folder: Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` (a transformers model without LoRA) with the adapter in ``folder``, loaded by PEFT."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder), is_trainable=False).eval()


def _base_name(base_model: dict) -> str:
    """The base model as PEFT records it: the Hugging Face id the run's model was loaded as, where known."""
    name = str(base_model.get("name_or_path") or "")
    return name if name and not Path(name).is_absolute() else str(base_model.get("id", ""))


def _readme(base: str, base_model: dict, config) -> str:
    layers = ", ".join(str(i) for i in config.layers_to_transform)
    return f"""# A personalized messenger as a PEFT LoRA adapter

The LoRA (rank {config.r}, alpha {config.lora_alpha:g}) of layers {layers} of `{base}`, on
{", ".join(sorted(config.target_modules))}, written by `ciders-edge export --format peft`. Its base is the base model
itself (content hash `{base_model.get("revision", "?")[:16]}…` when the run was prepared): the layers below
the messenger are the base model's own.

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "THIS_FOLDER")
model = model.merge_and_unload()  # optional: plain transformers weights
```

vLLM: `vllm serve {base} --enable-lora --lora-modules personal=THIS_FOLDER`. llama.cpp:
`python convert_lora_to_gguf.py THIS_FOLDER --base BASE_FOLDER` gives an adapter GGUF for the base GGUF.
"""
