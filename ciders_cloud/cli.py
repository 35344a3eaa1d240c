"""``ciders-cloud``: prepare a run, distill its learnable backbone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ciders_cloud.config import RunConfig, TakdConfig
from ciders_cloud.config_file import merge_config
from ciders_cloud.fidelity import Fidelity
from ciders_cloud.lock import run_lock
from ciders_cloud.prepare import distill as distill_run
from ciders_cloud.prepare import prepare as prepare_run
from ciders_cloud.rounds import aggregate_files
from ciders_cloud.strategies import STRATEGIES
from ciders_cloud.study.report import report as report_runs
from ciders_cloud.study.simulate import SimConfig
from ciders_cloud.study.simulate import simulate as simulate_run
from ciders_edge.cli_utils import JsonOpt, run_command
from ciders_edge.config import RoundHyperparams
from ciders_edge.data.demo import write_demo_data
from ciders_edge.errors import ConfigError
from ciders_edge.model.lora import LoraSettings
from ciders_edge.profiles import load_profile
from ciders_edge.progress import console

app = typer.Typer(
    help="CIDERS cloud: prepare models, distill, ship AdapEmu bundles.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.command()
def prepare(
    out: Annotated[Path, typer.Option(help="New run folder.")],
    public_data: Annotated[str | None, typer.Option(help="Public JSONL data for TAKD.")] = None,
    config: Annotated[str | None, typer.Option(help="TOML file (or preset name) whose keys mirror the flags.")] = None,
    model: Annotated[
        str | None, typer.Option(help="smollm2-135m (default), tiny, a local HF folder or a hub id.")
    ] = None,
    profile: Annotated[list[str] | None, typer.Option(help="Device profile (repeatable); one bundle each.")] = None,
    messenger_depth: Annotated[int | None, typer.Option(help="Messenger depth a (default: first profile's).")] = None,
    drop_ratio: Annotated[float | None, typer.Option(help="1 - beta (default: first profile's).")] = None,
    layer_steps: Annotated[
        int | None, typer.Option(help="Bootstrap stage 1: layer-wise fits of the layers after each gap (default 200).")
    ] = None,
    align_steps: Annotated[
        int | None, typer.Option(help="Bootstrap stage 2: end-to-end TAKD steps before round 0 (default 60).")
    ] = None,
    algorithm: Annotated[str | None, typer.Option(help="Strategy the run's rounds follow (default ciders-fo).")] = None,
    client: Annotated[list[str] | None, typer.Option(help="Accepted client id (repeatable; none: any).")] = None,
    takd_lr: Annotated[float | None, typer.Option(help="TAKD learning rate.")] = None,
    takd_batch_size: Annotated[int | None, typer.Option(help="TAKD batch size.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="TAKD sequence length.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for LoRA init and data order.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Split the model (Algorithm 1), align the learnable backbone by TAKD, write one bundle per profile."""

    def body() -> dict:
        flags = {
            "model": model,
            "profiles": profile,
            "messenger_depth": messenger_depth,
            "drop_ratio": drop_ratio,
            "public_data": public_data,
            "layer_steps": layer_steps,
            "align_steps": align_steps,
            "seed": seed,
            "algorithm": algorithm,
            "clients": client,
        }
        takd = {"lr": takd_lr, "batch_size": takd_batch_size, "seq_len": seq_len}
        merged = {"model": "smollm2-135m", **merge_config(config, flags, {"takd": takd}, command="prepare")}
        if "public_data" not in merged:
            raise ConfigError("--public-data is required (or `public_data` in --config)")
        first = load_profile((merged.get("profiles") or ["cpu-laptop"])[0])
        merged.setdefault("messenger_depth", first.messenger_depth)
        merged.setdefault("drop_ratio", first.drop_ratio)
        merged.setdefault("lora", LoraSettings(rank=first.lora_rank).to_dict())
        merged["takd"] = TakdConfig.from_dict(merged["takd"]).to_dict()
        merged["hyperparameters"] = RoundHyperparams.from_dict(merged.get("hyperparameters", {})).to_dict()
        return prepare_run(RunConfig.from_dict(merged, where="flags"), out)  # the file was checked at load

    run_command(body, as_json, _render)


def _locked(run: Path, command: str, body: Callable[[], dict]) -> Callable[[], dict]:
    """``body`` under the run's lock: one command writes a run folder at a time."""

    def locked() -> dict:
        with run_lock(run, command):
            return body()

    return locked


@app.command()
def distill(
    run: Annotated[Path, typer.Option(help="Run folder made by `prepare`.")],
    steps: Annotated[int, typer.Option(help="TAKD steps to add, warm-started.")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Continue TAKD of the learnable backbone and re-ship the current round's bundles."""
    run_command(_locked(run, "distill", lambda: distill_run(run, steps)), as_json, _render)


@app.command()
def aggregate(
    run: Annotated[Path, typer.Option(help="Run folder.")],
    packets: Annotated[list[Path], typer.Option("--packets", help="Δc packets of this round (repeatable).")],
    as_json: JsonOpt = False,
) -> None:
    """Close one round: check the packets, reconstruct and aggregate (eq. 11–12), TAKD (eq. 13), ship bundles."""

    def render(s: dict) -> None:
        if s.get("already_aggregated"):
            console.print(f"[yellow]round {s['round']} was already aggregated with these packets[/]")
        console.print(
            f"[green]✓[/] round {s['round']} ({s['algorithm']}): {len(s['clients'])} clients "
            f"{', '.join(s['clients'])}; |Δv| {s['v_change']:.3e}, |c| {s['c_norm']:.3e}, "
            f"{s['takd_steps']} TAKD steps; round {s['next_round']} bundles:"
        )
        if s.get("fidelity"):
            console.print(f"  AdapEmu fidelity: {Fidelity(**s['fidelity']).describe()}")
        for name, path in s["bundles"].items():
            console.print(f"  {name}: {path} ({s['bytes_down'][name]:,} new bytes)")

    run_command(_locked(run, "aggregate", lambda: aggregate_files(run, packets)), as_json, render)


@app.command()
def simulate(
    out: Annotated[Path, typer.Option(help="New folder for the whole study.")],
    data: Annotated[
        list[str] | None, typer.Option(help="JSONL data (repeatable; one per client with per-file).")
    ] = None,
    eval_data: Annotated[
        list[str] | None, typer.Option(help="Per-file: each client's evaluation JSONL (default: a held-out share).")
    ] = None,
    config: Annotated[
        str | None, typer.Option(help="TOML file (or preset name: paper) whose keys mirror the flags.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="smollm2-135m, tiny or a local folder.")] = None,
    clients: Annotated[int | None, typer.Option(help="Number of simulated edges.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds to run.")] = None,
    local_steps: Annotated[int | None, typer.Option(help="K local steps per round.")] = None,
    algorithm: Annotated[str | None, typer.Option(help=", ".join(STRATEGIES) + ".")] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid | dirichlet:ALPHA[:FIELD] | by-field:FIELD | per-file.")
    ] = None,
    participation: Annotated[float | None, typer.Option(help="Fraction of clients sampled per round.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for partition, sampling, LoRA init.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate every E rounds (and at the end).")] = None,
    eval_examples: Annotated[int | None, typer.Option(help="Held-out records per client for NLL.")] = None,
    eval_generate: Annotated[
        int | None, typer.Option(help="Held-out records per client answered (ROUGE-L, EM).")
    ] = None,
    max_records: Annotated[int | None, typer.Option(help="Cap records per client (0: all).")] = None,
    public_data: Annotated[
        str | None, typer.Option(help="Public JSONL for TAKD (default: a sample of client data).")
    ] = None,
    profile: Annotated[str | None, typer.Option(help="Device profile of every simulated edge.")] = None,
    messenger_depth: Annotated[int | None, typer.Option(help="Messenger depth a.")] = None,
    drop_ratio: Annotated[float | None, typer.Option(help="1 - beta.")] = None,
    layer_steps: Annotated[int | None, typer.Option(help="Bootstrap stage 1 steps (default: prepare's).")] = None,
    align_steps: Annotated[int | None, typer.Option(help="Bootstrap stage 2 TAKD steps (default: prepare's).")] = None,
    codec: Annotated[str | None, typer.Option(help="Packet codec: fp32, bf16, int8.")] = None,
    lr: Annotated[float | None, typer.Option(help="Base learning rate eta.")] = None,
    gamma: Annotated[float | None, typer.Option(help="Constant gamma (with --gamma-schedule constant).")] = None,
    gamma_schedule: Annotated[str | None, typer.Option(help="constant or protocol-c.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate the cloud and N edges in one process, through the same code as the CLIs."""

    def body() -> dict:
        flags = {
            "model": model,
            "data": data,
            "eval_data": eval_data,
            "clients": clients,
            "rounds": rounds,
            "local_steps": local_steps,
            "algorithm": algorithm,
            "partition": partition,
            "participation": participation,
            "seed": seed,
            "eval_every": eval_every,
            "eval_examples": eval_examples,
            "eval_generate": eval_generate,
            "max_records": max_records,
            "public_data": public_data,
            "profile": profile,
            "messenger_depth": messenger_depth,
            "drop_ratio": drop_ratio,
            "layer_steps": layer_steps,
            "align_steps": align_steps,
            "codec": codec,
            "gamma_schedule": gamma_schedule,
        }
        hp = {"eta": lr, "gamma": gamma, "local_steps": local_steps}  # the flag beats a file's [hyperparameters]
        merged = merge_config(config, flags, {"hyperparameters": hp}, command="simulate")
        return simulate_run(SimConfig.from_dict(merged, where="flags"), out)  # the file was checked at load

    def render(s: dict) -> None:
        console.print(f"[green]✓[/] {s['algorithm']}: {s['clients']} clients × {s['rounds']} rounds in {s['out']}")
        console.print(
            f"  mean held-out NLL: personalized {s['mean_nll_personal']:.4f}, global {s['mean_nll_global']:.4f}"
            + (f", Δcross {s['delta_cross']:.4f}" if s.get("delta_cross") is not None else "")
        )

    run_command(body, as_json, render)


@app.command()
def report(
    run: Annotated[list[Path], typer.Option("--run", help="Simulation output folder (repeatable, compared).")],
    out: Annotated[Path, typer.Option(help="Folder for the PNGs and summary.md.")],
    as_json: JsonOpt = False,
) -> None:
    """Plot loss, E-RAE, NLL, bytes and S-DR/S-PPR against gamma; write a markdown comparison."""
    run_command(
        lambda: report_runs(run, out),
        as_json,
        lambda s: console.print(f"[green]✓[/] {len(s['files'])} files in {s['out']}: {', '.join(s['files'])}"),
    )


@app.command()
def serve(
    run: Annotated[Path, typer.Option(help="Run folder made by `prepare`; edge keys in RUN/nodes/<id>.pub.")],
    rounds: Annotated[int, typer.Option(help="Run until this many rounds are complete (a restart resumes).")],
    min_clients: Annotated[int, typer.Option(help="Edges to wait for before a round (then whoever is there).")] = 1,
    address: Annotated[str, typer.Option(help="HOST:PORT the SuperLink listens on.")] = "0.0.0.0:9092",
    round_timeout: Annotated[float, typer.Option(help="Seconds to wait for edges and their replies.")] = 600.0,
    certs: Annotated[Path | None, typer.Option(help="Folder from `ciders-cloud certs` (default RUN/certs).")] = None,
    connect: Annotated[bool, typer.Option(help="Use the SuperLink running on this host.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the rounds over the network on a Flower SuperLink; edges join with `ciders-edge join`."""
    from ciders_cloud.fleet.serve import ServeOptions
    from ciders_cloud.fleet.serve import serve as serve_fleet

    def render(s: dict) -> None:
        table = Table("round", "client", "status", "bytes down", "bytes up", title=f"fleet {s['run']}")
        for r in s["clients"]:
            table.add_row(
                str(r["round"]), r["client"], r.get("status", ""), f"{r['bytes_down']:,}", f"{r['bytes_up']:,}"
            )
        console.print(table)
        done = "complete" if s["complete"] else "not complete"
        console.print(f"[green]✓[/] run at round {s['round']} of {s['rounds']} ({done})")

    opts = dict(min_clients=min_clients, address=address, round_timeout=round_timeout, certs=certs)
    body = _locked(run, "serve", lambda: serve_fleet(ServeOptions(run, rounds, connect=connect, **opts)))
    run_command(body, as_json, render)


@app.command()
def certs(
    out: Annotated[Path, typer.Option(help="Folder for ca.crt and server.pem/server.key.")],
    host: Annotated[
        list[str] | None, typer.Option(help="Name or IP the edges use to reach the cloud (repeatable).")
    ] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
    ca_key: Annotated[
        Path | None,
        typer.Option(help="Where to keep the CA's private key, outside --out (offline media); default: discard it."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a private CA and the SuperLink's TLS certificate (for a deployment or a test)."""
    from ciders_cloud.fleet.certs import make_certs

    def render(s: dict) -> None:
        kept = f"CA key in {s['ca_key']}" if s["ca_key"] else "CA key discarded (--ca-key PATH keeps it)"
        console.print(f"[green]✓[/] CA {s['ca']} and server certificate for {', '.join(s['hosts'])}; {kept}")

    run_command(lambda: make_certs(out, host or [], days, ca_key), as_json, render)


@app.command("demo-data")
def demo_data(
    out: Annotated[Path, typer.Option(help="Folder for {family}/{train,public,eval}.jsonl and public.jsonl.")],
    n_train: Annotated[int, typer.Option(help="Training records per family.")] = 200,
    n_public: Annotated[int, typer.Option(help="Public (TAKD) records per family.")] = 100,
    n_eval: Annotated[int, typer.Option(help="Evaluation records per family.")] = 50,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Generate the embedded demo data: five task families with exact-match answers."""

    def body() -> dict:
        paths = write_demo_data(out, n_train, n_public, n_eval, seed)
        return {"out": str(out), "files": {k: str(v) for k, v in paths.items()}}

    run_command(body, as_json, lambda s: console.print(f"[green]✓[/] {len(s['files'])} files under {s['out']}"))


def _render(s: dict) -> None:
    table = Table(title=f"run {s['run']}", show_header=False)
    table.add_row("model", f"{s['model']} ({s['n']} layers, messenger {s['messenger_depth']})")
    table.add_row("kept layers", f"{len(s['kept_layers'])}: {s['kept_layers']}")
    if s.get("layer_steps"):
        table.add_row("layer fits", f"{s['layer_steps']} steps")
    if s["takd_first"]:
        first, last = s["takd_first"], s["takd_last"]
        for k in ("loss", "hidden", "kl", "ce"):
            table.add_row(f"TAKD {k}", f"{first[k]:.4f} → {last[k]:.4f}  ({s['takd_steps']} steps)")
    if s.get("fidelity_before"):
        table.add_row("fidelity before", Fidelity(**s["fidelity_before"]).describe())
    if s.get("fidelity"):
        f = {k: v for k, v in s["fidelity"].items() if k != "takd_step"}
        table.add_row("fidelity" if not s.get("fidelity_before") else "fidelity after", Fidelity(**f).describe())
    for name, path in s["bundles"].items():
        deploy = f" (deploys {s['deploy'][name]})" if s.get("deploy") else ""
        table.add_row(f"bundle {name}", path + deploy)
    console.print(table)


def main() -> None:
    app()
