"""AdapEmu bundles (docs/design.md §5): the compact model and round state the cloud ships to edges.

A bundle is a directory whose ``manifest.json`` (:mod:`ciders_edge.formats.manifest`) records the
split, LoRA configs, round hyperparameters, the producer's versions and the sha256 of every other file.
:meth:`Bundle.load` verifies every checksum before anything is read; weights are safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ciders_edge import __version__
from ciders_edge.errors import BundleError
from ciders_edge.formats.atomic import fsync_dir, replace_dir, staging_dir, write_bytes, write_json, write_safetensors
from ciders_edge.formats.checksums import hash_folder, verify_files
from ciders_edge.formats.manifest import (
    ADAPTER_DIR,
    BACKBONE_ADAPTER_DIR,
    BACKBONE_FILE,
    CONSENSUS_FILE,
    FORMAT,
    FORMAT_VERSION,
    FULL_DIR,
    FULL_WEIGHTS,
    MANIFEST,
    MESSENGER_LAYERS_FILE,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    read_manifest,
    validate_manifest,
)
from ciders_edge.formats.storage import FORMATS, GROUP, decode, encode
from ciders_edge.formats.weights_check import check_weights
from ciders_edge.profiles import DTYPES

__all__ = [
    "Bundle",
    "BundleContents",
    "bundle_id",
    "MANIFEST",
    "producer_versions",
    "BACKBONE_FILE",
    "MESSENGER_LAYERS_FILE",
    "FULL_DIR",
    "FULL_WEIGHTS",
    "ADAPTER_DIR",
]


def producer_versions() -> dict[str, str]:
    import peft
    import transformers

    return {
        "ciders": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


@dataclass
class BundleContents:
    """Everything that goes into a bundle, in memory."""

    manifest: dict  # format-independent fields: round, split, lora, hyperparameters, ...
    config: object  # the AdapEmu's transformers config
    tokenizer: object
    generation_config: object
    base_weights: dict[str, torch.Tensor]  # AdapEmu weights without LoRA
    messenger_lora: dict[str, torch.Tensor]
    messenger_peft_config: object  # peft.LoraConfig
    backbone_lora: dict[str, torch.Tensor]
    backbone_peft_config: object
    consensus: dict[str, torch.Tensor]
    full_backbone: dict[str, torch.Tensor] | None = None  # source layers by source name (profiles deploying AdapFu)
    full_config: object | None = None  # the source model's config
    storage: str = "fp32"  # how the frozen weights are stored (formats/storage.py); the profile's by default


def bundle_id(path: str | Path) -> str:
    """The id of the bundle in ``path`` (sha256 of its manifest, as :meth:`Bundle.load` names it), read
    without verifying its files: for the cloud, which wrote the bundle and only matches packets to it;
    :meth:`Bundle.load` hashes and checks every weight (seconds at SmolLM2, a minute at 1.7B)."""
    path = Path(path)
    return hashlib.sha256(read_manifest(path, path / MANIFEST)).hexdigest()


class Bundle:
    """A verified bundle on disk."""

    def __init__(self, path: Path, manifest: dict, bundle_id: str, new_bytes: int | None = None) -> None:
        self.path = path
        self.manifest = manifest
        self.bundle_id = bundle_id  # sha256 of manifest.json: names this exact bundle in packets
        self.new_bytes = new_bytes  # set by save(): bytes not shared with the previous bundle

    @property
    def round(self) -> int:
        return int(self.manifest["round"])

    @property
    def frozen_digest(self) -> str:
        """Hash of everything but the round's global LoRA and consensus: the model a personalized
        messenger was trained against. Two bundles with the same digest run that messenger identically."""
        m = self.manifest
        round_files = (f"{ADAPTER_DIR}/", CONSENSUS_FILE)
        frozen = sorted((rel, d) for rel, d in m["files"].items() if not rel.startswith(round_files))
        settings = [m["split"], m["lora"], m.get("backbone_lora")]  # the messenger's shape and scaling
        return hashlib.sha256(json.dumps([frozen, settings], sort_keys=True).encode()).hexdigest()

    @classmethod
    def load(cls, path: str | Path) -> Bundle:
        """Open a bundle, verifying the manifest and the checksum of every file.

        Raises:
            BundleError: a file is missing or changed; the manifest is not a bundle's, lacks a core
                file, lists a path outside the folder, or holds a field of the wrong type; a weight
                file's header, dtypes, shapes or scales are not what loading relies on (weights_check).
        """
        path = Path(path)
        mpath = path / MANIFEST
        raw = read_manifest(path, mpath)
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deep, a 5000-digit number
            raise BundleError(f"{mpath}: corrupt manifest ({getattr(err, 'msg', err)})") from None
        validate_manifest(manifest, mpath)
        verify_files(path, manifest["files"], BundleError, "bundle")
        check_weights(path, manifest)  # what the checksums cannot say: that the weights are what loading expects
        return cls(path, manifest, hashlib.sha256(raw).hexdigest())

    @classmethod
    def save(cls, out: str | Path, contents: BundleContents, previous: Bundle | None = None) -> Bundle:
        """Write a bundle atomically; files identical to ``previous``'s become hard links to them."""
        out = Path(out)
        staging = staging_dir(out)
        try:
            formats = _write_contents(staging, contents)
            files = hash_folder(staging, exclude=MANIFEST)
            _link_unchanged(staging, files, previous)
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                **contents.manifest,
                "producer": producer_versions(),
                "special_tokens": {
                    "bos": contents.tokenizer.bos_token_id,
                    "eos": contents.tokenizer.eos_token_id,
                    "pad": contents.tokenizer.pad_token_id,
                },
                "files": files,
                "storage": {"format": contents.storage, "group": GROUP, "tensors": formats},
            }
            raw = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
            write_bytes(staging / MANIFEST, raw)
            replace_dir(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        # every file was hashed while writing; no need to read them back
        bundle = cls(out, manifest, hashlib.sha256(raw).hexdigest())
        bundle.new_bytes = bundle.delta_bytes(previous)
        return bundle

    def delta_bytes(self, previous: Bundle | None) -> int:
        """Bytes an edge holding ``previous`` downloads for this bundle: files whose content changed."""
        old = previous.manifest["files"] if previous is not None else {}
        files = {**self.manifest["files"], MANIFEST: ""}
        return sum((self.path / rel).stat().st_size for rel, digest in files.items() if old.get(rel) != digest)

    def tensors(self, rel: str, dtype: torch.dtype | None = None, keep: bool = False) -> dict[str, torch.Tensor]:
        """A weight file's tensors; frozen weights stored in 8 or 4 bits come back dequantized into
        ``dtype`` (default: the bundle's compute dtype), or with ``keep`` as stored (``storage.Quantized``);
        the rest as stored."""
        formats = self.manifest.get("storage", {}).get("tensors", {}).get(rel)
        if formats is None:  # LoRA, consensus, or a format-1 bundle's weights
            return load_file(self.path / rel)
        dtype = dtype or DTYPES[self.manifest["dtype"]]
        with safe_open(self.path / rel, framework="pt") as f:
            return decode(_LazyFile(f), formats, dtype, f"{self.path / rel}", keep)

    def base_weights(self, dtype: torch.dtype | None = None, keep: bool = False) -> dict[str, torch.Tensor]:
        return {**self.tensors(BACKBONE_FILE, dtype, keep), **self.tensors(MESSENGER_LAYERS_FILE, dtype, keep)}

    @property
    def quantized(self) -> bool:
        """Whether any frozen weight ships in 8 or 4 bits (and so can stay so in memory)."""
        formats = self.manifest.get("storage", {}).get("tensors", {})
        return any(FORMATS.get(fmt) for tensors in formats.values() for fmt in tensors.values())

    def messenger_lora(self) -> dict[str, torch.Tensor]:
        return self.tensors(f"{ADAPTER_DIR}/{PEFT_WEIGHTS}")

    def backbone_lora(self) -> dict[str, torch.Tensor]:
        return self.tensors(f"{BACKBONE_ADAPTER_DIR}/{PEFT_WEIGHTS}")

    def consensus(self) -> dict[str, torch.Tensor]:
        return self.tensors(CONSENSUS_FILE)

    @property
    def has_full_backbone(self) -> bool:
        return FULL_WEIGHTS in self.manifest["files"]

    @property
    def full_digest(self) -> str:
        """What a personalized messenger runs on under AdapFu: the source model, the split and the
        messenger's shape; the same in every bundle of a run, whatever TAKD did."""
        m = self.manifest
        key = [m["base_model"]["revision"], m["split"], m["lora"], m["files"].get(MESSENGER_LAYERS_FILE)]
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _write_contents(d: Path, c: BundleContents) -> dict[str, dict[str, str]]:
    """Write every file but the manifest; returns each frozen weight file's tensor formats."""
    n_kept = len(c.manifest["split"]["kept"])
    backbone, messenger = _split_weights(c.base_weights, n_kept)
    frozen = {BACKBONE_FILE: backbone, MESSENGER_LAYERS_FILE: messenger}
    if c.full_backbone is not None:
        frozen[FULL_WEIGHTS] = c.full_backbone
    formats = {}
    for rel, weights in frozen.items():
        stored, formats[rel] = encode(weights, c.storage)
        write_safetensors(d / rel, stored)
    c.config.save_pretrained(d)
    c.generation_config.save_pretrained(d)
    c.tokenizer.save_pretrained(d)
    for sub, state, cfg in (
        (ADAPTER_DIR, c.messenger_lora, c.messenger_peft_config),
        (BACKBONE_ADAPTER_DIR, c.backbone_lora, c.backbone_peft_config),
    ):
        write_safetensors(d / sub / PEFT_WEIGHTS, state)
        write_json(d / sub / PEFT_CONFIG, _peft_config_dict(cfg))
    write_safetensors(d / CONSENSUS_FILE, c.consensus)
    if c.full_backbone is not None:
        c.full_config.save_pretrained(d / FULL_DIR)
        fsync_dir(d / FULL_DIR)
    fsync_dir(d)
    return formats


def _peft_config_dict(cfg) -> dict:
    """PEFT's adapter_config.json content, with ``target_modules`` sorted: PEFT keeps them in a set,
    whose order changes between processes, and a bundle's bytes must not."""
    d = cfg.to_dict()
    for key, value in d.items():
        if isinstance(value, set):
            d[key] = sorted(value)
    return d


def _link_unchanged(d: Path, files: dict[str, str], previous: Bundle | None) -> None:
    """Replace files identical to ``previous``'s by hard links: a round update re-ships only what changed."""
    if previous is None:
        return
    for rel, digest in files.items():
        if previous.manifest["files"].get(rel) == digest:
            (d / rel).unlink()
            os.link(previous.path / rel, d / rel)


def _split_weights(weights: dict[str, torch.Tensor], n_kept: int) -> tuple[dict, dict]:
    """Embeddings and layers < n_kept form B_L; the remaining layers, final norm and head form P_M."""
    backbone, messenger = {}, {}
    for k, v in weights.items():
        if k.startswith("model.layers."):
            (backbone if int(k.split(".")[2]) < n_kept else messenger)[k] = v
        elif k.startswith("model.embed_tokens."):
            backbone[k] = v
        else:
            messenger[k] = v
    return backbone, messenger


class _LazyFile:
    """An open safetensors file as :func:`storage.decode` reads it: a tensor is read when it is popped."""

    def __init__(self, handle) -> None:
        self.handle, self.left = handle, set(handle.keys())

    def __contains__(self, name: object) -> bool:
        return name in self.left

    def __iter__(self):
        return iter(sorted(self.left))

    def pop(self, name: str) -> torch.Tensor:
        self.left.remove(name)
        return self.handle.get_tensor(name)
