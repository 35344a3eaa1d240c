"""AdapFu: the messenger on the full backbone B_F, the paper's full-model deployment (Protocol A).

AdapFu is the base model's first ``n - a`` layers, unchanged (no TAKD LoRA), then the messenger
layers with a messenger LoRA. Edges train on the AdapEmu; a device that can hold the full model runs
the messenger it trained on AdapFu instead. The full backbone comes from the bundle's
``full_backbone/`` files (the source layers its backbone file does not already hold unchanged, written
once per run for profiles that deploy AdapFu), or from a local copy of the base model, which is
accepted only when its content hash is the one the manifest records.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from ciders_edge.errors import BundleError, ModelError
from ciders_edge.formats.bundle import BACKBONE_FILE, FULL_DIR, FULL_WEIGHTS, MESSENGER_LAYERS_FILE, Bundle
from ciders_edge.model.adapemu import EdgeModel, instantiate, instantiate_quantized
from ciders_edge.model.lora import LoraSettings, attach_lora
from ciders_edge.model.sources import model_revision, resolve_model
from ciders_edge.model.split import SplitSpec, shift_layers
from ciders_edge.profiles import DTYPES

__all__ = ["load_adapfu", "full_backbone_source"]

EMBED = "model.embed_tokens.weight"


def full_backbone_source(
    bundle: Bundle, base_model: str | Path | None = None, dtype: torch.dtype | None = None, keep: bool = False
) -> tuple[PretrainedConfig, dict]:
    """The source model's config and its embeddings plus layers ``0..n-a-1`` (``keep``: the bundle's
    int8/int4 weights as stored).

    Raises:
        BundleError: the bundle holds no full backbone and no ``base_model`` was given.
        ModelError: ``base_model`` is not the model the run was prepared from.
    """
    m = bundle.manifest
    split = SplitSpec.from_dict(m["split"])
    wanted = [EMBED, *(f"model.layers.{i}." for i in range(split.n - split.a))]
    if base_model is not None:
        return _from_local_copy(bundle, base_model, wanted)
    if not bundle.has_full_backbone:
        model, revision = m["base_model"]["id"], m["base_model"]["revision"]
        raise BundleError(
            f"--backbone full: {bundle.path} carries no full backbone (profile {m['profile']['name']} deploys "
            f"the AdapEmu); pass --base-model with a local copy of {model} (content hash {revision[:16]}…), "
            "or use --backbone emu"
        )
    shipped = bundle.tensors(FULL_WEIGHTS, dtype, keep)
    backbone = bundle.tensors(BACKBONE_FILE, dtype, keep)
    weights = {EMBED: backbone[EMBED], **shipped}
    for j, i in enumerate(split.kept):
        if not any(k.startswith(f"model.layers.{i}.") for k in shipped):
            layer = {k: v for k, v in backbone.items() if k.startswith(f"model.layers.{j}.")}
            weights.update(shift_layers(layer, i - j))
    return AutoConfig.from_pretrained(bundle.path / FULL_DIR), weights


def _from_local_copy(bundle: Bundle, base_model: str | Path, wanted: list[str]) -> tuple[PretrainedConfig, dict]:
    m = bundle.manifest
    path = resolve_model(str(base_model))
    digest, expected = model_revision(path), m["base_model"]["revision"]
    if digest != expected:
        raise ModelError(
            f"{path}: content hash {digest[:16]}… is not the base model this run was prepared from "
            f"({m['base_model']['id']}, {expected[:16]}…); refusing it"
        )
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            weights.update({k: st.get_tensor(k) for k in st.keys() if any(k.startswith(w) for w in wanted)})
    return AutoConfig.from_pretrained(path), weights


def load_adapfu(
    bundle: Bundle, dtype: torch.dtype | None = None, base_model: str | Path | None = None, quantized: bool = False
) -> EdgeModel:
    """AdapFu of ``bundle`` with its global messenger LoRA live (load another with ``use_messenger``);
    ``quantized``: the bundle's int8/int4 frozen weights stay so in memory."""
    m = bundle.manifest
    split = SplitSpec.from_dict(m["split"])
    full = SplitSpec(split.n, split.a, 1.0, split.trained)  # every backbone layer kept: the messenger starts at n - a
    keep = quantized and bundle.quantized
    config, weights = full_backbone_source(bundle, base_model, dtype, keep)
    offset = full.n_kept - split.n_kept
    weights.update(shift_layers(bundle.tensors(MESSENGER_LAYERS_FILE, dtype, keep), offset, first=split.n_kept))
    build = instantiate_quantized if keep else instantiate
    base = build(bundle, config, weights, dtype or DTYPES[m["dtype"]], "the full backbone's weights")
    model = attach_lora(base, full, LoraSettings.from_dict(m["lora"]))
    tok = AutoTokenizer.from_pretrained(bundle.path, trust_remote_code=False)
    edge = EdgeModel(model.eval(), full, tok, bundle, backbone="full", messenger_offset=offset)
    edge.use_messenger({k: v.float() for k, v in bundle.messenger_lora().items()})
    return edge
