"""The rounds of a built study: each sampled client trains through ``ciders-edge train``'s code and
writes a real packet, the cloud aggregates them through ``ciders-cloud aggregate``'s, and every round's
client, round and evaluation records go to the study's ``metrics.jsonl``. An engine (:mod:`.engines`)
carries the clients' jobs: in this process, or on Flower's Simulation Engine.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from statistics import mean

import torch

from ciders_cloud.round.aggregate import aggregate_files
from ciders_cloud.round.probes import aggregate_probes
from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import StudyFolder
from ciders_cloud.run.sampling import sample_clients
from ciders_cloud.strategies import get_strategy, round_hyperparams_for
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.diagnostics import client_diagnostics
from ciders_cloud.study.engines import Engine, InProcess
from ciders_cloud.study.evaluation import Scoring, evaluate_baseline, evaluate_groups
from ciders_cloud.study.profiles import StudyProfiles
from ciders_cloud.study.snapshots import keep_state, round_committed
from ciders_edge.fleet.virtual import StudyJob
from ciders_edge.formats.atomic import append_jsonl
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import holds_choice
from ciders_edge.hyperparams import RoundHyperparams

__all__ = ["run_rounds", "evaluated_after"]


def run_rounds(
    cfg: SimConfig,
    study: StudyFolder,
    ids: list[str],
    domains: dict[str, str],
    device: torch.device,
    start: int = 0,
    evaluate_first: bool = False,
    engine: Engine | None = None,
) -> dict:
    """Rounds ``start`` to ``cfg.rounds - 1`` of a built study, the cloud's part and the evaluation on
    ``device``; returns the last evaluation. From a ``start`` past 0 (``simulate --resume``) the rounds
    draw the samples a run that never stopped would have; ``evaluate_first`` scores round ``start - 1``
    first, when its evaluation was cut short. ``engine`` carries the clients' jobs (:mod:`.engines`;
    default: this process)."""
    run = study.run
    engine = engine or InProcess()
    rng = random.Random(cfg.seed)
    for _ in range(start):  # the draws of the rounds already run
        sample_clients(ids, cfg.participation, cfg.sampling, rng, private=bool(cfg.dp))
    strategy = get_strategy(cfg.algorithm)
    profiles = StudyProfiles.of(cfg, ids, load_run(run.root))
    last_eval: dict = {}
    down = {p: _fetched(study, p, start) for p in profiles.groups}
    scoring = Scoring(study, domains, cfg, device)
    for p, members in profiles.groups.items() if start == 0 else ():
        baseline = evaluate_baseline(run.bundle(p, 0), members, scoring)
        append_jsonl(study.metrics, profiles.tag(baseline))
    if evaluate_first:
        last_eval = evaluate_groups(start, profiles.groups, scoring)
        append_jsonl(study.metrics, profiles.tag(last_eval["records"]))
    for t in range(start, cfg.rounds):
        started = time.perf_counter()
        participants = sample_clients(ids, cfg.participation, cfg.sampling, rng, private=bool(cfg.dp))
        probed = _probe(study, t, participants, profiles, engine, cfg, device) if strategy.needs_probe else {}
        for cid in participants:  # until the round commits: a resumed study trains them again from here
            keep_state(study, t, cid)
        jobs = [_job(study, t, cid, profiles, cfg, probe_answer=probed.get("path")) for cid in participants]
        outputs = engine.run(t, jobs, {cid: f"{strategy.name}{profiles.label(cid)}" for cid in participants})
        packets = [study.packet(t, cid) for cid in participants]
        reports = {cid: outputs[cid].summary for cid in participants}  # validation's evidence, for the next bundle
        agg = aggregate_files(run.root, packets, device, sampled=participants, noise_seed=cfg.seed, reports=reports)
        round_committed(study, t)
        hp = round_hyperparams_for(load_run(run.root), t)
        deltas = {cid: profiles.to_v_names(cid, o.delta_sent) for cid, o in outputs.items()}
        directions = {cid: profiles.to_v_names(cid, o.first_direction) for cid, o in outputs.items()}
        weights = dict(zip(agg["clients"], agg["weights"], strict=True))
        diag = client_diagnostics(deltas, directions, weights, t, hp.gamma, hp.alpha)
        wall = time.perf_counter() - started
        probe_up, probe_down = probed.get("bytes_up", {}), probed.get("bytes_down", 0)
        fetched = {cid: down[profiles.profile_of[cid]] + probe_down for cid in participants}
        records = [
            _client_record(t, cid, hp, outputs[cid].summary, diag[cid], fetched[cid], probe_up.get(cid, 0))
            for cid in participants
        ]
        # profiles' bundles differ
        per_client = mean(down[profiles.profile_of[cid]] for cid in participants) if participants else 0
        records.append(_round_record(cfg, t, wall, participants, hp, agg, probed, per_client))
        down = {p: agg["bytes_down"][p] for p in profiles.groups}  # what each client fetches for the next round
        append_jsonl(study.metrics, profiles.tag(records))  # before the evaluation's minutes
        if cfg.rechoose:
            append_jsonl(study.metrics, profiles.tag(_rechoose(study, t, ids, profiles, cfg, engine)))
        if evaluated_after(cfg, t):
            last_eval = evaluate_groups(t + 1, profiles.groups, scoring)
            append_jsonl(study.metrics, profiles.tag(last_eval["records"]))
    return last_eval


def evaluated_after(cfg: SimConfig, t: int) -> bool:
    """Whether round ``t`` ends with an evaluation: every ``eval_every`` rounds, and after the last."""
    return (t + 1) % cfg.eval_every == 0 or t == cfg.rounds - 1


def _fetched(study: StudyFolder, profile: str, round_: int) -> int:
    """Bytes a client of ``profile`` fetches for ``round_``'s bundle: all of round 0's, then what changed."""
    bundle = Bundle.load(study.run.bundle(profile, round_))
    return bundle.delta_bytes(Bundle.load(study.run.bundle(profile, round_ - 1)) if round_ else None)


def _job(
    study: StudyFolder, t: int, cid: str, profiles: StudyProfiles, cfg: SimConfig, packet: Path | None = None, **kw
) -> StudyJob:
    """Client ``cid``'s part of round ``t``: ``ciders-edge train``'s files and options (``kw``: the job's
    probe fields)."""
    profile = profiles.profile_of[cid]
    return StudyJob(
        client_id=cid,
        bundle=str(study.run.bundle(profile, t)),
        data=str(study.train_data(cid)),
        state=str(study.client_state(cid)),
        packet=str(packet or study.packet(t, cid)),
        profile=profiles.edge_profile(cid),
        codec=cfg.codec,
        frozen_weights=cfg.frozen_weights or None,
        val_fraction=cfg.val_fraction,
        **kw,
    )


def _probe(
    study: StudyFolder,
    t: int,
    ids: list[str],
    profiles: StudyProfiles,
    engine: Engine,
    cfg: SimConfig,
    device: torch.device,
) -> dict:
    """The round's first exchange: every client's gradient packet, then the cloud's answer ``h``."""
    paths = [study.probe_packet(t, cid) for cid in ids]
    jobs = [_job(study, t, cid, profiles, cfg, packet=p, probe=True) for cid, p in zip(ids, paths, strict=True)]
    engine.run(t, jobs, dict.fromkeys(ids, "probe"))
    return aggregate_probes(study.run.root, [(str(p), p.read_bytes()) for p in paths], device)


def _rechoose(
    study: StudyFolder, t: int, ids: list[str], profiles: StudyProfiles, cfg: SimConfig, engine: Engine
) -> list[dict]:
    """Every client that holds a deployed choice chooses again on round ``t + 1``'s bundle, as a device does
    when a bundle arrives (``ciders-edge validate``); those sampled next validate again when they train."""
    jobs = [
        _job(study, t + 1, cid, profiles, cfg, rechoose=True) for cid in ids if holds_choice(study.client_state(cid))
    ]
    outputs = engine.run(t + 1, jobs, {job.client_id: "re-choose" for job in jobs})
    return [
        {
            "type": "rechoice",
            "round": t,
            "client": cid,
            "bundle_round": t + 1,
            "deployed": outputs[cid].summary["deployed"],
            "deployed_nll": outputs[cid].summary["deployed_nll"],
            "kept_nll": outputs[cid].summary["val_nll_kept"],
        }
        for cid in (job.client_id for job in jobs)  # in the clients' order, whichever reply came first
    ]


def _client_record(
    t: int, cid: str, hp: RoundHyperparams, s: dict, diag: dict, bytes_down: int, probe_bytes: int = 0
) -> dict:
    return {
        "type": "client",
        "round": t,
        "client": cid,
        "gamma": hp.gamma,
        "loss_first": s["loss_first"],
        "loss_last": s["loss_last"],
        "dc_norm": s["dc_norm"],
        "c_i_norm": s["c_i_norm"],
        "r_fd": s["r_fd"],
        "bytes_up": s["packet_bytes"] + probe_bytes,
        "raw_bytes": s["raw_bytes"],
        "bytes_down": bytes_down,
        **diag,
    }


def _round_record(
    cfg: SimConfig,
    t: int,
    wall: float,
    participants: list[str],
    hp: RoundHyperparams,
    agg: dict,
    probed: dict,
    down: int,
) -> dict:
    probe_up, probe_down = probed.get("bytes_up", {}), probed.get("bytes_down", 0)
    return {
        "type": "round",
        "round": t,
        "algorithm": cfg.algorithm,
        "wall_s": wall,
        "participants": participants,
        "v_change": agg["v_change"],
        "c_norm": agg["c_norm"],
        "gamma": hp.gamma,
        "takd_last": agg["takd_last"],
        "bytes_up": sum(agg["bytes_up"].values()) + sum(probe_up.values()),
        "bytes_down": down + probe_down,  # per client, this round
        **({"backbones": agg["backbones"]} if "backbones" in agg else {}),  # each one's TAKD cost and fidelity
        **(probed.get("bilevel") or agg.get("bilevel") or {}),  # the strategy's report of its exchange or its step
        **({"privacy": _privacy_record(agg["privacy"])} if "privacy" in agg else {}),
        **({"fleet_choice": agg["fleet_choice"]} if "fleet_choice" in agg else {}),  # the next bundles' evidence
    }


def _privacy_record(privacy: dict) -> dict:
    """The round's epsilon and the mechanism's figures, without the per-client norms."""
    return {k: v for k, v in privacy.items() if k != "norms_before_clip"}
