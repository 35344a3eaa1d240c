import json
import re

import pytest

from ciders_edge.data.demo import TASK_FAMILIES, generate, write_demo_data
from ciders_edge.data.records import IGNORE, collate, encode, load_examples, read_jsonl, to_chat
from ciders_edge.errors import DataError


@pytest.mark.parametrize(
    ("record", "prompt", "response"),
    [
        ({"instruction": "Add", "input": "2 and 3", "output": "5"}, "Add\n\n2 and 3", "5"),
        ({"instruction": "Name one", "context": "", "response": "Oak", "category": "open_qa"}, "Name one", "Oak"),
        ({"question": "2+2?", "answer": "4\n#### 4"}, "2+2?", "4\n#### 4"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "hi", "hello"),
    ],
)
def test_schemas(record, prompt, response):
    msgs, resp = to_chat(record)
    assert msgs[-1]["content"] == prompt and resp == response


def test_unknown_schema_names_the_keys():
    with pytest.raises(DataError, match="unknown record schema.*keys: text"):
        to_chat({"text": "x", "_where": "f.jsonl:3"})


def test_labels_keep_only_the_response(tokenizer):
    ids, labels = encode(tokenizer, [{"role": "user", "content": "What is 2+3?"}], "5", 256)
    kept = [t for t in labels if t != IGNORE]
    assert tokenizer.decode(kept).startswith("5<|im_end|>")
    n_prompt = labels.index(kept[0])
    assert ids[n_prompt : n_prompt + len(kept)] == kept
    assert "What is 2+3?" in tokenizer.decode(ids[:n_prompt])


def test_bad_json_line_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "a", "answer": "b"}\n\n{oops\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: bad JSON"):
        read_jsonl(f)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        read_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        read_jsonl(tmp_path / "e.jsonl")


def test_collate_pads_right(tokenizer, demo_dir):
    ex = load_examples(demo_dir / "dates" / "train.jsonl", tokenizer, 128, limit=3)
    batch = collate(ex, tokenizer.pad_token_id)
    width = max(len(e.input_ids) for e in ex)
    assert batch["input_ids"].shape == (3, width)
    for i, e in enumerate(ex):
        assert batch["attention_mask"][i].sum() == len(e.input_ids)
        assert batch["labels"][i, len(e.input_ids) :].eq(IGNORE).all()
    assert ex[0].meta["domain"] == "dates"


def test_demo_data_is_deterministic_and_checkable(tmp_path):
    assert generate("arithmetic", 5, seed=1) == generate("arithmetic", 5, seed=1)
    assert generate("arithmetic", 5, seed=1) != generate("arithmetic", 5, seed=2)
    for family in TASK_FAMILIES:
        for rec in generate(family, 20):
            assert rec["domain"] == family
            assert rec["response"].split("#### ")[-1] == rec["answer"]
    rec = generate("arithmetic", 1)[0]
    nums = [int(w) for w in re.findall(r"\d+", rec["instruction"])]
    assert int(rec["answer"]) == nums[0] + nums[1] - nums[2]
    paths = write_demo_data(tmp_path, n_train=3, n_public=2, n_eval=1)
    assert len(paths) == 16 and len(paths["public"].read_text().splitlines()) == 10
    rows = [json.loads(line) for line in paths["units/train"].read_text().splitlines()]
    assert len(rows) == 3 and all(r["domain"] == "units" for r in rows)


def _record(i: int) -> str:
    return json.dumps({"instruction": f"Say {i}", "output": str(i)})


def test_a_huge_record_is_skipped_before_tokenizing(tokenizer, tmp_path, monkeypatch, capsys):
    """Item 7 of issue 16: a record is bounded before it is tokenized (a 50 MB line once cost 7.6 GB)."""
    huge = json.dumps({"instruction": "Summarize", "output": "word " * 400_000})  # 2 MB
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([_record(1), huge, _record(2), _record(3)]) + "\n")
    longest = []
    real = tokenizer.apply_chat_template

    def spy(conversation, *args, **kwargs):
        longest.append(max(len(m["content"]) for m in conversation))
        return real(conversation, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    examples = load_examples(f, tokenizer, 128)
    assert len(examples) == 3 and max(longest) < 128 * 256 < len(huge)  # LINE_BYTES_PER_TOKEN bytes a token
    assert "skipped 1 of 4 records (1 longer than 32768 bytes)" in capsys.readouterr().err


def test_a_huge_line_is_never_held_whole(tokenizer, tmp_path):
    import tracemalloc

    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([_record(1), "x" * 40_000, _record(2)]) + "\n")
    load_examples(f, tokenizer, 128)  # warm-up: the chat template compiles, the notice's console starts
    line = json.dumps({"instruction": "Summarize", "output": "x" * (8 << 20)})
    f.write_text("\n".join([_record(1), line, _record(2)]) + "\n")
    tracemalloc.start()
    try:
        examples = load_examples(f, tokenizer, 128)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(examples) == 2 and peak < (1 << 20), peak


def test_only_oversized_records_left_is_a_data_error_with_the_count(tokenizer, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q" * 40_000, "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: no record .* skipped 1 of 1 records \(1 longer than"):
        load_examples(f, tokenizer, 128)


def test_non_utf8_data_is_a_one_line_error_naming_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "caf\xe9", "answer": "b"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        read_jsonl(f)


def test_a_byte_order_mark_and_deep_nesting(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + _record(1).encode() + b"\n")
    assert read_jsonl(f)[0]["output"] == "1"
    f.write_text(_record(1) + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: bad JSON"):
        read_jsonl(f)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        [["user", "hi"], ["assistant", "yo"]],
        [{"role": "user"}, {"role": "assistant", "content": "yo"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": {"text": "yo"}}],
        [{"content": "hi"}, {"role": "assistant", "content": "yo"}],
    ],
)
def test_messages_of_the_wrong_shape_name_the_file_and_line(tmp_path, messages):
    from ciders_edge.data.records import to_prompt

    f = tmp_path / "d.jsonl"
    f.write_text(_record(1) + "\n" + json.dumps({"messages": messages}) + "\n")
    rec = read_jsonl(f)[1]
    with pytest.raises(DataError, match=r"d\.jsonl:2: `messages"):
        to_chat(rec)
    with pytest.raises(DataError, match=r"d\.jsonl:2: `messages"):
        to_prompt(rec)
