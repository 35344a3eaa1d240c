"""``ciders-edge evaluate`` on `tiny`: exact match and NLL on a hand-made file, skipped records, bad input."""

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_runs import train_once
from typer.testing import CliRunner

from ciders_edge.cli import app as edge_app
from ciders_edge.data.records import encode
from ciders_edge.formats.bundle import Bundle
from ciders_edge.inference.evaluate import exact_match_answer, read_eval_records, rouge_l, score
from ciders_edge.inference.generation import GenerationSettings, generate_batch
from ciders_edge.inference.personalize import load_personalized

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tiny_run, demo_dir, tmp_path_factory):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    root = tmp_path_factory.mktemp("evaluate")
    return bundle, train_once(bundle, demo_dir / "dates" / "train.jsonl", root, "d", local_steps=2, eta=1e-4)


def _file(tmp_path, records) -> str:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_exact_match_and_nll_on_a_hand_made_file(trained, tmp_path):
    """Two records: the model's own greedy answer (a match) and a wrong one; the NLL is the mean
    cross-entropy of both responses' tokens, computed here with a plain forward pass."""
    bundle, state = trained
    edge, _ = load_personalized(Bundle.load(bundle), state, backbone="emu")
    questions = ["Rewrite 2020-01-02.", "What is 2 + 3?", "Say a word.", "Hello", "Name a colour."]
    answers = generate_batch(
        edge.model,
        edge.tokenizer,
        [[{"role": "user", "content": q}] for q in questions],
        GenerationSettings(max_new_tokens=6),
    )
    q1, own = next((q, a) for q, a in zip(questions, answers, strict=True) if a.strip())
    q2, other = questions[-1], answers[-1]
    assert other.strip() != "a colour nobody says"  # an own answer that is not blank: a match that means something
    records = [
        {"instruction": q1, "response": own, "answer": own},
        {"instruction": q2, "response": "blue", "answer": "a colour nobody says"},
    ]
    scores = score(edge, read_eval_records(_file(tmp_path, records), edge.tokenizer), max_new_tokens=6)
    assert scores.exact_match == 0.5 and scores.counts == {"records": 2, "nll": 2, "exact_match": 2, "rouge_l": 2}
    total = count = 0
    for q, r in ((q1, own), (q2, "blue")):
        ids, labels = encode(edge.tokenizer, [{"role": "user", "content": q}], r, 1024)
        with torch.no_grad():
            logits = edge.model(input_ids=torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        keep = targets != -100
        total += F.cross_entropy(logits[keep], targets[keep], reduction="sum").item()
        count += int(keep.sum())
    assert scores.nll == pytest.approx(total / count, rel=1e-4)
    assert scores.rouge_l == pytest.approx((1.0 + rouge_l(other, "blue")) / 2)
    assert exact_match_answer("5 + 3 = 8\n#### 8") == "8" and exact_match_answer(" 2020-01-02 ") == "2020-01-02"


def test_cli_compare_table_and_json(trained, demo_dir):
    bundle, state = trained
    data = str(demo_dir / "dates" / "eval.jsonl")
    args = ["evaluate", "--bundle", str(bundle), "--state", str(state), "--data", data, "--compare", "--limit", "2",
            "--max-new-tokens", "4"]  # fmt: skip
    r = runner.invoke(edge_app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    models = [(x["backbone"], x["messenger"]) for x in s["results"]]
    assert models == [("full", "base"), ("emu", "global"), ("emu", "personalized"), ("full", "global"),
                      ("full", "personalized"), ("full", "best")]  # fmt: skip
    assert s["results"][-1]["deployed"] == "latest"  # this state held out no validation slice
    assert all(x["counts"]["exact_match"] == 2 and x["nll"] > 0 for x in s["results"])
    personal = {x["backbone"]: x["nll"] for x in s["results"] if x["messenger"] == "personalized"}
    assert personal["emu"] != personal["full"] and not s["skipped"]
    r = runner.invoke(edge_app, args)
    assert r.exit_code == 0 and "base model" in r.output
    assert "AdapFu, global messenger" in r.output and "AdapFu, personalized messenger" in r.output


def test_records_without_answer_or_response_are_noted(trained, tmp_path):
    bundle, state = trained
    data = _file(tmp_path, [{"prompt": "Say hi."}, {"question": "1+1?", "answer": "#### 2"},
                            {"instruction": "Say yes.", "response": "yes"}])  # fmt: skip
    r = runner.invoke(edge_app, ["evaluate", "--bundle", str(bundle), "--global", "--data", data,
                                 "--max-new-tokens", "3", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    (row,) = s["results"]
    assert row["counts"] == {"records": 3, "nll": 2, "exact_match": 1, "rouge_l": 1}
    (note,) = s["skipped"]
    assert "1 without a response (NLL over 2)" in note and "2 without an `answer` (exact match over 1)" in note


def test_bad_input_is_one_line(trained, tmp_path):
    bundle, state = trained
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for args, message in (
        (["--state", str(state), "--data", str(empty)], f"{empty}: no records (empty file)"),
        (["--data", str(empty)], "pass --state"),
        (["--state", str(state), "--state", str(state), "--data", str(empty)], "one --data per --state"),
        (["--global", "--compare", "--data", str(empty)], "at most one of"),
        (["--global", "--data", str(tmp_path / "nope.jsonl")], "no such data file"),
    ):
        r = runner.invoke(edge_app, ["evaluate", "--bundle", str(bundle), *args])
        assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output


def _with_a_huge_line(tmp_path, size: int):
    """Two small records around one valid record of ``size`` bytes (a 1 GB one reached 2.5 GB RSS)."""
    path = tmp_path / "huge.jsonl"
    small = [json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) for i in range(2)]
    huge = json.dumps({"question": "x" * size, "answer": "y"})
    path.write_text("\n".join([small[0], huge, small[1]]) + "\n")
    return path


def test_evaluate_skips_a_huge_line_unread_as_train_does(trained, tmp_path, tokenizer):
    import tracemalloc

    from ciders_edge.data.records import max_line_bytes

    path = _with_a_huge_line(tmp_path, 8 << 20)
    read_eval_records(_file(tmp_path, [{"question": "q", "answer": "a"}]), tokenizer, max_len=64)  # warm-up
    tracemalloc.start()
    try:
        records = read_eval_records(path, tokenizer, max_len=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.answer for r in records] == ["1", "2"] and peak < (1 << 20), peak  # never held whole
    bundle, state = trained
    path = _with_a_huge_line(tmp_path, max_line_bytes(1024))  # just over the limit (the line has its JSON too)
    r = runner.invoke(edge_app, ["evaluate", "--bundle", str(bundle), "--state", str(state), "--data", str(path)])
    assert r.exit_code == 0, r.output
    assert f"{path}: skipped 1 of 3 records (1 longer than {max_line_bytes(1024)} bytes)" in r.stderr


def test_infer_input_refuses_a_huge_line_before_the_model_loads(tmp_path, monkeypatch):
    """infer --input reads prompts with the same reader, bounded by MAX_LINE_BYTES (patched small here)."""
    monkeypatch.setattr("ciders_edge.data.records.MAX_LINE_BYTES", 4096)
    path = _with_a_huge_line(tmp_path, 4096)
    args = ["infer", "--input", str(path), "--output", str(tmp_path / "out.jsonl"), "--bundle", str(tmp_path / "none")]
    r = runner.invoke(edge_app, args)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.stderr.strip() == f"error: {path}:2: a line longer than 4,096 bytes; no record that long is read"
    assert not (tmp_path / "out.jsonl").exists()
