"""TAKD (eq. 2), prepare's bootstrap and the emulator's fidelity, against hand computations on `tiny`."""

import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from ciders_cloud.models.bootstrap import LayerAligner, gap_layers, gap_parameters
from ciders_cloud.models.fidelity import measure_fidelity
from ciders_cloud.models.takd import Distiller, adamw, hidden_term, public_split, takd_loss, task_term
from ciders_cloud.models.teacher import build_cloud_models, load_cloud_models
from ciders_cloud.run.config import RunConfig, TakdConfig, load_run
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.data.records import IGNORE, collate, load_examples
from ciders_edge.errors import ConfigError
from ciders_edge.model.sources import load_tokenizer
from ciders_edge.model.split import SplitSpec


def test_takd_loss_matches_eq2_by_hand():
    torch.manual_seed(0)
    hs, ht = torch.randn(3, 4), torch.randn(3, 4)
    ls, lt = torch.randn(3, 5), torch.randn(3, 5)
    targets = torch.tensor([IGNORE, 2, 4])
    weights = {"lambda_out": 0.5, "lambda_task": 2.0, "lambda_hidden": 3.0}
    terms = takd_loss(hs, ht, ls, lt, targets, **weights, task_loss="ce")
    relative = sum(((hs[t] - ht[t]) ** 2).sum() / (ht[t] ** 2).sum() for t in range(3)) / 3
    pt, ps = lt.softmax(-1), ls.softmax(-1)
    kl = (pt * (pt.log() - ps.log())).sum() / 3
    ce = -(ls.log_softmax(-1)[1, 2] + ls.log_softmax(-1)[2, 4]) / 2
    assert math.isclose(terms["hidden"].item(), relative.item(), rel_tol=1e-5)
    assert math.isclose(terms["kl"].item(), kl.item(), rel_tol=1e-5)
    assert math.isclose(terms["ce"].item(), ce.item(), rel_tol=1e-5)
    assert math.isclose(terms["loss"].item(), (3 * relative + 0.5 * kl + 2.0 * ce).item(), rel_tol=1e-5)
    paper = takd_loss(hs, ht, ls, lt, targets, lambda_out=0.5, lambda_task=2.0, hidden_loss="mse")
    assert math.isclose(paper["hidden"].item(), (((hs - ht) ** 2).sum() / 12).item(), rel_tol=1e-5)


def test_excess_task_term_counts_only_the_ce_beyond_the_teachers():
    """max(0, CE_student - CE_teacher) over the batch's response tokens: the difference while the emulator
    is worse than the full model, zero once it matches or beats it."""
    teacher = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    worse = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [5.0, 5.0, 5.0]])
    better = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [5.0, 5.0, 5.0]])
    targets = torch.tensor([0, 1, IGNORE])

    def ce(logits: torch.Tensor) -> torch.Tensor:
        return -logits.log_softmax(-1)[[0, 1], [0, 1]].mean()

    assert ce(worse) > ce(teacher) > ce(better)
    assert math.isclose(task_term(worse, teacher, targets).item(), (ce(worse) - ce(teacher)).item(), rel_tol=1e-6)
    assert task_term(better, teacher, targets).item() == 0.0
    assert task_term(teacher, teacher, targets).item() == 0.0
    assert math.isclose(task_term(better, teacher, targets, "ce").item(), ce(better).item(), rel_tol=1e-6)
    assert task_term(worse, teacher, torch.full((3,), IGNORE)).item() == 0.0  # no response token, no task term


def test_relative_hidden_term_has_its_documented_scale():
    """0 when exact, 1 for a zero student, the same for any scale of the stream, and every token counts
    alike: a massive first token (SmolLM2's attention sink) does not drown the others."""
    torch.manual_seed(1)
    h = torch.randn(6, 16)
    assert hidden_term(h, h).item() == 0.0
    assert math.isclose(hidden_term(torch.zeros_like(h), h).item(), 1.0, rel_tol=1e-6)
    noisy = h + 0.1 * torch.randn_like(h)
    assert math.isclose(hidden_term(1e3 * noisy, 1e3 * h).item(), hidden_term(noisy, h).item(), rel_tol=1e-4)
    sink = h.clone()
    sink[0] *= 1e4  # one token 10^4 times larger
    student = sink.clone()
    student[1:] = 0  # every other token wrong
    assert math.isclose(hidden_term(student, sink).item(), 5 / 6, rel_tol=1e-6)
    assert F.mse_loss(student, sink).item() < 1e-3 * sink[0].pow(2).mean().item()  # the raw form barely sees it


def test_takd_loss_is_zero_for_a_perfect_student():
    h, logits = torch.randn(4, 8), torch.randn(4, 11)
    terms = takd_loss(h, h, logits, logits, torch.full((4,), IGNORE), lambda_out=0.5, lambda_task=1.0)
    assert terms["loss"].item() == 0.0


def test_bad_takd_settings_are_refused():
    with pytest.raises(ConfigError, match="hidden_loss"):
        TakdConfig(hidden_loss="cosine")
    with pytest.raises(ConfigError, match="task_loss"):
        TakdConfig(task_loss="hinge")
    with pytest.raises(ConfigError, match="align_params"):
        TakdConfig(align_params="all")
    with pytest.raises(ConfigError, match="must not be negative"):
        TakdConfig(lambda_hidden=-1)


def test_public_split_holds_out_a_seeded_fifth(tiny_run):
    """Every command of a run holds out the same records, and never distils on them."""
    run = load_run(tiny_run[0])
    tok = load_tokenizer(run.model_path)
    train, held = public_split(run, tok)
    again_train, again_held = public_split(run, tok)
    ids = lambda xs: [tuple(e.input_ids) for e in xs]  # noqa: E731
    assert ids(held) == ids(again_held) and ids(train) == ids(again_train)
    everything = load_examples(run.public_data, tok, run.takd_config.seq_len)
    assert Counter(ids(train) + ids(held)) == Counter(ids(everything))  # a partition of the public records
    assert 0 < len(held) <= len(everything) // 5


def test_gap_layers_follow_the_dropped_ones():
    assert gap_layers(SplitSpec.from_drop_ratio(8, 2, 0.5)) == [1, 2]  # kept [0, 2, 5]
    assert gap_layers(SplitSpec.from_drop_ratio(30, 6, 0.2)) == [4, 8, 11, 15, 18]  # SmolLM2: 19 of 24 kept
    assert gap_layers(SplitSpec(n=8, a=2, beta=1.0)) == []


def test_layer_fits_train_only_the_gap_layers_and_lower_their_loss(tiny_path, demo_dir):
    run = RunConfig(model="tiny", model_path=str(tiny_path), messenger_depth=2, drop_ratio=0.5,
                    public_data=str(demo_dir / "public.jsonl"), takd={"seq_len": 64, "batch_size": 4})  # fmt: skip
    models = build_cloud_models(run)
    public, _ = public_split(run, models.tokenizer)
    assert not models.changed_layers()
    aligner = LayerAligner(models, public, run.takd_config, steps=30, seed=0)
    records = aligner.run()
    assert records[-1]["hidden"] < 0.5 * records[0]["hidden"]
    changed = {int(k.split(".")[2]) for k in models.changed_layers()}
    assert changed == {1, 2} and set(models.changed_layers()) == set(gap_parameters(models))
    # the full backbone ships the dropped source layers (1, 3, 4) and the sources of the trained ones (2, 5)
    assert {int(k.split(".")[2]) for k in models.full_backbone()} == {1, 2, 3, 4, 5}


def test_cloud_adamw_is_the_fused_kernel_and_steps_as_the_reference_one():
    """The bootstrap and TAKD step with torch's fused AdamW (no temporaries the size of every weight);
    it must move the weights as the default AdamW does."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 48)), torch.nn.Parameter(torch.randn(48))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    ours, reference = adamw(weights, 1e-2, 0.1), torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, foreach=False)
    assert ours.defaults["fused"] and not reference.defaults["fused"]
    for _ in range(5):
        grads = [torch.randn_like(w) for w in weights]
        for w, c, g in zip(weights, copies, grads, strict=True):
            w.grad, c.grad = g.clone(), g.clone()
        ours.step(), reference.step()
    for w, c in zip(weights, copies, strict=True):
        assert torch.allclose(w, c, rtol=0, atol=1e-6)


def test_fidelity_equals_a_direct_computation(tiny_run):
    run_dir = tiny_run[0]
    run = load_run(run_dir)
    [models] = load_cloud_models(run_dir, run, ServerState.load(RunFolder(run_dir).server_state)).values()
    _, held = public_split(run, models.tokenizer)
    held = held[:3]
    f = measure_fidelity(models, held, batch_size=2)
    b = collate(held, models.tokenizer.pad_token_id)
    with torch.no_grad():
        full = models.teacher(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        emu = models.emu(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    targets = b["labels"][:, 1:]
    mask = targets != IGNORE
    full, emu, targets = full[mask].log_softmax(-1), emu[mask].log_softmax(-1), targets[mask]
    nll_full, nll_emu = F.nll_loss(full, targets).item(), F.nll_loss(emu, targets).item()
    assert f.tokens == int(mask.sum()) and f.records == 3
    assert math.isclose(f.nll_full, nll_full, rel_tol=1e-4) and math.isclose(f.nll_emu, nll_emu, rel_tol=1e-4)
    assert math.isclose(f.nll_ratio, nll_emu / nll_full, rel_tol=1e-4)
    assert f.top1_agreement == pytest.approx((full.argmax(-1) == emu.argmax(-1)).float().mean().item())
    kl = (full.exp() * (full - emu)).sum(-1).mean().item()
    assert math.isclose(f.kl, kl, rel_tol=1e-3, abs_tol=1e-6)


def test_distill_trains_only_the_backbone_lora(tiny_run):
    run_dir = tiny_run[0]
    run = load_run(run_dir)
    state = ServerState.load(RunFolder(run_dir).server_state)
    [models] = load_cloud_models(run_dir, run, state).values()
    examples, _ = public_split(run, models.tokenizer)
    before_v, before_b = models.messenger_state(), models.backbone_state()
    before_w = {k: v.clone() for k, v in models.base_weights.items()}
    d = Distiller(
        models, examples, run.takd_config.replace(lambda_task=1.0), state.optimizer, state.takd_step, run.seed
    )
    records = d.run(8)
    after_v, after_b = models.messenger_state(), models.backbone_state()
    assert all(torch.equal(before_v[k], after_v[k]) for k in before_v)  # messenger held fixed
    assert all(torch.equal(before_w[k], models.base_weights[k]) for k in before_w)  # so are the base weights
    assert any(not torch.equal(before_b[k], after_b[k]) for k in before_b)
    assert d.step_count == state.takd_step + 8
    # the task term on a fixed family of prompts falls as the backbone adapts
    assert sum(r["ce"] for r in records[-3:]) < sum(r["ce"] for r in records[:3])


def test_bootstrap_is_cached_by_everything_it_depends_on(tiny_path, demo_dir, tmp_path, monkeypatch):
    """A second prepare of the same model, split, data, recipe and seed reuses the trained layers (same
    bundle bytes, log marked cached); another seed trains again."""
    import ciders_cloud.models.bootstrap as bootstrap_module
    from ciders_cloud import prepare
    from ciders_edge.formats.bundle import Bundle

    monkeypatch.setattr(bootstrap_module, "ciders_home", lambda: tmp_path / "home")
    run = RunConfig(model="tiny", messenger_depth=2, drop_ratio=0.5, public_data=str(demo_dir / "public.jsonl"),
                    layer_steps=4, align_steps=2, takd={"seq_len": 64})  # fmt: skip
    digests, logs = [], []
    for name, r in (("a", run), ("b", run), ("c", run.replace(seed=1))):
        prepare(r, tmp_path / name)
        m = Bundle.load(tmp_path / name / "bundles" / "cpu-laptop" / "round-0000").manifest
        digests.append(m["files"]["backbone.safetensors"])
        logs.append([json.loads(x) for x in (tmp_path / name / "distill.jsonl").read_text().splitlines()])
    steps = lambda log: [(r["type"], r["step"]) for r in log if r["type"] != "fidelity"]  # noqa: E731
    assert digests[0] == digests[1] != digests[2]
    assert steps(logs[0]) == steps(logs[1]) and len(steps(logs[0])) == 6
    assert not any(r.get("cached") for r in logs[0]) and all(r.get("cached") for r in logs[1][:-1])
    assert len(list((tmp_path / "home" / "bootstrap").iterdir())) == 2
