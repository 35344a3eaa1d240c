"""Evaluation for ``simulate``: held-out NLL with personalized and global messengers, ROUGE-L,
exact match, and the cross-domain NLL matrix with Delta_cross (paper §VI-E), on the AdapEmu; the
matched-domain NLL of the personalized messenger on AdapFu (the full backbone) beside it; and the
round-0 baseline every gain is measured from. The models run on the study's cloud device (bf16
autocast on CUDA, as :mod:`ciders_cloud.models.device` says)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import torch

from ciders_cloud.models.device import CPU, autocast
from ciders_cloud.run.folder import StudyFolder
from ciders_cloud.study.config import SimConfig
from ciders_edge.data.records import load_examples, read_jsonl, to_chat
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.inference.evaluate import (
    backbone_batches,
    exact_match_answer,
    messenger_nll,
    perplexity,
    rouge_l,
)
from ciders_edge.inference.generation import GenerationSettings, generate_batch
from ciders_edge.model.adapemu import EdgeModel, load_edge_model
from ciders_edge.model.adapfu import load_adapfu
from ciders_edge.progress import progress_bar

__all__ = ["Scoring", "evaluate_round", "evaluate_groups", "evaluate_baseline", "delta_cross"]


@dataclass(frozen=True)
class Scoring:
    """What every evaluation of a study reads: its folder, each client's domain, its config, the device."""

    study: StudyFolder
    domains: dict[str, str]
    cfg: SimConfig
    device: torch.device = CPU

    def examples(self, cid: str, tokenizer) -> list:
        """The first ``eval_examples`` of ``cid``'s held-out records, tokenized."""
        return load_examples(self.study.eval_data(cid), tokenizer, 512)[: self.cfg.eval_examples]

    def same_data(self, ids: list[str]) -> dict[str, str]:
        """Each client's held-out data by content (a digest): clients given the same eval file (every
        client of a domain, in a per-domain study) are scored on it once, not once per client."""
        return {cid: hashlib.sha256(self.study.eval_data(cid).read_bytes()).hexdigest() for cid in ids}


def delta_cross(matrix: list[list[float]]) -> float:
    """Mean off-diagonal NLL minus mean diagonal NLL: how much a personalized model loses off its domain."""
    n = len(matrix)
    diag = [matrix[i][i] for i in range(n)]
    off = [matrix[i][j] for i in range(n) for j in range(n) if i != j]
    return mean(off) - mean(diag) if off else 0.0


def _on(edge: EdgeModel, device: torch.device) -> EdgeModel:
    """``edge`` with its model moved to ``device`` (the batches follow the model)."""
    edge.model.to(device)
    return edge


def evaluate_baseline(bundle_dir: Path, ids: list[str], scoring: Scoring) -> list[dict]:
    """Before any training: each client's held-out NLL on the round-0 AdapEmu and on the base model
    (AdapFu with the round-0 messenger, which is the base model's own)."""
    bundle = Bundle.load(bundle_dir)
    records = []
    models = [("emu", load_edge_model(bundle))] + ([("full", load_adapfu(bundle))] if bundle.has_full_backbone else [])
    models = [(name, _on(edge, scoring.device)) for name, edge in models]
    key, scores = scoring.same_data(ids), {}
    for cid in ids:
        if key[cid] not in scores:
            with autocast(scoring.device):
                scores[key[cid]] = {
                    f"nll_{name}": messenger_nll(edge, backbone_batches(edge, scoring.examples(cid, edge.tokenizer)))
                    for name, edge in models
                }
        records.append(
            {"type": "baseline", "round": -1, "client": cid, "domain": scoring.domains[cid], **scores[key[cid]]}
        )
    return records


def evaluate_round(bundle_dir: Path, ids: list[str], scoring: Scoring) -> dict:
    """Score every client on its held-out data; the matrix when clients hold different domains."""
    edge = _on(load_edge_model(Bundle.load(bundle_dir)), scoring.device)
    domains = scoring.domains
    with autocast(scoring.device):
        records, matrix = _score_clients(edge, ids, scoring)
        full = _adapfu_nll(edge.bundle, ids, scoring)
    for rec in records:
        rec.update(full.get(rec["client"], {}))
    cross = delta_cross(matrix) if len(set(domains.values())) > 1 else None
    records.append(
        {
            "type": "cross",
            "round": edge.bundle.round - 1,
            "clients": ids,
            "domains": [domains[c] for c in ids],
            "matrix": matrix,
            "delta_cross": cross,
        }
    )
    clients = records[:-1]
    return {
        "records": records,
        "mean_nll_personal": mean(r["nll_personal"] for r in clients),
        "mean_nll_global": mean(r["nll_global"] for r in clients),
        "mean_nll_full_personal": mean(r["nll_full_personal"] for r in clients) if full else None,
        "delta_cross": cross,
    }


def evaluate_groups(round_: int, groups: dict[str, list[str]], scoring: Scoring) -> dict:
    """:func:`evaluate_round` for each profile's clients on that profile's bundle of ``round_``; the means
    are over every client, and each profile has its own cross matrix (its messengers on its backbone)."""
    parts = [evaluate_round(scoring.study.run.bundle(p, round_), ids, scoring) for p, ids in groups.items()]
    if len(parts) == 1:
        return parts[0]
    records = [rec for part in parts for rec in part["records"]]
    clients = [r for r in records if r["type"] == "eval"]
    full = [r["nll_full_personal"] for r in clients if "nll_full_personal" in r]
    return {
        "records": records,
        "mean_nll_personal": mean(r["nll_personal"] for r in clients),
        "mean_nll_global": mean(r["nll_global"] for r in clients),
        "mean_nll_full_personal": mean(full) if len(full) == len(clients) else None,
        "delta_cross": None,  # no one matrix of every client
    }


def _score_clients(edge: EdgeModel, ids: list[str], scoring: Scoring) -> tuple[list[dict], list[list[float]]]:
    """Every client's eval record on the AdapEmu, and the cross-domain NLL matrix's rows."""
    round_ = edge.bundle.round - 1
    with progress_bar() as bar:  # minutes on SmolLM2: one backbone pass and one matrix row per client
        task = bar.add_task(f"round {round_} evaluation", total=2 * len(ids), metrics="")
        key, by_data = scoring.same_data(ids), {}  # through the shared backbone once per eval set:
        for cid in ids:  # each row of the matrix only swaps the messenger
            if key[cid] not in by_data:
                by_data[key[cid]] = backbone_batches(edge, scoring.examples(cid, edge.tokenizer))
            bar.update(task, advance=1, metrics=f"backbone pass {cid}")
        records, matrix, v = [], [], _GlobalScores(edge, by_data, scoring.cfg.eval_generate)
        for cid in ids:
            record, row = _client_record(edge, v, key, cid, ids, scoring)
            records.append({"type": "eval", "round": round_, "client": cid, "domain": scoring.domains[cid], **record})
            matrix.append(row)
            bar.update(task, advance=1, metrics=f"{cid} NLL {records[-1]['nll_personal']:.3f}")
    return records, matrix


class _GlobalScores:
    """The bundle's global messenger v on every eval set, scored once: the same for every client, and the
    personalized scores of a client that holds no messenger of its own (in a large sampled population, most)."""

    def __init__(self, edge: EdgeModel, by_data: dict, generate: int) -> None:
        self.edge, self.by_data, self.generate = edge, by_data, generate
        self.tensors = {k: t.float() for k, t in edge.bundle.messenger_lora().items()}
        self._nll: dict[str, float] | None = None
        self._generation: dict[str, tuple[float | None, float | None]] = {}

    def nll(self) -> dict[str, float]:
        """v's NLL on each eval set (by its content key)."""
        if self._nll is None:
            self.edge.use_messenger(self.tensors)
            self._nll = {k: messenger_nll(self.edge, batches) for k, batches in self.by_data.items()}
        return self._nll

    def generation(self, key: str, path: Path) -> tuple[float | None, float | None]:
        """v's ROUGE-L and exact match on the eval set ``key`` (read from ``path``)."""
        if key not in self._generation:
            self.edge.use_messenger(self.tensors)
            self._generation[key] = _generation_scores(self.edge, path, self.generate)
        return self._generation[key]


def _adapfu_nll(bundle: Bundle, ids: list[str], scoring: Scoring) -> dict[str, dict]:
    """Each client's personalized (and the global) messenger on AdapFu, on its own held-out data; with a
    validation slice (``val_fraction``), the messenger it deploys (its state's best) and the base model
    (no messenger LoRA) too: what the deployed choice must never be worse than."""
    if not bundle.has_full_backbone:
        return {}
    edge = _on(load_adapfu(bundle), scoring.device)
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    key, by_data, base, scores = scoring.same_data(ids), {}, {}, {}
    for cid in ids:
        if key[cid] not in by_data:
            batches = backbone_batches(edge, scoring.examples(cid, edge.tokenizer))
            edge.use_messenger(v)
            by_data[key[cid]] = batches, messenger_nll(edge, batches)
        batches, nll_global = by_data[key[cid]]
        state = ClientState.load(scoring.study.client_state(cid))
        if state is not None and state.personalized:
            edge.use_messenger(state.personalized)
            scores[cid] = {"nll_full_personal": messenger_nll(edge, batches), "nll_full_global": nll_global}
        else:  # no messenger of its own: it answers with v
            scores[cid] = {"nll_full_personal": nll_global, "nll_full_global": nll_global}
        if state is not None and state.best:
            edge.use_messenger(state.best)
            scores[cid].update(nll_full_deployed=messenger_nll(edge, batches), deployed=state.best_info["messenger"])
            if key[cid] not in base:
                edge.use_messenger({k: torch.zeros_like(t) for k, t in v.items()})
                base[key[cid]] = messenger_nll(edge, batches)
            scores[cid]["nll_full_base"] = base[key[cid]]
    return scores


def _client_record(
    edge: EdgeModel, v: _GlobalScores, key: dict[str, str], cid: str, ids: list[str], scoring: Scoring
) -> tuple[dict, list[float]]:
    """One client's scores, and its matrix row: its personalized messenger on every client's data
    (``key``: each client's eval set), or v's scores when it holds none."""
    state = ClientState.load(scoring.study.client_state(cid))
    eval_path = scoring.study.eval_data(cid)
    if state is not None and state.personalized:
        edge.use_messenger(state.personalized)
        nll = {k: messenger_nll(edge, batches) for k, batches in v.by_data.items()}
        rouge, em = _generation_scores(edge, eval_path, scoring.cfg.eval_generate)
    else:
        nll, (rouge, em) = v.nll(), v.generation(key[cid], eval_path)
    row = [nll[key[other]] for other in ids]
    nll_personal, nll_global = row[ids.index(cid)], v.nll()[key[cid]]
    record = {
        "nll_personal": nll_personal,
        "nll_global": nll_global,
        "ppl_personal": perplexity(nll_personal),
        "ppl_global": perplexity(nll_global),
        "rouge_l": rouge,
        "exact_match": em,
    }
    return record, row


def _generation_scores(edge: EdgeModel, path: Path, n: int) -> tuple[float | None, float | None]:
    if n <= 0:
        return None, None
    rows = read_jsonl(path)[:n]
    chats = [to_chat(r) for r in rows]
    answers = generate_batch(
        edge.model, edge.tokenizer, [prompt for prompt, _ in chats], GenerationSettings(max_new_tokens=48)
    )
    refs = [str(r.get("answer", resp)) for r, (_, resp) in zip(rows, chats, strict=True)]
    rouge = mean(rouge_l(a, resp) for a, (_, resp) in zip(answers, chats, strict=True))
    em = mean(float(exact_match_answer(a) == exact_match_answer(ref)) for a, ref in zip(answers, refs, strict=True))
    return rouge, em
