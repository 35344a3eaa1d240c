"""The validation slice and the deployed messenger (issue 58): the slice by record hash, greedy exact match in
one teacher-forced pass, the state's best, and `--messenger best|latest|global` in infer and export."""

import json

import pytest
import torch
from typer.testing import CliRunner

from ciders_cloud.fleet.coordinator import validation_line
from ciders_cloud.round.reports import edge_report
from ciders_edge.cli import app as edge_app
from ciders_edge.data.holdout import hold_out, validation_size
from ciders_edge.data.records import Example, collate, encode, load_examples, read_examples, record_key
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import BEST_FILE, ClientState
from ciders_edge.inference.evaluate import backbone_batches
from ciders_edge.inference.generation import GenerationSettings, generate_batch
from ciders_edge.inference.personalize import _why, load_personalized, personal_messenger
from ciders_edge.model import forward
from ciders_edge.model.forward import messenger_loss, run_backbone
from ciders_edge.training.validation import Choice, Scores, deployable, messenger_scores, mix, paired_se

runner = CliRunner()


def _examples(n: int) -> list[Example]:
    return [Example([i], [i], key=record_key({"instruction": f"q{i % 97}", "output": str(i)})) for i in range(n)]


@pytest.mark.parametrize(("records", "size"), [(15, 0), (16, 8), (100, 10), (400, 40), (5000, 128)])
def test_the_slice_is_a_tenth_at_least_8_at_most_128_and_none_below_16(records, size):
    assert validation_size(records, 0.1) == size
    train, val = hold_out(_examples(records), 0.1)
    assert len(val) == size and len(train) + len(val) == records


def test_the_slice_is_the_same_whatever_the_order_and_never_trained_on():
    examples = _examples(200)
    train, val = hold_out(examples, 0.1)
    _, again = hold_out(list(reversed(examples)), 0.1)
    assert {e.key for e in val} == {e.key for e in again}
    assert not {e.key for e in val} & {e.key for e in train}


def test_copies_of_a_record_land_on_the_same_side_and_count_once():
    examples = _examples(40)
    _, val = hold_out(examples, 0.1)
    copies = examples + [Example([0], [0], key=e.key) for e in val for _ in range(11)]  # each held-out one 12 times
    train, val2 = hold_out(copies, 0.1)
    assert not {e.key for e in train} & {e.key for e in val2}
    assert [e.key for e in val2] == [e.key for e in val] and len(train) == 40 - len(val)  # 8 records, not 8 copies


def test_the_record_key_is_its_content_not_its_place(demo_dir, tokenizer, tmp_path):
    lines = (demo_dir / "units" / "train.jsonl").read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(["", *reversed(lines)]) + "\n")
    a, _ = read_examples(tmp_path / "a.jsonl", tokenizer, 128)
    b, _ = read_examples(tmp_path / "b.jsonl", tokenizer, 128)
    assert sorted(e.key for e in a) == sorted(e.key for e in b) and len({e.key for e in a}) == len(a)


@pytest.mark.parametrize("fraction", [-0.1, 0.6, float("nan")])
def test_a_fraction_out_of_range_is_refused(fraction):
    with pytest.raises(ConfigError, match="--val-fraction must be between 0 and 0.5"):
        hold_out(_examples(40), fraction)


def test_the_mixture_interpolates_factor_by_factor():
    x, v = {"a": torch.tensor([1.0, 3.0])}, {"a": torch.tensor([-1.0, 1.0])}
    assert torch.equal(mix(x, v, 0.25)["a"], torch.tensor([-0.5, 1.5]))


def test_teacher_forced_exact_match_is_greedy_decodings(tiny_run):
    """Fit the (untied) LM head to two of three short answers: exact match from one teacher-forced pass
    equals greedy generation's, record by record (2 of 3), and the NLL is the mean token cross-entropy."""
    edge, _ = load_personalized(Bundle.load(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"), None, "global")
    tok, head = edge.tokenizer, edge.model.get_base_model().lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied from the embeddings
    qa = [("Is the sky blue?", "yes"), ("Is fire cold?", "no"), ("Name a colour.", "blue")]
    examples = [Example(*encode(tok, [{"role": "user", "content": q}], a, 128)) for q, a in qa]
    with torch.no_grad():
        fit = run_backbone(edge.model, collate(examples[:2], tok.pad_token_id), edge.split.n_kept)
    opt = torch.optim.AdamW([head.weight], lr=3e-2)
    for _ in range(60):
        opt.zero_grad()
        messenger_loss(edge.model, fit, edge.split.n_kept).backward()
        opt.step()
    batches = backbone_batches(edge, examples)
    nll, em, short, record_nll, record_tokens = messenger_scores(edge, batches)
    answers = generate_batch(edge.model, tok, [[{"role": "user", "content": q}] for q, _ in qa], GenerationSettings())
    greedy = [a == ref for a, (_, ref) in zip(answers, qa, strict=True)]
    assert greedy == [True, True, False] and (em, short) == (2 / 3, 3)
    with torch.no_grad():
        want = torch.cat([messenger_loss(edge.model, b, edge.split.n_kept, reduction="none") for b in batches])
    assert nll == pytest.approx(float(want.mean()), rel=1e-6)
    assert len(record_nll) == 3 and float(record_nll.sum() / record_tokens.sum()) == pytest.approx(nll, rel=1e-12)


def test_scoring_runs_the_lm_head_a_chunk_of_positions_at_a_time(tiny_run, demo_dir, monkeypatch):
    """A slice's logits are never held all at once (at Qwen's vocabulary, 8 records' would be 1.2 GB): with
    chunks of 5 positions the LM head sees 5 rows at most and every position once, and the scores are those
    of one pass over them all."""
    edge, _ = load_personalized(Bundle.load(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"), None, "global")
    batches = backbone_batches(edge, load_examples(demo_dir / "dates" / "eval.jsonl", edge.tokenizer, 128)[:4])
    positions = sum(b.targets.numel() for b in batches)
    assert 5 < positions <= forward.HEAD_ROWS  # one chunk by default
    whole = messenger_scores(edge, batches)
    rows = []
    hook = edge.model.get_base_model().lm_head.register_forward_hook(lambda m, i, o: rows.append(len(i[0])))
    monkeypatch.setattr(forward, "HEAD_ROWS", 5)
    chunked = messenger_scores(edge, batches)
    hook.remove()
    assert max(rows) == 5 and sum(rows) == positions
    assert torch.allclose(chunked.record_nll, whole.record_nll, rtol=1e-6, atol=0)
    assert (chunked.exact_match, chunked.short) == (whole.exact_match, whole.short)


def _scores(record_nll: list[float], tokens: list[int]) -> Scores:
    nll, n = torch.tensor(record_nll, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    return Scores(float(nll.sum() / n.sum()), None, 0, nll, n)


def test_the_paired_standard_error_is_the_ratio_estimators():
    """Three records of 2, 4 and 2 tokens. Gaps (summed NLL) 1.0, 0.8, -0.2: mean gap 1.6 / 8 = 0.2 per token;
    residuals 1.0 - 0.4, 0.8 - 0.8, -0.2 - 0.4 = 0.6, 0, -0.6; SE = sqrt(3/2 * 0.72) / 8 = sqrt(1.08) / 8."""
    a, b = _scores([3.0, 4.0, 1.0], [2, 4, 2]), _scores([2.0, 3.2, 1.2], [2, 4, 2])
    assert a.nll - b.nll == pytest.approx(0.2)
    assert paired_se(a, b) == pytest.approx(1.08**0.5 / 8, rel=1e-12)
    assert paired_se(a, a) == 0.0 and paired_se(_scores([1.0], [3]), _scores([0.5], [3])) == float("inf")


@pytest.mark.parametrize(("rival_nll", "deployed"), [(1.0, "personalized"), (0.985, "personalized"), (0.97, "global")])
def test_a_rival_must_win_by_more_than_its_standard_error(rival_nll, deployed):
    """A slice of 8 records cannot tell 0.01 nats apart when the gap's standard error is 0.02: the device keeps
    this round's personalized messenger (on a tie too) and deploys the rival only beyond the noise."""
    choices = [Choice("personalized", 3, nll=1.0), Choice("global", 3, nll=rival_nll, se=0.02)]
    assert choices[deployable(choices)].messenger == deployed


def test_the_margin_counts_standard_errors():
    """A rival 0.03 ahead with a standard error of 0.02: beyond one (the default), within two, and any lead
    wins at margin 0 (the lowest NLL)."""
    choices = [Choice("personalized", 3, nll=1.0), Choice("global", 3, nll=0.97, se=0.02)]
    assert [choices[deployable(choices, m)].messenger for m in (0.0, 1.0, 2.0)] == ["global", "global", "personalized"]


@pytest.mark.parametrize(("base_nll", "deployed"), [(1.015, "base"), (1.03, "personalized"), (0.99, "base")])
def test_a_messenger_must_beat_the_base_model_by_its_standard_error_too(base_nll, deployed):
    """Where training barely helps, a slice's noise can favour a messenger that held-out records score worse
    than the model the device started from: it deploys only when it beats the base model by more than the
    standard error of that gap (0.02 here), else the base model does."""
    choices = [Choice("personalized", 3, nll=1.0, base_se=0.02), Choice("base", -1, nll=base_nll, se=0.02)]
    assert choices[deployable(choices)].messenger == deployed
    without_the_test = "base" if base_nll < 1.0 - 0.02 else "personalized"  # the base model as one more rival
    assert choices[deployable(choices, base_margin=None)].messenger == without_the_test


def test_infer_says_when_the_base_model_won_by_the_noise():
    best = {"messenger": "base", "round": -1, "nll": 1.015, "se": 0.02, "records": 8, "scored_round": 3}
    scores = {"personalized": {"nll": 1.0}, "global": {"nll": 1.1}, "base": {"nll": 1.015}}
    why = _why(best, scores)
    assert why.startswith("the base model's messenger layers, chosen on 8 held-out records in round 3: NLL 1.0150")
    assert why.endswith("as no messenger beat it beyond the standard error of the gap")
    ahead = "ahead of the personalized one by more than its standard error 0.0200"
    assert _why({**best, "nll": 0.9}, scores).endswith(ahead)  # ahead of every messenger: the old reason


@pytest.fixture(scope="module")
def mixed(tiny_run, demo_dir, tmp_path_factory):
    """A state whose round (a step far too large) made the personalized messenger worse than the global one:
    the device's best is not its latest."""
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    root = tmp_path_factory.mktemp("val")
    args = ["train", "--bundle", bundle, "--data", demo_dir / "units" / "train.jsonl", "--state", root / "s"]
    res = runner.invoke(
        edge_app, [*map(str, args), "--out", str(root / "p.pkt"), "--steps", "3", "--lr", "30", "--json"]
    )
    assert res.exit_code == 0, res.output
    return bundle, root / "s", json.loads(res.output.strip().splitlines()[-1])


def test_train_scores_every_candidate_and_the_state_keeps_the_best(mixed):
    bundle, state_dir, summary = mixed
    nll = {k[8:]: v for k, v in summary.items() if k.startswith("val_nll_")}
    assert set(nll) == {"base", "global", "personalized", "mix_0.25", "mix_0.5", "mix_0.75"}
    se = {k: summary.get(f"val_se_{k}", 0.0) for k in nll}
    assert 0 < se["global"] < nll["personalized"] - nll["global"]  # a step of 30 is far beyond the slice's noise
    state = ClientState.load(state_dir)
    assert {k: s["nll"] for k, s in state.validation.items()} == nll
    best = min(nll, key=lambda k: nll[k] + se[k])
    if nll[best] + state.validation[best]["base_se"] > nll["base"]:  # not beyond the noise of the base model's
        best = "base"
    assert summary["val_records"] == 8 and summary["deployed_nll"] == nll[best] < nll["personalized"]
    assert summary["val_seconds"] > 0 and summary["train_seconds"] > 0  # the slice's cost, beside training's
    assert state.best_info["nll"] == nll[best] and state.best_info["round"] == (-1 if best == "base" else 0)
    v = {k: t.float() for k, t in Bundle.load(bundle).messenger_lora().items()}
    zero = {k: torch.zeros_like(t) for k, t in v.items()}
    want = {"global": v, "personalized": state.personalized, "base": zero}.get(best)
    want = want or mix(state.personalized, v, float(best[4:]))
    assert all(torch.allclose(state.best[k], want[k]) for k in v)


def test_infer_and_export_use_the_best_unless_told_and_say_which(mixed, tmp_path):
    bundle, state_dir, _ = mixed
    b = Bundle.load(bundle)
    best, source = personal_messenger(b, state_dir, "best")
    latest, latest_source = personal_messenger(b, state_dir, "latest")
    assert source.messenger == "best" and "held-out records" in source.choice
    assert latest_source.messenger == "personalized"
    assert any(not torch.equal(best[k], latest[k]) for k in best)
    assert not source.same_model(latest_source.to_dict())
    args = ["infer", "--bundle", str(bundle), "--state", str(state_dir), "--runtime", "torch", "--prompt", "hi"]
    out = runner.invoke(edge_app, [*args, "--max-new-tokens", "2", "--json"])
    assert out.exit_code == 0, out.output
    said = json.loads(out.output.strip().splitlines()[-1])["source"]
    assert said["messenger"] == "best" and said["choice"] == source.choice
    out = runner.invoke(edge_app, [*args, "--max-new-tokens", "2"])
    assert f"messenger: {source.choice}" in " ".join(out.output.split())
    out = runner.invoke(edge_app, [*args, "--max-new-tokens", "2", "--messenger", "latest", "--json"])
    assert json.loads(out.output.strip().splitlines()[-1])["source"]["messenger"] == "personalized"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--messenger", "newest"], "--messenger must be one of best, latest, global"),
        (["--messenger", "latest", "--global"], "--global and --messenger latest disagree"),
    ],
)
def test_a_bad_messenger_choice_is_one_line(mixed, extra, message):
    bundle, state_dir, _ = mixed
    args = ["infer", "--bundle", str(bundle), "--state", str(state_dir), "--runtime", "torch", "--prompt", "hi"]
    out = runner.invoke(edge_app, [*args, *extra])
    assert out.exit_code != 0 and message in out.output and "Traceback" not in out.output


def test_train_refuses_a_bad_val_fraction_before_training(tiny_run, demo_dir, tmp_path):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    args = ["train", "--bundle", bundle, "--data", demo_dir / "units" / "train.jsonl", "--state", tmp_path / "s"]
    out = runner.invoke(edge_app, [*map(str, args), "--out", str(tmp_path / "p.pkt"), "--val-fraction", "0.9"])
    assert out.exit_code != 0 and "--val-fraction must be between 0 and 0.5, got 0.9" in out.output
    assert not (tmp_path / "s" / "current").exists() and not (tmp_path / "p.pkt").exists()


def test_without_a_slice_the_state_has_no_best_and_best_means_latest(tiny_run, demo_dir, tmp_path):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    args = ["train", "--bundle", bundle, "--data", demo_dir / "units" / "train.jsonl", "--state", tmp_path / "s"]
    out = runner.invoke(edge_app, [*map(str, args), "--out", str(tmp_path / "p.pkt"), "--steps", "1"])
    assert out.exit_code == 0
    (tmp_path / "few.jsonl").write_text("".join((demo_dir / "units" / "train.jsonl").read_text().splitlines(True)[:12]))
    args[4], args[6] = tmp_path / "few.jsonl", tmp_path / "s2"
    out = runner.invoke(edge_app, [*map(str, args), "--out", str(tmp_path / "p2.pkt"), "--steps", "1"])
    assert out.exit_code == 0 and "12 distinct records, fewer than 16: no validation slice" in out.output
    state = ClientState.load(tmp_path / "s2")
    assert not state.best and not (tmp_path / "s2" / "current" / BEST_FILE).exists()
    x, source = personal_messenger(Bundle.load(bundle), tmp_path / "s2", "best")
    assert source.messenger == "personalized" and "no validation slice" in source.choice


def test_a_state_whose_best_file_is_gone_is_refused(mixed, tmp_path):
    import shutil

    shutil.copytree(mixed[1], tmp_path / "s")
    (tmp_path / "s" / "current" / BEST_FILE).unlink()
    with pytest.raises(StateError, match="best.safetensors and state.json's `best` go together"):
        ClientState.load(tmp_path / "s")


def test_the_fleet_report_carries_the_scores_and_the_cloud_logs_them(mixed):
    summary = mixed[2]
    report = edge_report(json.dumps(summary))
    assert {k: v for k, v in summary.items() if k.startswith(("val_", "deployed"))}.items() <= report.items()
    line = validation_line(report)
    assert line.startswith(f"deploys {summary['deployed']}: NLL {summary['deployed_nll']:.4f} on 8 held-out records")
    assert f"personalized {summary['val_nll_personalized']:.4f}" in line and validation_line({"loss_last": 1.0}) is None


def test_evaluate_compare_scores_the_deployed_messenger_and_names_it(mixed, demo_dir):
    bundle, state_dir, _ = mixed
    args = ["evaluate", "--bundle", bundle, "--state", state_dir, "--data", demo_dir / "units" / "eval.jsonl"]
    out = runner.invoke(edge_app, [*map(str, args), "--compare", "--limit", "4", "--max-new-tokens", "4", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output.strip().splitlines()[-1])["results"]
    best = next(r for r in rows if r["messenger"] == "best")
    info = ClientState.load(state_dir).best_info
    assert best["deployed"] == f"{info['messenger']} r0" and best["backbone"] == Bundle.load(bundle).manifest.get(
        "deploy_backbone", "emu"
    )
    same = next(r for r in rows if (r["backbone"], r["messenger"]) == (best["backbone"], info["messenger"]))
    assert best["nll"] == pytest.approx(same["nll"], rel=1e-6)  # the deployed row is that messenger's


def test_the_choice_names_the_rivals_it_beat_not_itself():
    from ciders_edge.inference.personalize import _why

    scores = {"personalized": {"nll": 0.0552}, "global": {"nll": 0.4429}, "mix_0.5": {"nll": 0.121}}
    best = {"messenger": "personalized", "round": 0, "nll": 0.0552, "records": 20, "scored_round": 0}
    assert _why(best, scores) == (
        "the personalized messenger of round 0, chosen on 20 held-out records in round 0: NLL 0.0552, "
        "against global 0.4429"
    )
    mixed = {**best, "messenger": "mix", "alpha": 0.75, "nll": 0.04, "se": 0.0061}
    assert _why(mixed, scores).endswith(
        "in round 0: NLL 0.0400, against personalized 0.0552, global 0.4429, "
        "ahead of the personalized one by more than its standard error 0.0061"
    )


@pytest.fixture(scope="module")
def newer(mixed, tmp_path_factory):
    """The ``mixed`` state (trained in round 0) beside round 1's bundle of a copy of its run, which the
    state's own packet made: the device was not sampled for round 1 and re-chooses on its bundle."""
    import shutil

    from ciders_cloud.round.aggregate import aggregate_files

    bundle, state_dir, _ = mixed
    root = tmp_path_factory.mktemp("rechoice")
    run = root / "run"
    shutil.copytree(bundle.parents[2], run)
    shutil.copytree(state_dir, root / "s")
    aggregate_files(run, [state_dir.parent / "p.pkt"])
    return run / "bundles" / "cpu-laptop" / "round-0001", root / "s"


def _validate_cmd(bundle, state_dir, data, *extra):
    args = ["validate", "--bundle", bundle, "--data", data, "--state", state_dir, *extra]
    return runner.invoke(edge_app, [*map(str, args), "--json"])


def test_validate_chooses_again_on_a_newer_bundle_and_keeps_the_training(newer, demo_dir):
    bundle, state_dir = newer
    before = ClientState.load(state_dir)
    out = _validate_cmd(bundle, state_dir, demo_dir / "units" / "train.jsonl")
    assert out.exit_code == 0, out.output
    s = json.loads(out.output.strip().splitlines()[-1])
    assert (s["round"], s["trained_round"], s["val_records"]) == (1, 0, 8)
    nll = {k[8:]: v for k, v in s.items() if k.startswith("val_nll_")}
    assert set(nll) == {"kept", "base", "global", "personalized", "mix_0.25", "mix_0.5", "mix_0.75"}
    assert nll["kept"] == pytest.approx(before.best_info["nll"], abs=1e-9)  # the same messenger on the same slice
    se = {k: s.get(f"val_se_{k}", 0.0) for k in nll}  # against the kept best, the reference (its own: 0)
    best = min(nll, key=lambda k: nll[k] + se[k])
    after = ClientState.load(state_dir)
    assert s["deployed_nll"] == nll[best] == after.best_info["nll"] and after.best_info["scored_round"] == 1
    if best == "global":
        assert after.best_info["round"] == 1
    assert (after.round, after.counters) == (before.round, before.counters)  # no round trained
    assert all(torch.equal(after.c_i[k], before.c_i[k]) for k in before.c_i)
    assert all(torch.equal(after.personalized[k], before.personalized[k]) for k in before.personalized)


def test_the_kept_best_is_the_reference_a_rival_must_beat(newer, demo_dir):
    from ciders_edge.data.records import load_examples
    from ciders_edge.training.round import deployed_backbone
    from ciders_edge.training.validation import rechoose

    bundle, state_dir = newer
    b, state = Bundle.load(bundle), ClientState.load(state_dir)
    edge = deployed_backbone(b, None, False)
    val = hold_out(load_examples(demo_dir / "units" / "train.jsonl", edge.tokenizer, 128), 0.1)[1]
    v = {k: t.float() for k, t in b.messenger_lora().items()}
    kept = (v, {"messenger": "global", "round": 1, "alpha": None})  # the device kept the newest global
    result = rechoose(edge, val, v, state.personalized, kept, (1, 0))
    se = {c.name: c.se for c in result.scores}
    assert result.kept.se == 0 and se["global"] == 0  # the kept best is the reference: itself, no noise
    assert se["personalized"] > 0  # the personalized messenger's gap has a standard error against it
    choices = [result.kept, *result.scores]
    assert result.best.nll == choices[deployable(choices)].nll


def test_where_the_fleet_found_personalization_lost_the_global_messenger_is_the_reference(newer, demo_dir):
    """The bundle's evidence says personalized − global was 0.02 ± 0.01 across the fleet: the newest global
    comes first (its own se 0) and every rival's error is against it, the kept best's too."""
    from ciders_edge.data.records import load_examples
    from ciders_edge.training.fleet_evidence import FleetEvidence
    from ciders_edge.training.round import deployed_backbone
    from ciders_edge.training.validation import rechoose, validate

    bundle, state_dir = newer
    b, state = Bundle.load(bundle), ClientState.load(state_dir)
    edge = deployed_backbone(b, None, False)
    val = hold_out(load_examples(demo_dir / "units" / "train.jsonl", edge.tokenizer, 128), 0.1)[1]
    v = {k: t.float() for k, t in b.messenger_lora().items()}
    fleet = FleetEvidence(0, 3, 0.02, 0.01, -0.05, 0.0)
    kept = (state.personalized, {"messenger": "personalized", "round": 0, "alpha": None})  # earlier tests moved best
    for result in (
        rechoose(edge, val, v, state.personalized, kept, (1, 0), fleet),
        validate(edge, val, v, state.personalized, kept, (1, 0), fleet),
    ):
        se = {c.name: c.se for c in result.scores}
        assert se["global"] == 0 and se["personalized"] > 0 and result.kept.se > 0
        assert result.summary()["val_fleet_round"] == 0
    own = rechoose(edge, val, v, state.personalized, kept, (1, 0))  # no evidence: the kept best leads
    assert own.kept.se == 0 and {c.name: c.se for c in own.scores}["global"] > 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no state", "no client state; a device that never trained deploys the bundle's global"),
        ("same round", "bundle round 0 is not newer than the round this state trained (0)"),
        ("few records", "no validation slice to choose on"),
    ],
)
def test_validate_refuses_in_one_line_and_leaves_the_state(newer, mixed, demo_dir, tmp_path, case, message):
    bundle, state_dir = newer
    data = demo_dir / "units" / "train.jsonl"
    if case == "no state":
        state_dir = tmp_path / "none"
    elif case == "same round":
        bundle = mixed[0]
    else:
        data = tmp_path / "few.jsonl"
        data.write_text("".join((demo_dir / "units" / "train.jsonl").read_text().splitlines(True)[:12]))
    before = (state_dir / "current" / "state.json").read_bytes() if state_dir.exists() else None
    out = _validate_cmd(bundle, state_dir, data)
    assert out.exit_code == 1 and message in out.output and "Traceback" not in out.output
    after = (state_dir / "current" / "state.json").read_bytes() if (state_dir / "current").exists() else None
    assert after == before
