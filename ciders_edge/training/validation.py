"""The messenger a device deploys: never worse on its own data than the global one.

``train`` holds out a validation slice of the edge's records (:mod:`ciders_edge.data.holdout`). After
the round it scores, on the backbone the device deploys, the base model, the bundle's global messenger
v, this round's personalized x_K, the mixtures α·x_K + (1−α)·v (the personalized LoRA interpolated
toward the global one, factor by factor as the cloud averages them) and the best messenger kept from
earlier rounds, re-scored. Under partial participation or skewed data the global messenger can beat a
device's own (RESULTS.md's long run), so any of them can become the state's best. But a slice holds 8 to 128
records: a rival replaces this round's personalized messenger only when its NLL is lower by more than the
paired standard error of the gap, record by record on the slice. Smaller gaps are the slice's noise, and
picking on them deployed a stale or mixed messenger that held-out data scored worse (issue 58's study). And
any messenger must beat the base model by a standard error, or the device deploys the base model: where
training barely helps (general-domain data), a slice's noise let messengers through that held-out records
scored worse than the model the device started from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ciders_edge.data.records import Example
from ciders_edge.inference.evaluate import backbone_batches
from ciders_edge.model.adapemu import EdgeModel
from ciders_edge.model.forward import BackboneBatch, response_logits
from ciders_edge.tensors import Tensors
from ciders_edge.training.fleet_evidence import FleetEvidence

__all__ = [
    "BASE_MARGIN",
    "MIX_ALPHAS",
    "SE_MARGIN",
    "Choice",
    "Scores",
    "Validation",
    "deployable",
    "mix",
    "messenger_scores",
    "paired_se",
    "rechoose",
    "rivals_of",
    "validate",
]

MIX_ALPHAS = (0.25, 0.5, 0.75)  # α of α·x_K + (1−α)·v, besides 0 (global) and 1 (personalized)
SE_MARGIN = 1.0  # standard errors a rival must win by: 0 and 2 met the target on fewer clients (deployed_rules.py)
BASE_MARGIN = 1.0  # ... any messenger the base model by: 0 kept 3 clients worse than it, 2 lost 0.25 nats on 2
# where the slice's noise hid a real gain (deployed_rechoice.py)
SHORT_ANSWER = 16  # response tokens, the end of turn included: exact match is scored on records this short


def mix(x: Tensors, v: Tensors, alpha: float) -> Tensors:
    """α·x + (1−α)·v, tensor by tensor."""
    return {k: alpha * x[k] + (1 - alpha) * v[k] for k in v}


class Scores(NamedTuple):
    """A messenger's scores on a slice, and its loss record by record (for the paired standard error)."""

    nll: float  # per response token
    exact_match: float | None  # on the records with short answers, None without any
    short: int  # records with short answers
    record_nll: torch.Tensor  # (records,) summed token NLL of each record
    record_tokens: torch.Tensor  # (records,) response tokens of each record


@torch.no_grad()
def messenger_scores(edge: EdgeModel, batches: list[BackboneBatch]) -> Scores:
    """NLL per response token of the messenger now loaded, and greedy exact match on the records with
    short answers (and how many). Greedy decoding writes the reference exactly when every reference
    token, up to the end of turn, is the argmax given the reference before it: one teacher-forced pass."""
    edge.model.eval()
    eos = torch.tensor(_eos_ids(edge))
    record_nll, record_tokens, hits, short = [], [], 0, 0
    for b in batches:
        chunks = [
            (F.cross_entropy(logits, t, reduction="none"), logits.argmax(-1) == t)
            for logits, t in response_logits(edge.model, b, edge.split.n_kept)
        ]
        losses, right = (torch.cat(parts).cpu() for parts in zip(*chunks, strict=True))
        targets, rows = b.targets.cpu(), b.positions[0].cpu()
        for row in rows.unique():
            mine = rows == row
            record_nll.append(losses[mine].sum())
            record_tokens.append(int(mine.sum()))
            ends, ok = torch.isin(targets[mine], eos).nonzero(), right[mine]
            if len(ends) and int(ends[0]) < SHORT_ANSWER:  # a whole short answer (not one cut by seq_len)
                short += 1
                hits += bool(ok[: int(ends[0]) + 1].all())
    nll, tokens = torch.stack(record_nll).double(), torch.tensor(record_tokens, dtype=torch.float64)
    return Scores(float(nll.sum() / tokens.sum()), hits / short if short else None, short, nll, tokens)


def paired_se(a: Scores, b: Scores) -> float:
    """Standard error of NLL(a) − NLL(b) measured on the same records: the per-token NLL is a ratio of
    sums, so each record's residual is its loss gap less the mean gap times its tokens."""
    gaps, tokens = a.record_nll - b.record_nll, a.record_tokens
    if len(gaps) < 2:
        return math.inf
    residual = gaps - gaps.sum() / tokens.sum() * tokens
    return float(torch.sqrt(len(gaps) / (len(gaps) - 1) * (residual**2).sum()) / tokens.sum())


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
    se: float = 0.0  # paired standard error of its NLL gap to the reference, the first candidate (its own: 0)
    base_se: float = 0.0  # ... and of its gap to the base model's

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
    kept: Choice | None = None  # the state's best from before, scored again beside them
    evidence: dict = field(default_factory=dict)  # what the fleet pools (fleet_evidence.REPORT_KEYS)
    fleet: FleetEvidence | None = None  # the bundle's pooled evidence the choice used

    def keep_in(self, state) -> None:
        """Make the state's deployed messenger this validation's best, with its scores (a ClientState)."""
        state.best, state.best_info = self.best_tensors, {**self.best.to_dict(), "records": self.records}
        state.validation = {
            c.name: {"nll": c.nll, "exact_match": c.exact_match, "se": c.se, "base_se": c.base_se} for c in self.scores
        }

    def summary(self) -> dict:
        """Flat numbers for ``train --json`` and the fleet's round report (no records, no text of them)."""
        out: dict = {"val_records": self.records, "val_short_answers": self.short_answers}
        for c in self.scores:
            out[f"val_nll_{c.name}"] = c.nll
            if c.se:
                out[f"val_se_{c.name}"] = c.se
            if c.exact_match is not None:
                out[f"val_em_{c.name}"] = c.exact_match
        if self.kept is not None:
            out["val_nll_kept"] = self.kept.nll
        if self.fleet is not None:
            out |= {"val_fleet_round": self.fleet.round, "val_fleet_global_first": self.fleet.global_first}
        return {**out, **self.evidence, "deployed": self.best.label(), "deployed_nll": self.best.nll}


def deployable(
    choices: list[Choice],
    margin: float = SE_MARGIN,
    base_margin: float | None = BASE_MARGIN,
    fleet: FleetEvidence | None = None,
) -> int:
    """The index of the lowest NLL plus ``margin`` standard errors: the first choice (the reference, whose
    own ``se`` is 0) unless a rival's NLL is lower by more than that. Then the base model's test: the pick
    stays only if its NLL is below the base model's by at least ``base_margin`` standard errors of their gap
    (None: no such test), since a device must not deploy what it cannot tell from worse than the model it
    started with. With the ``fleet``'s prior the gap and its error are the posterior's (fleet_evidence.py).
    A messenger that is the base model's to the bit (round 0's global) stays."""
    pick = min(range(len(choices)), key=lambda i: choices[i].nll + margin * choices[i].se)
    base = next((i for i, c in enumerate(choices) if c.messenger == "base"), None)
    if base is None or base_margin is None or pick == base:
        return pick
    if fleet is None:
        beats_base = choices[pick].nll + base_margin * choices[pick].base_se <= choices[base].nll  # a tie: the pick
    else:
        gap, sd = fleet.posterior(choices[pick].nll - choices[base].nll, choices[pick].base_se)
        beats_base = gap + base_margin * sd <= 0
    return pick if beats_base else base


def rivals_of(x: Tensors, v: Tensors, rounds: tuple[int, int]) -> list[tuple[Choice, Tensors]]:
    """This round's candidates and their tensors: personalized, global, the mixtures, base, in this order
    (:func:`_choose` reads it so). On a tie the first wins (this round's over a kept one, the federation's
    over the base). ``rounds``: (the bundle's round, the state's)."""
    bundle_round, trained_round = rounds
    return [
        (Choice("personalized", trained_round), x),
        (Choice("global", bundle_round), v),
        *((Choice("mix", trained_round, a), mix(x, v, a)) for a in MIX_ALPHAS),
        (Choice("base", -1), {k: torch.zeros_like(t) for k, t in v.items()}),
    ]


def validate(
    edge: EdgeModel,
    val: list[Example],
    v: Tensors,
    x: Tensors,
    kept: tuple[Tensors, dict] | None,
    rounds: tuple[int, int],
    fleet: FleetEvidence | None = None,
) -> Validation:
    """Score the candidates on ``edge`` (the backbone the device deploys) and pick the lowest NLL plus
    standard error: a rival must beat this round's personalized messenger by more than the slice's noise.

    ``v``: the bundle's global messenger; ``x``: this round's personalized one; ``kept``: the state's best
    so far and its :class:`Choice` fields; ``rounds``: (the bundle's round, the state's); ``fleet``: the
    bundle's pooled evidence, which can make the global messenger the reference and shrinks the base test."""
    return _choose(edge, val, rivals_of(x, v, rounds), _kept(kept) if kept else None, rounds[0], fleet)


def rechoose(
    edge: EdgeModel,
    val: list[Example],
    v: Tensors,
    x: Tensors,
    kept: tuple[Tensors, dict],
    rounds: tuple[int, int],
    fleet: FleetEvidence | None = None,
) -> Validation:
    """Choose again on a newer bundle, without training: a device not sampled for rounds chose against
    an older global messenger, and the federation has moved on (issue 58's study: such clients held
    messengers 0.05 nats worse than the newest global). The kept best comes first, the messenger a rival
    must beat by a standard error; then the newer global, the latest personalized messenger ``x``, their
    mixtures and the base model. Arguments as :func:`validate`'s; ``rounds[1]``: the round ``x`` trained."""
    return _choose(edge, val, rivals_of(x, v, rounds), _kept(kept), rounds[0], fleet, kept_first=True)


def _kept(kept: tuple[Tensors, dict]) -> tuple[Choice, Tensors]:
    tensors, info = kept
    return Choice(**{k: info[k] for k in ("messenger", "round", "alpha")}), tensors


def _choose(
    edge: EdgeModel,
    val: list[Example],
    rivals: list[tuple[Choice, Tensors]],
    kept: tuple[Choice, Tensors] | None,
    bundle_round: int,
    fleet: FleetEvidence | None,
    kept_first: bool = False,
) -> Validation:
    """Score the candidates on the slice, each gap's standard error against the first (``rivals[0]``, the
    kept best when ``kept_first``, the global messenger when the fleet says so) and against the base model,
    and keep :func:`deployable`'s pick."""
    candidates = [kept, *rivals] if kept_first else rivals + ([kept] if kept else [])
    if fleet is not None and fleet.global_first:  # personalization lost across the fleet: v is the reference
        newest = next(i for i, (c, _) in enumerate(candidates) if c is rivals[1][0])
        candidates.insert(0, candidates.pop(newest))
    batches = backbone_batches(edge, val)
    scores = []
    for choice, tensors in candidates:
        edge.use_messenger(tensors)
        scores.append(messenger_scores(edge, batches))
        choice.nll, choice.exact_match, choice.scored_round = scores[-1].nll, scores[-1].exact_match, bundle_round
        choice.se = paired_se(scores[0], scores[-1]) if len(scores) > 1 else 0.0
    scored = {id(c): s for (c, _), s in zip(candidates, scores, strict=True)}
    base = scored[id(rivals[-1][0])]
    for choice, _ in candidates:
        choice.base_se = paired_se(scored[id(choice)], base) if choice.messenger != "base" else 0.0
    best, tensors = candidates[deployable([c for c, _ in candidates], fleet=fleet)]
    personalized, global_ = (scored[id(c)] for c, _ in rivals[:2])
    evidence = {  # what the fleet pools (fleet_evidence.REPORT_KEYS)
        "val_gap_personalized_global": personalized.nll - global_.nll,
        "val_se_personalized_global": paired_se(personalized, global_),
    }
    if best.messenger != "base":
        evidence |= {"val_gap_deployed_base": best.nll - base.nll, "val_se_deployed_base": best.base_se}
    return Validation(
        len(val),
        scores[0].short,
        [c for c, _ in rivals],
        best,
        {k: t.detach().clone() for k, t in tensors.items()},
        kept[0] if kept else None,
        evidence,
        fleet,
    )
