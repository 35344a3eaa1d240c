"""On-device evaluation of a (personalized) AdapEmu: response NLL, ROUGE-L, exact match."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .assembly import backbone_hidden, messenger_logits, response_positions
from .data import Example, collate
from .emu import EdgeModel
from .lora import MESSENGER, copy_into, lora_parameters
from .update import Tensors

__all__ = [
    "use_messenger",
    "backbone_batches",
    "messenger_nll",
    "response_nll",
    "perplexity",
    "rouge_l",
    "exact_match_answer",
    "generate_answers",
]


def use_messenger(edge: EdgeModel, x: Tensors) -> None:
    """Load messenger LoRA ``x`` (global v or a personalized x_K) into the model."""
    copy_into(lora_parameters(edge.model, MESSENGER), x)


@dataclass
class BackboneBatch:
    """One batch run through the frozen learnable backbone: what every messenger is scored on."""

    hidden: torch.Tensor
    ctx: object
    positions: torch.Tensor
    targets: torch.Tensor


@torch.no_grad()
def backbone_batches(edge: EdgeModel, examples: list[Example], batch_size: int = 8) -> list[BackboneBatch]:
    """Run ``examples`` through the backbone once; scoring several messengers on them (a cross-domain
    NLL matrix) then costs only messenger passes."""
    edge.model.eval()
    device = next(edge.model.parameters()).device
    out = []
    for i in range(0, len(examples), batch_size):
        b = {k: t.to(device) for k, t in collate(examples[i : i + batch_size], edge.tokenizer.pad_token_id).items()}
        h, ctx = backbone_hidden(edge.model, b["input_ids"], b["attention_mask"], edge.split.n_kept)
        positions, targets = response_positions(b["labels"])
        out.append(BackboneBatch(h, ctx, positions, targets))
    return out


@torch.no_grad()
def messenger_nll(edge: EdgeModel, batches: list[BackboneBatch]) -> float:
    """Mean negative log-likelihood per response token of the messenger now loaded."""
    edge.model.eval()
    total, count = 0.0, 0
    for b in batches:
        logits = messenger_logits(edge.model, b.hidden, b.ctx, edge.split.n_kept, b.positions)
        total += float(F.cross_entropy(logits.float(), b.targets, reduction="sum"))
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


@torch.no_grad()
def generate_answers(edge: EdgeModel, prompts: list[list[dict]], max_new_tokens: int = 48) -> list[str]:
    """Greedy answers to chat prompts, one at a time (edge inference is batch 1)."""
    edge.model.eval()
    device = next(edge.model.parameters()).device
    out = []
    for msgs in prompts:
        ids = edge.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt").to(device)
        gen = edge.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=edge.tokenizer.pad_token_id,
        )
        out.append(edge.tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out
