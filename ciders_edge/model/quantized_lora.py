"""PEFT's LoRA layer over a :class:`~ciders_edge.model.quantized.QuantizedLinear` (imported where PEFT is).

PEFT's own ``Linear`` computes ``base(x) + B A x``; only finding the base layer's sizes and merging need
its weight, which a quantized layer does not have as one tensor. Merging is refused: folding LoRA into
8- or 4-bit weights would requantize them (dequantize at load to merge).
"""

from __future__ import annotations

from peft.tuners.lora.layer import Linear

from ciders_edge.errors import ModelError
from ciders_edge.model.quantized import QuantizedLinear

__all__ = ["LoraQuantizedLinear", "CUSTOM_MODULES"]


class LoraQuantizedLinear(Linear):
    """LoRA on a frozen quantized linear layer; the LoRA itself is float, as on any other layer."""

    def _get_in_out_features(self, module: QuantizedLinear) -> tuple[int, int]:
        return module.in_features, module.out_features

    def merge(self, *args, **kwargs) -> None:
        raise ModelError("LoRA cannot be merged into weights held in 8 or 4 bits; load them dequantized to merge")


CUSTOM_MODULES = {QuantizedLinear: LoraQuantizedLinear}  # what PEFT's LoraConfig._register_custom_module takes
