"""Frozen weights kept in their int8/int4 storage on the edge: the same model as dequantizing at load, in a
fraction of the memory, with no dequantized weight kept beyond its matmul."""

import shutil

import pytest
import torch
from conftest import fast_run_config
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.errors import ModelError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.model.adapemu import load_edge_model
from ciders_edge.model.adapfu import load_adapfu
from ciders_edge.model.forward import decoder_of, messenger_loss, run_backbone
from ciders_edge.model.quantized import QuantizedEmbedding, QuantizedLinear, is_quantized
from ciders_edge.training.train import RoundOptions, train

IDS = torch.tensor([[1, 17, 230, 4051, 9, 77, 310, 2]])


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, demo_dir):
    """An int8 run's bundle after `distill`: its backbone LoRA is no longer zero, so the live backbone
    adapter the quantized path keeps (instead of merging it) is exercised."""
    from ciders_cloud import distill, prepare

    root = tmp_path_factory.mktemp("distilled") / "run"
    prepare(fast_run_config(demo_dir, storage="int8", takd={"seq_len": 64, "batch_size": 2, "lr": 1e-2}), root)
    distill(root, 3)
    bundle = Bundle.load(root / "bundles" / "cpu-laptop" / "round-0000")
    assert any(t.abs().sum() > 0 for k, t in bundle.backbone_lora().items() if "lora_B" in k)
    return bundle


def _logits(edge):
    with torch.no_grad():
        return edge.model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_the_frozen_weights_stay_integers_and_compute_the_same_logits(quantized_bundles, storage):
    bundle = Bundle.load(quantized_bundles[storage])
    floats, kept = load_edge_model(bundle), load_edge_model(bundle, quantized=True)
    base = kept.model.get_base_model()
    layers = [m for m in base.modules() if isinstance(m, QuantizedLinear)]
    assert isinstance(base.get_input_embeddings(), QuantizedEmbedding) and isinstance(base.lm_head, QuantizedLinear)
    assert base.lm_head.qweight is base.get_input_embeddings().qweight  # the tied head shares the table's integers
    assert {m.qweight.dtype for m in layers} == {torch.int8 if storage == "int8" else torch.uint8}
    assert len(layers) == 7 * len(decoder_of(base).layers) + 1  # every projection, and the head
    float_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n)
    assert float_bytes < 0.01 * sum(p.numel() * 4 for p in floats.model.parameters())  # norms only
    assert torch.equal(_logits(floats), _logits(kept))  # one arithmetic: the same bits in fp32


def test_adapfu_keeps_the_full_backbone_quantized_too(quantized_bundles):
    bundle = Bundle.load(quantized_bundles["int8"])
    floats, kept = load_adapfu(bundle), load_adapfu(bundle, quantized=True)
    assert is_quantized(kept.model) and not is_quantized(floats.model)
    assert torch.equal(_logits(floats), _logits(kept))


def _saved_shapes(edge) -> set[tuple[int, ...]]:
    """Shapes of the float tensors autograd keeps for backward through the messenger's loss."""
    batch = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS), "labels": IDS}
    edge.model.requires_grad_(False)
    for name, p in edge.model.named_parameters():
        p.requires_grad_("lora_" in name and ".messenger." in name)
    start = edge.split.n_kept
    with torch.no_grad():
        bb = run_backbone(edge.model, batch, start)
    shapes = set()

    def pack(t):
        if t.is_floating_point():
            shapes.add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        messenger_loss(edge.model, bb, start).backward()
    return shapes


def test_no_dequantized_weight_is_kept_for_backward(quantized_bundles):
    bundle = Bundle.load(quantized_bundles["int8"])
    kept = load_edge_model(bundle, quantized=True)
    weights = {(m.out_features, m.in_features) for m in kept.model.modules() if isinstance(m, QuantizedLinear)}
    weights |= {(i, o) for o, i in weights}
    assert not weights & _saved_shapes(kept)
    assert weights & _saved_shapes(load_edge_model(bundle))  # float layers do keep their weight: the check can fail


def test_training_on_quantized_weights_agrees_with_dequantizing_at_load(distilled, demo_dir, tmp_path):
    losses, states = {}, {}
    for mode in ("dequantized", "quantized"):
        options = RoundOptions(client_id="a", overrides={"local_steps": 5}, frozen_weights=mode)
        out = train(
            distilled.path, demo_dir / "dates" / "train.jsonl", tmp_path / mode, tmp_path / f"{mode}.pkt", options
        )
        losses[mode] = [s["loss"] for s in out.result.steps]
        states[mode] = out.state.personalized
    assert losses["quantized"] == pytest.approx(losses["dequantized"], rel=1e-5)
    x, y = (torch.cat([t.flatten() for _, t in sorted(states[m].items())]) for m in ("dequantized", "quantized"))
    assert (x - y).norm() <= 1e-3 * x.norm()  # AdamW's per-element steps amplify 1e-7 gradient noise a little


def test_gradient_checkpointing_trains_the_same_messenger(quantized_bundles, demo_dir, tmp_path):
    out = {}
    for flag in (False, True):
        options = RoundOptions(client_id="a", overrides={"local_steps": 3}, gradient_checkpointing=flag)
        data = demo_dir / "dates" / "train.jsonl"
        out[flag] = train(quantized_bundles["int8"], data, tmp_path / str(flag), tmp_path / f"{flag}.pkt", options)
    assert [s["loss"] for s in out[True].result.steps] == pytest.approx([s["loss"] for s in out[False].result.steps])
    for k, x in out[False].state.personalized.items():
        assert torch.allclose(out[True].state.personalized[k], x, rtol=1e-5, atol=1e-7), k


def test_quantized_weights_refuse_a_merge_and_survive_a_cast(quantized_bundles):
    edge = load_edge_model(Bundle.load(quantized_bundles["int4"]), quantized=True)
    layer = next(m for m in edge.model.modules() if isinstance(m, QuantizedLinear))
    scales = layer.scales.clone()
    edge.model.to(torch.bfloat16)
    assert torch.equal(layer.scales, scales)  # fp16 scales kept as their bits: a cast cannot round them
    with pytest.raises(ModelError, match="cannot be merged into weights held in 8 or 4 bits"):
        edge.model.merge_and_unload()


def test_cli_takes_the_choice_and_refuses_a_bad_one_before_touching_the_state(quantized_bundles, demo_dir, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(quantized_bundles["int8"], bundle)
    args = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "dates" / "train.jsonl"), "--client-id", "a"]
    r = CliRunner().invoke(edge_app, [*args, "--state", str(tmp_path / "s"), "--out", str(tmp_path / "p.pkt"),
                                      "--frozen-weights", "int8"])  # fmt: skip
    assert r.exit_code == 1 and "--frozen-weights must be one of quantized, dequantized, got 'int8'" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "s").exists()
    ok = [*args, "--state", str(tmp_path / "t"), "--out", str(tmp_path / "t.pkt"), "--steps", "1"]
    r = CliRunner().invoke(edge_app, [*ok, "--frozen-weights", "dequantized", "--gradient-checkpointing", "--json"])
    assert r.exit_code == 0 and (tmp_path / "t.pkt").is_file(), r.output
