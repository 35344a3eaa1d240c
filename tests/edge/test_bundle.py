import json
import re

import pytest
import torch
from peft import PeftModel

from ciders_cloud.models.teacher import load_cloud_models
from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import BundleError
from ciders_edge.formats.bundle import ADAPTER_DIR, Bundle, bundle_id
from ciders_edge.model.adapemu import load_edge_model


def _bundle_dir(tiny_run):
    return tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"


def test_manifest_describes_the_split(tiny_run):
    b = Bundle.load(_bundle_dir(tiny_run))
    m = b.manifest
    assert m["split"]["kept"] == [0, 2, 5] and m["split"]["a"] == 2
    assert m["round"] == 0 and m["dtype"] == "float32" and m["profile"]["name"] == "cpu-laptop"
    assert set(m["producer"]) == {"ciders", "torch", "transformers", "peft"}
    assert {
        "backbone.safetensors",
        "messenger.safetensors",
        "consensus.safetensors",
        "adapter/adapter_model.safetensors",
        "tokenizer.json",
    } <= set(m["files"])
    assert m["special_tokens"]["eos"] is not None and len(b.bundle_id) == 64


def test_edge_model_equals_the_cloud_emu(tiny_run):
    """Bundle round trip: the edge's AdapEmu (backbone LoRA merged) computes what the cloud's does."""
    run_dir = tiny_run[0]
    [cloud] = load_cloud_models(run_dir, load_run(run_dir), ServerState.load(RunFolder(run_dir).server_state)).values()
    edge = load_edge_model(Bundle.load(_bundle_dir(tiny_run)))
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        ref = cloud.emu(input_ids=ids).logits
        out = edge.model(input_ids=ids).logits
    assert torch.allclose(ref, out, atol=1e-5)
    assert torch.equal(
        edge.bundle.messenger_lora()[next(iter(cloud.messenger_state()))], next(iter(cloud.messenger_state().values()))
    )


def test_adapter_folder_loads_in_plain_peft(tiny_run):
    bdir = _bundle_dir(tiny_run)
    edge = load_edge_model(Bundle.load(bdir))
    base = edge.model.get_base_model()
    # Unwrap our adapter and load the shipped folder with PEFT's own loader.
    plain = edge.model.unload()
    loaded = PeftModel.from_pretrained(plain, bdir / ADAPTER_DIR)
    ids = torch.randint(0, 1000, (1, 7))
    assert loaded.peft_config["default"].r == 4
    assert base is not None and loaded(input_ids=ids).logits.shape[-1] == edge.model.config.vocab_size


def test_flipped_byte_is_refused_naming_the_file(tiny_run, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(_bundle_dir(tiny_run), copy)
    f = copy / "messenger.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"messenger\.safetensors: checksum mismatch"):
        Bundle.load(copy)


def test_bundle_id_names_the_bundle_without_reading_its_weights(tiny_run, tmp_path):
    """The cloud matches packets to its own bundles by id: the manifest's hash, as Bundle.load gives it,
    without hashing every weight file (a changed weight is Bundle.load's to refuse, not the id's)."""
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(_bundle_dir(tiny_run), copy)
    assert bundle_id(copy) == Bundle.load(copy).bundle_id
    (copy / "messenger.safetensors").write_bytes(b"changed")
    assert bundle_id(copy) == Bundle.load(_bundle_dir(tiny_run)).bundle_id
    with pytest.raises(BundleError, match="messenger.safetensors"):
        Bundle.load(copy)
    with pytest.raises(BundleError, match="not a bundle"):
        bundle_id(tmp_path)


def test_missing_file_and_bad_manifest(tiny_run, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(_bundle_dir(tiny_run), copy)
    (copy / "consensus.safetensors").unlink()
    with pytest.raises(BundleError, match="consensus.safetensors: missing"):
        Bundle.load(copy)
    (copy / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(BundleError, match="not a CIDERS bundle"):
        Bundle.load(copy)
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.load(tmp_path)


# Issue 16, item 9: Bundle.load trusts nothing the manifest says.


def _copy_with_manifest(tiny_run, tmp_path, edit):
    """A copy of the round-0 bundle whose manifest ``edit(manifest)`` changed (in place)."""
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(_bundle_dir(tiny_run), copy)
    m = json.loads((copy / "manifest.json").read_text())
    edit(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy


def _sha(path):
    from ciders_edge.formats.checksums import sha256_file

    return sha256_file(path)


@pytest.mark.parametrize("rel", ["../outside.txt", "{abs}", "adapter/../../outside.txt", "./config.json", "a//b"])
def test_a_path_outside_the_folder_is_refused_even_with_the_right_sha256(tiny_run, tmp_path, rel):
    outside = tmp_path / "outside.txt"
    outside.write_text("root:x:0:0")
    rel = rel.format(abs=outside)
    copy = _copy_with_manifest(tiny_run, tmp_path, lambda m: m["files"].update({rel: _sha(outside)}))
    with pytest.raises(BundleError, match="unsafe path"):
        Bundle.load(copy)


def test_a_link_out_of_the_folder_is_refused(tiny_run, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("root:x:0:0")
    copy = _copy_with_manifest(tiny_run, tmp_path, lambda m: m["files"].update({"extra.txt": _sha(outside)}))
    (copy / "extra.txt").symlink_to(outside)
    with pytest.raises(BundleError, match=r"extra\.txt: a link out of the bundle"):
        Bundle.load(copy)


@pytest.mark.parametrize("drop", [None, "consensus.safetensors", "adapter/adapter_model.safetensors", "config.json"])
def test_the_core_files_must_be_listed(tiny_run, tmp_path, drop):
    def edit(m):
        if drop is None:
            m["files"] = {}
        else:
            del m["files"][drop]

    with pytest.raises(BundleError, match=rf"manifest does not list {drop or 'backbone.safetensors'}"):
        Bundle.load(_copy_with_manifest(tiny_run, tmp_path, edit))


def _set(path: str, value):
    """An edit that sets the manifest field at dotted ``path`` (``...``: deletes it)."""

    def edit(m):
        *parents, last = path.split(".", 1)
        for key in parents:
            m = m[key]
        if value is ...:
            del m[last]
        else:
            m[last] = value

    return edit


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("round", "0", "'round' must be a round number"),
        ("round", -1, "'round' must be a round number"),
        ("round", True, "'round' must be a round number"),
        ("format_version", True, "format version True is not supported"),
        ("files", ["backbone.safetensors"], "'files' must be an object"),
        ("files.backbone.safetensors", 5, "no sha256 for 'backbone.safetensors'"),
        ("split.kept", ["0", "2", "5"], "'split' needs integers"),
        ("split.n", 10**12, "'split' needs integers n"),
        ("split.beta", 0.75, "kept layer indices"),
        ("lora.rank", "4", "'lora': `rank` must be an integer"),
        ("lora.rank", 0, "'lora': `rank` must be an integer from 1 to 1,024; got 0"),
        ("backbone_lora", [], "'backbone_lora' must be an object"),
        ("hyperparameters.eta", float("nan"), "'hyperparameters': `eta` must be a number"),
        ("hyperparameters.local_steps", 2.5, "'hyperparameters': `local_steps` must be an integer"),
        ("hyperparameters.eta_in", "fast", "`eta_in` must be a number"),
        ("hyperparameters.solver", "newton", "`solver` must be a string, one of 'fo', 'fd', 'svrg'"),
        ("dtype", ["float32"], "'dtype' must be one of"),
        ("dtype", "float64", "'dtype' must be one of"),
        ("base_model", "tiny", "'base_model' needs string id and revision"),
        ("base_model.revision", ..., "'base_model' needs string id and revision"),
        ("profile.name", 3, "'profile': `name` must be a string"),
        ("profile.execution_providers", "CPUExecutionProvider", "`execution_providers` must be a list"),
        ("deploy_backbone", "half", "'deploy_backbone' must be one of"),
        ("special_tokens", {"eos": "2"}, "'special_tokens' has the wrong type"),
        ("hyperparameters", ..., "manifest lacks 'hyperparameters'"),
    ],
)
def test_a_mistyped_manifest_field_is_named(tiny_run, tmp_path, path, value, message):
    with pytest.raises(BundleError, match=re.escape(message)):
        Bundle.load(_copy_with_manifest(tiny_run, tmp_path, _set(path, value)))


@pytest.mark.parametrize(
    "raw", [b'{"format": "ciders-bundle\xff"}', b"[" * 100_000, b'{"round": 1' + b"0" * 5000 + b"}", b"\x00" * 64]
)
def test_a_manifest_that_is_no_json_is_a_bundle_error(tiny_run, tmp_path, raw):
    copy = _copy_with_manifest(tiny_run, tmp_path, lambda m: None)
    (copy / "manifest.json").write_bytes(raw)
    with pytest.raises(BundleError, match="corrupt manifest"):
        Bundle.load(copy)


def test_cli_verify_refuses_a_traversal_in_one_line(tiny_run, tmp_path):
    from typer.testing import CliRunner

    from ciders_edge.cli import app as edge

    outside = tmp_path / "outside.txt"
    outside.write_text("root:x:0:0")
    copy = _copy_with_manifest(tiny_run, tmp_path, lambda m: m["files"].update({"../outside.txt": _sha(outside)}))
    r = CliRunner().invoke(edge, ["verify", "--bundle", str(copy)])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "unsafe path '../outside.txt'" in lines[0], r.output
