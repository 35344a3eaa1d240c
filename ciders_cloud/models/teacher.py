"""The cloud's two models: the frozen full model M* (the cloud teacher: full backbone B_F and the
original top layers) and the AdapEmu (the learnable backbone B_L with the messenger on top) with both
LoRAs, the messenger's v and the backbone's. :class:`CloudModels` holds them for TAKD and bundles, on
the run's compute device; what it hands out for the disk is on the CPU.

A run whose profiles drop different shares of the backbone has one AdapEmu per drop ratio
(:func:`build_backbones`), all over one teacher. Their messenger layers sit at different AdapEmu
indices; v, c and every c_i are named as the reference backbone's AdapEmu names them.

The weights are in memory once: every AdapEmu holds the teacher's own tensors, save the layers the
bootstrap trains (its own fp32 copies), in the teacher's dtype (:mod:`.source`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ciders_cloud.models.backbones import unpack
from ciders_cloud.models.device import CPU, autocast, to_cpu
from ciders_cloud.models.layers import gap_layers, messenger_offset, split_for
from ciders_cloud.models.source import DTYPES, load_teacher, teacher_dtype
from ciders_cloud.run.config import RunConfig, backbone_name
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import StateError
from ciders_edge.model.forward import Recompute, decoder_of
from ciders_edge.model.lora import BACKBONE_ADAPTER, MESSENGER_ADAPTER, attach_lora, load_lora_state, lora_state
from ciders_edge.model.sources import load_tokenizer
from ciders_edge.model.split import SplitSpec, build_adapemu, layer_of, shift_layers
from ciders_edge.tensors import Tensors

__all__ = ["CloudModels", "build_cloud_models", "build_backbones", "load_cloud_models"]


@dataclass
class CloudModels:
    """The teacher M* and its AdapEmu student, as one run's prepare, distill and aggregate load them."""

    teacher: PreTrainedModel  # M*: B_F followed by the original top layers; frozen
    emu: PeftModel  # AdapEmu = P_M ∘ B_L with adapters `messenger` (v) and `backbone`
    base_weights: dict[str, torch.Tensor]  # AdapEmu weights without LoRA, for bundles (views of the live weights)
    split: SplitSpec
    tokenizer: PreTrainedTokenizerBase
    device: torch.device = CPU  # where both models live and compute
    name: str = ""  # the backbone's name (config.backbone_name)
    offset: int = 0  # its messenger layers' AdapEmu indices minus the reference backbone's

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch (built on the CPU) on the models' device."""
        return {k: v.to(self.device) for k, v in batch.items()}

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision TAKD, the bootstrap and fidelity compute in: bf16 autocast on CUDA; on the CPU
        fp32, over a bf16 teacher's weights too (widened at each use, :class:`~.device.WidenBf16`)."""
        return autocast(self.device, self.teacher.dtype)

    @property
    def checkpoint(self) -> Recompute:
        """Whether TAKD recomputes the AdapEmu's activations in backward instead of keeping them: for a
        model held in bf16 (``teacher_dtype``, 1B parameters and more), where they are gigabytes (the
        same numbers either way). The recomputation runs in :meth:`autocast`, as the forward did."""
        return self.autocast if self.teacher.dtype != torch.float32 else False

    def changed_layers(self) -> dict[str, torch.Tensor]:
        """The AdapEmu base weights that differ from the source layers they were copied from (prepare's
        bootstrap trains the layers after each gap): what the run folder keeps beside the source model.
        On the CPU, views of the live weights (write them before training on)."""
        changed = self._changed()
        return to_cpu({k: v for k, v in self.base_weights.items() if layer_of(k) in changed})

    def _changed(self) -> set[int]:
        """AdapEmu indices of the kept layers whose weights are not their source's (shared, or equal)."""
        source, out = self.teacher.state_dict(), set()
        for j, i in enumerate(self.split.kept):
            layer = {k: v for k, v in self.base_weights.items() if k.startswith(f"model.layers.{j}.")}
            if any(not _same(v, source[k.replace(f"layers.{j}.", f"layers.{i}.", 1)]) for k, v in layer.items()):
                out.add(j)
        return out

    def full_backbone(self) -> dict[str, torch.Tensor]:
        """The source layers ``0..n-a-1`` that the AdapEmu's backbone does not hold unchanged (the dropped
        ones and the ones bootstrap trained), under their source names: with the bundle's backbone file,
        they make the full backbone B_F that AdapFu runs on."""
        changed = self._changed()
        unchanged = {i for j, i in enumerate(self.split.kept) if j not in changed}
        needed = [i for i in range(self.split.n - self.split.a) if i not in unchanged]
        source = self.teacher.state_dict()
        return to_cpu({k: v for k, v in source.items() for i in needed if k.startswith(f"model.layers.{i}.")})

    def messenger_state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of v, named as the reference backbone's AdapEmu names it."""
        v = {k: v.to("cpu", copy=True) for k, v in lora_state(self.emu, MESSENGER_ADAPTER).items()}
        return shift_layers(v, -self.offset)

    def load_messenger(self, v: dict[str, torch.Tensor]) -> None:
        """Hold ``v`` (reference names) as the messenger LoRA (for TAKD after aggregation)."""
        load_lora_state(self.emu, self.to_own(v), MESSENGER_ADAPTER)

    def to_own(self, tensors: Tensors) -> Tensors:
        """Messenger tensors named as the reference backbone names them, named as this one does."""
        return shift_layers(tensors, self.offset)

    def backbone_state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the backbone LoRA."""
        return {k: v.to("cpu", copy=True) for k, v in lora_state(self.emu, BACKBONE_ADAPTER).items()}


def _same(trained: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether an AdapEmu weight still is its source's: the very tensor, or equal in value (an fp32 copy
    of a bf16 teacher's weight is equal when it holds the same numbers)."""
    return trained.data_ptr() == source.data_ptr() or torch.equal(trained, source.to(trained.dtype))


def build_backbones(
    run: RunConfig, state: ServerState | None = None, aligned: Tensors | None = None, device: torch.device = CPU
) -> dict[str, CloudModels]:
    """One :class:`CloudModels` per learnable backbone of the run (reference first), over one teacher;
    ``state`` and ``aligned`` hold every backbone's tensors (:mod:`ciders_cloud.models.backbones`)."""
    names = run.backbone_names
    backbone_lora = unpack(state.backbone, names, names[0], "server state") if state is not None else {}
    aligned_parts = unpack(aligned or {}, names, names[0], "aligned layers")
    out: dict[str, CloudModels] = {}
    teacher = None
    for name, drop in zip(names, run.drop_ratios, strict=True):
        if state is not None and not backbone_lora[name]:
            raise StateError(
                f"the server state holds no LoRA of backbone {name}: was `profile_splits` changed after prepare?"
            )
        part = dataclasses.replace(state, backbone=backbone_lora[name]) if state is not None else None
        out[name] = build_cloud_models(run, part, aligned_parts[name], device, drop, teacher)
        teacher = out[name].teacher
    if state is None:  # every backbone starts from the same v (the reference's seeded init)
        for models in list(out.values())[1:]:
            models.load_messenger(out[names[0]].messenger_state())
    return out


def build_cloud_models(
    run: RunConfig,
    state: ServerState | None = None,
    aligned: dict[str, torch.Tensor] | None = None,
    device: torch.device = CPU,
    drop_ratio: float | None = None,
    teacher: PreTrainedModel | None = None,
) -> CloudModels:
    """Load M* (unless ``teacher`` is it already), build its AdapEmu of ``drop_ratio`` (default: the
    reference) with the run's ``aligned`` layers (prepare's bootstrap), both on ``device``, attach the
    LoRAs (seeded) and, if given, load their state.

    The AdapEmu is built on ``device`` from the teacher there, sharing its tensors but for its own fp32
    copies of the layers the bootstrap trains (and any ``aligned`` holds)."""
    path = Path(run.model_path)
    drop = run.drop_ratio if drop_ratio is None else drop_ratio
    split = split_for(run, drop)
    if teacher is None:
        teacher = load_teacher(path, DTYPES[teacher_dtype(run)], device)
    emu = build_adapemu(teacher, split, own := _trained_layers(run, split, aligned or {}))
    layers = decoder_of(emu).layers
    for j in own:
        layers[j].float()  # what trains, trains in fp32 (a no-op over an fp32 teacher)
    emu.to(device)  # its buffers; before the views below are taken and the LoRAs attached (PEFT's init is on the CPU)
    if aligned:
        names = emu.state_dict().keys()
        missing = sorted(k for k in aligned if k not in names or layer_of(k) is None)
        if missing:  # a layer's tensors only: anything else is the teacher's own, shared
            raise StateError(f"aligned layer tensors {missing[:2]} do not belong to this run's AdapEmu")
        emu.load_state_dict(aligned, strict=False)
    base = {k: v for k, v in emu.state_dict().items()}
    if emu.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    torch.manual_seed(run.seed)
    model = attach_lora(emu, split, run.lora_settings, run.backbone_lora_settings).eval()
    offset = messenger_offset(run, split)
    models = CloudModels(teacher, model, base, split, load_tokenizer(path), device, backbone_name(drop), offset)
    if state is not None:
        models.load_messenger(state.messenger)
        load_lora_state(model, state.backbone, BACKBONE_ADAPTER)
    return models


def _trained_layers(run: RunConfig, split: SplitSpec, aligned: dict[str, torch.Tensor]) -> set[int]:
    """The AdapEmu layers that hold weights of their own: those the bootstrap trains, and ``aligned``'s."""
    trained = gap_layers(split) if run.takd_config.align_params == "layers" else []
    return {*trained, *(j for k in aligned if (j := layer_of(k)) is not None)}


def load_cloud_models(
    run_dir: Path, run: RunConfig, state: ServerState, device: torch.device = CPU
) -> dict[str, CloudModels]:
    """The run's models as the last command left them (source model, aligned layers, LoRA state), on
    ``device``: one per learnable backbone, by name, the reference first."""
    aligned = RunFolder(run_dir).aligned
    return build_backbones(run, state, load_file(aligned) if aligned.is_file() else None, device)
