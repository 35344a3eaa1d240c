"""The bundle's manifest (docs/design.md §5): its file names, and the checks a manifest passes before any file it
lists is opened. A manifest is data from elsewhere; what it says decides which files are read and how,
so every field the toolkit reads is typed here, once."""

from __future__ import annotations

import reprlib
from pathlib import Path

from ciders_edge.config import ConfigMixin, check_value
from ciders_edge.errors import BundleError, ConfigError
from ciders_edge.formats.checksums import check_relpath
from ciders_edge.formats.storage import FORMATS, STORAGES
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.lora import LoraSettings
from ciders_edge.model.split import SplitSpec
from ciders_edge.profiles import BACKBONES, DTYPES, DeviceProfile
from ciders_edge.training.fleet_evidence import MANIFEST_KEY as FLEET_KEY
from ciders_edge.training.fleet_evidence import FleetEvidence

__all__ = ["read_manifest", "validate_manifest", "MANIFEST", "FORMAT", "FORMAT_VERSION", "CORE_FILES"]

FORMAT = "ciders-bundle"
FORMAT_VERSION = 2  # 2: frozen weights in a storage format (``storage``); 1: in the compute dtype
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
BACKBONE_FILE = "backbone.safetensors"
MESSENGER_LAYERS_FILE = "messenger.safetensors"
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
    MESSENGER_LAYERS_FILE,
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
FROZEN_FILES = (BACKBONE_FILE, MESSENGER_LAYERS_FILE, FULL_WEIGHTS)  # what `storage` applies to
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


def read_manifest(path: Path, mpath: Path) -> bytes:
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


def validate_manifest(m: object, where: Path) -> None:
    """Type-check every field the toolkit reads, and the file list, before anything is opened: a
    manifest is data from elsewhere, and what it says decides which files are read and how."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BundleError(f"{where}: not a CIDERS bundle manifest")
    if type(m.get("format_version")) is not int or m["format_version"] not in READABLE_VERSIONS:
        raise BundleError(
            f"{where}: bundle format version {reprlib.repr(m.get('format_version'))} is not supported "
            f"(this toolkit reads {' and '.join(map(str, READABLE_VERSIONS))}); update ciders"
        )
    for key in REQUIRED_FIELDS:
        if key not in m:
            raise BundleError(f"{where}: manifest lacks {key!r}")
    if not check_value(m["round"], int) or m["round"] < 0:
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
    if m["format_version"] >= 2:
        _check_storage(m, where)


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
    ok = isinstance(split, dict) and all(check_value(split.get(k), int) for k in ("n", "a"))
    ok = ok and check_value(split.get("beta"), float) and isinstance(split.get("kept"), list)
    ok = ok and all(check_value(i, int) for i in split["kept"]) and 0 < split["n"] <= MAX_LAYERS
    if not ok:
        raise BundleError(
            f"{where}: manifest field 'split' needs integers n (1..{MAX_LAYERS}), a, number beta, list kept"
        )
    try:
        SplitSpec.from_dict(split)
    except ConfigError as err:
        raise BundleError(f"{where}: manifest field 'split': {err}") from None


def _check_storage(m: dict, where: Path) -> None:
    """``storage``: the bundle's storage name and, for each frozen weight file, every tensor's format."""
    st = m.get("storage")
    if not isinstance(st, dict) or st.get("format") not in STORAGES or not isinstance(st.get("tensors"), dict):
        raise BundleError(f"{where}: manifest field 'storage' needs a format ({', '.join(STORAGES)}) and tensors")
    for rel, formats in st["tensors"].items():
        if rel not in FROZEN_FILES or rel not in m["files"]:
            raise BundleError(f"{where}: manifest field 'storage' names {reprlib.repr(rel)}, not a frozen weight file")
        if not isinstance(formats, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v in FORMATS for k, v in formats.items()
        ):
            raise BundleError(f"{where}: manifest field 'storage' for {rel}: formats must be {', '.join(FORMATS)}")
    missing = [f for f in FROZEN_FILES if f in m["files"] and f not in st["tensors"]]
    if missing:
        raise BundleError(f"{where}: manifest field 'storage' does not describe {missing[0]}")


def _check_base_model(base: object, where: Path) -> None:
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("id", "revision")):
        raise BundleError(f"{where}: manifest field 'base_model' needs string id and revision")


def _check_settings(m: dict, where: Path) -> None:
    """The config dataclasses the edge builds from the manifest: typed fields, then their own checks."""
    for key, cls in (("lora", LoraSettings), ("backbone_lora", LoraSettings), ("hyperparameters", RoundHyperparams)):
        _check_dataclass(m[key], cls, f"{where}: manifest field {key!r}")
    _check_dataclass(m["profile"], DeviceProfile, f"{where}: manifest field 'profile'")
    if m.get(FLEET_KEY) is not None:
        _check_dataclass(m[FLEET_KEY], FleetEvidence, f"{where}: manifest field {FLEET_KEY!r}")
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


OPTIONAL_FIELDS = {
    "takd_step": lambda v: check_value(v, int) and v >= 0,
    "special_tokens": lambda v: isinstance(v, dict) and all(t is None or check_value(t, int) for t in v.values()),
    "fidelity": lambda v: v is None or isinstance(v, dict),
}
