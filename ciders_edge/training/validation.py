"""The messenger a device deploys: never worse on its own data than the global one.

``train`` holds out a validation slice of the edge's records (:mod:`ciders_edge.data.holdout`). After
the round it scores, on the backbone the device deploys, the base model, the bundle's global messenger
v, this round's personalized x_K, the mixtures α·x_K + (1−α)·v (the personalized LoRA interpolated
toward the global one, factor by factor as the cloud averages them) and the best messenger kept from
earlier rounds, re-scored. The lowest NLL becomes the state's best: under partial participation or
skewed data the global messenger can beat a device's own (RESULTS.md's long run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ciders_edge.data.records import Example
from ciders_edge.inference.evaluate import backbone_batches
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import BackboneBatch, messenger_logits
from ciders_edge.tensors import Tensors

__all__ = [
    "MIX_ALPHAS",
    "Choice",
    "Validation",
    "mix",
    "messenger_scores",
    "validate",
]

MIX_ALPHAS = (0.25, 0.5, 0.75)  # α of α·x_K + (1−α)·v, besides 0 (global) and 1 (personalized)
SHORT_ANSWER = 16  # response tokens, the end of turn included: exact match is scored on records this short


def mix(x: Tensors, v: Tensors, alpha: float) -> Tensors:
    """α·x + (1−α)·v, tensor by tensor."""
    return {k: alpha * x[k] + (1 - alpha) * v[k] for k in v}


@torch.no_grad()
def messenger_scores(edge: EdgeModel, batches: list[BackboneBatch]) -> tuple[float, float | None, int]:
    """NLL per response token of the messenger now loaded, and greedy exact match on the records with
    short answers (and how many). Greedy decoding writes the reference exactly when every reference
    token, up to the end of turn, is the argmax given the reference before it: one teacher-forced pass."""
    edge.model.eval()
    eos = torch.tensor(_eos_ids(edge))
    total, tokens, hits, short = 0.0, 0, 0, 0
    for b in batches:
        logits = messenger_logits(edge.model, b.hidden, b.ctx, edge.split.n_kept, b.positions).float()
        total += float(F.cross_entropy(logits, b.targets, reduction="sum"))
        tokens += b.targets.numel()
        targets, rows = b.targets.cpu(), b.positions[0].cpu()
        right = logits.argmax(-1).cpu() == targets
        for row in rows.unique():
            mine = rows == row
            ends, ok = torch.isin(targets[mine], eos).nonzero(), right[mine]
            if len(ends) and int(ends[0]) < SHORT_ANSWER:  # a whole short answer (not one cut by seq_len)
                short += 1
                hits += bool(ok[: int(ends[0]) + 1].all())
    return total / max(tokens, 1), (hits / short if short else None), short


def _eos_ids(edge: EdgeModel) -> list[int]:
    ids = getattr(edge.model.generation_config, "eos_token_id", None) or edge.tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


@dataclass
class Choice:
    """A deployable messenger and its scores on the validation slice."""

    messenger: str  # base | global | personalized | mix
    round: int  # the bundle's (global) or the training's (personalized, mix) round; -1 for base
    alpha: float | None = None  # of a mixture α·x_K + (1−α)·v
    nll: float = float("inf")
    exact_match: float | None = None
    scored_round: int = -1  # the round it was last scored in, on that round's backbone

    @property
    def name(self) -> str:
        return f"mix_{self.alpha:g}" if self.messenger == "mix" else self.messenger

    def label(self) -> str:
        if self.messenger == "base":
            return "the base model's messenger"
        if self.messenger == "mix":
            return f"round {self.round}'s personalized messenger mixed {self.alpha:g} with its global one"
        return f"round {self.round}'s {self.messenger} messenger"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Validation:
    """A round's validation: every candidate's scores, the best of them (the state keeps it) and its tensors."""

    records: int
    short_answers: int  # records exact match was scored on
    scores: list[Choice]
    best: Choice
    best_tensors: Tensors

    def summary(self) -> dict:
        """Flat numbers for ``train --json`` and the fleet's round report (no records, no text of them)."""
        out: dict = {"val_records": self.records, "val_short_answers": self.short_answers}
        for c in self.scores:
            out[f"val_nll_{c.name}"] = c.nll
            if c.exact_match is not None:
                out[f"val_em_{c.name}"] = c.exact_match
        return {**out, "deployed": self.best.label(), "deployed_nll": self.best.nll}


def validate(
    edge: EdgeModel,
    val: list[Example],
    v: Tensors,
    x: Tensors,
    kept: tuple[Tensors, dict] | None,
    rounds: tuple[int, int],
) -> Validation:
    """Score the candidates on ``edge`` (the backbone the device deploys) and pick the lowest NLL.

    ``v``: the bundle's global messenger; ``x``: this round's personalized one; ``kept``: the state's best
    so far and its :class:`Choice` fields; ``rounds``: (the bundle's round, the state's)."""
    bundle_round, trained_round = rounds
    candidates = [  # on a tie the first wins: this round's over the kept one, the federation's over the base
        (Choice("personalized", trained_round), x),
        (Choice("global", bundle_round), v),
        *((Choice("mix", trained_round, a), mix(x, v, a)) for a in MIX_ALPHAS),
        (Choice("base", -1), {k: torch.zeros_like(t) for k, t in v.items()}),
    ]
    if kept is not None:
        info = {k: kept[1][k] for k in ("messenger", "round", "alpha")}
        candidates.append((Choice(**info), kept[0]))
    batches = backbone_batches(edge, val)
    short = 0
    for choice, tensors in candidates:
        edge.use_messenger(tensors)
        choice.nll, choice.exact_match, short = messenger_scores(edge, batches)
        choice.scored_round = bundle_round
    best, tensors = min(candidates, key=lambda c: c[0].nll)
    scores = [c for c, _ in candidates[: len(candidates) - (kept is not None)]]
    return Validation(len(val), short, scores, best, {k: t.detach().clone() for k, t in tensors.items()})
