"""AdapFu (the messenger on the full backbone) on `tiny`: exact, from the bundle or a local copy, bad input."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from tiny_runs import prepare_tiny
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.errors import BundleError, ModelError
from ciders_edge.formats.bundle import FULL_WEIGHTS, Bundle
from ciders_edge.inference.personalize import load_personalized
from ciders_edge.model.adapfu import load_adapfu
from ciders_edge.model.sources import load_model
from ciders_edge.model.split import shift_layers
from ciders_edge.training.train import RoundOptions, train
from export import export_model
from export.check import all_logits, check_inputs, compare_logits

runner = CliRunner()


def _random_messenger(bundle: Bundle) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in bundle.messenger_lora().items()}


@pytest.mark.parametrize(("depth", "drop"), [(2, 0.5), (3, 0.25), (1, 0.0)])
def test_adapfu_is_the_base_model_with_the_lora_on_its_top_layers(tmp_path, demo_dir, tiny_path, depth, drop):
    bundle = prepare_tiny(tmp_path, demo_dir, depth, drop)
    x = _random_messenger(bundle)
    edge = load_adapfu(bundle)
    edge.use_messenger(x)
    n = edge.model.config.num_hidden_layers
    lora = bundle.manifest["lora"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=targets,
                        layers_to_transform=list(range(n - depth, n)), layers_pattern="layers")  # fmt: skip
    reference = get_peft_model(load_model(tiny_path), config)
    n_kept = len(bundle.manifest["split"]["kept"])
    set_peft_model_state_dict(reference, shift_layers(x, (n - depth) - n_kept))
    ids = torch.randint(0, 5000, (2, 16))
    with torch.no_grad():
        want = reference.eval()(input_ids=ids).logits
        got = edge.model(input_ids=ids).logits
    assert n == 8 and torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, load_model(tiny_path)(input_ids=ids).logits, atol=1e-3)  # the LoRA is live


def test_a_local_copy_of_the_base_model_gives_the_same_adapfu(tmp_path, demo_dir):
    bundle = prepare_tiny(tmp_path, demo_dir, 2, 0.5)
    dropped_and_trained = {int(k.split(".")[2]) for k in bundle.tensors(FULL_WEIGHTS)}
    assert dropped_and_trained == {1, 2, 3, 4, 5}  # kept [0, 2, 5]: layer 0 comes from backbone.safetensors
    ids = torch.randint(0, 5000, (1, 12))
    with torch.no_grad():
        a = load_adapfu(bundle).model(input_ids=ids).logits
        b = load_adapfu(bundle, base_model="tiny").model(input_ids=ids).logits
    assert torch.equal(a, b)


def test_personalized_adapfu_exports_and_answers(tmp_path, demo_dir):
    bundle = prepare_tiny(tmp_path, demo_dir, 2, 0.5)
    state = tmp_path / "state"
    train(
        bundle.path,
        demo_dir / "dates" / "train.jsonl",
        state,
        tmp_path / "p.pkt",
        RoundOptions(client_id="e", overrides={"local_steps": 2, "eta": 1e-2}),
    )
    edge, source = load_personalized(bundle, state, backbone="full")
    assert source.backbone == "full" and source.messenger == "personalized"
    inputs = check_inputs(edge.tokenizer)
    reference = all_logits(edge.model, inputs)
    summary = export_model(bundle.path, state, "hf", tmp_path / "hf")  # the bundle deploys AdapFu by default
    assert summary["source"]["backbone"] == "full" and summary["check"]["max_abs_logit_diff"] < 1e-4
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert exported.config.num_hidden_layers == 8
    assert compare_logits(inputs, reference, all_logits(exported, inputs))["max_abs_logit_diff"] < 1e-4
    r = runner.invoke(edge_app, ["infer", "--export", str(tmp_path / "hf"), "--bundle", str(bundle.path),
                                 "--state", str(state), "--prompt", "hi", "--max-new-tokens", "2"])  # fmt: skip
    assert r.exit_code == 0 and "AdapFu" in r.output, r.output


def test_full_backbone_that_is_not_there_is_one_line(tmp_path, demo_dir):
    profile = tmp_path / "small.toml"
    profile.write_text('name = "small"\nbackbone = "emu"\n')
    bundle = prepare_tiny(tmp_path, demo_dir, 2, 0.5, profile=str(profile))
    assert not bundle.has_full_backbone and bundle.manifest["deploy_backbone"] == "emu"
    with pytest.raises(BundleError, match=r"carries no full backbone .*--base-model with a local copy of tiny"):
        load_adapfu(bundle)
    out = tmp_path / "export"
    r = runner.invoke(edge_app, ["export", "--bundle", str(bundle.path), "--global", "--backbone", "full",
                                 "--out", str(out)])  # fmt: skip
    assert r.exit_code == 1 and "carries no full backbone" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_a_base_model_with_another_hash_is_refused(tmp_path, demo_dir, tiny_path):
    import shutil

    bundle = prepare_tiny(tmp_path, demo_dir, 2, 0.5)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(ModelError, match="is not the base model this run was prepared from .tiny"):
        load_adapfu(bundle, base_model=other)
    out = tmp_path / "export"
    r = runner.invoke(edge_app, ["export", "--bundle", str(bundle.path), "--global", "--backbone", "full",
                                 "--base-model", str(other), "--out", str(out)])  # fmt: skip
    assert r.exit_code == 1 and "refusing it" in r.output and not out.exists()
