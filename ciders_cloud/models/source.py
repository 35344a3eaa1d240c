"""The source model M* as the cloud holds it: in which dtype (``RunConfig.teacher_dtype``), and loaded so
that its peak memory is the model's own.

The teacher is frozen and the AdapEmu shares its weights (:func:`ciders_edge.model.split.build_adapemu`
with ``own``), so the teacher's dtype is that of every frozen weight on the cloud. fp32 is the reference:
small models keep it, and their runs stay bit-identical to the runs before there was a choice. From
:data:`BF16_FROM` parameters ``auto`` picks bf16, which halves what prepare, distill and aggregate hold
(SmolLM2-1.7B: 3.4 GB instead of 6.8); what trains (the bootstrap's layers, the LoRAs and their AdamW
moments) stays fp32. On the CPU everything computes in fp32, each bf16 weight widened where it is used;
CUDA computes in bf16 autocast as it does over fp32 weights (:meth:`CloudModels.autocast`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.modeling_utils import no_init_weights

from ciders_cloud.run.config import RunConfig
from ciders_edge.model.sources import load_model

__all__ = ["BF16_FROM", "DTYPES", "teacher_dtype", "parameter_count", "load_teacher"]

BF16_FROM = 1_000_000_000  # parameters: `auto` holds a model this large in bf16, a smaller one in fp32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def teacher_dtype(run: RunConfig) -> str:
    """The run's teacher dtype by name: as set, or for ``auto`` bf16 from :data:`BF16_FROM` parameters."""
    if run.teacher_dtype != "auto":
        return run.teacher_dtype
    return "bf16" if parameter_count(run.model_path) >= BF16_FROM else "fp32"


@functools.cache
def parameter_count(model_path: str) -> int:
    """The model's parameters (tied ones once), from its config alone: built on the meta device, no memory."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def load_teacher(path: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """M*, frozen, in ``dtype`` on ``device``.

    fp32 is the toolkit's own load (its tensors map the checkpoint lazily). Another dtype is read one
    tensor at a time into a model built empty, each file opened only for its tensor: transformers'
    converting load keeps the whole checkpoint mapped until it returns, and its pages count beside the
    converted copy (SmolLM2-1.7B: a 10 GB peak for a 3.4 GB model). A checkpoint whose tensor names are
    not the model's own (one transformers renames on load) takes transformers' load instead.
    """
    files = sorted(path.glob("*.safetensors"))
    if dtype == torch.float32 or not files:
        return load_model(path, dtype).to(device).eval().requires_grad_(False)
    config = AutoConfig.from_pretrained(path)
    with no_init_weights():  # every weight is replaced below: its memory is never touched
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = model.state_dict(keep_vars=True)
    names = {name: f for f in files for name in _tensor_names(f)}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(names) != set(params) - tied:
        return load_model(path, dtype).to(device).eval().requires_grad_(False)
    for name, file in names.items():
        with safe_open(file, "pt") as f:  # closed at once: no page of the file stays mapped
            params[name].data = f.get_tensor(name).to(device, dtype)
    model.to(device).tie_weights()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval().requires_grad_(False)


def _tensor_names(file: Path) -> list[str]:
    with safe_open(file, "pt") as f:
        return list(f.keys())
