"""The ``ciders-edge export`` and ``ciders-edge bench`` commands (registered by entry point)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ciders_edge.cli_utils import (
    BackboneOpt,
    BaseModelOpt,
    GlobalOpt,
    JsonOpt,
    MessengerOpt,
    key_table,
    messenger_choice,
    print_table,
    run_command,
)
from ciders_edge.progress import console, status

__all__ = ["export_command", "bench_command"]


def export_command(
    bundle: Annotated[Path, typer.Option(help="Bundle folder the state trained on.")],
    out: Annotated[Path, typer.Option(help="Export folder to write (replaced if it is an export).")],
    state: Annotated[Path | None, typer.Option(help="Client state: its personalized messenger.")] = None,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf (merged transformers folder), onnx, genai (ONNX Runtime GenAI), gguf, "
            "or peft (a PEFT LoRA adapter of the base model; --backbone full).",
        ),
    ] = "hf",
    quantize: Annotated[
        str,
        typer.Option(
            help="onnx: none, int8 (weight-only, blockwise), int8-dynamic; genai: none, int8, int4; "
            "gguf: f16, q8_0 (default), q4_0."
        ),
    ] = "none",
    messenger: MessengerOpt = None,
    use_global: GlobalOpt = False,
    merged: Annotated[
        bool, typer.Option("--merged", help="gguf: the whole model in one GGUF, not a LoRA adapter for the base GGUF.")
    ] = False,
    base_gguf: Annotated[
        Path | None, typer.Option(help="gguf: the base GGUF the adapter is for (default: the embedded SmolLM2's).")
    ] = None,
    backbone: BackboneOpt = None,
    base_model: BaseModelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Merge the personalized messenger (and backbone) LoRA into a standalone model folder (hf, onnx, genai), write
    it for llama.cpp and ollama (gguf: a LoRA adapter for the base GGUF, or --merged) with an ollama Modelfile, or
    as a PEFT LoRA adapter of the base model (peft)."""

    def render(s: dict) -> None:
        c = s["check"]
        console.print(
            f"[green]✓[/] {s['out']}: {s['runtime']} model, {s['files']} files, {s['bytes'] / 2**20:.1f} MiB "
            f"in {s['seconds']:.0f} s; against the unmerged {_model_name(s)}: "
            f"max |Δlogit| {c['max_abs_logit_diff']:.2e}, "
            f"greedy agreement {c['greedy_agreement']:.1%} of {c['positions']} positions"
        )
        console.print(f"  messenger: {escape(_messenger(s['source']))}", soft_wrap=True)

    from export.api import export_model  # the model stack loads for this command only, not for every `ciders-edge`

    run_command(
        lambda: export_model(
            bundle,
            state,
            format,
            out,
            quantize,
            messenger_choice(messenger, use_global),
            status,
            backbone,
            base_model,
            merged,
            base_gguf,
        ),
        as_json,
        render,
    )


def _messenger(source: dict) -> str:
    """Which messenger a summary's model runs, and why (the best: what the state's validation chose)."""
    from ciders_edge.inference.personalize import Source  # torch: the command has loaded it already

    return Source.from_dict(source).describe()


def _model_name(s: dict) -> str:
    return "AdapFu" if s["source"].get("backbone") == "full" else "AdapEmu"


def bench_command(
    bundle: Annotated[Path, typer.Option(help="Bundle folder.")],
    state: Annotated[Path | None, typer.Option(help="Client state (default: the bundle's global messenger).")] = None,
    runtimes: Annotated[
        str,
        typer.Option(
            help="Comma-separated: torch, onnx, onnx-int8, onnx-int8-dynamic, genai, genai-int8, genai-int4, "
            "llamacpp-lora (base GGUF + adapter), llamacpp-q8_0, llamacpp-q4_0 (merged GGUF)."
        ),
    ] = "torch,onnx,onnx-int8,genai-int8",
    profile: Annotated[str | None, typer.Option(help="Device profile (default: the bundle's).")] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens each generation decodes.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed generations per runtime (median reported).")] = 3,
    train_steps: Annotated[int, typer.Option(help="Timed training steps (0: skip).")] = 3,
    exports: Annotated[Path | None, typer.Option(help="Keep (and reuse) the ONNX exports in this folder.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of decode speed and memory per runtime.")] = None,
    backbone: BackboneOpt = None,
    base_model: BaseModelOpt = None,
    messenger: MessengerOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decode tokens/s, first-token latency, peak memory and size per runtime; the training step time."""

    from export.bench import BenchSettings, bench
    from export.plots import plot_bench

    def body() -> dict:
        settings = BenchSettings(
            tuple(r.strip() for r in runtimes.split(",") if r.strip()), new_tokens, repeats, train_steps
        )
        chosen = messenger_choice(messenger, False)
        result = bench(bundle, state, profile, settings, exports, status, backbone, base_model, chosen)
        if plot is not None:
            plot_bench(result, plot)
            result["plot"] = str(plot)
        return result

    run_command(body, as_json, _render_bench)


def _render_bench(s: dict) -> None:
    model = "AdapFu" if s.get("backbone") == "full" else "AdapEmu"
    title = f"{s['bundle']}: {model}, {s['messenger']} messenger, profile {s['profile']}"
    if "source" in s:
        console.print(f"messenger: {escape(_messenger(s['source']))}", soft_wrap=True)
    header = ("runtime", "MiB", "load s", "TTFT ms", "tok/s", "×torch", "RSS MiB", "agree")
    console.print(f"decode: {s['new_tokens']} new tokens, median of {s['repeats']} generations")
    print_table(key_table(header, [_bench_row(r) for r in s["runtimes"]], title=title))
    t = s.get("train_step")
    if t:
        console.print(
            f"training step ({t['solver'].upper()}, batch {t['batch_size']}×{t['grad_accum']}×{t['seq_len']} tokens, "
            f"{t['device']}): {t['step_s']:.2f} s ({t['tokens_per_s']:.0f} tokens/s), "
            f"peak RSS {t['peak_rss_mib']:.0f} MiB"
        )
    if s.get("plot"):
        console.print(f"plot: {s['plot']}")


def _bench_row(r: dict) -> tuple[str, ...]:
    agree = f"{r['check']['greedy_agreement']:.1%}" if r.get("check") else "ref"
    ratio = f"{r['speedup_vs_torch']:.2f}" if r["speedup_vs_torch"] is not None else "—"
    return (
        r["runtime"],
        f"{r['files_bytes'] / 2**20:.0f}",
        f"{r['load_s']:.1f}",
        f"{r['first_token_s'] * 1000:.0f}",
        f"{r['decode_tokens_per_s']:.1f}",
        ratio,
        f"{r['peak_rss_mib']:.0f}",
        agree,
    )
