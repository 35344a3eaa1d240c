"""Each round's bundles: one per profile, on the profile's learnable backbone, with the whole global
messenger and the consensus of the layers the profile trains (docs/design.md §5)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from ciders_cloud.models.backbones import backbone_part
from ciders_cloud.models.fidelity import Fidelity
from ciders_cloud.models.layers import profile_spec
from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.privacy import PrivateRelease
from ciders_cloud.run.config import RunConfig, TakdConfig, backbone_name
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import round_hyperparams_for, round_takd
from ciders_edge.errors import ConfigError
from ciders_edge.formats.bundle import Bundle, BundleContents
from ciders_edge.memory import estimate_memory
from ciders_edge.model.lora import peft_config
from ciders_edge.model.split import SplitSpec
from ciders_edge.profiles import DeviceProfile
from ciders_edge.progress import console
from ciders_edge.training.fleet_evidence import MANIFEST_KEY as FLEET_KEY

__all__ = ["write_bundles", "bundle_contents", "bundle_takd_loss", "deployments", "frozen_weights", "TAKD_LOSS_KEYS"]

TAKD_LOSS_KEYS = ("hidden_loss", "lambda_hidden", "lambda_out", "lambda_task", "task_loss")  # shown in manifests


def write_bundles(
    run_dir: Path,
    run: RunConfig,
    backbones: dict[str, CloudModels],
    state: ServerState,
    profiles: list[DeviceProfile],
    fidelities: dict[str, Fidelity | None],
) -> dict[str, Bundle]:
    """Write round ``state.round``'s bundle for every profile, each on its own backbone; unchanged
    files are hard-linked."""
    out = {}
    for profile in profiles:
        name = backbone_name(run.profile_split(profile.name)[1])
        path = RunFolder(run_dir).bundle(profile.name, state.round)
        previous = _previous_bundle(run_dir, profile.name, state.round)
        contents = bundle_contents(run, backbones[name], state, profile, fidelities[name])
        out[profile.name] = Bundle.save(path, contents, previous)
    return out


def bundle_contents(
    run: RunConfig, models: CloudModels, state: ServerState, profile: DeviceProfile, fidelity: Fidelity | None
) -> BundleContents:
    """One profile's bundle of this round, in memory, from the cloud's full-precision weights (stored as
    ``run.storage`` or the profile says), on ``models``' backbone (the profile's drop ratio). It holds
    the whole messenger at v and the consensus c of the layers the profile trains."""
    emu = models.emu.get_base_model()
    split = profile_spec(run, profile.name)
    hp = round_hyperparams_for(run, state.round).replace(
        batch_size=profile.batch_size, seq_len=profile.seq_len, grad_accum=profile.grad_accum
    )
    deploy, takd = _deployment(run, profile, split), bundle_takd_loss(run, state.round)
    manifest = {
        "round": state.round,
        "run_id": run.run_id,
        "base_model": {"id": run.model, "name_or_path": emu.config.name_or_path, "revision": run.model_revision},
        "architecture": (emu.config.architectures or [type(emu).__name__])[0],
        "model_type": emu.config.model_type,
        "split": {**split.to_dict(), "drop_ratio": run.profile_split(profile.name)[1]},
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
    if (release := PrivateRelease.of(run)) is not None:  # what v and c have spent: the round's releases so far
        manifest["privacy"] = release.spent(state.round).to_dict()
    if state.fleet_choice is not None:  # the last round's validation, pooled (fleet_evidence.py)
        manifest[FLEET_KEY] = state.fleet_choice
    full = models.full_backbone() if deploy == "full" else None
    consensus = models.to_own(state.consensus)
    return BundleContents(
        manifest=manifest,
        config=emu.config,
        tokenizer=models.tokenizer,
        generation_config=emu.generation_config,
        base_weights=frozen_weights(models.base_weights, profile.torch_dtype),
        messenger_lora=models.to_own(state.messenger),
        messenger_peft_config=peft_config(emu, run.lora_settings, split.emu_messenger),
        backbone_lora=backbone_part(run, state.backbone, models.name),
        backbone_peft_config=peft_config(emu, run.backbone_lora_settings, list(range(split.n_kept))),
        consensus={k: t for k, t in consensus.items() if split.trains(k)},
        full_backbone=frozen_weights(full, profile.torch_dtype) if full is not None else None,
        full_config=models.teacher.config if full is not None else None,
        storage=run.storage or profile.storage,
    )


def frozen_weights(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Frozen weights on the CPU for a profile that computes in ``dtype``: rounded to it where that
    narrows them, as they are where it would only widen them (a bf16 teacher's in an fp32 profile): the
    bundle's storage gives the same numbers either way, and 8 or 4 bits widen one tensor at a time, so
    the model is not copied whole in fp32 first."""
    out = {}
    for k, v in tensors.items():
        widens = torch.promote_types(v.dtype, dtype) == dtype
        out[k] = v.detach().to("cpu", v.dtype if widens else dtype)
    return out


def bundle_takd_loss(run: RunConfig, round_: int) -> TakdConfig:
    """The loss that last distilled round ``round_``'s backbone: round ``round_ - 1``'s eq. (13) (FedBiOT's
    has no task CE), or prepare's bootstrap (round 0, or a strategy that runs no TAKD)."""
    steps, loss = round_takd(run, round_ - 1) if round_ else (0, run.takd_config)
    return loss if steps else run.takd_config


def _previous_bundle(run_dir: Path, profile: str, round_: int) -> Bundle | None:
    """What an edge holds before round ``round_``'s bundle: round ``round_ - 1``'s (or, for distill's
    rewrite of round 0, round 0's). Never a later one, which a killed ``aggregate`` may have left."""
    for r in (round_ - 1, round_):
        path = RunFolder(run_dir).bundle(profile, r)
        if r >= 0 and path.is_dir():
            return Bundle.load(path)
    return None


def deployments(run: RunConfig, profiles: list[DeviceProfile]) -> dict[str, str]:
    """Refuse a profile whose AdapEmu (its backbone, its trained messenger layers) does not fit; say
    which backbone each profile deploys."""
    config = AutoConfig.from_pretrained(run.model_path)
    out = {}
    for p in profiles:
        split = profile_spec(run, p.name)
        est = estimate_memory(config, split.emu_layers, split.trained, p, run.storage)
        if not est.fits:
            raise ConfigError(f"model {run.model} does not fit profile {p.name}: {est.describe()}")
        out[p.name] = _deployment(run, p, split, config)
        if p.backbone == "full" and out[p.name] == "emu":
            full = estimate_memory(config, split.n, split.trained, p)
            console.print(f"[yellow]note:[/] profile {p.name} deploys the AdapEmu: the full model {full.describe()}")
    return out


def _deployment(run: RunConfig, profile: DeviceProfile, split: SplitSpec, config=None) -> str:
    """``full`` when the profile asks for it and the full model fits its memory budget, else ``emu``."""
    if profile.backbone == "emu":
        return "emu"
    config = config or AutoConfig.from_pretrained(run.model_path)
    return "full" if estimate_memory(config, split.n, split.trained, profile).fits else "emu"
