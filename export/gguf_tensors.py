"""GGUF files the way llama.cpp's own converters write them, with gguf-py's writer and quantizers.

Names come from gguf-py's tensor map for the model's llama.cpp architecture (:mod:`export.gguf_arch`:
llama, qwen2, qwen3, gemma3); for the llama architecture q_proj and k_proj rows are permuted as
``convert_hf_to_gguf.py`` does (``LlamaModel.permute``: llama.cpp rotates adjacent pairs, transformers
the two halves of each head), and Gemma's norms are written as ``1 + w``. A LoRA adapter is written as
``convert_lora_to_gguf.py`` writes one: ``<base tensor>.lora_a`` is A (rank x in), ``.lora_b`` is B
(out x rank) with B's rows permuted like the base weight's, both float32, and ``adapter.lora.alpha``
(llama.cpp scales by alpha / rank, as PEFT does).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig

from ciders_edge.errors import ExportError
from export.gguf_arch import GgufArch, extra_tensors, gguf_arch, write_hparams

__all__ = [
    "GGUF_TYPES",
    "SmolLM2Vocab",
    "gguf_name",
    "permute",
    "unpermute",
    "write_model",
    "write_adapter",
    "read_adapter",
    "read_model",
]

# --quantize -> (type of the 2-D weights, llama.cpp's file type); norms stay float32
GGUF_TYPES = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
# the embedding (also the LM head when tied) keeps 8 bits under 4-bit weights, as the embedded base does
EMBEDDING_FLOOR = gguf.GGMLQuantizationType.Q8_0


class SmolLM2Vocab:
    """The tokenizer metadata of a GGUF (``tokenizer.*`` keys), to copy into the GGUFs we write."""

    def __init__(self, path: Path) -> None:
        reader = gguf.GGUFReader(path)
        self.fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        self.tokens: list[str] = self.fields["tokenizer.ggml.tokens"].contents()

    @classmethod
    @functools.cache
    def of(cls, path: Path) -> SmolLM2Vocab:
        """Read once per process: parsing 98k strings out of a GGUF takes seconds."""
        return cls(path)

    @property
    def chat_template(self) -> str:
        return self.fields["tokenizer.chat_template"].contents()

    @property
    def default_system(self) -> str:
        """The system prompt the chat template inserts when a chat has none."""
        m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", self.chat_template)
        return m.group(1) if m else ""

    def check(self, vocab: dict[str, int], what: str) -> None:
        """Refuse a model whose tokenizer is not this vocabulary (the metadata would be wrong)."""
        if sorted(vocab, key=vocab.get) != self.tokens:
            raise ExportError(
                f"{what}: its tokenizer is not SmolLM2's ({len(vocab)} tokens), so `--format gguf` cannot write "
                "its vocabulary; export --format hf and convert it with llama.cpp's convert_hf_to_gguf.py"
            )

    def add_to(self, writer: gguf.GGUFWriter, n_vocab: int) -> None:
        """Write the tokenizer keys for a model of ``n_vocab`` embedding rows: ids past the tokenizer's
        get ``[PAD<i>]`` tokens of type UNUSED, as ``convert_hf_to_gguf.py`` writes them (Qwen's configs
        have more rows than tokens; llama.cpp refuses a GGUF whose token list is shorter than its embedding)."""
        pad = max(n_vocab - len(self.tokens), 0)
        padding = {
            "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(self.tokens), n_vocab)],
            "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
        }
        for key, f in self.fields.items():
            kind = f.types[0]
            sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            value = f.contents() + padding[key] if key in padding else f.contents()
            writer.add_key_value(key, value, kind, sub)


def gguf_name(hf_name: str, n_layers: int, arch: gguf.MODEL_ARCH = gguf.MODEL_ARCH.LLAMA) -> str:
    """The GGUF name of a transformers tensor (``model.layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``) in llama.cpp's architecture ``arch``."""
    name = gguf.get_tensor_name_map(arch, n_layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ExportError(f"tensor {hf_name}: no GGUF name for it in the {gguf.MODEL_ARCH_NAMES[arch]} architecture")
    return name


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` of q/k rows (``n_head``: kv heads for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute` (what transformers' GGUF loader applies)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(hf_name: str, config: PretrainedConfig, arch: GgufArch) -> int | None:
    """How many heads to permute ``hf_name``'s rows over, or ``None`` when they stay as they are."""
    if not arch.permute_qk:
        return None
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def _metadata(writer: gguf.GGUFWriter, name: str, meta: dict[str, str | int]) -> None:
    writer.add_name(name)
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_int64(f"ciders.{key}", value)
        else:
            writer.add_string(f"ciders.{key}", value)


def _quantized(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``w`` as ``qtype``; a row that does not fill whole blocks falls back to f16 (as the converter does)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.ndim < 2:
        return w.astype(np.float32), gguf.GGMLQuantizationType.F32
    if w.shape[-1] % block:
        qtype = gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(w, qtype), qtype


def write_model(
    path: Path,
    state: dict[str, torch.Tensor],
    config: PretrainedConfig,
    vocab: SmolLM2Vocab,
    quantize: str,
    name: str,
    meta: dict[str, str | int],
) -> dict[str, int]:
    """A whole model GGUF from a transformers state dict; returns the count of each tensor type."""
    qtype, ftype = GGUF_TYPES[quantize]
    arch = gguf_arch(config, str(path))
    writer = gguf.GGUFWriter(path, arch.name)
    writer.add_type(gguf.GGUFType.MODEL)
    _metadata(writer, name, meta)
    write_hparams(writer, config, arch)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_to(writer, config.vocab_size)
    kinds: dict[str, int] = {}
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        w = t.detach().float()
        if (heads := _heads(hf_name, config, arch)) is not None:
            w = permute(w, heads)
        if hf_name.endswith("norm.weight"):
            w = w + arch.norm_shift
        out = gguf_name(hf_name, config.num_hidden_layers, arch.arch)
        want = qtype
        if out in ("token_embd.weight", "output.weight") and qtype == gguf.GGMLQuantizationType.Q4_0:
            want = EMBEDDING_FLOOR
        data, kind = _quantized(w.numpy(), want)
        writer.add_tensor(out, data, raw_dtype=kind)
        kinds[kind.name] = kinds.get(kind.name, 0) + 1
    for out, t in extra_tensors(config).items():
        writer.add_tensor(out, t.numpy())
    _finish(writer)
    return kinds


def write_adapter(
    path: Path,
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    config: PretrainedConfig,
    name: str,
    meta: dict[str, str | int],
) -> None:
    """A llama.cpp LoRA adapter GGUF. ``lora``: base weight name (transformers, full-model layer
    numbering) -> (A, B) as PEFT holds them."""
    arch = gguf_arch(config, str(path))
    writer = gguf.GGUFWriter(path, arch.name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    _metadata(writer, name, meta)
    if "base_gguf" in meta:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, str(meta["base_gguf"]))
    for hf_name, (a, b) in lora.items():
        b = b.detach().float()
        if (heads := _heads(hf_name, config, arch)) is not None:
            b = permute(b, heads)
        out = gguf_name(hf_name, config.num_hidden_layers, arch.arch)
        writer.add_tensor(f"{out}.lora_a", a.detach().float().contiguous().numpy())
        writer.add_tensor(f"{out}.lora_b", b.contiguous().numpy())
    _finish(writer)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_adapter(path: Path, config: PretrainedConfig) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """An adapter GGUF back in transformers' terms: alpha and, per base weight name, (A, B) unpermuted."""
    reader = gguf.GGUFReader(path)
    arch = gguf_arch(config, str(path))
    alpha = float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].contents())
    names = {}
    for i in range(config.num_hidden_layers):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            hf = f"model.layers.{i}.{module}.weight"
            names[gguf_name(hf, config.num_hidden_layers, arch.arch)] = hf
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
    out = {}
    for key in tensors:
        if not key.endswith(".lora_a"):
            continue
        base = key[: -len(".lora_a")]
        hf = names[base]
        b = tensors[f"{base}.lora_b"]
        if (heads := _heads(hf, config, arch)) is not None:
            b = unpermute(b, heads)
        out[hf] = (tensors[key], b)
    return alpha, out


def read_model(path: Path, config: PretrainedConfig, hf_names: list[str]) -> dict[str, torch.Tensor]:
    """A model GGUF's weights dequantized, in transformers' names and conventions (the inverse of
    :func:`write_model`): ``hf_names`` are the model's state-dict keys; llama.cpp's extras are skipped."""
    arch = gguf_arch(config, str(path))
    names = {gguf_name(k, config.num_hidden_layers, arch.arch): k for k in hf_names}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name not in names:
            continue  # rope_freqs: computed from the config on the transformers side
        hf = names[t.name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if (heads := _heads(hf, config, arch)) is not None:
            w = unpermute(w, heads)
        out[hf] = w - arch.norm_shift if hf.endswith("norm.weight") else w
    return out
