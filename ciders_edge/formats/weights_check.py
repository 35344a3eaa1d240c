"""What a bundle's weight files must be before anything reads them, beyond their checksums.

A checksum only says a file is the one the manifest lists; whoever can rewrite the files can rewrite the
manifest too. So :meth:`Bundle.load` (and with it ``ciders-edge verify``) also checks what loading relies
on: every safetensors header parses and covers its file; every frozen weight file holds exactly its
storage record (each tensor's dtype, integers and scales of one shape, formats the bundle's storage
writes), of the shapes the bundle's model config gives; every scale is finite, positive and at most
:data:`MAX_SCALE`. Headers and scales are read, not the weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ciders_edge.errors import BundleError
from ciders_edge.formats.manifest import FROZEN_FILES, FULL_DIR, FULL_WEIGHTS
from ciders_edge.formats.storage import FORMATS, GROUP, SCALE_SUFFIX

__all__ = ["check_weights", "MAX_SCALE"]

MAX_SCALE = 1024.0  # a step this large means weights of 10^5 (int8): no model has them; fp16's 65504 is a bomb
WRITES = {  # the tensor formats each storage writes (storage.tensor_format)
    "fp32": {"fp32"},
    "bf16": {"bf16"},
    "int8": {"int8-g32", "int8-row", "fp32"},
    "int4": {"int4-g32", "fp32"},
}
_FLOAT = {"fp32": "F32", "bf16": "BF16"}
_INTEGERS = {8: "I8", 4: "U8"}  # int4: two per byte
Header = dict[str, tuple[str, tuple[int, ...]]]  # name: (safetensors dtype, shape)


def check_weights(path: Path, manifest: dict) -> None:
    """Raise a one-line :class:`BundleError` naming the file and tensor that loading would trip on.
    ``manifest`` has passed ``validate_manifest`` and every file its checksum."""
    storage = manifest.get("storage") if manifest["format_version"] >= 2 else None
    if storage is not None and storage.get("group") != GROUP:  # every reader splits rows in groups of GROUP
        raise BundleError(
            f"{path / 'manifest.json'}: storage group {storage.get('group')!r} is not {GROUP}, the group of every "
            "quantized weight this toolkit writes and reads"
        )
    for rel in sorted(r for r in manifest["files"] if r.endswith(".safetensors")):
        where = path / rel
        record = storage["tensors"].get(rel) if storage else None
        header = _header(where, record)
        if rel in FROZEN_FILES:
            if record is not None:
                shapes = _check_record(header, record, storage["format"], where)
            else:  # format 1: the weights as the model holds them
                shapes = {name: shape for name, (_, shape) in header.items()}
            config = FULL_DIR + "/config.json" if rel == FULL_WEIGHTS else "config.json"
            split = manifest["split"]  # the AdapEmu: its kept layers, then the messenger's; AdapFu: all n
            layers = split["n"] if rel == FULL_WEIGHTS else len(split["kept"]) + split["a"]
            model = _model_shapes(path / config, manifest["files"][config], layers)
            _check_shapes(shapes, model, where, config)


def _header(where: Path, record: dict[str, str] | None) -> Header:
    """The file's tensors as its header declares them; the scales of ``record`` are read and checked."""
    header, scales = {}, {}
    try:
        with safe_open(where, framework="np") as f:  # numpy: a few small arrays, no thread pool to wake
            for name in f.keys():
                part = f.get_slice(name)
                header[name] = (part.get_dtype(), tuple(part.get_shape()))
            for name, fmt in (record or {}).items():
                if FORMATS.get(fmt) and header.get(name + SCALE_SUFFIX, ("",))[0] == "F16":
                    scales[name] = f.get_tensor(name + SCALE_SUFFIX)
    except (SafetensorError, OSError) as err:
        raise BundleError(f"{where}: not a readable safetensors file ({str(err)[:120]})") from None
    if scales and not _in_range(np.concatenate([a.reshape(-1) for a in scales.values()])):  # one pass per file
        for name, scale in scales.items():
            _check_scales(scale, f"{where}: tensor {name}")
    return header


def _in_range(scale: np.ndarray) -> bool:
    s = scale.astype(np.float32)
    return not s.size or bool(np.isfinite(s).all() and s.min() > 0 and s.max() <= MAX_SCALE)


def _check_scales(scale: np.ndarray, where: str) -> None:
    """Name the first way one tensor's scales leave (0, MAX_SCALE]: dequantized, they would be
    NaN, Inf, sign-flipped or absurdly large weights."""
    s = scale.astype(np.float32)
    if not np.isfinite(s).all():
        raise BundleError(f"{where}: a quantization scale is not finite ({s[~np.isfinite(s)][0]})")
    if not _in_range(s):
        bad = s.min() if s.min() <= 0 else s.max()
        raise BundleError(f"{where}: a quantization scale is {bad:g}; scales lie in (0, {MAX_SCALE:g}]")


def _check_record(header: Header, formats: dict[str, str], storage: str, where: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor as its format stores it; returns the weights' shapes as the model sees them."""
    shapes = {}
    for name, fmt in formats.items():
        if fmt not in WRITES[storage]:
            raise BundleError(f"{where}: tensor {name} is recorded as {fmt}, which {storage} storage never writes")
        if name not in header or (FORMATS[fmt] and name + SCALE_SUFFIX not in header):
            raise BundleError(f"{where}: tensor {name} ({fmt}) is missing")
        dtype, shape = header[name]
        if FORMATS[fmt] is None:
            if dtype != _FLOAT[fmt]:
                raise BundleError(f"{where}: tensor {name} is {dtype}, its storage record says {fmt}")
            shapes[name] = shape
            continue
        shapes[name] = _check_pair(name, header[name], header[name + SCALE_SUFFIX], fmt, where)
    scales = {n + SCALE_SUFFIX for n, fmt in formats.items() if FORMATS[fmt]}
    extra = sorted(set(header) - set(formats) - scales)
    if extra:
        raise BundleError(f"{where}: tensor {extra[0]} is not in the manifest's storage record")
    return shapes


def _check_pair(name: str, q: tuple, scale: tuple, fmt: str, where: Path) -> tuple[int, ...]:
    """Integers and scales of one ``fmt`` tensor; returns the weight's shape (int4: two per byte)."""
    (dtype, shape), bits = q, FORMATS[fmt]
    cols = shape[1] * (2 if bits == 4 else 1) if len(shape) == 2 else 0
    row = fmt.endswith("-row")
    want = ("F16", (shape[0], 1 if row else cols // GROUP)) if len(shape) == 2 else None
    if dtype != _INTEGERS[bits] or scale != want or not (row or cols % GROUP == 0) or not cols:
        raise BundleError(
            f"{where}: tensor {name}: integers {shape} {dtype} and scales {scale[1]} {scale[0]} are not {fmt}"
        )
    return (shape[0], cols)


def _check_shapes(shapes: dict[str, tuple[int, ...]], model: dict, where: Path, config: str) -> None:
    for name, shape in shapes.items():
        want = model.get(name)
        if want is None:
            raise BundleError(f"{where}: tensor {name} is not a weight of the model its {config} describes")
        if shape != want:
            raise BundleError(f"{where}: tensor {name} has shape {shape}, its {config} gives {want}")


def _model_shapes(config: Path, digest: str, layers: int) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in the model ``config`` describes (of ``layers`` layers, as the split
    says), built on the meta device (no memory); ``digest``, its verified sha256, keys a cache, so
    every bundle of a run builds it once."""
    if (digest, layers) not in _SHAPES:
        _SHAPES[digest, layers] = _build_shapes(config, layers)
    return _SHAPES[digest, layers]


_SHAPES: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {}
_CONFIG_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, ArithmeticError, OSError, RuntimeError)


def _build_shapes(config: Path, layers: int) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(config.parent)
        got = getattr(cfg, "num_hidden_layers", None)
        if got == layers:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
    except (*_CONFIG_ERRORS, ImportError) as err:
        raise BundleError(f"{config}: not a model config this toolkit can build ({str(err)[:120]})") from None
    if got != layers:
        raise BundleError(f"{config}: num_hidden_layers is {got!r:.20}, the manifest's split gives {layers}")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
