"""The memory model: what keeping frozen weights quantized and checkpointing save, what `profiles` says of
each device, and the round `train` refuses before loading anything."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.formats.storage import bytes_per_param
from ciders_edge.memory import GIB, RUNTIME_BYTES, class_fits, estimate_memory, parameter_count
from ciders_edge.model.classes import MODEL_CLASSES, class_config
from ciders_edge.profiles import DeviceProfile, load_profile


def test_parameter_counts_are_the_published_ones():
    published = {"smollm2-135m": 134_515_008, "qwen2.5-1.5b": 1_543_714_304, "smollm2-1.7b": 1_711_376_384,
                 "qwen3-0.6b": 596_049_920, "gemma-3-270m": 268_098_176}  # fmt: skip
    for name, count in published.items():  # biases and q/k norms are left out: 2e-4 of the weights at most
        assert abs(parameter_count(class_config(name)) - count) <= 2e-4 * count, name


def test_quantized_frozen_weights_cost_their_storage_and_checkpointing_keeps_one_layer():
    config = class_config("qwen2.5-1.5b")
    fp32 = DeviceProfile(frozen_weights="dequantized", storage="int8")
    int8, int4 = DeviceProfile(storage="int8"), DeviceProfile(storage="int4")
    weights = {p.storage + p.frozen_weights: estimate_memory(config, 19, 6, p).weights for p in (fp32, int8, int4)}
    fp32 = weights["int8dequantized"]
    assert weights["int8quantized"] / fp32 == pytest.approx(bytes_per_param("int8-g32") / 4, rel=1e-6)
    assert weights["int4quantized"] / fp32 == pytest.approx(bytes_per_param("int4-g32") / 4, rel=1e-6)
    config = class_config("smollm2-1.7b")
    kept = estimate_memory(config, 20, 6, DeviceProfile(seq_len=1024)).activations
    recomputed = estimate_memory(config, 20, 6, DeviceProfile(seq_len=1024, gradient_checkpointing=True)).activations
    assert recomputed < 0.5 * kept  # six layers' activations become six inputs and one layer's


def test_every_class_is_sized_and_a_small_budget_trains_only_the_small_ones():
    fits = class_fits(DeviceProfile(memory_budget_gb=1.0, messenger_depth=2, drop_ratio=0.5))
    assert [f.name for f in fits][0] == "smollm2-135m" and {f.name for f in fits} == set(MODEL_CLASSES)
    assert [f.parameters for f in fits] == sorted(f.parameters for f in fits)
    trains = [f.train.fits for f in fits]
    assert trains[0] and not trains[-1]
    assert all(f.train.total > RUNTIME_BYTES for f in fits)


def test_profiles_detect_names_the_largest_class_it_trains_and_runs():
    r = CliRunner().invoke(edge_app, ["profiles", "rpi5-8gb", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output.strip().splitlines()[-1])
    fits = {c["name"]: c for c in s["classes"]}
    assert s["largest_train"] in fits and fits[s["largest_train"]]["trains"]
    larger = [c for c in s["classes"] if c["parameters"] > fits[s["largest_train"]]["parameters"]]
    assert not any(c["trains"] for c in larger)
    budget = load_profile("rpi5-8gb").memory_budget_gb * GIB
    assert all((c["train_gib"] * GIB <= budget + 0.01 * GIB) == c["trains"] for c in s["classes"])
    r = CliRunner().invoke(edge_app, ["profiles", "--detect", "--json"])
    assert r.exit_code == 0 and "largest_run" in json.loads(r.output.strip().splitlines()[-1]), r.output


def test_train_refuses_a_round_that_cannot_fit_before_loading(quantized_bundles, demo_dir, tmp_path):
    tiny = tmp_path / "tiny.toml"
    tiny.write_text('name = "tiny-device"\nmemory_budget_gb = 0.3\n')
    bundle = tmp_path / "b"
    shutil.copytree(quantized_bundles["int8"], bundle)
    args = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "dates" / "train.jsonl"), "--client-id", "a"]
    r = CliRunner().invoke(edge_app, [*args, "--state", str(tmp_path / "s"), "--out", str(tmp_path / "p.pkt"),
                                      "--profile", str(tiny)])  # fmt: skip
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "needs" in r.output and "of a 0.30 GiB budget" in r.output and "profile tiny-device" in r.output
    assert not (tmp_path / "p.pkt").exists() and not any((tmp_path / "s").glob("*.safetensors"))
