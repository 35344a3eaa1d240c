"""Issue 58's judge: each client's deployed messenger against its rivals on many held-out records.

A study evaluates on ``eval_examples`` records a client (8 in the long run's settings): on 8 records the
paired noise of an NLL gap is 0.01-0.1 nats, as large as the 0.01-nat target itself, so the study's own
figures cannot say whether a choice met it. The judge scores, after a round, every client that holds a
deployed choice on the first ``records`` of its held-out eval set, on AdapFu: the deployed messenger (its
state's best), its latest personalized one, the newest global one and the base model, each gap with its
paired standard error (:func:`ciders_edge.training.validation.paired_se`, the device's own statistic).

A client not sampled in the last rounds chose against the global messenger of the bundle it last trained
from, and has not seen the newer ones: beside the issue's gap (to the newest global) the judge gives the gap
to the better of {latest personalized, the global the device holds}.

A client whose eval set holds fewer than ``records`` (the Dirichlet settings hold out 10% of 64 records: 6) is
judged on it topped up with records of its own partition that the study's cap left out
(:func:`judge_records`): drawn from the client's own category mix, and in no client's data nor TAKD's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ciders_cloud.run.folder import StudyFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.round_loop import evaluated_after
from ciders_cloud.study.simulate import client_ids, client_records, without_where
from ciders_edge.data.holdout import hold_out
from ciders_edge.data.records import Example, load_examples, read_jsonl
from ciders_edge.formats.atomic import write_json, write_jsonl
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.inference.evaluate import backbone_batches
from ciders_edge.model.adapfu import load_adapfu
from ciders_edge.profiles import load_profile
from ciders_edge.progress import progress_bar
from ciders_edge.training.round import round_hyperparams
from ciders_edge.training.validation import Scores, messenger_scores, paired_se

__all__ = [
    "JUDGED",
    "StudyClients",
    "judge_parser",
    "client_states",
    "judge_records",
    "judge_round",
    "judged",
    "open_study",
]

JUDGED = "deployed_judge"  # in each study: round-NNNN.json, one per judged round


def judged_path(out: Path, round_: int) -> Path:
    return out / JUDGED / f"round-{round_:04d}.json"


def open_study(out: Path) -> tuple[StudyFolder, SimConfig, int]:
    """The study in ``out``, its config and how many rounds it has run."""
    study = StudyFolder(out)
    cfg = SimConfig.from_dict(json.loads(study.config.read_text()), where=str(study.config))
    return study, cfg, ServerState.load(study.run.server_state).round


def client_states(study: StudyFolder) -> dict[str, ClientState]:
    """The clients that hold a deployed choice (every client that has trained), by id."""
    root = study.root / "clients"
    ids = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return {c: s for c in ids if (s := ClientState.load(study.client_state(c))) is not None and s.best}


def judge_records(study: StudyFolder, cfg: SimConfig, records: int) -> dict[str, Path]:
    """Each client's held-out records to judge it on, by id: its eval set where that holds ``records``, else
    (written once, to ``JUDGED/records/``) its eval set and then the records of its own partition past the
    study's ``max_records``, less any record some client trains or evaluates on or TAKD's data holds; twice
    ``records`` of those at most, as a few may be too long to score."""
    ids = client_ids(cfg.clients)
    paths = {c: study.eval_data(c) for c in ids}
    evals = {c: read_jsonl(p) for c, p in paths.items()}
    short = [c for c in ids if len(evals[c]) < records]
    if not short or not cfg.max_records:
        return paths
    topped = {c: study.root / JUDGED / "records" / f"{c}.jsonl" for c in short}
    if missing := [c for c in short if not topped[c].is_file()]:  # Dolly partitioned again only to write them
        parts, _ = client_records(cfg)
        public = Path(cfg.public_data) if cfg.public_data else study.public_data
        rows = [*evals.values(), *(read_jsonl(study.train_data(c)) for c in ids), read_jsonl(public)]
        used = {_key(r) for part in rows for r in part}
        for cid in missing:
            unused = [r for r in parts[ids.index(cid)][cfg.max_records :] if _key(r) not in used]
            write_jsonl(topped[cid], without_where(evals[cid] + unused[: 2 * records]))
    return {**paths, **topped}
    parts, _ = client_records(cfg)
    public = Path(cfg.public_data) if cfg.public_data else study.public_data
    used = {_key(r) for f in [*paths.values(), *map(study.train_data, ids), public] for r in read_jsonl(f)}
    for cid in short:
        path = paths[cid] = study.root / JUDGED / "records" / f"{cid}.jsonl"
        if not path.is_file():
            unused = [r for r in parts[ids.index(cid)][cfg.max_records :] if _key(r) not in used]
            write_jsonl(path, without_where(read_jsonl(study.eval_data(cid)) + unused[: 2 * records]))
    return paths


def _key(record: dict) -> str:
    return json.dumps(without_where([record])[0], sort_keys=True)


def judge_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a benchmark that judges a study's choices after its last round."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--study", type=Path, required=True, help="a study folder (simulate with --val-fraction)")
    ap.add_argument("--judge-records", type=int, default=64, help="held-out records a client the choice is judged on")
    ap.add_argument("--tolerance", type=float, default=0.01)
    return ap


class StudyClients:
    """After a study's last round, on AdapFu with the newest bundle: each client that holds a choice, with its
    validation slice (as its device holds it out) and the judge's batches of its first ``judge_records`` eval
    records (each eval file's backbone pass once). ``edge``, ``v`` (the newest global) and ``done`` for the rest."""

    def __init__(self, study_dir: Path, judge_records: int) -> None:
        study, self.cfg, self.done = open_study(study_dir)
        self.study, self.judge_records = study, judge_records
        bundle = Bundle.load(study.run.bundle(self.cfg.profile, self.done))
        self.edge = load_adapfu(bundle)
        self.seq_len = round_hyperparams(bundle, load_profile(self.cfg.profile), {}).seq_len
        self.v = {k: t.float() for k, t in bundle.messenger_lora().items()}

    def __iter__(self) -> Iterator[tuple[str, ClientState, list[Example], list]]:
        """(client id, state, validation slice, judge batches), with a progress bar."""
        study, edge, judged = self.study, self.edge, {}
        states = client_states(study)
        judged_on = judge_records(study, self.cfg, self.judge_records)
        with progress_bar() as bar:
            task = bar.add_task("candidates", total=len(states), metrics="")
            for cid, state in states.items():
                examples = load_examples(study.train_data(cid), edge.tokenizer, self.seq_len)
                digest = hashlib.sha256(judged_on[cid].read_bytes()).hexdigest()
                if digest not in judged:
                    records = load_examples(judged_on[cid], edge.tokenizer, 512)[: self.judge_records]
                    judged[digest] = backbone_batches(edge, records)
                yield cid, state, hold_out(examples, self.cfg.val_fraction)[1], judged[digest]
                bar.update(task, advance=1, metrics=cid)


@torch.no_grad()
def judge_round(out: Path, records: int, device: str = "cpu") -> Path | None:
    """Judge the clients of the study in ``out`` after its last round, on ``device``; None when the study
    does not evaluate that round, it is judged already or no client holds a deployed choice yet."""
    study, cfg, done = open_study(out)
    path = judged_path(out, done - 1)
    if done == 0 or not evaluated_after(cfg, done - 1) or path.is_file():
        return None
    states = client_states(study)
    if not states:
        return None
    edge = load_adapfu(Bundle.load(study.run.bundle(cfg.profile, done)))  # the newest global messenger
    edge.model.to(device)
    v = dict(edge.bundle.messenger_lora())
    judged_on = judge_records(study, cfg, records)
    shared: dict[str, tuple] = {}  # by eval data: its batches, the global's and the base model's scores
    clients = {}
    with progress_bar() as bar:  # minutes on SmolLM2: two messengers a client, two more per eval set
        task = bar.add_task(f"judge round {done - 1}", total=len(states), metrics="")
        for cid, state in states.items():
            stale = state.round + 1 < done  # not sampled since: it chose against an older global messenger
            held = Bundle.load(study.run.bundle(cfg.profile, state.round)).messenger_lora() if stale else None
            clients[cid] = _judge(edge, (v, held), judged_on[cid], state, records, shared)
            bar.update(task, advance=1, metrics=cid)
    write_json(path, {"round": done - 1, "records": records, "clients": clients})
    return path


def _judge(
    edge, globals_: tuple[dict, dict | None], eval_data: Path, state: ClientState, records: int, shared: dict
) -> dict:
    """One client's four messengers on its judge's records (the global's and the base's shared by its data);
    ``globals_``: the newest global messenger and, for a stale client, the one its last round trained from."""
    v, held = globals_
    digest = hashlib.sha256(eval_data.read_bytes()).hexdigest()
    if digest not in shared:
        batches = backbone_batches(edge, load_examples(eval_data, edge.tokenizer, 512)[:records])
        base = {k: torch.zeros_like(t) for k, t in v.items()}
        shared[digest] = batches, _score(edge, v, batches), _score(edge, base, batches)
    batches, glob, base = shared[digest]
    deployed, latest = _score(edge, state.best, batches), _score(edge, state.personalized, batches)
    better = min((latest, glob), key=_nll)
    known = min((latest, glob if held is None else _score(edge, held, batches)), key=_nll)
    return {
        "deployed": state.best_info["messenger"],
        "alpha": state.best_info.get("alpha"),
        "records": len(deployed.record_nll),
        **{f"nll_{n}": s.nll for n, s in (("deployed", deployed), ("latest", latest), ("global", glob))},
        "nll_base": base.nll,
        "gap": deployed.nll - better.nll,  # to the better of {latest personalized, global}
        "gap_se": paired_se(deployed, better),
        "stale_rounds": edge.bundle.round - 1 - state.round,  # rounds since it last trained
        "gap_held": deployed.nll - known.nll,  # to the better of {latest, the global it holds}
        "over_base": deployed.nll - base.nll,
        "over_base_se": paired_se(deployed, base),
    }


def _nll(s: Scores) -> float:
    return s.nll


def _score(edge, messenger: dict, batches: list) -> Scores:
    edge.use_messenger({k: t.float() for k, t in messenger.items()})
    return messenger_scores(edge, batches)


def judged(out: Path) -> dict[int, dict]:
    """Every judged round of the study in ``out``."""
    folder = out / JUDGED
    files = sorted(folder.glob("round-*.json")) if folder.is_dir() else []
    return {(d := json.loads(f.read_text()))["round"]: d for f in files}
