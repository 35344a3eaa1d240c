"""``prepare`` and ``distill``: split the model, align the learnable backbone, ship bundles."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from ciders_cloud.models.backbones import backbone_part, label, pack, tagged
from ciders_cloud.models.bootstrap import bootstrap
from ciders_cloud.models.device import cloud_device
from ciders_cloud.models.fidelity import Fidelity, fidelity_record, measure_fidelity
from ciders_cloud.models.source import teacher_dtype
from ciders_cloud.models.takd import TERMS, Distiller, public_split
from ciders_cloud.models.teacher import CloudModels, build_backbones, load_cloud_models
from ciders_cloud.privacy import PrivateRelease, with_noise
from ciders_cloud.round.bundles import deployments, write_bundles
from ciders_cloud.run.config import RunConfig, load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.lock import claim_new_run
from ciders_cloud.run.logs import write_round_log
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.run.splits import run_profiles
from ciders_cloud.strategies import check_run
from ciders_edge.errors import ConfigError
from ciders_edge.formats.atomic import append_jsonl, staging_dir, write_json, write_safetensors
from ciders_edge.formats.checksums import sha256_file
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.sources import load_tokenizer, model_revision, resolve_model

__all__ = ["prepare", "distill"]


def prepare(run: RunConfig, out: str | Path, device: str | torch.device = "cpu") -> dict:
    """Algorithm 1 and the bootstrap; writes ``out`` with server state and one bundle per profile.

    The run folder is built beside ``out`` and renamed into place at the end, so a failure
    leaves nothing behind.

    Args:
        device: where TAKD and fidelity run (``auto``, ``cpu``, ``cuda``); not part of the run.

    Raises:
        ConfigError: ``out`` exists, a profile is unknown, the model does not fit a profile, the
            algorithm cannot serve the run, or ``device`` is not here.
    """
    run = with_noise(check_run(_self_contained(run)))  # before any work: refused in one line, or noise solved
    device = cloud_device(device)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")
    with claim_new_run(out):
        return _prepare(run, out, device)


def _self_contained(run: RunConfig) -> RunConfig:
    """``run`` as later commands read it from any folder: its profiles by name with its own copy of each one
    not shipped (:func:`run_profiles`), its public data by absolute path."""
    _, kept = run_profiles(run.profiles, run.own_profiles)
    return run.replace(**kept, public_data=str(Path(run.public_data).absolute()) if run.public_data else "")


def _prepare(run: RunConfig, out: Path, device: torch.device) -> dict:
    """:func:`prepare`'s work, with ``out`` claimed: an empty folder no other prepare writes."""
    profiles = run.device_profiles()
    hp = RoundHyperparams.from_dict(run.hyperparameters, where="`hyperparameters`")  # run.json names every one
    run = run.replace(model_path=str(resolve_model(run.model)), hyperparameters=hp.to_dict())
    deploy = deployments(run, profiles)
    public, held = public_split(run, load_tokenizer(Path(run.model_path)))  # bad data fails before the model loads
    run = run.replace(model_revision=model_revision(Path(run.model_path)), teacher_dtype=teacher_dtype(run))
    run = run.replace(run_id=run.run_id or run_identity(run))

    backbones = build_backbones(run, device=device)
    records, optimizers, fidelities, before = [], {}, {}, {}
    for name, models in backbones.items():  # each learnable backbone is aligned on the same public data
        before[name] = measure_fidelity(models, held)
        steps, distiller = bootstrap(models, public, run)
        gc.collect()  # the bootstrap's optimizers and gradients: as large as the layers it trained, twice over
        fidelities[name] = measure_fidelity(models, held)
        optimizers[name] = distiller.optimizer_state() if distiller else {}
        takd_step = distiller.step_count if distiller else 0
        records += tagged(run, name, [*steps, fidelity_record(0, takd_step, fidelities[name])])
        del distiller
    reference = next(iter(backbones))
    state = ServerState(
        round=0,
        messenger=backbones[reference].messenger_state(),
        backbone=pack({n: m.backbone_state() for n, m in backbones.items()}, reference),
        consensus={k: torch.zeros_like(v) for k, v in backbones[reference].messenger_state().items()},
        optimizer=pack(optimizers, reference),
        takd_step=takd_step,
    )
    staging = staging_dir(out)
    folder = RunFolder(staging)
    try:
        write_json(folder.config, run.to_dict())
        write_safetensors(folder.aligned, pack({n: m.changed_layers() for n, m in backbones.items()}, reference))
        state.save(folder.server_state)
        append_jsonl(folder.distill_log, records)
        bundles = write_bundles(staging, run, backbones, state, profiles, fidelities)
        out.rmdir()  # the claim: empty, and no other prepare can have written it
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    paths = {p: RunFolder(out).bundle(p, state.round) for p in bundles}
    summary = _summary(out, run, backbones, records, fidelities, paths)
    first = before[reference]
    return {**summary, "fidelity_before": first.to_dict() if first else None, "deploy": deploy}


def distill(run_dir: str | Path, steps: int, device: str | torch.device = "cpu") -> dict:
    """Continue TAKD warm-started from the saved backbone LoRA and optimizer; re-ship the bundles.
    TAKD and fidelity run on ``device`` (``auto``, ``cpu``, ``cuda``)."""
    device = cloud_device(device)
    run_dir, folder = Path(run_dir), RunFolder(run_dir)
    run = load_run(run_dir)
    state = ServerState.load(folder.server_state)
    backbones = load_cloud_models(run_dir, run, state, device)
    public, held = public_split(run, next(iter(backbones.values())).tokenizer)
    records, optimizers, fidelities = [], {}, {}
    for name, models in backbones.items():
        optimizer = backbone_part(run, state.optimizer, name)
        distiller = Distiller(models, public, run.takd_config, optimizer, state.takd_step, run.seed)
        done = distiller.run(steps, round_=state.round, label=label(run, name, "TAKD"))
        fidelities[name] = measure_fidelity(models, held)
        records += tagged(run, name, [*done, fidelity_record(state.round, distiller.step_count, fidelities[name])])
        optimizers[name] = distiller.optimizer_state()
    write_round_log(folder.distill_log, state, records)
    reference = next(iter(backbones))
    state.backbone = pack({n: m.backbone_state() for n, m in backbones.items()}, reference)
    state.optimizer = pack(optimizers, reference)
    state.takd_step = distiller.step_count
    state.save(folder.server_state)
    bundles = write_bundles(run_dir, run, backbones, state, run.device_profiles(), fidelities)
    return _summary(run_dir, run, backbones, records, fidelities, {p: b.path for p, b in bundles.items()})


def run_identity(run: RunConfig) -> str:
    """The run's id: a digest of what it is made of (source model, split, public data by content,
    recipe, algorithm, seed), not of where its files lie. Bundles carry it and a client state keeps
    it, so an edge state is never trained on another run's bundles; two runs made alike are alike to
    the bit (so a fleet and a simulation of it can be compared), and the cloud's c_i digest check
    tells their clients apart."""
    made_of = {k: v for k, v in run.to_dict().items() if k not in ("model_path", "public_data", "run_id")}
    made_of["clients"] = made_of.pop("client_ids")  # the key before the rename: a run made alike keeps its id
    if not made_of["profile_splits"]:  # a one-split run keeps the id it had before there could be several
        del made_of["profile_splits"]
    before_them = (
        ("participation", 1.0), ("sampling", "fixed"), ("dp", {}), ("teacher_dtype", "fp32"), ("own_profiles", {}),
    )  # fmt: skip
    for key, before in before_them:  # as it had before them
        if made_of[key] == before:
            del made_of[key]
    made_of["public_data"] = sha256_file(Path(run.public_data))
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]


def _summary(
    run_dir: Path,
    run: RunConfig,
    backbones: dict[str, CloudModels],
    records: list[dict],
    fidelities: dict[str, Fidelity | None],
    bundles: dict[str, Path],
) -> dict:
    reference = next(iter(backbones))
    split = backbones[reference].split
    mine = [r for r in records if r.get("backbone", reference) == reference]
    steps = [r for r in mine if r["type"] in ("takd", "align")]
    first, last = (steps[0], steps[-1]) if steps else ({}, {})
    fidelity = next((r for r in reversed(mine) if r["type"] == "fidelity"), {})
    summary = {
        "run": str(run_dir),
        "model": run.model,
        "n": split.n,
        "messenger_depth": split.a,
        "kept_layers": split.kept,
        "layer_steps": sum(r["type"] == "layer" for r in mine),
        "takd_steps": len(steps),
        "takd_first": {k: first.get(k) for k in TERMS} if first else None,
        "takd_last": {k: last.get(k) for k in TERMS} if last else None,
        "fidelity": {k: v for k, v in fidelity.items() if k not in ("type", "round", "backbone")} or None,
        "bundles": {k: str(v) for k, v in bundles.items()},
    }
    if len(backbones) > 1:
        summary["backbones"] = {
            name: {"kept_layers": m.split.kept, "fidelity": f.to_dict() if (f := fidelities[name]) else None}
            for name, m in backbones.items()
        }
        splits = {p: run.profile_split(p) for p in run.profiles}
        summary["profile_splits"] = {p: {"trains": a, "drop_ratio": r} for p, (a, r) in splits.items()}
    if (release := PrivateRelease.of(run)) is not None:
        planned = release.dp.rounds
        summary["privacy"] = {
            **release.spent(0).to_dict(),
            "denominator": release.denominator,
            "budget": release.dp.budget,
            "planned": release.spent(planned).to_dict() if planned else None,
        }
    return summary
