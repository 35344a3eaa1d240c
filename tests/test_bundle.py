import json

import pytest
import torch
from peft import PeftModel

from ciders_cloud.prepare import STATE_DIR, load_cloud_models, load_run
from ciders_cloud.state import ServerState
from ciders_edge.bundle import ADAPTER_DIR, Bundle
from ciders_edge.emu import load_edge_model
from ciders_edge.errors import BundleError


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
    cloud = load_cloud_models(run_dir, load_run(run_dir), ServerState.load(run_dir / STATE_DIR))
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
