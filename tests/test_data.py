import json
import re

import pytest

from ciders_edge.data import IGNORE, collate, encode, load_examples, read_jsonl, to_chat
from ciders_edge.demo_data import FAMILIES, generate, write_demo_data
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
    for family in FAMILIES:
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
