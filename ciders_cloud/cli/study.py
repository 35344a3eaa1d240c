"""The study commands: ``simulate`` a federation (in one process or on Flower's Simulation Engine), ``report``
on studies, ``demo-data``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ciders_cloud.cli.privacy import DpClipOnOpt, DpClipOpt, DpDeltaOpt, DpEpsilonOpt, DpNoiseOpt, SamplingOpt, dp_table
from ciders_cloud.cli.run import DeviceOpt
from ciders_cloud.run.algorithms import ALGORITHMS
from ciders_edge.cli_utils import JsonOpt, run_command
from ciders_edge.errors import ConfigError
from ciders_edge.progress import console

__all__ = ["simulate", "report", "demo_data"]


def simulate(
    out: Annotated[Path, typer.Option(help="New folder for the whole study (with --resume: the study to go on with).")],
    data: Annotated[
        list[str] | None, typer.Option(help="JSONL data (repeatable; one per client with per-file).")
    ] = None,
    eval_data: Annotated[
        list[str] | None, typer.Option(help="Per-file: each client's evaluation JSONL (default: a held-out share).")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(help="TOML file or preset name (paper): the run's settings (docs/studies.md); flags win."),
    ] = None,
    model: Annotated[str | None, typer.Option(help="smollm2-135m, tiny or a local folder.")] = None,
    clients: Annotated[int | None, typer.Option(help="Number of simulated edges.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds to run.")] = None,
    local_steps: Annotated[int | None, typer.Option(help="K local steps per round.")] = None,
    algorithm: Annotated[str | None, typer.Option(help=", ".join(ALGORITHMS) + ".")] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid | dirichlet:ALPHA[:FIELD] | by-field:FIELD | per-file.")
    ] = None,
    participation: Annotated[float | None, typer.Option(help="Fraction of clients sampled per round.")] = None,
    sampling: SamplingOpt = None,
    seed: Annotated[int | None, typer.Option(help="Seed for partition, sampling, LoRA init.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate every E rounds (and at the end).")] = None,
    eval_examples: Annotated[int | None, typer.Option(help="Held-out records per client for NLL.")] = None,
    eval_generate: Annotated[
        int | None, typer.Option(help="Held-out records per client answered (ROUGE-L, EM).")
    ] = None,
    max_records: Annotated[int | None, typer.Option(help="Cap records per client (0: all).")] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option(
            help="Each client holds out this share of its records to choose its deployed messenger (0: none)."
        ),
    ] = None,
    rechoose: Annotated[
        bool | None,
        typer.Option(
            "--rechoose/--no-rechoose",
            help="Each new bundle, clients that hold a choice choose their deployed messenger again "
            "(`ciders-edge validate`; needs --val-fraction).",
            show_default=False,
        ),
    ] = None,
    public_data: Annotated[
        str | None, typer.Option(help="Public JSONL for TAKD (default: a sample of client data).")
    ] = None,
    profile: Annotated[str | None, typer.Option(help="Device profile of every simulated edge.")] = None,
    profile_mix: Annotated[
        str | None,
        typer.Option(help="A mixed fleet, e.g. cpu-laptop:3,rpi5-8gb:2 (clients in order; sets --clients)."),
    ] = None,
    messenger_depth: Annotated[int | None, typer.Option(help="Messenger depth a.")] = None,
    drop_ratio: Annotated[float | None, typer.Option(help="1 - beta.")] = None,
    layer_steps: Annotated[int | None, typer.Option(help="Bootstrap stage 1 steps (default: prepare's).")] = None,
    align_steps: Annotated[int | None, typer.Option(help="Bootstrap stage 2 TAKD steps (default: prepare's).")] = None,
    codec: Annotated[str | None, typer.Option(help="Packet codec: fp32, bf16, int8.")] = None,
    lr: Annotated[float | None, typer.Option(help="Base learning rate eta.")] = None,
    gamma: Annotated[float | None, typer.Option(help="Constant gamma (with --gamma-schedule constant).")] = None,
    gamma_schedule: Annotated[str | None, typer.Option(help="constant or protocol-c.")] = None,
    dp_clip: DpClipOpt = None,
    dp_noise: DpNoiseOpt = None,
    dp_epsilon: DpEpsilonOpt = None,
    dp_delta: DpDeltaOpt = None,
    dp_clip_on: DpClipOnOpt = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Go on with the study in --out to --rounds in all, from where it stopped (a kill too); "
            "its own settings hold: only --rounds and where it runs (--engine, --device) are taken."
        ),
    ] = False,
    engine: Annotated[
        str,
        typer.Option(
            help="Where the clients train: in-process (one after another) or flower (virtual SuperNodes of "
            "Flower's Simulation Engine on Ray; the simulation extra). Results are the same."
        ),
    ] = "in-process",
    actors: Annotated[
        int | None, typer.Option(help="--engine flower: Ray actors on this machine (default: as the cores allow).")
    ] = None,
    cpus_per_client: Annotated[float, typer.Option(help="--engine flower: CPUs each client's actor holds.")] = 1.0,
    gpus_per_client: Annotated[
        float, typer.Option(help="--engine flower: GPUs (or a share) each client's actor holds.")
    ] = 0.0,
    ray_address: Annotated[
        str | None,
        typer.Option(help="--engine flower: join this Ray cluster (its nodes must mount --out at the same path)."),
    ] = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Simulate the cloud and N edges, in one process or on Flower's Simulation Engine, through the CLIs' code."""

    def body() -> dict:  # the study's modules and the model stack load when a study runs, not for --help
        from ciders_cloud.cli.config_file import merge_config
        from ciders_cloud.models.device import cloud_device
        from ciders_cloud.study.config import SimConfig, parse_profile_mix
        from ciders_cloud.study.engines import EngineSettings
        from ciders_cloud.study.resume import resume as resume_run
        from ciders_cloud.study.simulate import simulate as simulate_run

        where = cloud_device(device)  # refused before anything is read or written
        engine_settings = EngineSettings(engine, actors, cpus_per_client, gpus_per_client, ray_address)
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
            "sampling": sampling,
            "seed": seed,
            "eval_every": eval_every,
            "eval_examples": eval_examples,
            "eval_generate": eval_generate,
            "max_records": max_records,
            "val_fraction": val_fraction,
            "rechoose": rechoose,
            "public_data": public_data,
            "profile": profile,
            "profile_mix": profile_mix,
            "messenger_depth": messenger_depth,
            "drop_ratio": drop_ratio,
            "layer_steps": layer_steps,
            "align_steps": align_steps,
            "codec": codec,
            "gamma_schedule": gamma_schedule,
        }
        hp = {"eta": lr, "gamma": gamma, "local_steps": local_steps}  # the flag beats a file's [hyperparameters]
        dp = dp_table(dp_clip, dp_noise, dp_epsilon, dp_delta, dp_clip_on)
        if resume:
            dp_flags = {"dp_clip": dp_clip, "dp_noise": dp_noise, "dp_epsilon": dp_epsilon, "dp_delta": dp_delta}
            _only_rounds({**flags, "config": config, "lr": lr, "gamma": gamma, **dp_flags, "dp_clip_on": dp_clip_on})
            return resume_run(out, rounds, where, engine_settings)
        merged = merge_config(config, flags, {"hyperparameters": hp, "dp": dp}, command="simulate")
        if merged.get("profile_mix") and clients is None:  # the mix says how many edges there are
            merged["clients"] = sum(parse_profile_mix(merged["profile_mix"]).values())
        cfg = SimConfig.from_dict(merged, where="flags")  # the file was checked at load
        return simulate_run(cfg, out, where, engine_settings)

    def render(s: dict) -> None:
        console.print(f"[green]✓[/] {s['algorithm']}: {s['clients']} clients × {s['rounds']} rounds in {s['out']}")
        console.print(
            f"  mean held-out NLL: personalized {s['mean_nll_personal']:.4f}, global {s['mean_nll_global']:.4f}"
            + (f", Δcross {s['delta_cross']:.4f}" if s.get("delta_cross") is not None else "")
        )

    run_command(body, as_json, render)


def _only_rounds(options: dict) -> None:
    """``--resume`` goes on with a study as it was made: any other setting given is refused, not ignored."""
    given = [name for name, value in options.items() if value is not None and name != "rounds"]
    if given:
        flag = "--" + given[0].replace("_", "-")
        made = "--resume goes on with the study as it was made (its config.json)"
        raise ConfigError(f"{flag}: {made}; only --rounds can grow")


def report(
    run: Annotated[list[Path], typer.Option("--run", help="Simulation output folder (repeatable, compared).")],
    out: Annotated[Path, typer.Option(help="Folder for the PNGs and summary.md.")],
    as_json: JsonOpt = False,
) -> None:
    """Plot loss, E-RAE, NLL, bytes and S-DR/S-PPR against gamma; write a markdown comparison."""
    from ciders_cloud.study.report import report as report_runs  # matplotlib loads for a report only

    run_command(
        lambda: report_runs(run, out),
        as_json,
        lambda s: console.print(f"[green]✓[/] {len(s['files'])} files in {s['out']}: {', '.join(s['files'])}"),
    )


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
        from ciders_edge.config import check_limit
        from ciders_edge.data.demo import write_demo_data

        for key, value in (("n_train", n_train), ("n_public", n_public), ("n_eval", n_eval), ("seed", seed)):
            check_limit(key, value, "--" + key.replace("_", "-"))
        paths = write_demo_data(out, n_train, n_public, n_eval, seed)
        return {"out": str(out), "files": {k: str(v) for k, v in paths.items()}}

    run_command(body, as_json, lambda s: console.print(f"[green]✓[/] {len(s['files'])} files under {s['out']}"))
