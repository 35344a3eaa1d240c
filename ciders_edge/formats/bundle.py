"""AdapEmu bundles (DESIGN §3): the compact model and round state the cloud ships to edges.

A bundle is a directory whose ``manifest.json`` records the split, LoRA configs, round
hyperparameters, the producer's versions and the sha256 of every other file. :meth:`Bundle.load`
verifies every checksum before anything is read; weights are safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import reprlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ciders_edge import __version__
from ciders_edge.config import ConfigMixin, RoundHyperparams
from ciders_edge.errors import BundleError, ConfigError
from ciders_edge.formats.atomic import fsync_dir, replace_dir, staging_dir, write_bytes, write_json, write_safetensors
from ciders_edge.formats.checksums import check_relpath, hash_folder, verify_files
from ciders_edge.model.lora import LoraSettings
from ciders_edge.model.split import SplitSpec
from ciders_edge.profiles import BACKBONES, DTYPES, DeviceProfile

__all__ = ["Bundle", "BundleContents", "MANIFEST", "producer_versions"]

FORMAT = "ciders-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKBONE_FILE = "backbone.safetensors"
MESSENGER_FILE = "messenger.safetensors"
ADAPTER_DIR = "adapter"  # global messenger LoRA v, PEFT format
BACKBONE_ADAPTER_DIR = "backbone_adapter"  # learnable-backbone LoRA from TAKD, PEFT format
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
CONSENSUS_FILE = "consensus.safetensors"
FULL_DIR = "full_backbone"  # the source layers AdapFu needs beyond backbone.safetensors, and the source config
FULL_WEIGHTS = f"{FULL_DIR}/model.safetensors"
# what every bundle lists: Bundle.load refuses a manifest without them rather than fail later, unverified
CORE_FILES = (
    BACKBONE_FILE,
    MESSENGER_FILE,
    CONSENSUS_FILE,
    f"{ADAPTER_DIR}/{PEFT_WEIGHTS}",
    f"{ADAPTER_DIR}/{PEFT_CONFIG}",
    f"{BACKBONE_ADAPTER_DIR}/{PEFT_WEIGHTS}",
    f"{BACKBONE_ADAPTER_DIR}/{PEFT_CONFIG}",
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
)
FULL_FILES = (FULL_WEIGHTS, f"{FULL_DIR}/config.json")  # a bundle that deploys AdapFu
REQUIRED_FIELDS = (
    "round",
    "split",
    "files",
    "lora",
    "backbone_lora",
    "hyperparameters",
    "base_model",
    "dtype",
    "profile",
)
MAX_MANIFEST_BYTES = 16 << 20
MAX_LAYERS = 10_000  # bounds the layer lists a split builds


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
                file, lists a path outside the folder, or holds a field of the wrong type.
        """
        path = Path(path)
        mpath = path / MANIFEST
        raw = _read_manifest(path, mpath)
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deep, a 5000-digit number
            raise BundleError(f"{mpath}: corrupt manifest ({getattr(err, 'msg', err)})") from None
        _validate_manifest(manifest, mpath)
        verify_files(path, manifest["files"], BundleError, "bundle")
        return cls(path, manifest, hashlib.sha256(raw).hexdigest())

    @classmethod
    def save(cls, out: str | Path, contents: BundleContents, previous: Bundle | None = None) -> Bundle:
        """Write a bundle atomically; files identical to ``previous``'s become hard links to them."""
        out = Path(out)
        staging = staging_dir(out)
        try:
            _write_contents(staging, contents)
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

    def tensors(self, rel: str) -> dict[str, torch.Tensor]:
        return load_file(self.path / rel)

    def base_weights(self) -> dict[str, torch.Tensor]:
        return {**self.tensors(BACKBONE_FILE), **self.tensors(MESSENGER_FILE)}

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
        key = [m["base_model"]["revision"], m["split"], m["lora"], m["files"].get(MESSENGER_FILE)]
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _read_manifest(path: Path, mpath: Path) -> bytes:
    """The manifest's bytes, refused beyond MAX_MANIFEST_BYTES (it lists files, it holds none)."""
    try:
        if not mpath.is_file():
            raise FileNotFoundError
        with mpath.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise BundleError(f"{path}: not a bundle (no {MANIFEST})") from None
    except OSError as err:
        raise BundleError(f"{mpath}: unreadable ({err.strerror or err})") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{mpath}: corrupt manifest (over {MAX_MANIFEST_BYTES} bytes)")
    return raw


def _validate_manifest(m: object, where: Path) -> None:
    """Type-check every field the toolkit reads, and the file list, before anything is opened: a
    manifest is data from elsewhere, and what it says decides which files are read and how."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BundleError(f"{where}: not a CIDERS bundle manifest")
    if type(m.get("format_version")) is not int or m["format_version"] != FORMAT_VERSION:
        raise BundleError(
            f"{where}: bundle format version {reprlib.repr(m.get('format_version'))} is not supported "
            f"(expected {FORMAT_VERSION})"
        )
    for key in REQUIRED_FIELDS:
        if key not in m:
            raise BundleError(f"{where}: manifest lacks {key!r}")
    if not _is_int(m["round"]) or m["round"] < 0:
        raise BundleError(f"{where}: manifest field 'round' must be a round number, got {reprlib.repr(m['round'])}")
    _check_files(m, where)
    _check_split(m["split"], where)
    _check_base_model(m["base_model"], where)
    if not isinstance(m["dtype"], str) or m["dtype"] not in DTYPES:
        raise BundleError(
            f"{where}: manifest field 'dtype' must be one of {', '.join(DTYPES)}, got {reprlib.repr(m['dtype'])}"
        )
    if m.get("deploy_backbone", "emu") not in BACKBONES:
        raise BundleError(f"{where}: manifest field 'deploy_backbone' must be one of {', '.join(BACKBONES)}")
    for key, check in OPTIONAL_FIELDS.items():
        if key in m and not check(m[key]):
            raise BundleError(f"{where}: manifest field {key!r} has the wrong type ({reprlib.repr(m[key])})")
    _check_settings(m, where)


def _check_files(m: dict, where: Path) -> None:
    """Every listed path plain and relative, every core file listed (so nothing is read unverified)."""
    files = m["files"]
    if not isinstance(files, dict):
        raise BundleError(f"{where}: manifest field 'files' must be an object of path: sha256")
    for rel in files:
        check_relpath(rel, BundleError, str(where))
    if MANIFEST in files:
        raise BundleError(f"{where}: the manifest lists itself")
    full = m.get("deploy_backbone") == "full" or FULL_WEIGHTS in files
    missing = [f for f in CORE_FILES + (FULL_FILES if full else ()) if f not in files]
    if missing:
        raise BundleError(f"{where}: manifest does not list {', '.join(missing[:3])}; not a complete bundle")


def _check_split(split: object, where: Path) -> None:
    """The split's fields typed, and ``kept`` the layers its n, a, beta select."""
    ok = isinstance(split, dict) and all(_is_int(split.get(k)) for k in ("n", "a"))
    ok = ok and _is_number(split.get("beta")) and isinstance(split.get("kept"), list)
    ok = ok and all(_is_int(i) for i in split["kept"]) and 0 < split["n"] <= MAX_LAYERS
    if not ok:
        raise BundleError(
            f"{where}: manifest field 'split' needs integers n (1..{MAX_LAYERS}), a, number beta, list kept"
        )
    try:
        SplitSpec.from_dict(split)
    except ConfigError as err:
        raise BundleError(f"{where}: manifest field 'split': {err}") from None


def _check_base_model(base: object, where: Path) -> None:
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("id", "revision")):
        raise BundleError(f"{where}: manifest field 'base_model' needs string id and revision")


def _check_settings(m: dict, where: Path) -> None:
    """The config dataclasses the edge builds from the manifest: typed fields, then their own checks."""
    for key, cls in (("lora", LoraSettings), ("backbone_lora", LoraSettings), ("hyperparameters", RoundHyperparams)):
        _check_dataclass(m[key], cls, f"{where}: manifest field {key!r}")
    _check_dataclass(m["profile"], DeviceProfile, f"{where}: manifest field 'profile'")
    if not isinstance(m["profile"].get("name"), str):
        raise BundleError(f"{where}: manifest field 'profile' needs a string name")


def _check_dataclass(d: object, cls: type[ConfigMixin], where: str) -> None:
    """``d`` fits ``cls``'s typed fields (unknown keys are left alone) and passes its own checks."""
    if not isinstance(d, dict):
        raise BundleError(f"{where} must be an object")
    try:
        cls.from_dict(d, where)
    except (ConfigError, TypeError, ValueError) as err:  # a type error names `where`; a range error does not
        raise BundleError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """A finite JSON number that converts to a float (an integer of 400 digits does not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


OPTIONAL_FIELDS = {
    "takd_step": lambda v: _is_int(v) and v >= 0,
    "special_tokens": lambda v: isinstance(v, dict) and all(t is None or _is_int(t) for t in v.values()),
    "fidelity": lambda v: v is None or isinstance(v, dict),
}


def _write_contents(d: Path, c: BundleContents) -> None:
    n_kept = len(c.manifest["split"]["kept"])
    backbone, messenger = _split_weights(c.base_weights, n_kept)
    write_safetensors(d / BACKBONE_FILE, backbone)
    write_safetensors(d / MESSENGER_FILE, messenger)
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
        write_safetensors(d / FULL_WEIGHTS, c.full_backbone)
        c.full_config.save_pretrained(d / FULL_DIR)
        fsync_dir(d / FULL_DIR)
    fsync_dir(d)


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
