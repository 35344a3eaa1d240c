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
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ciders_edge.config import RoundHyperparams
from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import MANIFEST, Bundle
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
]
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
    assert isinstance(m["base_model"]["id"] + m["base_model"]["revision"][:12] + m["profile"]["name"], str)
    assert sum((b.path / f).stat().st_size for f in m["files"]) > 0 and b.has_full_backbone in (True, False)


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
