"""``prepare`` and ``distill``: split the model, align the learnable backbone, ship bundles."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from ciders_cloud.bootstrap import bootstrap
from ciders_cloud.config import RunConfig
from ciders_cloud.device import CPU, cloud_device, to_cpu
from ciders_cloud.fidelity import Fidelity, measure_fidelity
from ciders_cloud.run_folder import RunFolder
from ciders_cloud.server_state import ServerState
from ciders_cloud.strategies import round_hyperparams_for
from ciders_cloud.takd import TERMS, Distiller, public_split
from ciders_cloud.teacher import CloudModels, build_cloud_models, split_for
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.atomic import append_jsonl, staging_dir, write_json, write_jsonl, write_safetensors
from ciders_edge.formats.bundle import Bundle, BundleContents
from ciders_edge.formats.checksums import sha256_file
from ciders_edge.model.lora import peft_config
from ciders_edge.model.sources import load_tokenizer, model_revision, resolve_model
from ciders_edge.profiles import DeviceProfile, estimate_memory, load_profile
from ciders_edge.progress import console

__all__ = [
    "prepare",
    "distill",
    "write_bundles",
    "load_run",
    "write_round_log",
    "load_cloud_models",
    "fidelity_record",
]

TAKD_LOSS_KEYS = ("hidden_loss", "lambda_hidden", "lambda_out", "lambda_task", "task_loss")  # shown in manifests


def prepare(run: RunConfig, out: str | Path, device: str | torch.device = "cpu") -> dict:
    """Algorithm 1 and the bootstrap; writes ``out`` with server state and one bundle per profile.

    The run folder is built beside ``out`` and renamed into place at the end, so a failure
    leaves nothing behind.

    Args:
        device: where TAKD and fidelity run (``auto``, ``cpu``, ``cuda``); not part of the run.

    Raises:
        ConfigError: ``out`` exists, a profile is unknown, the model does not fit a profile, or
            ``device`` is not here.
    """
    device = cloud_device(device)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")
    profiles = [load_profile(p) for p in run.profiles]
    run = run.replace(model_path=str(resolve_model(run.model)))
    split = split_for(run)
    deploy = _deployments(run, profiles, split)
    public, held = public_split(run, load_tokenizer(Path(run.model_path)))  # bad data fails before the model loads
    run = run.replace(model_revision=model_revision(Path(run.model_path)))
    run = run.replace(run_id=run.run_id or run_identity(run))

    models = build_cloud_models(run, device=device)
    before = measure_fidelity(models, held)
    records, distiller = bootstrap(models, public, run)
    fidelity = measure_fidelity(models, held)
    records.append(fidelity_record(0, distiller.step_count if distiller else 0, fidelity))
    state = ServerState(
        round=0,
        messenger=models.messenger_state(),
        backbone=models.backbone_state(),
        consensus={k: torch.zeros_like(v) for k, v in models.messenger_state().items()},
        optimizer=distiller.optimizer_state() if distiller else {},
        takd_step=distiller.step_count if distiller else 0,
    )
    staging = staging_dir(out)
    folder = RunFolder(staging)
    try:
        write_json(folder.config, run.to_dict())
        write_safetensors(folder.aligned, models.changed_layers())
        state.save(folder.server_state)
        append_jsonl(folder.distill_log, records)
        bundles = write_bundles(staging, run, models, state, profiles, fidelity)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    summary = _summary(out, run, split, records, {p: RunFolder(out).bundle(p, state.round) for p in bundles})
    return {**summary, "fidelity_before": before.to_dict() if before else None, "deploy": deploy}


def distill(run_dir: str | Path, steps: int, device: str | torch.device = "cpu") -> dict:
    """Continue TAKD warm-started from the saved backbone LoRA and optimizer; re-ship the bundles.
    TAKD and fidelity run on ``device`` (``auto``, ``cpu``, ``cuda``)."""
    device = cloud_device(device)
    run_dir, folder = Path(run_dir), RunFolder(run_dir)
    run = load_run(run_dir)
    state = ServerState.load(folder.server_state)
    models = load_cloud_models(run_dir, run, state, device)
    public, held = public_split(run, models.tokenizer)
    distiller = Distiller(models, public, run.takd_config, state.optimizer, state.takd_step, run.seed)
    records = distiller.run(steps, round_=state.round, label="TAKD")
    fidelity = measure_fidelity(models, held)
    records.append(fidelity_record(state.round, distiller.step_count, fidelity))
    write_round_log(folder.distill_log, state, records)
    state.backbone = models.backbone_state()
    state.optimizer = distiller.optimizer_state()
    state.takd_step = distiller.step_count
    state.save(folder.server_state)
    bundles = write_bundles(run_dir, run, models, state, [load_profile(p) for p in run.profiles], fidelity)
    return _summary(run_dir, run, models.split, records, {p: b.path for p, b in bundles.items()})


def run_identity(run: RunConfig) -> str:
    """The run's id: a digest of what it is made of (source model, split, public data by content,
    recipe, algorithm, seed), not of where its files lie. Bundles carry it and a client state keeps
    it, so an edge state is never trained on another run's bundles; two runs made alike are alike to
    the bit (so a fleet and a simulation of it can be compared), and the cloud's c_i digest check
    tells their clients apart."""
    made_of = {k: v for k, v in run.to_dict().items() if k not in ("model_path", "public_data", "run_id")}
    made_of["clients"] = made_of.pop("client_ids")  # the key before the rename: a run made alike keeps its id
    made_of["public_data"] = sha256_file(Path(run.public_data))
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]


def load_cloud_models(run_dir: Path, run: RunConfig, state: ServerState, device: torch.device = CPU) -> CloudModels:
    """The run's models as the last command left them (source model, aligned layers, LoRA state), on ``device``."""
    aligned = RunFolder(run_dir).aligned
    return build_cloud_models(run, state, load_file(aligned) if aligned.is_file() else None, device)


def load_run(run_dir: Path) -> RunConfig:
    path = RunFolder(run_dir).config
    if not path.is_file():
        raise StateError(f"{run_dir}: not a run folder (no {path.name}); create one with `ciders-cloud prepare`")
    return RunConfig.from_dict(json.loads(path.read_text()), where=str(path))


def write_bundles(
    run_dir: Path,
    run: RunConfig,
    models: CloudModels,
    state: ServerState,
    profiles: list[DeviceProfile],
    fidelity: Fidelity | None,
) -> dict[str, Bundle]:
    """Write round ``state.round``'s bundle for every profile; unchanged files are hard-linked."""
    out = {}
    for profile in profiles:
        path = RunFolder(run_dir).bundle(profile.name, state.round)
        previous = _previous_bundle(run_dir, profile.name, state.round)
        contents = bundle_contents(run, models, state, profile, fidelity)
        out[profile.name] = Bundle.save(path, contents, previous)
    return out


def bundle_contents(
    run: RunConfig, models: CloudModels, state: ServerState, profile: DeviceProfile, fidelity: Fidelity | None
) -> BundleContents:
    """One profile's bundle of this round, in memory, from the cloud's full-precision weights (stored as
    ``run.storage`` or the profile says)."""
    emu = models.emu.get_base_model()
    split = models.split
    hp = round_hyperparams_for(run, state.round).replace(
        batch_size=profile.batch_size, seq_len=profile.seq_len, grad_accum=profile.grad_accum
    )
    deploy, takd = _deployment(run, profile, split), run.takd_config
    manifest = {
        "round": state.round,
        "run_id": run.run_id,
        "base_model": {"id": run.model, "name_or_path": emu.config.name_or_path, "revision": run.model_revision},
        "architecture": (emu.config.architectures or [type(emu).__name__])[0],
        "model_type": emu.config.model_type,
        "split": {**split.to_dict(), "drop_ratio": run.drop_ratio},
        "lora": run.lora,
        "backbone_lora": run.backbone_lora,
        "dtype": profile.dtype,
        "profile": profile.to_dict(),
        "hyperparameters": hp.to_dict(),
        "takd_step": state.takd_step,
        "takd_loss": {k: getattr(takd, k) for k in TAKD_LOSS_KEYS},
        "fidelity": fidelity.to_dict() if fidelity else None,
        "deploy_backbone": deploy,
    }
    full = models.full_backbone() if deploy == "full" else None
    return BundleContents(
        manifest=manifest,
        config=emu.config,
        tokenizer=models.tokenizer,
        generation_config=emu.generation_config,
        base_weights=to_cpu(models.base_weights, profile.torch_dtype),
        messenger_lora=state.messenger,
        messenger_peft_config=peft_config(emu, run.lora_settings, split.emu_messenger),
        backbone_lora=state.backbone,
        backbone_peft_config=peft_config(emu, run.backbone_lora_settings, list(range(split.n_kept))),
        consensus=state.consensus,
        full_backbone=to_cpu(full, profile.torch_dtype) if full is not None else None,
        full_config=models.teacher.config if full is not None else None,
        storage=run.storage or profile.storage,
    )


def _previous_bundle(run_dir: Path, profile: str, round_: int) -> Bundle | None:
    """What an edge holds before round ``round_``'s bundle: round ``round_ - 1``'s (or, for distill's
    rewrite of round 0, round 0's). Never a later one, which a killed ``aggregate`` may have left."""
    for r in (round_ - 1, round_):
        path = RunFolder(run_dir).bundle(profile, r)
        if r >= 0 and path.is_dir():
            return Bundle.load(path)
    return None


def _deployments(run: RunConfig, profiles: list[DeviceProfile], split) -> dict[str, str]:
    """Refuse a profile the AdapEmu does not fit; say which backbone each profile deploys."""
    config = AutoConfig.from_pretrained(run.model_path)
    out = {}
    for p in profiles:
        est = estimate_memory(config, split.emu_layers, split.a, p)
        if not est.fits:
            raise ConfigError(f"model {run.model} does not fit profile {p.name}: {est.describe()}")
        out[p.name] = _deployment(run, p, split, config)
        if p.backbone == "full" and out[p.name] == "emu":
            full = estimate_memory(config, split.n, split.a, p)
            console.print(f"[yellow]note:[/] profile {p.name} deploys the AdapEmu: the full model {full.describe()}")
    return out


def _deployment(run: RunConfig, profile: DeviceProfile, split, config=None) -> str:
    """``full`` when the profile asks for it and the full model fits its memory budget, else ``emu``."""
    if profile.backbone == "emu":
        return "emu"
    config = config or AutoConfig.from_pretrained(run.model_path)
    return "full" if estimate_memory(config, split.n, split.a, profile).fits else "emu"


def fidelity_record(round_: int, takd_step: int, fidelity: Fidelity | None) -> dict:
    return {"type": "fidelity", "round": round_, "takd_step": takd_step, **(fidelity.to_dict() if fidelity else {})}


def write_round_log(path: Path, committed: ServerState, records: list[dict]) -> None:
    """Add ``records`` to the log *before* the state commit, replacing whatever an interrupted attempt
    left: a TAKD or fidelity record past ``committed``'s round or TAKD step is from an attempt that
    never committed. So a rerun after a kill logs each step exactly once."""
    logged = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    write_jsonl(path, [rec for rec in logged if _committed(rec, committed)] + records)


def _committed(rec: dict, state: ServerState) -> bool:
    step = {"takd": rec.get("step"), "fidelity": rec.get("takd_step")}.get(rec.get("type"))
    return step is None or (rec.get("round", 0) <= state.round and step <= state.takd_step)


def _summary(run_dir: Path, run: RunConfig, split, records: list[dict], bundles: dict[str, Path]) -> dict:
    steps = [r for r in records if r["type"] in ("takd", "align")]
    first, last = (steps[0], steps[-1]) if steps else ({}, {})
    fidelity = next((r for r in reversed(records) if r["type"] == "fidelity"), {})
    return {
        "run": str(run_dir),
        "model": run.model,
        "n": split.n,
        "messenger_depth": split.a,
        "kept_layers": split.kept,
        "layer_steps": sum(r["type"] == "layer" for r in records),
        "takd_steps": len(steps),
        "takd_first": {k: first.get(k) for k in TERMS} if first else None,
        "takd_last": {k: last.get(k) for k in TERMS} if last else None,
        "fidelity": {k: v for k, v in fidelity.items() if k not in ("type", "round")} or None,
        "bundles": {k: str(v) for k, v in bundles.items()},
    }
