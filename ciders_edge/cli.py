"""``ciders-edge``: the on-device runtime's commands."""

from __future__ import annotations

import statistics
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ciders_edge.cli_utils import BackboneOpt, BaseModelOpt, JsonOpt, run_command
from ciders_edge.data.records import read_jsonl
from ciders_edge.errors import ConfigError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.packet import read_key_file
from ciders_edge.inference.generation import GenerationSettings
from ciders_edge.inference.infer import answer, answer_file
from ciders_edge.inference.personalize import resolve_backbone
from ciders_edge.inference.runtime import open_runtime
from ciders_edge.profiles import GIB, detect_profile, list_profiles, load_profile
from ciders_edge.progress import LazyBar, console, status
from ciders_edge.training.train import train as train_run

app = typer.Typer(
    help="CIDERS edge runtime: train the messenger, infer, export, benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.command()
def profiles(
    name: Annotated[str | None, typer.Argument(help="Show one profile (a name, `auto`, or a .toml path).")] = None,
    detect: Annotated[bool, typer.Option(help="Show the profile `auto` picks on this device.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List the device profiles, show one, or detect this device's."""

    def body() -> dict:
        if detect:
            return {"detected": detect_profile().to_dict()}
        if name is not None:
            return {"profile": load_profile(name).to_dict()}
        return {"profiles": [p.to_dict() for p in list_profiles()]}

    run_command(body, as_json, _render_profiles)


def _render_profiles(s: dict) -> None:
    if "profiles" in s:
        # piped output is 80 columns: no frame, and no value is cut (the name is the key: it never wraps)
        table = Table(box=None, collapse_padding=True, pad_edge=False)
        table.add_column("name", no_wrap=True, min_width=max(len(p["name"]) for p in s["profiles"]))
        for col in ("target", "dtype", "memory", "depth", "drop", "rank", "seq×batch", "runtime"):
            table.add_column(col, overflow="fold")
        for p in s["profiles"]:
            table.add_row(
                p["name"],
                p["target"],
                p["dtype"],
                f"{p['memory_budget_gb']:g} GB",
                str(p["messenger_depth"]),
                f"{p['drop_ratio']:g}",
                str(p["lora_rank"]),
                f"{p['seq_len']}×{p['batch_size']}",
                f"{p['runtime']}/{p['quantization']}",
            )
        console.print(table)
        return
    p = s.get("profile") or s["detected"]
    table = Table(title=p["name"] + (" (detected)" if "detected" in s else ""), show_header=False)
    for k, v in p.items():
        table.add_row(k, str(v))
    console.print(table)


@app.command()
def verify(
    bundle: Annotated[Path, typer.Option(help="Bundle folder.")],
    as_json: JsonOpt = False,
) -> None:
    """Check every checksum of a bundle and show what it holds."""

    def body() -> dict:
        b = Bundle.load(bundle)
        m = b.manifest
        size = sum((b.path / f).stat().st_size for f in m["files"])
        return {
            "bundle": str(b.path),
            "bundle_id": b.bundle_id,
            "round": b.round,
            "model": m["base_model"]["id"],
            "kept_layers": m["split"]["kept"],
            "messenger_depth": m["split"]["a"],
            "profile": m["profile"]["name"],
            "files": len(m["files"]),
            "bytes": size,
        }

    def render(s: dict) -> None:
        console.print(
            f"[green]✓[/] {s['bundle']}: {s['files']} files verified ({s['bytes'] / GIB * 1024:.1f} MiB), "
            f"round {s['round']}, {s['model']}, {len(s['kept_layers'])} kept layers, "
            f"messenger depth {s['messenger_depth']}, profile {s['profile']}"
        )

    run_command(body, as_json, render)


@app.command()
def train(
    bundle: Annotated[Path, typer.Option(help="Bundle folder from the cloud.")],
    data: Annotated[Path, typer.Option(help="This device's private JSONL data.")],
    state: Annotated[Path, typer.Option(help="Client state folder (created on first use).")],
    out: Annotated[Path, typer.Option(help="Where to write the Δc packet.")],
    profile: Annotated[str | None, typer.Option(help="Device profile name, `auto`, or a .toml path.")] = None,
    steps: Annotated[int | None, typer.Option(help="Local steps K (default: the bundle's).")] = None,
    solver: Annotated[str | None, typer.Option(help="fo (first order) or fd (finite-difference HVP).")] = None,
    codec: Annotated[str, typer.Option(help="Packet codec: fp32 (lossless), bf16 or int8.")] = "fp32",
    lr: Annotated[float | None, typer.Option(help="Base learning rate eta.")] = None,
    eta_in: Annotated[float | None, typer.Option(help="Look-ahead step (default: eta).")] = None,
    gamma: Annotated[float | None, typer.Option(help="Consensus-correction weight gamma_t.")] = None,
    eps_prox: Annotated[float | None, typer.Option(help="Proximal weight.")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Mini-batch size.")] = None,
    grad_accum: Annotated[int | None, typer.Option(help="Micro-batches per step.")] = None,
    client_id: Annotated[str | None, typer.Option(help="This edge's id (first round only; default: hostname).")] = None,
    key_file: Annotated[Path | None, typer.Option(help="Client key: packets get an HMAC tag.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Train the messenger for one round (CIDERS update) and write the Δc packet."""

    def body() -> dict:
        overrides = {
            "local_steps": steps,
            "solver": solver,
            "eta": lr,
            "eta_in": eta_in,
            "gamma": gamma,
            "eps_prox": eps_prox,
            "optimizer": optimizer,
            "batch_size": batch_size,
            "grad_accum": grad_accum,
        }
        key = read_key_file(key_file) if key_file else None
        with LazyBar("local steps") as bar:

            def on_step(m: dict) -> None:
                extra = f"  r_fd {m['r_fd']:.2e}" if "r_fd" in m else ""
                bar.update(m["steps"], f"loss {m['loss']:.3f}  |g| {m['grad_norm']:.3f}{extra}")

            return train_run(
                bundle,
                data,
                state,
                out,
                profile=profile,
                codec=codec,
                client_id=client_id,
                key=key,
                overrides=overrides,
                on_step=on_step,
            ).summary

    def render(s: dict) -> None:
        console.print(
            f"[green]✓[/] round {s['round']} client {s['client_id']}: "
            f"loss {s['loss_first']:.4f} → {s['loss_last']:.4f} "
            f"in {s['steps']} {s['solver'].upper()} steps; packet {s['packet']} {s['packet_bytes']:,} bytes "
            f"({s['codec']}, raw {s['raw_bytes']:,}, {s['raw_bytes'] / s['packet_bytes']:.1f}x)"
        )

    run_command(body, as_json, render)


@app.command()
def infer(
    prompt: Annotated[str | None, typer.Option(help="One prompt to answer.")] = None,
    input: Annotated[Path | None, typer.Option("--input", help="JSONL of prompts (any training schema).")] = None,
    output: Annotated[Path | None, typer.Option(help="JSONL to write the answers to (with --input).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Bundle folder (torch runtime).")] = None,
    state: Annotated[Path | None, typer.Option(help="Client state: its personalized messenger.")] = None,
    export: Annotated[Path | None, typer.Option(help="Export folder from `ciders-edge export`.")] = None,
    use_global: Annotated[bool, typer.Option("--global", help="Run the bundle's global messenger.")] = False,
    runtime: Annotated[str | None, typer.Option(help="torch or onnx (default: the export's, else torch).")] = None,
    profile: Annotated[str | None, typer.Option(help="Device profile: dtype, device, ONNX providers.")] = None,
    backbone: BackboneOpt = None,
    base_model: BaseModelOpt = None,
    stream: Annotated[bool, typer.Option(help="Print the answer as it is generated.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Answer a prompt (or a JSONL file) with the personalized model, in torch or ONNX Runtime."""

    def body() -> dict:
        if (prompt is None) == (input is None):
            raise ConfigError("pass exactly one of --prompt or --input")
        if (input is None) != (output is None):
            raise ConfigError("--input and --output go together (prompts in, answers out)")
        if output is not None and output.is_dir():
            raise ConfigError(f"--output {output} is a folder; give the JSONL file to write")
        if export is not None and bundle is None and (state is not None or use_global):
            raise ConfigError("with --export, --state/--global only check the export: pass --bundle too, or neither")
        records = read_jsonl(input) if input is not None else None  # bad input fails before the model loads
        settings = GenerationSettings(max_new_tokens, temperature, top_p, seed)
        prof = load_profile(profile) if profile else None
        with status("loading the model"):
            rt = open_runtime(
                runtime,
                bundle=bundle,
                state=state,
                export=export,
                use_global=use_global,
                profile=prof,
                backbone=backbone,
                base_model=base_model,
            )
        summary = {"runtime": rt.name, "providers": rt.providers, "source": rt.source}
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
        src = s["source"]
        who = (
            f"client {src['client_id']} round {src['state_round']}"
            if src["messenger"] == "personalized"
            else (f"global messenger round {src['round']}")
        )
        who += ", AdapFu" if src.get("backbone") == "full" else ", AdapEmu"
        what = f"{s['new_tokens']} tokens" if "text" in s else f"{s['answers']} answers → {s['output']}"
        rate = f", {s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens_per_s"] is not None else ""
        console.print(f"[dim]{what}, first token {s['first_token_s']:.2f} s{rate} ({s['runtime']}, {who})[/]")

    run_command(body, as_json, render)


@app.command()
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
        typer.Option(help="Score the base model, the AdapEmu (global, personalized) and AdapFu (personalized)."),
    ] = False,
    limit: Annotated[int | None, typer.Option(help="Score only the first N records of each file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens per generated answer.")] = 64,
    profile: Annotated[str | None, typer.Option(help="Device profile: dtype and device.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Score messengers on your data: response NLL, exact match (records with `answer`), ROUGE-L (with `response`)."""
    from ciders_edge.inference.evaluate import COMPARE, evaluate_models

    def body() -> dict:
        states = list(state or [])
        if states and len(states) != len(data):
            raise ConfigError(f"pass one --data per --state (got {len(data)} --data for {len(states)} --state)")
        if use_global + base + compare > 1:
            raise ConfigError("pass at most one of --global, --base and --compare")
        if limit is not None and limit <= 0:
            raise ConfigError(f"--limit must be positive, got {limit}")
        b = Bundle.load(bundle)
        if compare:
            models = list(COMPARE)
        else:
            messenger = "global" if use_global else "base" if base else "personalized"
            models = [(resolve_backbone(b, backbone), messenger)]
        if any(m == "personalized" for _, m in models) and not states:
            raise ConfigError("pass --state (the personalized messenger), or --global / --base")
        edges = list(zip(states, data, strict=True)) if states else [(None, d) for d in data]
        prof = load_profile(profile) if profile else None
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
            if c[k] < c["records"]
        ]
        if missing:
            notes[r["data"]] = f"{r['data']}: {c['records']} records, " + "; ".join(missing)
    return list(notes.values())


def _render_evaluate(s: dict) -> None:
    names = {"base": "base model", "global": "global messenger", "personalized": "personalized messenger"}
    files = list(dict.fromkeys(r["data"] for r in s["results"]))
    table = Table("model", *(f"{Path(f).parent.name}/{Path(f).name}" for f in files), title=f"{s['bundle']}")
    for key in dict.fromkeys((r["backbone"], r["messenger"]) for r in s["results"]):
        backbone, messenger = key
        label = f"{'AdapFu' if backbone == 'full' else 'AdapEmu'}, {names[messenger]}"
        if key == ("full", "base"):
            label = "base model"
        cells = []
        for f in files:
            r = next(r for r in s["results"] if (r["backbone"], r["messenger"]) == key and r["data"] == f)
            cells.append(_cell(r))
        table.add_row(label, *cells)
    console.print(table)
    for note in s["skipped"]:
        console.print(f"[dim]note: {note}[/]", highlight=False)


def _cell(r: dict) -> str:
    parts = []
    if r["exact_match"] is not None:
        parts.append(f"EM {r['exact_match']:.0%}")
    if r["nll"] is not None:
        parts.append(f"NLL {r['nll']:.3f}")
    if r["rouge_l"] is not None and r["exact_match"] is None:
        parts.append(f"ROUGE-L {r['rouge_l']:.3f}")
    return "  ".join(parts) or "—"


@app.command()
def keygen(
    state: Annotated[Path, typer.Option(help="Client state folder; the key is made there once.")],
    as_json: JsonOpt = False,
) -> None:
    """Make this device's fleet node key (once) and print the public key the cloud registers."""
    from ciders_edge.fleet.keys import ensure_node_key

    def body() -> dict:
        state.mkdir(parents=True, exist_ok=True)
        private, public = ensure_node_key(state)
        return {"private": str(private), "public": str(public), "line": public.read_text().strip()}

    def render(s: dict) -> None:
        console.print(f"[green]✓[/] node key {s['private']}; the cloud registers {s['public']} as RUN/nodes/ID.pub:")
        console.print(s["line"], highlight=False, soft_wrap=True)

    run_command(body, as_json, render)


@app.command()
def join(
    server: Annotated[str, typer.Option(help="The cloud's SuperLink, HOST:PORT.")],
    state: Annotated[Path, typer.Option(help="Client state folder: c_i, personalized messenger, bundle, node key.")],
    data: Annotated[Path, typer.Option(help="This device's private JSONL data.")],
    profile: Annotated[str, typer.Option(help="Device profile name, `auto`, or a .toml path.")] = "auto",
    root_certificates: Annotated[
        Path | None, typer.Option(help="The cloud's CA certificate (ca.crt from `ciders-cloud certs`).")
    ] = None,
    codec: Annotated[str, typer.Option(help="Packet codec: fp32 (lossless), bf16 or int8.")] = "fp32",
    key_file: Annotated[Path | None, typer.Option(help="Client key: packets get an HMAC tag.")] = None,
    admit_wait: Annotated[float, typer.Option(help="Seconds to keep asking a SuperLink that does not admit us.")] = 60,
    as_json: JsonOpt = False,
) -> None:
    """Join a fleet: run this device's Flower SuperNode; each round trains here and sends Δc up."""
    from ciders_edge.fleet.join import join as join_fleet  # Flower loads only for fleet commands

    run_command(
        lambda: join_fleet(
            server,
            state,
            data,
            profile,
            root_certificates=root_certificates,
            codec=codec,
            key=key_file,
            admit_wait=admit_wait,
        ),
        as_json,
        lambda s: console.print("[green]✓[/] the SuperNode stopped"),
    )


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


def _add_plugin_commands() -> None:
    """Commands other packages contribute (``export`` adds export and bench): entry-point group
    ``ciders_edge.commands``, so this light runtime never imports them itself."""
    for ep in entry_points(group="ciders_edge.commands"):
        try:
            app.command(ep.name)(ep.load())
        except ImportError as err:  # a broken plugin must not take `train` down with it
            console.print(f"[yellow]notice:[/] command {ep.name!r} unavailable ({err})", soft_wrap=True)


_add_plugin_commands()


def main() -> None:
    app()
