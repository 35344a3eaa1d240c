"""Fuzzing the bundle manifest loader (issue 16, item 9).

Whatever ``manifest.json`` holds, :meth:`Bundle.load` either refuses it with a :class:`BundleError` or
returns a bundle whose fields everything on the edge reads without failing; never another exception.
Inputs: random bytes, byte flips and cuts of a real manifest, and structured mutations of it (a field
replaced by any JSON value, deleted or added; a file entry added). Derandomized and bounded, so a run
is repeatable and takes seconds.
"""

import copy
import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import MANIFEST, Bundle
from ciders_edge.formats.bundle import MESSENGER_LAYERS_FILE as MESSENGER
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.lora import LoraSettings
from ciders_edge.model.split import SplitSpec
from ciders_edge.profiles import DTYPES, DeviceProfile

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TRICKY = [
    "../outside.txt",
    "/etc/passwd",
    "",
    ".",
    "..",
    "a//b",
    "./config.json",
    "a\x00b",
    "a\\b",
    "\ud800",
    "manifest.json",
    "backbone.safetensors",
    "full_backbone/model.safetensors",
    "float32",
    "full",
    "emu",
    "0" * 64,
    "ciders-bundle",
    10**400,
    -1,
    2**63,
    float("nan"),
    float("inf"),
    1e308,
    "int8-g32",
    "int8-row",
    "int4-g32",
    "int4",
]
SCALE = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 65504.0, 2**-24]
NAMES = st.text(max_size=8) | st.sampled_from([t for t in TRICKY if isinstance(t, str)])  # keys and paths
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12), st.sampled_from(TRICKY))
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def bundle(tiny_run, tmp_path_factory):
    """A private copy of the round-0 bundle (its manifest is rewritten by every example) and that manifest."""
    path = tmp_path_factory.mktemp("fuzz") / "b"
    shutil.copytree(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000", path)
    raw = (path / MANIFEST).read_bytes()
    return path, raw


def _load(path, raw: bytes) -> None:
    """Load a bundle with manifest ``raw``: a BundleError, or a bundle the edge can use."""
    (path / MANIFEST).write_bytes(raw)
    try:
        b = Bundle.load(path)
    except BundleError as err:
        assert "\n" not in str(err)  # one line on the CLI
        event("refused")
        return
    event("loaded")
    _use(b)


def _use(b: Bundle) -> None:
    """What the edge reads from a loaded manifest (verify, train, infer, evaluate, export, bench)."""
    m = b.manifest
    assert b.round >= 0 and len(b.frozen_digest) == len(b.full_digest) == 64
    assert SplitSpec.from_dict(m["split"]).kept == m["split"]["kept"]
    LoraSettings.from_dict(m["lora"])
    LoraSettings.from_dict(m["backbone_lora"]).replace(dropout=0.0)
    RoundHyperparams.from_dict(m["hyperparameters"])
    DeviceProfile.from_dict(m["profile"])
    assert DTYPES[m["dtype"]] is not None and m.get("deploy_backbone", "emu") in ("emu", "full")
    names = (m["base_model"]["id"], m["base_model"]["revision"], m["profile"]["name"])  # in the edge's messages
    assert all(isinstance(n, str) for n in names), names
    assert sum((b.path / f).stat().st_size for f in m["files"]) > 0 and isinstance(b.has_full_backbone, bool)
    b.base_weights()  # the weights decode as the storage record says (Bundle.load checked that it fits)


def _paths(node, prefix=()):
    """Every path into the JSON tree, as key/index tuples."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _mutate(m: dict, data) -> dict:
    """One structured mutation of manifest ``m``: replace, delete or add a field, or add a file entry."""
    m = copy.deepcopy(m)
    paths = list(_paths(m))[1:]
    if not paths:
        return m
    path = data.draw(st.sampled_from(paths))
    *parents, last = path
    parent = m
    for key in parents:
        parent = parent[key]
    op = data.draw(st.sampled_from(["replace", "delete", "add", "file"]))
    if op == "replace":
        parent[last] = data.draw(JSON)
    elif op == "delete" and isinstance(parent, dict):
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent[data.draw(NAMES)] = data.draw(JSON)
    elif isinstance(m.get("files"), dict) and m["files"]:
        real = sorted({d for d in m["files"].values() if isinstance(d, str)}) or ["0" * 64]
        digest = data.draw(st.sampled_from(real) | st.text("0123456789abcdef", min_size=64, max_size=64))
        m["files"][data.draw(NAMES)] = digest
    return m


@FUZZ
@given(raw=st.binary(max_size=2048))
def test_random_bytes_are_a_bundle_error(bundle, raw):
    path, _ = bundle
    (path / MANIFEST).write_bytes(raw)
    with pytest.raises(BundleError):
        Bundle.load(path)


@FUZZ
@pytest.mark.filterwarnings("ignore:.*unknown keys ignored:UserWarning")
@given(data=st.data())
def test_flipped_and_cut_manifests(bundle, data):
    path, raw = bundle
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] = data.draw(st.sampled_from(b'0123456789.-e"/\\ ') | st.integers(0, 255))
    cut = data.draw(st.integers(0, len(b)) | st.just(len(b)))
    _load(path, bytes(b[:cut]))


@FUZZ
@pytest.mark.filterwarnings("ignore:.*unknown keys ignored:UserWarning")
@given(data=st.data())
def test_structured_mutations(bundle, data):
    path, raw = bundle
    m = json.loads(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        m = _mutate(m, data)
    _load(path, json.dumps(m).encode())


def test_the_unmutated_manifest_loads(bundle):
    path, raw = bundle
    (path / MANIFEST).write_bytes(raw)
    _use(Bundle.load(path))


WEIGHT_EDITS = ("flip", "cut", "scale", "rows", "drop", "dtype")


@pytest.fixture(scope="module")
def quantized(quantized_bundles, tmp_path_factory):
    """Private copies of the int8 and int4 bundles, and their messenger file's bytes and decoded weights."""
    out = {}
    for storage, src in quantized_bundles.items():
        path = tmp_path_factory.mktemp("fuzz-q") / storage
        shutil.copytree(src, path)
        raw = (path / MESSENGER).read_bytes(), (path / MANIFEST).read_bytes()
        out[storage] = path, raw, {k: v.shape for k, v in Bundle.load(path).tensors(MESSENGER).items()}
    return out


def _replace(path, data: bytes) -> None:
    """Write by rename: tensors still mapped from the old file keep their bytes (no SIGBUS)."""
    path.with_suffix(".new").write_bytes(data)
    path.with_suffix(".new").replace(path)


def _edit_weights(raw: bytes, data) -> bytes:
    """One hostile edit of a safetensors file: bytes flipped or cut, or a tensor's scales, rows, dtype
    changed or the tensor dropped."""
    op = data.draw(st.sampled_from(WEIGHT_EDITS))
    if op in ("flip", "cut"):
        b = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4)) if op == "flip" else 0):
            b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
        return bytes(b[: data.draw(st.integers(0, len(b)))] if op == "cut" else b)
    tensors = load(raw)
    name = data.draw(st.sampled_from(sorted(tensors)))
    t = tensors[name]
    if op == "scale" and t.dtype == torch.float16:
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = data.draw(st.floats(width=16) | st.sampled_from(SCALE))
    elif op == "rows":
        tensors[name] = t[: data.draw(st.integers(0, t.shape[0]))].clone()
    elif op == "drop":
        del tensors[name]
    else:
        tensors[name] = t.to(data.draw(st.sampled_from([torch.float16, torch.float32, torch.int8, torch.uint8])))
    return save(tensors)


@FUZZ
@given(data=st.data())
def test_resigned_weight_files_are_refused_or_load_as_the_model_expects(quantized, data):
    """An attacker who can write the folder re-signs the checksums; a bundle whose messenger file was
    edited is then refused with one BundleError line, or its weights decode, finite where quantized, to
    exactly the shapes of the untouched file (issue 27, item 6)."""
    from forgery import resign

    path, (raw, manifest), shapes = quantized[data.draw(st.sampled_from(sorted(quantized)))]
    _replace(path / MESSENGER, _edit_weights(raw, data))
    (path / MANIFEST).write_bytes(manifest)
    resign(path)
    try:
        b = Bundle.load(path)
    except BundleError as err:
        assert "\n" not in str(err) and str(path) in str(err)
        event("refused")
        return
    event("loaded")
    got = b.tensors(MESSENGER)
    assert {k: v.shape for k, v in got.items()} == shapes
    quantized_names = [k for k, f in b.manifest["storage"]["tensors"][MESSENGER].items() if f != "fp32"]
    assert all(torch.isfinite(got[k]).all() for k in quantized_names)
