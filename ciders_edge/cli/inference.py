"""``ciders-edge infer`` and ``evaluate``: answer with a messenger, and score it on your data."""

from __future__ import annotations

import statistics
import sys
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ciders_edge.cli_utils import (
    BackboneOpt,
    BaseModelOpt,
    FrozenOpt,
    GlobalOpt,
    JsonOpt,
    MessengerOpt,
    key_table,
    messenger_choice,
    print_table,
    run_command,
)
from ciders_edge.config import check_limit
from ciders_edge.data.records import read_jsonl
from ciders_edge.errors import ConfigError, ExportError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.profiles import keeps_quantized, load_profile
from ciders_edge.progress import LazyBar, console, status

__all__ = ["infer", "evaluate"]


def infer(
    prompt: Annotated[str | None, typer.Option(help="One prompt to answer.")] = None,
    input: Annotated[Path | None, typer.Option("--input", help="JSONL of prompts (any training schema).")] = None,
    output: Annotated[Path | None, typer.Option(help="JSONL to write the answers to (with --input).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Bundle folder (with --state or --global).")] = None,
    state: Annotated[Path | None, typer.Option(help="Client state: its personalized messenger.")] = None,
    export: Annotated[Path | None, typer.Option(help="Export folder from `ciders-edge export`.")] = None,
    messenger: MessengerOpt = None,
    use_global: GlobalOpt = False,
    runtime: Annotated[
        str | None,
        typer.Option(
            help="torch, onnx, genai or llamacpp (default: the export's; from a bundle, genai: an int8 export "
            "made on first use and kept under $CIDERS_HOME/exports)."
        ),
    ] = None,
    profile: Annotated[str | None, typer.Option(help="Device profile: dtype, device, ONNX providers.")] = None,
    backbone: BackboneOpt = None,
    base_model: BaseModelOpt = None,
    frozen_weights: FrozenOpt = None,
    stream: Annotated[bool, typer.Option(help="Print the answer as it is generated.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Answer a prompt (or a JSONL file) with the personalized model: from a bundle in ONNX Runtime GenAI (an int8
    export made once; --runtime torch for none), from an export in its runtime (GenAI, ONNX Runtime, llama.cpp)."""

    def body() -> dict:
        if (prompt is None) == (input is None):
            raise ConfigError("pass exactly one of --prompt or --input")
        if (input is None) != (output is None):
            raise ConfigError("--input and --output go together (prompts in, answers out)")
        if output is not None and output.is_dir():
            raise ConfigError(f"--output {output} is a folder; give the JSONL file to write")
        chosen_messenger = messenger_choice(messenger, use_global)
        if export is not None and bundle is None and (state is not None or use_global or messenger):
            raise ConfigError("with --export, --state/--messenger only check the export: pass --bundle too, or neither")
        records = read_jsonl(input) if input is not None else None  # bad input fails before the model loads
        flags = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
        from ciders_edge.inference.generation import GenerationSettings  # transformers: only to answer

        settings = GenerationSettings.from_dict(flags, where="flags")  # NaN, inf and huge counts refused
        prof = load_profile(profile) if profile else None
        from ciders_edge.inference.infer import answer, answer_file  # torch and transformers: past the checks

        rt, chosen, made = _open(
            runtime, export, bundle, state, chosen_messenger, prof, backbone, base_model, frozen_weights
        )
        summary = {"runtime": rt.name, "providers": rt.providers, "source": rt.source}
        if chosen is not export:
            summary["export"] = {"path": str(chosen), "made_now": made}
        if prompt is not None:
            g = answer(rt, prompt, settings, _print_text if stream else None)
            if stream:
                sys.stdout.write("\n")
            return {**summary, **g.to_dict()}
        with LazyBar("prompts") as bar:
            gens = answer_file(rt, records, output, settings, lambda i, n: bar.update(n, f"{i}/{n}"))
        return {**summary, "answers": len(gens), "output": str(output), **_rates(gens)}

    def render(s: dict) -> None:
        if "text" in s and not stream:
            sys.stdout.write(s["text"] + "\n")
        from ciders_edge.inference.personalize import Source  # loaded by now: the model answered

        src, model = s["source"], "AdapFu" if s["source"].get("backbone") == "full" else "AdapEmu"
        what = f"{s['new_tokens']} tokens" if "text" in s else f"{s['answers']} answers → {s['output']}"
        rate = f", {s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens_per_s"] is not None else ""
        console.print(f"[dim]{what}, first token {s['first_token_s']:.2f} s{rate} ({s['runtime']}, {model})[/]")
        if s.get("export", {}).get("made_now"):
            console.print(f"[dim]exported once for this model: {s['export']['path']} (--runtime torch: no export)[/]")
        console.print(f"[dim]messenger: {escape(Source.from_dict(src).describe())}[/]", soft_wrap=True)

    run_command(body, as_json, render)


def _open(runtime, export, bundle, state, messenger, prof, backbone, base_model, frozen_weights):
    """The runtime ``infer`` answers in, with the export it runs (``(runtime, export, made_now)``): the one
    named; from a bundle on a CPU, or with ``--runtime genai``, the cached GenAI export, made on first use
    and made again when the cached one fails its check (a damaged cache entry must not fail every call)."""
    from ciders_edge.inference.runtime import open_runtime

    kw = {"bundle": bundle, "state": state, "messenger": messenger, "profile": prof, "backbone": backbone}
    open_ = partial(open_runtime, runtime, base_model=base_model, frozen_weights=frozen_weights, **kw)
    chosen, made = export, None
    if export is None and bundle is not None and (runtime == "genai" or (runtime is None and _on_cpu(prof))):
        chosen, made = _default_export(bundle, state, messenger, backbone, base_model)  # the fastest installed
        if chosen is None and runtime == "genai":
            raise ConfigError("--runtime genai from a bundle needs the exporter (the toolkit's `export` package)")
    try:
        with status("loading the model"):
            return open_(export=chosen), chosen, made
    except ExportError as err:
        if made is not False:  # not a cache entry made earlier: the user's export, or one just made
            raise
        console.print(f"[yellow]notice:[/] {escape(str(err))}; the cached export is made again", soft_wrap=True)
    chosen, made = _default_export(bundle, state, messenger, backbone, base_model, rebuild=True)
    with status("loading the model"):
        return open_(export=chosen), chosen, made


def _default_export(bundle, state, messenger, backbone, base_model, rebuild=False) -> tuple[Path | None, bool | None]:
    """The exporter's cached GenAI int8 export of this model, made on first use (``export/cache.py``, found
    by entry point: this runtime never imports the exporter); ``(None, None)`` without it: torch answers."""
    for ep in entry_points(group="ciders_edge.exporters", name="default"):
        return ep.load()(bundle, state, messenger, backbone, base_model, status, rebuild=rebuild)
    return None, None


def _runtime_exports(runtime: str, exports: list, states: list, bundle, backbone, base_model) -> list:
    """``evaluate --runtime genai``: each state's cached GenAI export, scored beside the torch rows."""
    if runtime != "genai":
        raise ConfigError(f"--runtime for evaluate is genai (torch rows are always scored), got {runtime!r}")
    if exports or not states:
        raise ConfigError("--runtime genai scores each --state's export: pass --state, and no --export")
    made = [_default_export(bundle, s, "best", backbone, base_model)[0] for s in states]  # the ones infer runs
    if None in made:
        raise ConfigError("--runtime genai needs the exporter (the toolkit's `export` package) installed")
    return made


def _on_cpu(profile) -> bool:
    """Whether torch would run on the CPU: there GenAI's loop is faster; on a GPU, torch's compiled decode is."""
    from ciders_edge.profiles import pick_device

    return pick_device(profile).type == "cpu"


def evaluate(
    bundle: Annotated[Path, typer.Option(help="Bundle folder.")],
    data: Annotated[list[Path], typer.Option("--data", help="Evaluation JSONL (repeatable: one per --state).")],
    state: Annotated[
        list[Path] | None, typer.Option("--state", help="Client state whose personalized messenger is scored.")
    ] = None,
    backbone: BackboneOpt = None,
    base_model: BaseModelOpt = None,
    use_global: Annotated[bool, typer.Option("--global", help="Score the bundle's global messenger.")] = False,
    base: Annotated[bool, typer.Option("--base", help="Score the messenger layers without LoRA.")] = False,
    compare: Annotated[
        bool,
        typer.Option(help="Score the base model, and the global and personalized messengers on AdapEmu and AdapFu."),
    ] = False,
    export: Annotated[
        list[Path] | None,
        typer.Option(
            "--export", help="An export of a --state's model (repeatable: one per --state), scored in its runtime."
        ),
    ] = None,
    runtime: Annotated[
        str | None,
        typer.Option(
            help="genai: also score each --state's model in ONNX Runtime GenAI, through infer's cached int8 export."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Score only the first N records of each file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens per generated answer.")] = 64,
    profile: Annotated[str | None, typer.Option(help="Device profile: dtype and device.")] = None,
    frozen_weights: FrozenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Score messengers on your data: response NLL, exact match (records with `answer`), ROUGE-L (with `response`)."""
    from ciders_edge.inference.evaluate import COMPARE, evaluate_exports, evaluate_models
    from ciders_edge.inference.personalize import resolve_backbone

    def body() -> dict:
        states = list(state or [])
        if states and len(states) != len(data):
            raise ConfigError(f"pass one --data per --state (got {len(data)} --data for {len(states)} --state)")
        if use_global + base + compare > 1:
            raise ConfigError("pass at most one of --global, --base and --compare")
        exports = list(export or [])
        if exports and len(exports) != len(states):
            raise ConfigError(f"pass one --export per --state (got {len(exports)} --export for {len(states)} --state)")
        check_limit("limit", limit, "--limit")
        check_limit("max_new_tokens", max_new_tokens, "--max-new-tokens")
        if runtime is not None:  # bad flags fail before the exports are made
            exports = _runtime_exports(runtime, exports, states, bundle, backbone, base_model)
        b = Bundle.load(bundle)
        if compare:  # and what the device deploys: the state's best messenger on the bundle's backbone
            models = [*COMPARE, (resolve_backbone(b, backbone), "best")] if states else list(COMPARE)
        else:
            messenger = "global" if use_global else "base" if base else "personalized"
            models = [(resolve_backbone(b, backbone), messenger)]
        if any(m == "personalized" for _, m in models) and not states:
            raise ConfigError("pass --state (the personalized messenger), or --global / --base")
        edges = list(zip(states, data, strict=True)) if states else [(None, d) for d in data]
        prof = load_profile(profile) if profile else None
        quantized = keeps_quantized(frozen_weights, prof, b.manifest["profile"])
        with LazyBar("scoring") as bar:
            rows = evaluate_models(
                b,
                edges,
                models,
                dtype=prof.torch_dtype if prof else None,
                base_model=base_model,
                limit=limit,
                max_new_tokens=max_new_tokens,
                on_progress=lambda label, i, n: bar.update(n, f"{label} {i}/{n}", completed=i),
                quantized=quantized,
            )
            rows += evaluate_exports(
                b,
                [(s, d, e) for (s, d), e in zip(edges, exports, strict=True)] if exports else [],
                limit=limit,
                max_new_tokens=max_new_tokens,
                on_progress=lambda label, i, n: bar.update(n, f"{label} {i}/{n}", completed=i),
            )
        return {"bundle": str(b.path), "round": b.round, "results": rows, "skipped": _skipped(rows)}

    run_command(body, as_json, _render_evaluate)


def _skipped(rows: list[dict]) -> list[str]:
    """One note per file on records that could not be scored by some measure."""
    notes = {}
    for r in rows:
        c = r["counts"]
        missing = [
            f"{c['records'] - c[k]} without {what} ({label} over {c[k]})"
            for k, what, label in (
                ("nll", "a response", "NLL"),
                ("exact_match", "an `answer`", "exact match"),
                ("rouge_l", "a `response`", "ROUGE-L"),
            )
            if c[k] < c["records"] and not (k == "nll" and "runtime" in r)  # an export's runtime gives no NLL
        ]
        if missing:
            notes[r["data"]] = f"{r['data']}: {c['records']} records, " + "; ".join(missing)
    return list(notes.values())


def _render_evaluate(s: dict) -> None:
    files = list(dict.fromkeys(r["data"] for r in s["results"]))
    header = ["model", *(f"{Path(f).parent.name}/{Path(f).name}" for f in files)]
    rows = []
    for key in dict.fromkeys(_row_key(r) for r in s["results"]):
        cells = {r["data"]: _cell(r) for r in s["results"] if _row_key(r) == key}
        rows.append([_model_label(*key), *(cells.get(f, "—") for f in files)])
    print_table(key_table(header, rows, whole_headers=True, title=s["bundle"]))
    for note in s["skipped"]:
        console.print(f"[dim]note: {note}[/]", highlight=False)


def _row_key(r: dict) -> tuple[str, str, str | None]:
    return r["backbone"], r["messenger"], r.get("runtime")


def _model_label(backbone: str, messenger: str, runtime: str | None = None) -> str:
    if (backbone, messenger) == ("full", "base"):
        return "base model"
    names = {"base": "base model", "global": "global messenger", "personalized": "personalized messenger"}
    names["best"] = "deployed messenger"
    label = f"{'AdapFu' if backbone == 'full' else 'AdapEmu'}, {names[messenger]}"
    return f"{label} ({runtime} export)" if runtime else label


def _cell(r: dict) -> str:
    parts = []
    if r["exact_match"] is not None:
        parts.append(f"EM {r['exact_match']:.0%}")
    if r["nll"] is not None:
        parts.append(f"NLL {r['nll']:.3f}")
    if r["rouge_l"] is not None and r["exact_match"] is None:
        parts.append(f"ROUGE-L {r['rouge_l']:.3f}")
    return "  ".join(parts + ([f"({r['deployed']})"] if r.get("deployed") else [])) or "—"


def _print_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _rates(gens: list) -> dict:
    """Medians over a file's answers."""
    rates = [g.decode_tokens_per_s for g in gens if g.decode_tokens_per_s is not None]
    return {
        "first_token_s": statistics.median(g.first_token_s for g in gens),
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "new_tokens": sum(g.new_tokens for g in gens),
    }
