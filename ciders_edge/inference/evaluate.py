"""On-device evaluation of a messenger on a backbone: response NLL, exact match, ROUGE-L.

``ciders-edge evaluate`` scores one or more models (a backbone, AdapEmu or AdapFu, with the base,
global or personalized messenger) on a user's JSONL files; ``simulate`` scores NLL matrices with the
same functions. Each backbone is loaded once and the messengers are swapped into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from statistics import mean

import torch
import torch.nn.functional as F

from ciders_edge.data.records import (
    Example,
    LongLine,
    Skipped,
    collate,
    encode,
    iter_jsonl,
    max_line_bytes,
    to_chat,
    to_prompt,
)
from ciders_edge.errors import DataError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.inference.generation import ANSWER_BATCH, GenerationSettings, generate_batch
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import BackboneBatch, response_logits, run_backbone

__all__ = [
    "backbone_batches",
    "messenger_nll",
    "response_nll",
    "perplexity",
    "rouge_l",
    "exact_match_answer",
    "EvalRecord",
    "Scores",
    "read_eval_records",
    "score",
    "evaluate_models",
    "evaluate_exports",
    "score_answers",
    "COMPARE",
]

# ``evaluate --compare``: where the user started, what the federation gives, what personalization gives; the
# global messenger on AdapFu too, as a device that trains a few rounds of many can find it better than its own
COMPARE = (
    ("full", "base"),
    ("emu", "global"),
    ("emu", "personalized"),
    ("full", "global"),
    ("full", "personalized"),
)


@torch.no_grad()
def backbone_batches(edge: EdgeModel, examples: list[Example], batch_size: int = 8) -> list[BackboneBatch]:
    """Run ``examples`` through the backbone once; scoring several messengers on them (a cross-domain
    NLL matrix) then costs only messenger passes."""
    edge.model.eval()
    pad = edge.tokenizer.pad_token_id
    return [
        run_backbone(edge.model, collate(examples[i : i + batch_size], pad), edge.split.n_kept)
        for i in range(0, len(examples), batch_size)
    ]


@torch.no_grad()
def messenger_nll(edge: EdgeModel, batches: list[BackboneBatch]) -> float:
    """Mean negative log-likelihood per response token of the messenger now loaded."""
    edge.model.eval()
    total, count = 0.0, 0
    for b in batches:
        for logits, targets in response_logits(edge.model, b, edge.split.n_kept):
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
        count += b.targets.numel()
    return total / max(count, 1)


def response_nll(edge: EdgeModel, examples: list[Example], batch_size: int = 8) -> float:
    """Mean negative log-likelihood per response token (perplexity = exp of it)."""
    return messenger_nll(edge, backbone_batches(edge, examples, batch_size))


def perplexity(nll: float) -> float:
    return math.exp(min(nll, 50.0))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    p, r = prediction.split(), reference.split()
    if not p or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for a in p:
        cur = [0]
        for j, b in enumerate(r):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def exact_match_answer(text: str) -> str:
    """The answer to score: what follows ``####`` (GSM8K style), else the whole stripped text."""
    if "####" in text:
        return text.split("####")[-1].strip().replace(",", "")
    return text.strip()


@dataclass
class EvalRecord:
    """One record to score: its prompt, and what it can be scored on."""

    prompt: list[dict]
    example: Example | None  # tokenized prompt + response, for NLL (None: no response)
    answer: str | None  # for exact match
    reference: str | None  # the response, for ROUGE-L


def read_eval_records(path: str | Path, tokenizer, max_len: int = 1024, limit: int | None = None) -> list[EvalRecord]:
    """Read a JSONL file of any training schema (or ``{"prompt": ...}``) into records to score.

    As ``train``'s reader does, a line too long for ``max_len`` tokens is skipped unread (a notice
    counts them): a 1 GB line used to be read, then parsed, whole."""
    out, skipped = [], Skipped()
    for rec in islice(iter_jsonl(path, max_line_bytes(max_len)), limit):
        skipped.read += 1
        if isinstance(rec, LongLine):
            skipped.too_long += 1
            continue
        prompt = to_prompt(rec)
        response = to_chat(rec)[1] if _has_response(rec) else None
        example = None
        if response is not None:
            ids, labels = encode(tokenizer, prompt, response, max_len)
            example = Example(ids, labels) if any(x != -100 for x in labels[1:]) else None
        answer = str(rec["answer"]) if "answer" in rec else None
        reference = response if any(k in rec for k in ("response", "output", "messages")) else None
        out.append(EvalRecord(prompt, example, answer, reference))
    if not skipped.read:
        raise DataError(f"{path}: no records (empty file)")
    if not out:
        raise DataError(f"{path}: no record to score: {skipped.describe(max_len)}")
    skipped.notice(path, max_len)
    return out


def _has_response(rec: dict) -> bool:
    try:
        return bool(to_chat(rec)[1])
    except DataError:
        return False


@dataclass
class Scores:
    """A model's scores on one file; ``None`` where no record can be scored that way."""

    nll: float | None
    exact_match: float | None
    rouge_l: float | None
    counts: dict = field(default_factory=dict)  # records scored by each measure

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def score(edge: EdgeModel, records: list[EvalRecord], max_new_tokens: int = 64, on_record=None) -> Scores:
    """NLL of the responses, then greedy answers for exact match and ROUGE-L, with the loaded messenger."""
    examples = [r.example for r in records if r.example is not None]
    nll = response_nll(edge, examples) if examples else None
    answers = score_answers(edge.model, edge.tokenizer, records, max_new_tokens, on_record)
    return Scores(nll, answers.exact_match, answers.rouge_l, {**answers.counts, "nll": len(examples)})


def score_answers(model, tokenizer, records: list[EvalRecord], max_new_tokens: int = 64, on_record=None) -> Scores:
    """Greedy answers for exact match and ROUGE-L from any runtime's model (torch, ONNX, a
    :class:`~ciders_edge.inference.generation.TokenDecoder`); no NLL, which needs the torch model."""
    em, rouge = [], []
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    to_answer = [r for r in records if r.answer is not None or r.reference is not None]
    for i in range(0, len(to_answer), ANSWER_BATCH):
        chunk = to_answer[i : i + ANSWER_BATCH]
        for r, text in zip(chunk, generate_batch(model, tokenizer, [r.prompt for r in chunk], settings), strict=True):
            if r.answer is not None:
                em.append(float(exact_match_answer(text) == exact_match_answer(r.answer)))
            if r.reference is not None:
                rouge.append(rouge_l(text, r.reference))
        if on_record is not None:
            on_record(i + len(chunk), len(to_answer))
    counts = {"records": len(records), "nll": 0, "exact_match": len(em), "rouge_l": len(rouge)}
    return Scores(None, mean(em) if em else None, mean(rouge) if rouge else None, counts)


def evaluate_exports(
    bundle: Bundle,
    edges: list[tuple[str | Path, str | Path, str | Path]],
    *,
    limit: int | None = None,
    max_new_tokens: int = 64,
    on_progress=None,
) -> list[dict]:
    """Score each ``(state, data, export)``: the state's personalized model as exported, in the runtime
    a device runs it in (llama.cpp, ONNX Runtime GenAI, ...). The export must be of that bundle and state."""
    from ciders_edge.inference.runtime import open_runtime

    rows = []
    for state, data, export in edges:
        rt = open_runtime(None, bundle=bundle.path, state=state, export=export)
        records = read_eval_records(data, rt.tokenizer, limit=limit)
        label = f"{rt.name} {data}"
        progress = (lambda i, n, label=label: on_progress(label, i, n)) if on_progress else None
        s = score_answers(rt.model, rt.tokenizer, records, max_new_tokens, progress)
        backbone = rt.source.get("backbone", "emu")
        row = {"backbone": backbone, "messenger": rt.source.get("messenger", "personalized"), "runtime": rt.name}
        row["state"] = str(state)
        rows.append({**row, "data": str(data), "client_id": rt.source.get("client_id"), **s.to_dict()})
        del rt
    return rows


def evaluate_models(
    bundle: Bundle,
    edges: list[tuple[str | None, str | Path]],
    models: list[tuple[str, str]],
    *,
    dtype: torch.dtype | None = None,
    base_model: str | Path | None = None,
    limit: int | None = None,
    max_new_tokens: int = 64,
    on_progress=None,
    quantized: bool = False,
) -> list[dict]:
    """Score every ``(backbone, messenger)`` model on every ``(state, data)`` edge.

    Each backbone is loaded once (``quantized``: int8/int4 frozen weights kept so); messengers (base,
    the bundle's global one, each state's x_K) are swapped into it. Returns one row per model and edge.
    """
    from ciders_edge.inference.personalize import load_backbone, personal_messenger

    rows = []
    for backbone in dict.fromkeys(b for b, _ in models):
        edge = load_backbone(bundle, backbone, dtype, base_model, quantized)
        for state, data in edges:
            records = read_eval_records(data, edge.tokenizer, limit=limit)
            for messenger in [m for b, m in models if b == backbone]:
                x, source = personal_messenger(bundle, state, messenger, backbone)
                edge.use_messenger(x)
                progress = (
                    (lambda i, n, label=f"{backbone}:{messenger} {data}": on_progress(label, i, n))
                    if on_progress
                    else None
                )
                s = score(edge, records, max_new_tokens, progress)
                row = {"backbone": backbone, "messenger": messenger, "state": str(state) if state else None}
                if messenger == "best":  # which one the state's validation chose
                    row["deployed"] = source.pick
                rows.append({**row, "data": str(data), "client_id": source.client_id, **s.to_dict()})
        del edge
    order = {m: i for i, m in enumerate(models)}
    return sorted(rows, key=lambda r: order[(r["backbone"], r["messenger"])])
