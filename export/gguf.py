"""``export --format gguf``: the personalized model for llama.cpp, ollama and LM Studio.

AdapFu (``--backbone full``) is the base model plus the messenger LoRA, so by default the export is a
LoRA adapter GGUF of about 1 MB for the base GGUF a user already has: for ``smollm2-135m`` the very
GGUF the toolkit embeds (``SmolLM2-135M-Instruct.Q4_1.gguf``), identified by its sha256, which the
adapter's metadata and the manifest record. An adapter is only right on that file, so another base
GGUF is refused. A base model that does not come from a GGUF (``tiny``, a Hugging Face folder) gets its
base written beside the adapter (``base.gguf``, at ``--quantize``). ``--merged`` (and the AdapEmu,
which no one has a base GGUF of) writes the whole personalized model as one ``model.gguf`` instead.

Beside the model: an ollama ``Modelfile`` (ChatML template, SmolLM2's default system prompt, stop
tokens), a ``README.md`` with the commands that run it, and the Hugging Face tokenizer files, with
which ``ciders-edge infer --runtime llamacpp`` builds the chat prompt as every other runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.atomic import write_bytes
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.checksums import sha256_file
from ciders_edge.inference.personalize import merge_messenger
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.lora import MESSENGER_ADAPTER, lora_state
from ciders_edge.model.sources import base_gguf, smollm2_gguf
from export.gguf_arch import gguf_arch
from export.gguf_tensors import GGUF_TYPES, SmolLM2Vocab, read_adapter, read_model, write_adapter, write_model

__all__ = ["GgufPlan", "plan_gguf", "save_gguf", "gguf_torch_model", "ADAPTER_FILE", "MODEL_FILE", "BASE_FILE"]

ADAPTER_FILE = "adapter.gguf"
MODEL_FILE = "model.gguf"
BASE_FILE = "base.gguf"
DEFAULT_QUANT = "q8_0"


@dataclass
class GgufPlan:
    """What a gguf export writes, settled (and refused) before the model loads."""

    merged: bool
    quantize: str  # of model.gguf or base.gguf; "none" when the adapter runs on an existing base GGUF
    base: Path | None = None  # the existing base GGUF the adapter is for
    base_name: str = ""
    base_sha256: str = ""


def plan_gguf(bundle: Bundle, backbone: str, merged: bool, quantize: str, base: str | Path | None) -> GgufPlan:
    """Check the options against the bundle: the quantize type, that llama.cpp runs its architecture, and
    that ``base`` is the bundle's base GGUF."""
    from transformers import AutoConfig

    if quantize != "none" and quantize not in GGUF_TYPES:
        raise ConfigError(f"--quantize for --format gguf must be one of {', '.join(GGUF_TYPES)}, got {quantize!r}")
    gguf_arch(AutoConfig.from_pretrained(bundle.path), f"{bundle.path} ({bundle.manifest['base_model']['id']})")
    merged = merged or backbone == "emu"  # the AdapEmu's backbone is no model anyone has a GGUF of
    model_id = bundle.manifest["base_model"]["id"]
    known = base_gguf(model_id) if not merged else None
    if merged or known is None:
        if base is not None:
            why = "a merged export" if merged else f"base model {model_id}, which does not come from a GGUF"
            raise ConfigError(f"--base-gguf is not used for {why}: the export writes the base model itself")
        return GgufPlan(merged, DEFAULT_QUANT if quantize == "none" else quantize)
    if quantize != "none":
        raise ConfigError(
            f"--quantize {quantize}: the adapter runs on the base GGUF {known[0]} as it is; "
            "pass --merged for a whole model at that precision"
        )
    path = Path(base).expanduser() if base is not None else smollm2_gguf()
    if not path.is_file():
        raise ConfigError(f"--base-gguf {path}: no such file")
    digest = sha256_file(path)
    if digest != known[1]:
        raise ExportError(
            f"{path}: sha256 {digest[:16]}… is not the base GGUF bundle {bundle.path} was prepared from "
            f"({known[0]}, {known[1][:16]}…); an adapter for it would be wrong, refusing"
        )
    return GgufPlan(False, "none", path.resolve(), known[0], digest)


def save_gguf(edge: EdgeModel, plan: GgufPlan, folder: Path, source: dict, name: str) -> dict:
    """Write the GGUF(s), Modelfile and README into ``folder``; return the manifest's ``gguf`` entry.

    ``name``: the export folder's final name (the ollama model's name in the README). Consumes
    ``edge`` (a merged export folds the LoRA in place)."""
    config = edge.model.get_base_model().config
    model_id = edge.bundle.manifest["base_model"]["id"]
    gguf_arch(config, f"{edge.bundle.path} ({model_id})")
    vocab = SmolLM2Vocab.of(smollm2_gguf())  # tiny uses SmolLM2's tokenizer too; others are refused here
    vocab.check(edge.tokenizer.get_vocab(), f"{edge.bundle.path} ({model_id})")
    title = f"ciders {source['bundle_id'][:12]} {source.get('client_id') or source['messenger']}"
    entry: dict = {"kind": "merged" if plan.merged else "adapter"}
    if plan.merged:
        state = merge_messenger(edge).state_dict()
        kinds = write_model(folder / MODEL_FILE, state, config, vocab, plan.quantize, title, _meta(source))
        entry.update(model=MODEL_FILE, tensor_types=kinds)
    else:
        if plan.base is None:  # a base model that does not come from a GGUF: write it beside the adapter
            kinds = write_model(folder / BASE_FILE, _base_state(edge), config, vocab, plan.quantize, model_id, {})
            entry.update(model=BASE_FILE, tensor_types=kinds)
            entry["base"] = {"name": BASE_FILE, "sha256": sha256_file(folder / BASE_FILE), "path": BASE_FILE}
        else:
            entry["base"] = {"name": plan.base_name, "sha256": plan.base_sha256, "path": str(plan.base)}
        alpha = edge.bundle.manifest["lora"]["alpha"]
        meta = _meta(source) | {"base_gguf": entry["base"]["name"], "base_gguf_sha256": entry["base"]["sha256"]}
        write_adapter(folder / ADAPTER_FILE, _messenger_pairs(edge), alpha, config, title, meta)
        entry.update(adapter=ADAPTER_FILE, lora_alpha=alpha)
    write_bytes(folder / "Modelfile", _modelfile(entry, vocab).encode())
    write_bytes(folder / "README.md", _readme(entry, source, name).encode())
    edge.tokenizer.save_pretrained(folder)  # for `ciders-edge infer/evaluate/bench`: the chat prompt, ids to text
    return entry


def _meta(source: dict) -> dict[str, str | int]:
    """Where the model came from (bundle, client, round), as ``ciders.*`` keys."""
    return {k: v for k, v in source.items() if isinstance(v, str | int) and v != ""}


def _messenger_pairs(edge: EdgeModel) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The live messenger LoRA as (A, B) per base weight, in the model's own layer numbering."""
    state = lora_state(edge.model, MESSENGER_ADAPTER)
    pairs = {}
    for key, a in state.items():
        if ".lora_A." in key:
            base = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            pairs[base] = (a, state[key.replace(".lora_A.", ".lora_B.")])
    return pairs


def _base_state(edge: EdgeModel) -> dict[str, torch.Tensor]:
    """The weights under the messenger LoRA (what the adapter applies to)."""
    state = edge.model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}


def gguf_torch_model(folder: Path, entry: dict, config: PretrainedConfig | None = None):
    """The export as transformers computes it: the GGUF dequantized (and the adapter folded in) —
    what ``export`` checks against the unmerged model and the tests compare with llama.cpp.

    ``config``: the exported model's transformers config; ``None`` reads it from the GGUF's metadata as
    transformers does (enough for a plain Llama, not for rope scaling or Gemma 3's layer pattern)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    model_path = folder / entry["model"] if "model" in entry else Path(entry["base"]["path"])
    if config is None:
        config = AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config.__class__.from_dict(config.to_dict()), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(read_model(model_path, config, list(model.state_dict())), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ExportError(
            f"{model_path}: its tensors do not match the model (missing {missing[:2]}, extra {unexpected[:2]})"
        )
    model.tie_weights()
    if entry["kind"] == "adapter":
        alpha, pairs = read_adapter(folder / entry["adapter"], model.config)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                params[name] += (alpha / a.shape[0]) * (b @ a)
    return model.eval()


def _modelfile(entry: dict, vocab: SmolLM2Vocab) -> str:
    """An ollama Modelfile: ChatML in ollama's Go template syntax, as SmolLM2's chat template renders it."""
    lines = [f"FROM {_from(entry)}"]
    if entry["kind"] == "adapter":
        lines.append(f"ADAPTER ./{entry['adapter']}")
    lines += [
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}',
        "{{ .Content }}<|im_end|>",
        "{{ end }}<|im_start|>assistant",
        '"""',
        f'SYSTEM """{vocab.default_system}"""',
        'PARAMETER stop "<|im_start|>"',
        'PARAMETER stop "<|im_end|>"',
        "PARAMETER temperature 0",
    ]
    return "\n".join(lines) + "\n"


def _from(entry: dict) -> str:
    if "model" in entry:
        return f"./{entry['model']}"
    return entry["base"]["path"]


def _readme(entry: dict, source: dict, name: str) -> str:
    tag = "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower()) or "ciders-model"
    who = source.get("client_id") or f"the {source['messenger']} messenger"
    model = "AdapFu" if source.get("backbone") == "full" else "AdapEmu"
    if entry["kind"] == "adapter":
        base = entry["base"]
        run = f"llama-cli -m {_from(entry)} --lora {entry['adapter']} -cnv -ctk f32 -ctv f32"
        what = (
            f"a LoRA adapter ({entry['adapter']}) for the base GGUF {base['name']} "
            f"(sha256 {base['sha256']}; the adapter is wrong on any other file)"
        )
    else:
        run = f"llama-cli -m {entry['model']} -cnv -ctk f32 -ctv f32"
        what = f"the whole model in one GGUF ({entry['model']})"
    return (
        f"# Personalized {model} of {who} (bundle {source['bundle_id'][:12]}, round {source['round']})\n\n"
        f"This folder holds {what}, an ollama Modelfile and manifest.json (sha256 of every file).\n"
        f"Run it from this folder:\n\n"
        f"    ollama create {tag} -f Modelfile && ollama run {tag}\n"
        f"    {run}\n\n"
        "`-ctk f32 -ctv f32` keeps the KV cache in float32, as `ciders-edge infer` and torch do (llama.cpp's default\n"
        "is float16, which costs this small model a little exact match).\n"
    )
