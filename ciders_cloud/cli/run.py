"""The commands on a run folder: ``prepare`` makes one, ``distill`` and ``aggregate`` move it on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ciders_cloud.cli.privacy import (
    DpClipOnOpt,
    DpClipOpt,
    DpDeltaOpt,
    DpEpsilonOpt,
    DpNoiseOpt,
    SamplingOpt,
    dp_table,
    epsilon_text,
)
from ciders_edge.cli_utils import JsonOpt, key_table, print_table, run_command
from ciders_edge.progress import console

__all__ = ["prepare", "distill", "aggregate", "locked", "DeviceOpt"]

DeviceOpt = Annotated[
    str,
    typer.Option(
        help="Where the cloud's torch work runs (TAKD, fidelity, a strategy's Hessian products, simulate's evaluation):"
        " auto (CUDA when present), cpu or cuda."
    ),
]


def prepare(
    out: Annotated[Path, typer.Option(help="New run folder.")],
    public_data: Annotated[str | None, typer.Option(help="Public JSONL data for TAKD.")] = None,
    config: Annotated[
        str | None,
        typer.Option(help="TOML file or preset name (paper): the run's settings (docs/studies.md); flags win."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="smollm2-135m (default), tiny, a local HF folder or a hub id.")
    ] = None,
    profile: Annotated[
        list[str] | None, typer.Option(help="Device profile: a name or a .toml path (repeatable); one bundle each.")
    ] = None,
    messenger_depth: Annotated[
        int | None,
        typer.Option(help="Messenger depth a (default: the deepest profile's; each profile trains its own top ones)."),
    ] = None,
    drop_ratio: Annotated[
        float | None, typer.Option(help="1 - beta for every profile (default: each profile's own backbone).")
    ] = None,
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
    storage: Annotated[
        str | None,
        typer.Option(help="How bundles store frozen weights: fp32, bf16, int8 or int4 (default: each profile's)."),
    ] = None,
    teacher_dtype: Annotated[
        str | None,
        typer.Option(
            help="The cloud's teacher and the frozen weights the AdapEmu shares with it: fp32, bf16, or auto "
            "(default: bf16 from 1B parameters); what trains stays fp32."
        ),
    ] = None,
    participation: Annotated[
        float | None, typer.Option(help="Share q of the clients each fleet round samples.")
    ] = None,
    sampling: SamplingOpt = None,
    dp_clip: DpClipOpt = None,
    dp_noise: DpNoiseOpt = None,
    dp_epsilon: DpEpsilonOpt = None,
    dp_delta: DpDeltaOpt = None,
    dp_rounds: Annotated[
        int | None, typer.Option(help="DP: the rounds --dp-epsilon must last.", rich_help_panel="Differential privacy")
    ] = None,
    dp_clip_on: DpClipOnOpt = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Split the model (Algorithm 1), align the learnable backbone by TAKD, write one bundle per profile."""

    def body() -> dict:  # the run's modules and the model stack load when a command runs, not for --help
        from ciders_cloud.cli.config_file import merge_config
        from ciders_cloud.models.device import cloud_device
        from ciders_cloud.preparation import prepare as prepare_run
        from ciders_cloud.run.config import RunConfig, TakdConfig
        from ciders_cloud.run.splits import fleet_split, run_profiles
        from ciders_edge.errors import ConfigError
        from ciders_edge.hyperparams import RoundHyperparams
        from ciders_edge.model.lora import LoraSettings

        where = cloud_device(device)  # refused before anything is read or written
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
            "client_ids": client,
            "storage": storage,
            "teacher_dtype": teacher_dtype,
            "participation": participation,
            "sampling": sampling,
        }
        tables = {
            "takd": {"lr": takd_lr, "batch_size": takd_batch_size, "seq_len": seq_len},
            "dp": {**dp_table(dp_clip, dp_noise, dp_epsilon, dp_delta, dp_clip_on), "rounds": dp_rounds},
        }
        merged = {"model": "smollm2-135m", **merge_config(config, flags, tables, command="prepare")}
        if not merged["dp"]:
            del merged["dp"]
        if "public_data" not in merged:
            raise ConfigError("--public-data is required (or `public_data` in --config)")
        profiles, kept = run_profiles(merged.get("profiles") or ["cpu-laptop"])
        merged.update(kept)
        split = fleet_split(profiles, merged.get("messenger_depth"), merged.get("drop_ratio"))
        merged = {**split, **merged} if "profile_splits" in merged else {**merged, **split}
        merged.setdefault("lora", LoraSettings(rank=profiles[0].lora_rank).to_dict())  # one messenger: one rank
        merged["takd"] = TakdConfig.from_dict(merged["takd"]).to_dict()
        merged["hyperparameters"] = RoundHyperparams.from_dict(merged.get("hyperparameters", {})).to_dict()
        return prepare_run(RunConfig.from_dict(merged, where="flags"), out, where)  # the file was checked at load

    run_command(body, as_json, _render)


def locked(run: Path, command: str, body: Callable[[], dict]) -> Callable[[], dict]:
    """``body`` under the run's lock: one command writes a run folder at a time."""

    def held() -> dict:
        from ciders_cloud.run.lock import run_lock

        with run_lock(run, command):
            return body()

    return held


def distill(
    run: Annotated[Path, typer.Option(help="Run folder made by `prepare`.")],
    steps: Annotated[int, typer.Option(help="TAKD steps to add, warm-started.")] = 5,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Continue TAKD of the learnable backbone and re-ship the current round's bundles."""

    def body() -> dict:
        from ciders_edge.config import check_limit

        check_limit("steps", steps, "--steps")
        from ciders_cloud.models.device import cloud_device
        from ciders_cloud.preparation import distill as distill_run

        where = cloud_device(device)  # refused before the run is locked or read
        return locked(run, "distill", lambda: distill_run(run, steps, where))()

    run_command(body, as_json, _render)


def aggregate(
    run: Annotated[Path, typer.Option(help="Run folder.")],
    packets: Annotated[list[Path], typer.Option("--packets", help="Δc packets of this round (repeatable).")],
    reports: Annotated[
        list[Path] | None,
        typer.Option(
            "--reports",
            help="The edges' `ciders-edge train --json` output (repeatable): their validation, pooled, helps "
            "each device choose the messenger it deploys.",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Close one round: check the packets, reconstruct and aggregate (eq. 11–12), TAKD (eq. 13), ship bundles."""

    def render(s: dict) -> None:
        from ciders_cloud.models.fidelity import Fidelity

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
        if f := s.get("fleet_choice"):
            from ciders_edge.training.fleet_evidence import FleetEvidence

            reference = "the global messenger" if FleetEvidence.from_dict(f).global_first else "their own"
            console.print(
                f"  deployed choice: {f['reports']} edges' validation pooled; personalized − global "
                f"{f['personalized_gap']:+.4f} ± {f['personalized_se']:.4f} nats (reference: {reference}), "
                f"deployed − base {f['base_mean']:+.4f}, spread {f['base_var'] ** 0.5:.4f}"
            )
        if p := s.get("privacy"):
            console.print(
                f"  differential privacy: {epsilon_text(p)} (noise std {p['noise_std_of_mean']:.3g} on the mean)"
            )

    def body() -> dict:
        from ciders_cloud.models.device import cloud_device
        from ciders_cloud.round.aggregate import aggregate_files
        from ciders_cloud.round.reports import read_reports

        where = cloud_device(device)  # refused before the run is locked or read
        said = read_reports(reports or [])
        return locked(run, "aggregate", lambda: aggregate_files(run, packets, where, reports=said))()

    run_command(body, as_json, render)


def _render(s: dict) -> None:
    from ciders_cloud.models.fidelity import Fidelity  # loaded by the command that made ``s``

    rows = [("model", f"{s['model']} ({s['n']} layers, messenger {s['messenger_depth']})")]
    reference = (
        f" (drop{s['profile_splits'][next(iter(s['profile_splits']))]['drop_ratio']:g})" if s.get("backbones") else ""
    )
    rows.append((f"kept layers{reference}", f"{len(s['kept_layers'])}: {s['kept_layers']}"))
    if s.get("layer_steps"):
        rows.append(("layer fits", f"{s['layer_steps']} steps"))
    if s["takd_first"]:
        first, last = s["takd_first"], s["takd_last"]
        for k in ("loss", "hidden", "kl", "ce"):
            rows.append((f"TAKD {k}", f"{first[k]:.4f} → {last[k]:.4f}  ({s['takd_steps']} steps)"))
    if s.get("fidelity_before"):
        rows.append(("fidelity before", Fidelity(**s["fidelity_before"]).describe()))
    if s.get("fidelity"):
        f = {k: v for k, v in s["fidelity"].items() if k != "takd_step"}
        rows.append(("fidelity" if not s.get("fidelity_before") else "fidelity after", Fidelity(**f).describe()))
    for name, b in (s.get("backbones") or {}).items():
        fidelity = Fidelity(**{k: v for k, v in b["fidelity"].items() if k != "takd_step"}) if b["fidelity"] else None
        rows.append((f"backbone {name}", f"{len(b['kept_layers'])} layers; {fidelity.describe() if fidelity else ''}"))
    for name, path in s["bundles"].items():
        deploy = f" (deploys {s['deploy'][name]})" if s.get("deploy") else ""
        trains = s.get("profile_splits", {}).get(name)
        split = (
            f"; trains messenger {trains['trains']}/{s['messenger_depth']} on backbone drop{trains['drop_ratio']:g}"
            if trains
            else ""
        )
        rows.append((f"bundle {name}", path + deploy + split))
    if p := s.get("privacy"):
        rows.append(("differential privacy", _privacy_line(p)))
    print_table(key_table(("", ""), rows, show_header=False, title=f"run {s['run']}"))


def _privacy_line(p: dict) -> str:
    """Prepare's DP settings and what the planned rounds will spend."""
    line = (
        f"clip {p['clip']:g}, noise multiplier {p['noise_multiplier']:.4g} "
        f"({p['sampling']} sampling, q {p['participation']:g} of {p['population']} clients, each weighing 1/D, "
        f"D = {p['denominator']:g})"
    )
    if planned := p["planned"]:
        line += "; " + epsilon_text(planned)
    return line
