"""The cloud holds the source model once, in the run's teacher dtype (``ciders_cloud.models.source``)."""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import ciders_cloud.models.bootstrap as bootstrap_module
import ciders_cloud.models.source as source
from ciders_cloud import prepare
from ciders_cloud.cli.config_file import load_config
from ciders_cloud.models.bootstrap import gap_parameters
from ciders_cloud.models.device import WidenBf16
from ciders_cloud.models.layers import gap_layers
from ciders_cloud.models.source import load_teacher, parameter_count, teacher_dtype
from ciders_cloud.models.takd import public_split, takd_terms
from ciders_cloud.models.teacher import build_cloud_models, load_cloud_models
from ciders_cloud.preparation import distill
from ciders_cloud.round.bundles import frozen_weights
from ciders_cloud.run.config import RunConfig, load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies.fednest.bilevel import TakdInner
from ciders_edge.data.records import collate
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.model.forward import decoder_of
from ciders_edge.model.lora import set_trainable
from ciders_edge.model.sources import load_model
from ciders_edge.model.split import layer_of

CPU = torch.device("cpu")


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A bootstrap cache of the test's own: each prepare here trains its layers."""
    monkeypatch.setattr(bootstrap_module, "ciders_home", lambda: tmp_path / "home")


def _run(demo_dir, **kw) -> RunConfig:
    return RunConfig(model="tiny", messenger_depth=2, drop_ratio=0.5, public_data=str(demo_dir / "public.jsonl"),
                     layer_steps=2, align_steps=1, takd={"seq_len": 64, "batch_size": 2}, **kw)  # fmt: skip


def test_auto_keeps_small_models_in_fp32_and_picks_bf16_from_a_billion_parameters(tiny_path, monkeypatch):
    run = RunConfig(model="tiny", model_path=str(tiny_path))
    count = parameter_count(str(tiny_path))
    assert count == sum(p.numel() for p in load_model(tiny_path).parameters())  # tied weights once
    assert source.BF16_FROM == 10**9 and teacher_dtype(run) == "fp32"
    monkeypatch.setattr(source, "BF16_FROM", count)  # `tiny` as large as the threshold
    assert teacher_dtype(run) == "bf16"
    assert teacher_dtype(run.replace(teacher_dtype="fp32")) == "fp32"  # a choice is kept as made
    with pytest.raises(ConfigError, match="`teacher_dtype` must be one of auto, fp32, bf16, got 'fp16'"):
        RunConfig(teacher_dtype="fp16")


def test_a_bf16_teacher_streams_in_as_transformers_loads_it(tiny_path):
    got, want = load_teacher(tiny_path, torch.bfloat16, CPU), load_model(tiny_path, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and not any(p.requires_grad for p in got.parameters())
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in got.state_dict().items())
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert got.generation_config.to_dict() == want.generation_config.to_dict()
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_emulator_shares_the_teachers_frozen_weights_and_trains_its_own_in_fp32(tiny_path, demo_dir, dtype):
    models = build_cloud_models(_run(demo_dir, model_path=str(tiny_path), teacher_dtype=dtype))
    teacher = {v.data_ptr() for v in models.teacher.state_dict().values()}
    gaps = set(gap_layers(models.split))
    own = {k for k, v in models.base_weights.items() if v.data_ptr() not in teacher}
    assert {layer_of(k) for k in own} == gaps  # everything else is the teacher's tensor itself
    assert all(models.base_weights[k].dtype == torch.float32 for k in own)
    assert models.teacher.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    lora = [p for n, p in models.emu.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)  # both LoRAs train in fp32
    before = {k: v.clone() for k, v in models.teacher.state_dict().items()}
    with torch.no_grad():
        for j in gaps:
            for p in decoder_of(models.emu).layers[j].parameters():
                p.add_(1.0)  # what the bootstrap trains
    assert all(torch.equal(v, before[k]) for k, v in models.teacher.state_dict().items())  # M* untouched
    assert {layer_of(k) for k in models.changed_layers()} == gaps


def test_a_bf16_run_records_its_dtype_distills_and_ships_bundles(demo_dir, tmp_path, own_cache):
    run = _run(demo_dir, teacher_dtype="bf16", storage="fp32")
    summary = prepare(run, tmp_path / "bf16")
    fp32 = prepare(_run(demo_dir, storage="fp32"), tmp_path / "fp32")
    assert json.loads((tmp_path / "bf16" / "run.json").read_text())["teacher_dtype"] == "bf16"
    assert json.loads((tmp_path / "fp32" / "run.json").read_text())["teacher_dtype"] == "fp32"  # auto's pick
    run_ids = [Bundle.load(s["bundles"]["cpu-laptop"]).manifest["run_id"] for s in (summary, fp32)]
    assert run_ids[0] != run_ids[1]  # another recipe, another run
    assert summary["fidelity"]["nll_ratio"] > 0 and summary["takd_steps"] == 1
    aligned = load_file(RunFolder(tmp_path / "bf16").aligned)
    assert aligned and all(t.dtype == torch.float32 for t in aligned.values())
    state = ServerState.load(RunFolder(tmp_path / "bf16").server_state)
    [models] = load_cloud_models(tmp_path / "bf16", load_run(tmp_path / "bf16"), state).values()
    assert models.teacher.dtype == torch.bfloat16
    assert all(torch.equal(models.base_weights[k], t) for k, t in aligned.items())  # resumed as prepare left it
    out = distill(tmp_path / "bf16", steps=2)
    assert out["takd_steps"] == 2 and ServerState.load(RunFolder(tmp_path / "bf16").server_state).takd_step == 2
    bundle = Bundle.load(out["bundles"]["cpu-laptop"])
    weights = bundle.base_weights()
    assert all(t.dtype == torch.float32 for t in weights.values())  # the profile's dtype, bf16 values widened
    shared = next(k for k in weights if layer_of(k) == 0)
    assert torch.equal(weights[shared], models.base_weights[shared].float())


def test_a_run_from_before_the_choice_keeps_an_fp32_teacher(tiny_run, tmp_path):
    d = json.loads((tiny_run[0] / "run.json").read_text())
    assert d["teacher_dtype"] == "fp32"
    del d["teacher_dtype"]
    (tmp_path / "run.json").write_text(json.dumps(d))
    assert load_run(tmp_path).teacher_dtype == "fp32"


def test_bundles_never_widen_the_frozen_weights_whole():
    bf16, fp32 = torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4)
    out = frozen_weights({"a": bf16, "b": fp32}, torch.float32)
    assert out["a"].data_ptr() == bf16.data_ptr() and out["b"].data_ptr() == fp32.data_ptr()  # no copy
    rounded = frozen_weights({"b": fp32}, torch.bfloat16)["b"]
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, fp32.to(torch.bfloat16))
    assert frozen_weights({"a": bf16}, torch.float16)["a"].dtype == torch.float16  # not exact: rounded


def test_a_bf16_teacher_computes_in_fp32_on_the_cpu(tiny_path):
    """Each bf16 weight is widened where it is used: the same numbers as the model widened up front, the
    same input gradients, and a frozen weight's backward keeps it in bf16."""
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    wide = load_model(tiny_path, torch.bfloat16).float()
    model = load_teacher(tiny_path, torch.bfloat16, CPU)
    with WidenBf16():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, wide(input_ids=ids).logits)
    x, weight = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 8).bfloat16()
    with WidenBf16():
        y = F.linear(x, weight)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    x2 = x.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(F.linear(x2, weight.float()).square().sum(), x2, create_graph=True)
    assert torch.equal(gx, want)
    assert torch.equal(torch.autograd.grad(gx.sum(), x)[0], torch.autograd.grad(want.sum(), x2)[0])  # FedNest's


def test_fednests_inner_problem_runs_over_a_bf16_teacher(tiny_path, demo_dir):
    run = _run(demo_dir, model_path=str(tiny_path), teacher_dtype="bf16")
    models = build_cloud_models(run)
    examples, _ = public_split(run, models.tokenizer)
    batch = models.on_device(collate(examples[:2], models.tokenizer.pad_token_id))
    inner = TakdInner(models, batch, run.takd_config)
    loss, _, y = inner.loss_at(models.messenger_state(), models.backbone_state())
    grads = torch.autograd.grad(loss, list(y.values()), create_graph=True)
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), list(y.values()))
    assert all(torch.isfinite(g).all() for g in second)


def test_aligned_tensors_outside_a_layer_are_refused(tiny_path, demo_dir):
    """Only a layer's weights may be restored: anything else is the teacher's own tensor, shared."""
    run = _run(demo_dir, model_path=str(tiny_path))
    embed = load_model(tiny_path).model.embed_tokens.weight.detach() + 1
    with pytest.raises(StateError, match="do not belong to this run's AdapEmu"):
        build_cloud_models(run, aligned={"model.embed_tokens.weight": embed})


def test_a_config_file_sets_the_teacher_dtype_for_prepare_only(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('teacher_dtype = "bf16"\n')
    assert load_config(str(path), "prepare")["teacher_dtype"] == "bf16"
    with pytest.raises(ConfigError, match="`teacher_dtype` is a key of `prepare`"):
        load_config(str(path), "simulate")
    path.write_text('teacher_dtype = "fp16"\n')
    with pytest.raises(ConfigError, match="`teacher_dtype` must be a string, one of 'auto', 'fp32', 'bf16'"):
        load_config(str(path), "prepare")


def test_a_bf16_teachers_takd_recomputes_the_emulators_activations_to_the_same_gradients(tiny_path, demo_dir):
    """Over a bf16 teacher (a model of 1B parameters and more) TAKD checkpoints the AdapEmu: the same loss
    and gradients, with the activations of its layers not kept for backward."""
    run = _run(demo_dir, model_path=str(tiny_path), teacher_dtype="bf16")
    models = build_cloud_models(run)
    assert models.checkpoint and not build_cloud_models(run.replace(teacher_dtype="fp32")).checkpoint
    examples, _ = public_split(run, models.tokenizer)
    batch = collate(examples[:2], models.tokenizer.pad_token_id)
    params = list(gap_parameters(models).values())
    out, recompute, vocab = {}, models.checkpoint, models.teacher.config.vocab_size
    for checkpoint in (False, recompute):
        set_trainable(models.emu, None)
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        saved = []
        torch.manual_seed(0)  # LoRA dropout draws the same masks in both
        with torch.autograd.graph.saved_tensors_hooks(partial(_count, saved, vocab), lambda t: t):
            with models.autocast():
                terms = takd_terms(models, batch, run.takd_config, checkpoint)
        terms["loss"].backward()  # recomputes in fp32 over the bf16 weights, as the forward did
        out[bool(checkpoint)] = terms["loss"].detach(), [p.grad.clone() for p in params], sum(saved)
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1], strict=True))
    assert out[True][2] < out[False][2] / 5  # what backward keeps: the layers' inputs, not their activations


def _count(saved: list[int], vocab: int, t: torch.Tensor) -> torch.Tensor:
    """A saved-tensor hook: the bytes of what backward keeps, less the logits' and the LM head's (kept
    either way)."""
    saved.append(0 if vocab in t.shape else t.nbytes)
    return t
