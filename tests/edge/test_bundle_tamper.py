"""Tampered quantized bundles whose checksums the attacker recomputed (issue 27, item 6).

Only a semantic check catches these: ``verify`` and every command that loads the bundle refuse each one
in one line naming the file and tensor, before any weight is used.
"""

import json
import shutil

import pytest
import torch
from forgery import resign
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ciders_edge.cli import app as edge
from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import MANIFEST, Bundle
from ciders_edge.formats.storage import SCALE_SUFFIX

runner = CliRunner()
MESSENGER = "messenger.safetensors"
DOWN = "model.layers.3.mlp.down_proj.weight"  # a quantized messenger weight (64 x 128) in both storages
EMBED = "model.embed_tokens.weight"


def _edit_tensors(bundle, rel, edit) -> None:
    tensors = load_file(bundle / rel)
    edit(tensors)
    save_file(tensors, bundle / rel)


def _set_scale(value):
    def edit(t):
        t[DOWN + SCALE_SUFFIX][0, 0] = value

    return edit


def _truncate(t):  # integers and scales cut alike: consistent with each other, not with the model
    t[DOWN], t[DOWN + SCALE_SUFFIX] = t[DOWN][:32].clone(), t[DOWN + SCALE_SUFFIX][:32].clone()


def _rename(rel, name, fmt):
    def edit(bundle):
        m = json.loads((bundle / MANIFEST).read_text())
        m["storage"]["tensors"][rel][name] = fmt
        (bundle / MANIFEST).write_text(json.dumps(m))

    return edit


def _cut_half(bundle):
    data = (bundle / MESSENGER).read_bytes()
    (bundle / MESSENGER).write_bytes(data[: len(data) // 2])


def _storage(key, value):
    """The manifest's storage record with ``key`` set to ``value``."""

    def edit(bundle):
        m = json.loads((bundle / MANIFEST).read_text())
        m["storage"][key] = value
        (bundle / MANIFEST).write_text(json.dumps(m))

    return edit


def _config(**changes):
    def edit(bundle):
        config = json.loads((bundle / "config.json").read_text())
        (bundle / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


SCALES = [(v, "a quantization scale is") for v in (float("nan"), float("inf"), -1.0, 65504.0, 0.0)]
CASES = [
    *[(s, lambda b, v=v: _edit_tensors(b, MESSENGER, _set_scale(v)), f"{MESSENGER}: tensor {DOWN}: {msg}")
      for s in ("int8", "int4") for v, msg in SCALES],
    *[(s, lambda b: _edit_tensors(b, MESSENGER, _truncate), f"{MESSENGER}: tensor {DOWN} has shape (32, 128), its "
       "config.json gives (64, 128)") for s in ("int8", "int4")],
    *[(s, _cut_half, f"{MESSENGER}: not a readable safetensors file") for s in ("int8", "int4")],
    ("int8", _rename(MESSENGER, DOWN, "int4-g32"), "which int8 storage never writes"),
    ("int4", _rename(MESSENGER, DOWN, "int8-g32"), "which int4 storage never writes"),
    ("int8", _rename("backbone.safetensors", EMBED, "int8-g32"), f"tensor {EMBED}: integers (49152, 64) I8 and scales"),
    ("int8", _rename(MESSENGER, DOWN, "int8-row"), f"{MESSENGER}: tensor {DOWN}: integers (64, 128) I8 and scales"),
    ("int8", _storage("format", "int4"), "which int4 storage never writes"),
    ("int4", _storage("format", "int8"), "is recorded as int4-g32, which int8 storage never writes"),
    *[(s, _storage("group", 16), "manifest.json: storage group 16 is not 32, the group of every quantized weight")
      for s in ("int8", "int4")],
    ("int8", _config(num_hidden_layers=6), "config.json: num_hidden_layers is 6, the manifest's split gives 5"),
    ("int4", _config(hidden_size=32), f"backbone.safetensors: tensor {EMBED} has shape (49152, 64), its config.json"),
]  # fmt: skip


@pytest.fixture
def tampered(quantized_bundles, tmp_path):
    def make(storage, edit):
        bundle = tmp_path / f"{storage}-bundle"
        shutil.copytree(quantized_bundles[storage], bundle)
        edit(bundle)
        resign(bundle)
        return bundle

    return make


@pytest.mark.parametrize(("storage", "edit", "message"), CASES)
def test_verify_train_and_infer_refuse_a_resigned_tampered_bundle(tampered, demo_dir, tmp_path, storage, edit, message):
    bundle = tampered(storage, edit)
    train = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "dates" / "train.jsonl")]
    commands = {
        "verify": ["verify", "--bundle", str(bundle)],
        "train": [*train, "--state", str(tmp_path / "s"), "--out", str(tmp_path / "p.pkt"), "--client-id", "e"],
        "infer": ["infer", "--bundle", str(bundle), "--prompt", "What is 2 + 2?", "--max-new-tokens", "2"],
    }
    for name, args in commands.items():
        r = runner.invoke(edge, args)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 1 and "Traceback" not in r.output and len(lines) == 1, (name, r.output)
        assert str(bundle) in lines[0] and message in lines[0], (name, lines[0])
    assert not (tmp_path / "p.pkt").exists() and not (tmp_path / "s").exists()


def test_the_untampered_quantized_bundles_verify_and_their_scales_are_in_range(quantized_bundles, tmp_path):
    for storage, path in quantized_bundles.items():
        bundle = tmp_path / storage
        shutil.copytree(path, bundle)
        resign(bundle)  # re-signing alone changes nothing
        r = runner.invoke(edge, ["verify", "--bundle", str(bundle)])
        assert r.exit_code == 0 and f"frozen weights stored {storage}" in " ".join(r.output.split()), r.output
        scales = load_file(bundle / MESSENGER)[DOWN + SCALE_SUFFIX].float()
        assert 0 < scales.min() and scales.max() < 1  # far inside (0, MAX_SCALE]


def test_bundle_load_refuses_before_any_weight_is_decoded(tampered, monkeypatch):
    """The check is Bundle.load's own, so every loader (the cloud's too) gets it, and it reads headers and
    scales only: the weights are never decoded."""
    from ciders_edge.formats import bundle as bundle_module

    monkeypatch.setattr(bundle_module, "decode", lambda *a: pytest.fail("decoded"))
    bad = tampered("int4", lambda b: _edit_tensors(b, MESSENGER, _set_scale(float("nan"))))
    with pytest.raises(BundleError, match=f"{MESSENGER}: tensor {DOWN}: a quantization scale is not finite"):
        Bundle.load(bad)
    assert torch.isnan(load_file(bad / MESSENGER)[DOWN + SCALE_SUFFIX][0, 0])  # the file was as tampered
