"""Assemble the AdapEmu from a verified bundle: base weights, backbone LoRA merged, messenger LoRA live."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase
from transformers.modeling_utils import no_init_weights

from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.storage import Quantized
from ciders_edge.model.lora import (
    BACKBONE_ADAPTER,
    MESSENGER_ADAPTER,
    LoraSettings,
    attach_lora,
    copy_into,
    load_lora_state,
    lora_parameters,
    peft_config,
)
from ciders_edge.model.quantized import place_quantized
from ciders_edge.model.split import SplitSpec, shift_layers
from ciders_edge.profiles import DTYPES

__all__ = ["EdgeModel", "load_edge_model", "EmulatorCache"]


@dataclass
class EdgeModel:
    """What the edge runtime works with: the AdapEmu, or AdapFu (:mod:`.adapfu`)."""

    model: PeftModel  # the backbone, then the messenger layers with the messenger LoRA as adapter ``messenger``
    split: SplitSpec  # for AdapFu every backbone layer is kept: the messenger starts at n - a
    tokenizer: PreTrainedTokenizerBase
    bundle: Bundle
    backbone: str = "emu"  # emu (the learnable backbone) | full (AdapFu)
    messenger_offset: int = 0  # where this model's messenger layers sit relative to the AdapEmu's
    checkpoint: bool = False  # training recomputes the messenger layers' activations in backward

    def use_messenger(self, x: dict[str, torch.Tensor]) -> None:
        """Load messenger LoRA ``x`` (global v or a personalized x_K, keyed as in the AdapEmu)."""
        copy_into(lora_parameters(self.model, MESSENGER_ADAPTER), shift_layers(x, self.messenger_offset))


def load_edge_model(
    bundle: Bundle, dtype: torch.dtype | None = None, live_backbone: bool = False, quantized: bool = False
) -> EdgeModel:
    """Build the AdapEmu of ``bundle``: the backbone LoRA is merged (it is frozen on the edge), or
    kept as a second adapter when the edge must differentiate through it (the bilevel ask's grad_y f_i).

    With ``quantized``, frozen weights the bundle ships in 8 or 4 bits stay so in memory
    (:mod:`.quantized`); the backbone LoRA then stays a live adapter, since merging would requantize.
    """
    m = bundle.manifest
    split = SplitSpec.from_dict(m["split"])
    config = AutoConfig.from_pretrained(bundle.path)
    dtype = dtype or DTYPES[m["dtype"]]
    if quantized and bundle.quantized:
        base = instantiate_quantized(bundle, config, bundle.base_weights(dtype, keep=True), dtype, "weights")
        live_backbone = True
    else:
        base = instantiate(bundle, config, bundle.base_weights(dtype), dtype, "weights")
    if live_backbone:  # no dropout: the same function as the merged backbone
        frozen = LoraSettings.from_dict(m["backbone_lora"]).replace(dropout=0.0)
        model = attach_lora(base, split, LoraSettings.from_dict(m["lora"]), frozen)
        load_lora_state(model, bundle.backbone_lora(), BACKBONE_ADAPTER)
    else:
        model = attach_lora(_merge_backbone_lora(base, bundle, split), split, LoraSettings.from_dict(m["lora"]))
    load_lora_state(model, {k: v.float() for k, v in bundle.messenger_lora().items()}, MESSENGER_ADAPTER)
    tok = AutoTokenizer.from_pretrained(bundle.path, trust_remote_code=False)
    return EdgeModel(model.eval(), split, tok, bundle)


class EmulatorCache:
    """The AdapEmu of the last bundle this process loaded, kept for its next round on the same bundle.

    A study's actor (or ``simulate``'s own process) trains many clients on one round's bundle, and building
    the model was a quarter of a SmolLM2 client's round. A real edge trains once per bundle and keeps no
    model between rounds, so only a study's jobs ask for it. Each reuse puts back every LoRA tensor as
    loaded: a round moves the messenger's, and validation on the AdapEmu loads rivals into all of them.
    """

    def __init__(self) -> None:
        self.clear()

    def get(self, bundle: Bundle, dtype: torch.dtype | None, live_backbone: bool, quantized: bool) -> EdgeModel:
        """:func:`load_edge_model`'s model, built once per bundle and settings, as loaded."""
        key = (str(bundle.path.resolve()), bundle.bundle_id, dtype, live_backbone, quantized)
        if key != self._key:
            self.clear()
            self._edge = load_edge_model(bundle, dtype, live_backbone, quantized)
            params = dict(self._edge.model.named_parameters())
            self._loaded = {k: p.detach().clone() for k, p in params.items() if ".lora_" in k}
            self._key, self._requires_grad = key, {k: p.requires_grad for k, p in params.items()}
        else:
            with torch.no_grad():
                for k, p in self._edge.model.named_parameters():
                    if k in self._loaded:
                        p.copy_(self._loaded[k])
                    p.requires_grad_(self._requires_grad[k])
            self._edge.model.eval()
        self._edge.bundle = bundle
        return self._edge

    def clear(self) -> None:
        """Let the model go (before a larger one loads: validation's AdapFu)."""
        self._key: tuple | None = None
        self._edge: EdgeModel | None = None
        self._loaded: dict[str, torch.Tensor] = {}
        self._requires_grad: dict[str, bool] = {}


def instantiate(bundle: Bundle, config, weights: dict[str, torch.Tensor], dtype: torch.dtype, what: str):
    """The Hugging Face model of ``config`` holding exactly ``weights`` (a tied head may be absent),
    without the random init it would overwrite; a BundleError names what does not fit."""
    with no_init_weights():
        base = AutoModelForCausalLM.from_config(config).to(dtype)
    # assign: the model takes the loaded tensors as its parameters (no second copy of the weights;
    # the uninitialized ones it had were never touched, so they never took memory)
    weights = {k: v.to(dtype) for k, v in weights.items()}
    missing, unexpected = base.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise BundleError(
            f"{bundle.path}: {what} do not match its config (missing {missing[:2]}, unexpected {unexpected[:2]})"
        )
    base.tie_weights()
    base.generation_config = GenerationConfig.from_pretrained(bundle.path)
    return base


def instantiate_quantized(bundle: Bundle, config, weights: dict, dtype: torch.dtype, what: str):
    """:func:`instantiate` with the ``Quantized`` weights of ``weights`` held as they are stored: the
    model is built without memory for its parameters (PEFT's and accelerate's meta device), the quantized
    layers are placed, then the float tensors (norms, biases) are assigned."""
    from transformers.integrations.accelerate import init_empty_weights

    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) real
        base = AutoModelForCausalLM.from_config(config)
    place_quantized(base, {k: w for k, w in weights.items() if isinstance(w, Quantized)}, dtype)
    floats = {k: v.to(dtype) for k, v in weights.items() if not isinstance(v, Quantized)}
    missing, unexpected = base.load_state_dict(floats, strict=False, assign=True)
    if missing or unexpected:
        raise BundleError(
            f"{bundle.path}: {what} do not match its config (missing {missing[:2]}, unexpected {unexpected[:2]})"
        )
    base.to(dtype)  # the float buffers, as instantiate casts them (the integers and scale bits stay)
    base.generation_config = GenerationConfig.from_pretrained(bundle.path)
    return base


def _merge_backbone_lora(base, bundle: Bundle, split: SplitSpec):
    settings = LoraSettings.from_dict(bundle.manifest["backbone_lora"])
    wrapped = get_peft_model(
        base, peft_config(base, settings, list(range(split.n_kept))), adapter_name=BACKBONE_ADAPTER
    )
    load_lora_state(wrapped, bundle.backbone_lora(), BACKBONE_ADAPTER)
    return wrapped.merge_and_unload()
