"""``prepare`` and ``distill``: split the model, align the learnable backbone, ship bundles."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig

from ciders_edge.atomic import staging_dir, write_json
from ciders_edge.bundle import Bundle, BundleContents
from ciders_edge.checksums import sha256_file
from ciders_edge.data import load_examples
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.lora import peft_config
from ciders_edge.models import load_tokenizer, resolve_model
from ciders_edge.profiles import DeviceProfile, estimate_memory, load_profile

from .config import RunConfig
from .models import CloudModels, build_cloud_models, split_for
from .state import ServerState
from .strategies import round_hyperparams_for
from .takd import Distiller

__all__ = [
    "prepare",
    "distill",
    "write_bundles",
    "load_run",
    "RUN_CONFIG",
    "STATE_DIR",
    "DISTILL_LOG",
    "append_log",
    "bundle_path",
]

RUN_CONFIG = "run.json"
STATE_DIR = "server"
DISTILL_LOG = "distill.jsonl"
BUNDLES_DIR = "bundles"


def prepare(run: RunConfig, out: str | Path) -> dict:
    """Algorithm 1 and the bootstrap TAKD; writes ``out`` with server state and one bundle per profile.

    The run folder is built beside ``out`` and renamed into place at the end, so a failure
    leaves nothing behind.

    Raises:
        ConfigError: ``out`` exists, a profile is unknown, or the model does not fit a profile.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")
    profiles = [load_profile(p) for p in run.profiles]
    run = run.replace(model_path=str(resolve_model(run.model)))
    split = split_for(run)
    _check_fits(run, profiles, split)
    examples = load_examples(run.public_data, load_tokenizer(Path(run.model_path)), run.takd_config.seq_len)
    run = run.replace(model_revision=_revision(Path(run.model_path)))

    models = build_cloud_models(run)
    distiller = Distiller(models, examples, run.takd_config, seed=run.seed)
    records = distiller.run(run.align_steps, round_=0, label="bootstrap TAKD") if run.align_steps else []
    state = ServerState(
        round=0,
        messenger=models.messenger_state(),
        backbone=models.backbone_state(),
        consensus={k: torch.zeros_like(v) for k, v in models.messenger_state().items()},
        optimizer=distiller.optimizer_state(),
        takd_step=distiller.step_count,
    )
    staging = staging_dir(out)
    try:
        write_json(staging / RUN_CONFIG, run.to_dict())
        state.save(staging / STATE_DIR)
        append_log(staging / DISTILL_LOG, records)
        bundles = write_bundles(staging, run, models, state, profiles)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _summary(out, run, split, records, {p: out / b.path.relative_to(staging) for p, b in bundles.items()})


def distill(run_dir: str | Path, steps: int) -> dict:
    """Continue TAKD warm-started from the saved backbone LoRA and optimizer; re-ship the bundles."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    state = ServerState.load(run_dir / STATE_DIR)
    models = build_cloud_models(run, state)
    examples = load_examples(run.public_data, models.tokenizer, run.takd_config.seq_len)
    distiller = Distiller(models, examples, run.takd_config, state.optimizer, state.takd_step, run.seed)
    records = distiller.run(steps, round_=state.round, label="TAKD")
    state.backbone = models.backbone_state()
    state.optimizer = distiller.optimizer_state()
    state.takd_step = distiller.step_count
    state.save(run_dir / STATE_DIR)
    append_log(run_dir / DISTILL_LOG, records)
    bundles = write_bundles(run_dir, run, models, state, [load_profile(p) for p in run.profiles])
    return _summary(run_dir, run, models.split, records, {p: b.path for p, b in bundles.items()})


def load_run(run_dir: Path) -> RunConfig:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise StateError(f"{run_dir}: not a run folder (no {RUN_CONFIG}); create one with `ciders-cloud prepare`")
    return RunConfig.from_dict(json.loads(path.read_text()), where=str(path))


def bundle_path(run_dir: Path, profile: str, round_: int) -> Path:
    return run_dir / BUNDLES_DIR / profile / f"round-{round_:04d}"


def write_bundles(
    run_dir: Path, run: RunConfig, models: CloudModels, state: ServerState, profiles: list[DeviceProfile]
) -> dict[str, Bundle]:
    """Write round ``state.round``'s bundle for every profile; unchanged files are hard-linked."""
    out = {}
    for profile in profiles:
        path = bundle_path(run_dir, profile.name, state.round)
        previous = _latest_bundle(run_dir / BUNDLES_DIR / profile.name)
        out[profile.name] = Bundle.save(path, _contents(run, models, state, profile), previous)
    return out


def _contents(run: RunConfig, models: CloudModels, state: ServerState, profile: DeviceProfile) -> BundleContents:
    emu = models.emu.get_base_model()
    split = models.split
    hp = round_hyperparams_for(run, state.round).replace(
        batch_size=profile.batch_size, seq_len=profile.seq_len, grad_accum=profile.grad_accum
    )
    manifest = {
        "round": state.round,
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
    }
    return BundleContents(
        manifest=manifest,
        config=emu.config,
        tokenizer=models.tokenizer,
        generation_config=emu.generation_config,
        base_weights={k: v.to(profile.torch_dtype) for k, v in models.base_weights.items()},
        messenger_lora=state.messenger,
        messenger_peft_config=peft_config(emu, run.lora_settings, split.emu_messenger),
        backbone_lora=state.backbone,
        backbone_peft_config=peft_config(emu, run.backbone_lora_settings, list(range(split.n_kept))),
        consensus=state.consensus,
    )


def _latest_bundle(profile_dir: Path) -> Bundle | None:
    rounds = sorted(profile_dir.glob("round-*")) if profile_dir.is_dir() else []
    return Bundle.load(rounds[-1]) if rounds else None


def _check_fits(run: RunConfig, profiles: list[DeviceProfile], split) -> None:
    config = AutoConfig.from_pretrained(run.model_path)
    for p in profiles:
        est = estimate_memory(config, split.emu_layers, split.a, p)
        if not est.fits:
            raise ConfigError(f"model {run.model} does not fit profile {p.name}: {est.describe()}")


def _revision(path: Path) -> str:
    """A content hash of the source model: config plus every weight file."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def append_log(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _summary(run_dir: Path, run: RunConfig, split, records: list[dict], bundles: dict[str, Path]) -> dict:
    first, last = (records[0], records[-1]) if records else ({}, {})
    return {
        "run": str(run_dir),
        "model": run.model,
        "n": split.n,
        "messenger_depth": split.a,
        "kept_layers": split.kept,
        "takd_steps": len(records),
        "takd_first": {k: first.get(k) for k in ("loss", "hidden_mse", "kl", "ce")} if first else None,
        "takd_last": {k: last.get(k) for k in ("loss", "hidden_mse", "kl", "ce")} if last else None,
        "bundles": {k: str(v) for k, v in bundles.items()},
    }
