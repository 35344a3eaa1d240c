"""Instruction data: JSONL in the common schemas, chat template applied, loss on response tokens.

Schemas (detected per record): Alpaca (``instruction``/``input``/``output``), Dolly
(``instruction``/``context``/``response``), GSM8K (``question``/``answer``) and chat
(``messages``: the last assistant turn is the response).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .errors import DataError

__all__ = ["Example", "read_jsonl", "to_chat", "to_prompt", "encode", "load_examples", "collate", "batch_stream"]

IGNORE = -100


@dataclass
class Example:
    """One tokenized record; ``labels`` is ``IGNORE`` outside the response."""

    input_ids: list[int]
    labels: list[int]
    meta: dict = field(default_factory=dict)  # domain, category, reference answer, ...


def read_jsonl(path: str | Path) -> list[dict]:
    """Read JSON objects, one a line, with the file and line number in every error."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: bad JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            obj["_where"] = f"{path}:{lineno}"
            records.append(obj)
    if not records:
        raise DataError(f"{path}: no records (empty file)")
    return records


def to_chat(record: dict) -> tuple[list[dict], str]:
    """Split a record into prompt messages and the response text."""
    where = record.get("_where", "record")
    if "messages" in record:
        msgs = record["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise DataError(f"{where}: `messages` must end with an assistant turn")
        return [dict(m) for m in msgs[:-1]], str(msgs[-1]["content"])
    if "question" in record and "answer" in record:
        return [{"role": "user", "content": str(record["question"])}], str(record["answer"])
    if "instruction" in record:
        extra = record.get("input") or record.get("context") or ""
        prompt = str(record["instruction"]) + (f"\n\n{extra}" if extra else "")
        response = record.get("output", record.get("response"))
        if response is not None:
            return [{"role": "user", "content": prompt}], str(response)
    keys = ", ".join(k for k in record if k != "_where")
    raise DataError(
        f"{where}: unknown record schema (keys: {keys}); expected Alpaca, Dolly, GSM8K question/answer or chat messages"
    )


def to_prompt(record: dict) -> list[dict]:
    """The prompt messages of a record for inference: its response, if any, is not needed.

    Besides the training schemas, a bare ``{"prompt": "..."}`` works.
    """
    if "prompt" in record and isinstance(record["prompt"], str):
        return [{"role": "user", "content": record["prompt"]}]
    if "messages" in record and record["messages"] and record["messages"][-1].get("role") != "assistant":
        return [dict(m) for m in record["messages"]]
    if "instruction" in record and "output" not in record and "response" not in record:
        record = {**record, "output": ""}
    if "question" in record and "answer" not in record:
        record = {**record, "answer": ""}
    return to_chat(record)[0]


def encode(
    tok: PreTrainedTokenizerBase, prompt: list[dict], response: str, max_len: int
) -> tuple[list[int], list[int]]:
    """Token ids of the chat, and labels that keep only the response (and its end-of-turn)."""
    prompt_ids = _ids(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    full_ids = _ids(tok.apply_chat_template(prompt + [{"role": "assistant", "content": response}], tokenize=True))
    if full_ids[: len(prompt_ids)] != prompt_ids:  # a template that rewrites the prompt turn
        full_ids = prompt_ids + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    full_ids = full_ids[:max_len]
    labels = [IGNORE] * min(len(prompt_ids), len(full_ids)) + full_ids[len(prompt_ids) :]
    return full_ids, labels


def _ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def load_examples(
    path: str | Path, tok: PreTrainedTokenizerBase, max_len: int, limit: int | None = None
) -> list[Example]:
    """Read and tokenize a JSONL file; records whose response does not fit ``max_len`` are skipped."""
    records = read_jsonl(path)[:limit]
    examples = []
    for rec in records:
        ids, labels = encode(tok, *to_chat(rec), max_len)
        if any(x != IGNORE for x in labels[1:]):
            meta = {k: rec[k] for k in ("domain", "category", "answer") if k in rec}
            examples.append(Example(ids, labels, meta))
    if not examples:
        raise DataError(f"{path}: no record has a response within {max_len} tokens")
    return examples


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into ``input_ids``, ``attention_mask``, ``labels`` (B, T)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batch_stream(
    examples: list[Example], batch_size: int, rng: random.Random, pad_id: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled mini-batches (reshuffled every epoch by ``rng``)."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            yield collate([examples[j] for j in order[i : i + batch_size]], pad_id)
