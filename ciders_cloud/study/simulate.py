"""``ciders-cloud simulate``: the cloud and N edges in one process, through the same code as the CLIs.

Each round, every sampled client runs :func:`ciders_edge.training.train.train` (``ciders-edge train``)
on its own data and state folder and writes a real packet; the cloud runs
:func:`ciders_cloud.round.aggregate.aggregate_files` (``ciders-cloud aggregate``) on those packets. The
algorithm is the run's strategy; diagnostics and evaluations go to the study's ``metrics.jsonl``.
With ``--profile-mix`` the clients run different device profiles (:mod:`.profiles`), each on its own
profile's bundle.

This module builds the study (its data, the prepared run: :class:`ciders_cloud.run.folder.StudyFolder`
draws the tree); :mod:`.round_loop` runs the rounds; :mod:`.staging` builds it all in a hidden
folder beside ``--out`` and renames it into place after the last round.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ciders_cloud.models.device import cloud_device
from ciders_cloud.preparation import prepare
from ciders_cloud.privacy import PrivateRelease, with_noise
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.run.folder import StudyFolder
from ciders_cloud.run.splits import fleet_split, run_profiles
from ciders_cloud.strategies import check_run
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.engines import EngineSettings, run_with
from ciders_cloud.study.partition import partition
from ciders_cloud.study.round_loop import run_rounds
from ciders_cloud.study.staging import staged
from ciders_edge.data.records import read_jsonl
from ciders_edge.errors import ConfigError
from ciders_edge.formats.atomic import write_json, write_jsonl
from ciders_edge.hyperparams import RoundHyperparams

__all__ = [
    "SimConfig",
    "simulate",
    "prepare_study",
    "client_ids",
    "client_records",
    "without_where",
    "write_client_data",
]


def client_ids(n: int) -> list[str]:
    return [f"client-{i:02d}" for i in range(n)]


def simulate(
    cfg: SimConfig, out: str | Path, device: str | torch.device = "cpu", engine: EngineSettings | None = None
) -> dict:
    """Run ``cfg.rounds`` rounds; returns the last evaluation and where everything is.

    Args:
        device: where the cloud's TAKD, fidelity, Hessian products and the evaluation run (``auto``,
            ``cpu``, ``cuda``); not part of the study. The edges run where their profile says.
        engine: where the clients train (:mod:`.engines`: in this process by default, or Flower's
            Simulation Engine); not part of the study either.

    Raises:
        ConfigError: ``out`` exists and is not empty, or ``device`` is not here.
    """
    device = cloud_device(device)
    out = Path(out)
    with staged(out) as study:
        ids, domains = _build_study(cfg, study, device)
        last_eval = run_with(engine, ids, lambda e: run_rounds(cfg, study, ids, domains, device, engine=e))
    return {
        "out": str(out),
        "run": str(StudyFolder(out).run.root),
        "algorithm": cfg.algorithm,
        "rounds": cfg.rounds,
        "clients": cfg.clients,
        **{k: v for k, v in last_eval.items() if k != "records"},
    }


def prepare_study(
    cfg: SimConfig, out: str | Path, device: str | torch.device = "cpu"
) -> tuple[Path, list[str], dict[str, str]]:
    """The study before round 0: ``config.json``, each client's ``data/<id>/{train,eval}.jsonl`` and
    the prepared ``run``. Deterministic in ``cfg`` (and the device), so a fleet started on a second copy
    (``ciders-cloud serve``) can be checked against ``simulate`` bit for bit."""
    device = cloud_device(device)
    out = Path(out)
    with staged(out) as study:
        ids, domains = _build_study(cfg, study, device)
    return StudyFolder(out).run.root, ids, domains


def _build_study(cfg: SimConfig, study: StudyFolder, device: torch.device) -> tuple[list[str], dict[str, str]]:
    write_json(study.config, cfg.to_dict())
    ids = client_ids(cfg.clients)
    domains = write_client_data(cfg, study, ids)
    run = with_noise(check_run(_run_config(cfg, ids, study)))  # refused, or epsilon's noise solved, before the model
    if (release := PrivateRelease.of(run)) is not None:  # before the model loads: the budget must last the rounds
        release.check_rounds(cfg.rounds)
    prepare(run, study.run.root, device)
    return ids, domains


def client_records(cfg: SimConfig) -> tuple[list[list[dict]], list[str]]:
    """Each client's records in the order it takes them (``max_records`` keeps the first, its eval set the
    first of those) and its domain label: the partition, each part shuffled by the study's seed."""
    if cfg.partition == "per-file":
        if len(cfg.data) != cfg.clients:
            raise ConfigError(f"per-file partition needs one --data file per client: {len(cfg.data)} for {cfg.clients}")
        parts = [read_jsonl(f) for f in cfg.data]
        labels = [_label(p, Path(f).parent.name) for p, f in zip(parts, cfg.data, strict=True)]
    else:
        records = [r for f in cfg.data for r in read_jsonl(f)]
        parts = partition(records, cfg.clients, cfg.partition, cfg.seed)
        labels = [_label(p, f"part-{i}") for i, p in enumerate(parts)]
    rng = random.Random(cfg.seed)
    parts = [list(p) for p in parts]
    for part in parts:
        rng.shuffle(part)
    return parts, labels


def write_client_data(cfg: SimConfig, study: StudyFolder, ids: list[str]) -> dict[str, str]:
    """Write each client's train/eval JSONL; returns each client's domain label (for the NLL matrix)."""
    parts, labels = client_records(cfg)
    public = []
    evals = [read_jsonl(f) for f in cfg.eval_data] or [None] * len(parts)
    for cid, part, held in zip(ids, parts, evals, strict=True):
        if cfg.max_records:
            part = part[: cfg.max_records]
        if held is None:  # hold out a share of the client's own records
            n_eval = max(1, int(len(part) * cfg.holdout))
            if len(part) <= n_eval:
                raise ConfigError(f"{cid} has {len(part)} records: too few to hold out {n_eval} for evaluation")
            held, part = part[:n_eval], part[n_eval:]
        write_jsonl(study.eval_data(cid), without_where(held))
        write_jsonl(study.train_data(cid), without_where(part))
        public += part[:40]
    if not cfg.public_data:
        write_jsonl(study.public_data, without_where(public))
    return dict(zip(ids, labels, strict=True))


def _label(records: list[dict], default: str) -> str:
    """A client's majority domain/category, for naming the rows of the NLL matrix."""
    for fld in ("domain", "category"):
        values = [str(r[fld]) for r in records if fld in r]
        if values:
            return max(set(values), key=values.count)
    return default


def _run_config(cfg: SimConfig, ids: list[str], study: StudyFolder) -> RunConfig:
    hp = RoundHyperparams(local_steps=cfg.local_steps).replace(**cfg.hyperparameters)
    profiles, kept = run_profiles(list(cfg.mix) or [cfg.profile])
    split = fleet_split(profiles, cfg.messenger_depth, cfg.drop_ratio)
    if cfg.profile_splits:
        split["profile_splits"] = cfg.profile_splits
    return RunConfig(
        model=cfg.model,
        **kept,
        seed=cfg.seed,
        **split,
        public_data=cfg.public_data or str(study.public_data),
        **{k: getattr(cfg, k) for k in ("layer_steps", "align_steps") if getattr(cfg, k) is not None},
        takd=TakdConfig().replace(**cfg.takd).to_dict(),
        hyperparameters=hp.to_dict(),
        algorithm=cfg.algorithm,
        **cfg.strategy_tables(),
        gamma_schedule=cfg.gamma_schedule,
        client_ids=ids,
        participation=cfg.participation,
        sampling=cfg.sampling,
        dp={"rounds": cfg.rounds, **cfg.dp} if "target_epsilon" in cfg.dp else cfg.dp,  # the study's rounds, planned
    )


def without_where(rows: list[dict]) -> list[dict]:
    """The records without ``read_jsonl``'s ``_where`` (the line they came from)."""
    return [{k: v for k, v in r.items() if k != "_where"} for r in rows]
