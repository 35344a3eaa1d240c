"""Open the personalized model in the runtime a device uses: torch, ONNX Runtime or llama.cpp.

torch and onnx yield a model with transformers' ``generate``; genai (ONNX Runtime GenAI, the fast
default for a ``genai`` export) and llamacpp (a ``gguf`` export) a :class:`~.generation.TokenDecoder`
with its own decode loop; the ``generate`` functions take either, so ``infer``, ``evaluate`` and
``bench`` are one code path. The torch runtime merges the messenger LoRA first: decoding then runs
dense layers, no PEFT. On a GPU it decodes through a static KV cache and CUDA graphs (:mod:`.compiled_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.export_folder import Export
from ciders_edge.inference.compiled_decode import (
    DECODE_MODES,
    compile_problem,
    decode_mode,
    decodes_compiled,
    use_compiled_decode,
)
from ciders_edge.inference.exported import load_exported_model, load_exported_tokenizer
from ciders_edge.inference.generation import context_length
from ciders_edge.inference.personalize import (
    Source,
    load_personalized,
    merge_messenger,
    personal_messenger,
    resolve_backbone,
)
from ciders_edge.inference.providers import resolve_providers
from ciders_edge.profiles import DeviceProfile, keeps_quantized, pick_device
from ciders_edge.progress import console

__all__ = ["Runtime", "open_runtime", "RUNTIMES"]

RUNTIMES = ("torch", "onnx", "genai", "llamacpp")
EXPORT_RUNTIME = {
    "hf": "torch",
    "onnx": "onnx",
    "genai": "genai",
    "gguf": "llamacpp",
    "peft": "torch",
}  # what runs each


@dataclass
class Runtime:
    name: str  # torch, onnx, onnx-int8, ...
    model: object  # anything with transformers' ``generate``, or a TokenDecoder
    tokenizer: PreTrainedTokenizerBase
    context: int
    source: dict  # bundle, messenger (personalized/global), client, round
    providers: list[str] = field(default_factory=list)

    @property
    def decode(self) -> str:
        """``compiled`` (static KV cache, CUDA graphs) or ``eager``; the first compiled call compiles."""
        return "compiled" if decodes_compiled(self.model) else "eager"


def open_runtime(
    runtime: str | None,
    *,
    bundle: str | Path | None = None,
    state: str | Path | None = None,
    export: str | Path | None = None,
    messenger: str = "best",
    profile: DeviceProfile | None = None,
    backbone: str | None = None,
    base_model: str | Path | None = None,
    decode: str = "auto",
    frozen_weights: str | None = None,
) -> Runtime:
    """torch from a bundle (+ state) or an ``hf`` export; onnx from an ``onnx`` export; genai from a
    ``genai`` export (``None``: the export's own runtime).

    ``messenger``: the state's ``best`` (what its validation chose), ``latest``, or the bundle's ``global``.
    ``backbone`` (torch from a bundle): ``emu`` or ``full`` (AdapFu); default, what the bundle deploys.
    With an export *and* a bundle, the export must have been made from that bundle and state.
    ``decode`` (torch): ``auto`` compiles on a GPU (:func:`decode_mode`), ``eager`` or ``compiled`` force one.
    ``frozen_weights`` (torch from a bundle): ``quantized`` or ``dequantized``; default, the profile's.
    """
    exp = Export.load(export) if export is not None else None
    if runtime is None:  # the export's own runtime, else torch
        runtime = EXPORT_RUNTIME[exp.format] if exp is not None else "torch"
    if runtime not in RUNTIMES:
        raise ConfigError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if decode not in DECODE_MODES:
        raise ConfigError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if exp is None:
        if runtime != "torch":
            fmt = next(f for f, r in EXPORT_RUNTIME.items() if r == runtime)
            raise ConfigError(
                f"--runtime {runtime} runs an export: make one with `ciders-edge export --format {fmt}`, "
                "pass it as --export"
            )
        if bundle is None:
            raise ConfigError("pass --bundle (with --state or --global), or --export")
        b = Bundle.load(bundle)
        quantized = keeps_quantized(frozen_weights, profile, b.manifest["profile"])
        rt = _torch_from_bundle(b, state, messenger, profile, resolve_backbone(b, backbone), base_model, quantized)
        _set_decode(rt.model, profile, decode)
        return rt
    if EXPORT_RUNTIME[exp.format] != runtime:
        raise ConfigError(f"{export}: a {exp.format} export runs with --runtime {EXPORT_RUNTIME[exp.format]}")
    if bundle is not None:
        b = Bundle.load(bundle)
        _check_export_source(exp, b, state, messenger, exp.source.get("backbone", "emu"))
    if runtime == "llamacpp":
        return _llamacpp(exp)
    providers = resolve_providers(profile.execution_providers if profile else []) if runtime == "onnx" else []
    model = load_exported_model(exp, providers)
    if runtime == "torch":
        model.to(pick_device(profile))
        _set_decode(model, profile, decode)
    if runtime == "genai":
        return Runtime(
            exp.runtime, model, load_exported_tokenizer(exp), model.context, exp.source, ["CPUExecutionProvider"]
        )
    return Runtime(
        exp.runtime, model, load_exported_tokenizer(exp), context_length(model.config), exp.source, providers
    )


def _llamacpp(exp: Export) -> Runtime:
    from ciders_edge.inference.llamacpp import LlamaCppDecoder

    model, adapter = exp.gguf_files()
    tokenizer = load_exported_tokenizer(exp)
    decoder = LlamaCppDecoder(model, adapter, {tokenizer.eos_token_id})
    return Runtime(exp.runtime, decoder, tokenizer, decoder.context, exp.source)


def _torch_from_bundle(
    bundle: Bundle, state, messenger: str, profile: DeviceProfile | None, backbone: str, base_model, quantized: bool
) -> Runtime:
    dtype = profile.torch_dtype if profile else None
    edge, source = load_personalized(bundle, state, messenger, dtype, backbone, base_model, quantized=quantized)
    model = merge_messenger(edge).to(pick_device(profile))
    return Runtime("torch", model, edge.tokenizer, context_length(model.config), source.to_dict())


def _set_decode(model, profile: DeviceProfile | None, requested: str) -> None:
    target = profile.target if profile else None
    mode, notice = decode_mode(model.device, target, compile_problem(model.device), requested)
    if notice is not None:
        console.print(f"[yellow]notice:[/] {notice}", soft_wrap=True)
    if mode == "compiled":
        use_compiled_decode(model)


def _check_export_source(exp: Export, bundle: Bundle, state, messenger: str, backbone: str) -> None:
    _, source = personal_messenger(bundle, state, messenger, backbone)
    if not source.same_model(exp.source):
        raise ExportError(
            f"{exp.path}: made from {_describe(exp.source)}, but --bundle/--state give "
            f"{_describe(source.to_dict())}; export again"
        )


def _describe(s: dict) -> str:
    backbone = f"{'the full' if s.get('backbone') == 'full' else 'the AdapEmu'} backbone {s['frozen_digest'][:12]}"
    return f"{Source.from_dict(s).describe()} on {backbone}"
