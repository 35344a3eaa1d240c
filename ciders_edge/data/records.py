"""Instruction data: JSONL in the common schemas, chat template applied, loss on response tokens.

Schemas (detected per record): Alpaca (``instruction``/``input``/``output``), Dolly
(``instruction``/``context``/``response``), GSM8K (``question``/``answer``) and chat
(``messages``: the last assistant turn is the response).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
from rich.markup import escape

from ciders_edge.errors import DataError
from ciders_edge.progress import console

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Example",
    "Skipped",
    "LongLine",
    "MAX_LINE_BYTES",
    "read_jsonl",
    "iter_jsonl",
    "to_chat",
    "to_prompt",
    "encode",
    "load_examples",
    "read_examples",
    "max_line_bytes",
    "collate",
    "batch_stream",
    "record_key",
]

IGNORE = -100
# A record whose JSON line is longer than this many bytes per token of ``max_len`` is skipped unread:
# it could hardly fit (a token is a few characters), and tokenizing it whole costs about 150 bytes of
# memory per character (a 50 MB line took 7.6 GB), more than an edge device has.
LINE_BYTES_PER_TOKEN = 256
# The longest line a whole-file reader (:func:`read_jsonl`: infer's prompts, simulate's data) takes:
# room for a 32k-token prompt; a longer line is refused, naming it, without being read whole.
MAX_LINE_BYTES = 32_768 * LINE_BYTES_PER_TOKEN
_SKIP_CHUNK = 1 << 16


@dataclass(frozen=True)
class LongLine:
    """What :func:`iter_jsonl` yields for a line over its byte limit: where it is, and the limit."""

    where: str
    limit: int


@dataclass
class Example:
    """One tokenized record; ``labels`` is ``IGNORE`` outside the response."""

    input_ids: list[int]
    labels: list[int]
    meta: dict = field(default_factory=dict)  # domain, category, reference answer, ...
    key: str = ""  # the record's content hash (:func:`record_key`): the same record, the same key, every round


def read_jsonl(path: str | Path, max_line_bytes: int | None = None) -> list[dict]:
    """Read JSON objects, one a line, with the file and line number in every error; a line over
    ``max_line_bytes`` (default :data:`MAX_LINE_BYTES`) is refused, never read whole."""
    records = []
    for rec in iter_jsonl(path, max_line_bytes or MAX_LINE_BYTES):
        if isinstance(rec, LongLine):
            raise DataError(f"{rec.where}: a line longer than {rec.limit:,} bytes; no record that long is read")
        records.append(rec)
    if not records:
        raise DataError(f"{path}: no records (empty file)")
    return records


def iter_jsonl(path: str | Path, max_line_bytes: int) -> Iterator[dict | LongLine]:
    """Yield the JSON object of each non-blank line, tagged with ``_where`` (file:line): the one
    reader of every JSONL file (train's, evaluate's and infer's data).

    A line longer than ``max_line_bytes`` yields a :class:`LongLine` and is read past in chunks,
    never held whole: one huge record must not cost more memory than the device has.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    with path.open("rb") as f:
        for lineno, raw in enumerate(_lines(f, max_line_bytes), 1):
            if raw is None:
                yield LongLine(f"{path}:{lineno}", max_line_bytes)
            elif raw.strip():
                yield _parse_line(raw, f"{path}:{lineno}", first=lineno == 1)


def _lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes | None]:
    """Lines of a binary file; ``None`` for one over ``max_bytes`` (its rest is skipped in chunks)."""
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        if len(raw) <= max_bytes or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(_SKIP_CHUNK)
        yield None


def _parse_line(raw: bytes, where: str, first: bool) -> dict:
    """One JSONL line to a dict; undecodable bytes, bad JSON and non-objects are one-line DataErrors."""
    if first and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: bad JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # an integer of too many digits; nesting too deep
        raise DataError(f"{where}: bad JSON ({err})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    obj["_where"] = where
    return obj


def to_chat(record: dict) -> tuple[list[dict], str]:
    """Split a record into prompt messages and the response text."""
    where = record.get("_where", "record")
    if "messages" in record:
        msgs = _messages(record)
        if msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: `messages` must end with an assistant turn")
        return msgs[:-1], msgs[-1]["content"]
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


def _messages(record: dict) -> list[dict]:
    """A record's ``messages``, checked: a non-empty list of objects with string ``role`` and ``content``."""
    where, msgs = record.get("_where", "record"), record["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: `messages[{i}]` must be an object with string `role` and `content`")
    return [dict(m) for m in msgs]


def to_prompt(record: dict) -> list[dict]:
    """The prompt messages of a record for inference: its response, if any, is not needed.

    Besides the training schemas, a bare ``{"prompt": "..."}`` works.
    """
    if "prompt" in record and isinstance(record["prompt"], str):
        return [{"role": "user", "content": record["prompt"]}]
    if "messages" in record:
        msgs = _messages(record)
        if msgs[-1]["role"] != "assistant":
            return msgs
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
    """Read and tokenize a JSONL file; records too long to read or without a response token within
    ``max_len`` are skipped, and a notice on stderr counts them."""
    examples, skipped = read_examples(path, tok, max_len, limit)
    skipped.notice(path, max_len)
    return examples


@dataclass
class Skipped:
    """Records :func:`read_examples` left out, by reason."""

    too_long: int = 0  # JSON line over ``max_len * LINE_BYTES_PER_TOKEN`` bytes, never read whole
    no_response: int = 0  # no response token within ``max_len`` tokens
    read: int = 0  # every record seen, kept or not

    @property
    def total(self) -> int:
        return self.too_long + self.no_response

    def notice(self, path: str | Path, max_len: int) -> None:
        """One notice line on stderr counting what was skipped (nothing when nothing was)."""
        if self.total:
            text = escape(f"{path}: {self.describe(max_len)}")
            console.print(f"[yellow]notice:[/] {text}", highlight=False, soft_wrap=True)

    def describe(self, max_len: int) -> str:
        parts = []
        if self.too_long:
            parts.append(f"{self.too_long} longer than {max_line_bytes(max_len)} bytes")
        if self.no_response:
            parts.append(f"{self.no_response} with no response token within {max_len} tokens")
        return f"skipped {self.total} of {self.read} records ({'; '.join(parts)})"


def max_line_bytes(max_len: int) -> int:
    """The longest JSONL line read for a sequence length of ``max_len`` tokens."""
    return max_len * LINE_BYTES_PER_TOKEN


def read_examples(
    path: str | Path, tok: PreTrainedTokenizerBase, max_len: int, limit: int | None = None
) -> tuple[list[Example], Skipped]:
    """:func:`load_examples` without the notice: the examples and what was skipped.

    Raises:
        DataError: the file is missing, malformed, or no record fits.
    """
    examples, skipped = [], Skipped()
    for rec in islice(iter_jsonl(path, max_line_bytes(max_len)), limit):
        skipped.read += 1
        if isinstance(rec, LongLine):
            skipped.too_long += 1
            continue
        ids, labels = encode(tok, *to_chat(rec), max_len)
        if any(x != IGNORE for x in labels[1:]):
            meta = {k: rec[k] for k in ("domain", "category", "answer") if k in rec}
            examples.append(Example(ids, labels, meta, record_key(rec)))
        else:
            skipped.no_response += 1
    if not skipped.read:
        raise DataError(f"{path}: no records (empty file)")
    if not examples:
        raise DataError(f"{path}: no record has a response within {max_len} tokens: {skipped.describe(max_len)}")
    return examples, skipped


def record_key(record: dict) -> str:
    """SHA-256 of a record's content (not of where it sits in the file): a validation slice chosen by
    it stays the same slice however the file is reordered or appended to."""
    content = {k: v for k, v in record.items() if k != "_where"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


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
