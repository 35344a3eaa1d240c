"""``simulate --resume``: a study continued where it stopped, in place, to as many rounds as asked.

A long study runs a few rounds at a time: ``simulate --rounds 2`` publishes it, and ``simulate --resume
--rounds 20`` takes it on, as often as needed. A resume that is killed is resumed again: the server
state commits each round whole, each round's records are appended as it commits, and the states of a
round's participants are kept until it commits (:mod:`.snapshots`), so an interrupted round runs
again from its start. The study's own settings (its ``config.json``) hold; only the rounds grow.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import torch

from ciders_cloud.models.device import cloud_device
from ciders_cloud.privacy import PrivateRelease
from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import StudyFolder
from ciders_cloud.run.lock import run_lock
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.engines import EngineSettings, run_with
from ciders_cloud.study.report import load_metrics
from ciders_cloud.study.round_loop import evaluated_after, run_rounds
from ciders_cloud.study.simulate import client_ids
from ciders_cloud.study.snapshots import check_resumable, restore_uncommitted
from ciders_edge.errors import ConfigError
from ciders_edge.formats.atomic import write_json
from ciders_edge.progress import console

__all__ = ["resume"]


def resume(
    out: str | Path, rounds: int | None = None, device: str | torch.device = "cpu", engine: EngineSettings | None = None
) -> dict:
    """Run the study in ``out`` on to ``rounds`` rounds in all (default: its config's), on ``engine``;
    returns the last evaluation, as :func:`~ciders_cloud.study.simulate.simulate` does.

    Raises:
        ConfigError: ``out`` is not a study, or has run more than ``rounds`` rounds.
        BudgetError: a private study's budget does not allow ``rounds``.
        StateError: another command holds the study.
    """
    device = cloud_device(device)
    study = StudyFolder(out)
    old = _saved_config(study)
    with run_lock(study.root, "simulate --resume"):
        done = ServerState.load(study.run.server_state).round
        cfg = old.replace(rounds=old.rounds if rounds is None else rounds)
        if cfg.rounds < done:
            raise ConfigError(f"--rounds {cfg.rounds}: {out} has run {done} rounds already")
        if (release := PrivateRelease.of(load_run(study.run.root))) is not None:
            release.check_rounds(cfg.rounds)
        records = _consistent_metrics(study, done)
        check_resumable(study, client_ids(cfg.clients), done)
        restored = restore_uncommitted(study, done)
        if restored:
            console.print(f"[yellow]notice:[/] round {done} stopped after {len(restored)} trained; it runs again")
        write_json(study.config, cfg.to_dict())
        ids = client_ids(cfg.clients)
        domains = {r["client"]: r["domain"] for r in records if r["type"] == "baseline"}
        owed = done > 0 and evaluated_after(old, done - 1) and not _evaluated(records, done - 1)
        last = run_with(
            engine, ids, lambda e: run_rounds(cfg, study, ids, domains, device, done, evaluate_first=owed, engine=e)
        )
    last = last or _last_evaluation(load_metrics(study.root))
    return {
        "out": str(out),
        "run": str(study.run.root),
        "algorithm": cfg.algorithm,
        "rounds": cfg.rounds,
        "clients": cfg.clients,
        "resumed_at": done,
        **{k: v for k, v in last.items() if k != "records"},
    }


def _saved_config(study: StudyFolder) -> SimConfig:
    try:
        saved = json.loads(study.config.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{study.root}: no config.json; --resume takes a study `simulate` made") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{study.config}: not the study's config ({_reason(err)}); restore it") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{study.config}: not the study's config (a JSON {type(saved).__name__}); restore it")
    return SimConfig.from_dict(saved, where=str(study.config))


def _reason(err: UnicodeDecodeError | json.JSONDecodeError) -> str:
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 at byte {err.start}"
    return f"not JSON: {err.msg} at line {err.lineno}"


def _consistent_metrics(study: StudyFolder, done: int) -> list[dict]:
    """The study's records; a round the state committed but the log lacks (stopped in between) is named."""
    records = load_metrics(study.root, repair=True)  # the rounds run next append after its last whole line
    logged = {r["round"] for r in records if r["type"] == "round"}
    lost = sorted(set(range(done)) - logged)
    if lost:
        console.print(f"[yellow]notice:[/] round {lost[-1]}'s records were lost as it committed; its state holds")
    return records


def _evaluated(records: list[dict], t: int) -> bool:
    return any(r["type"] == "cross" and r["round"] == t for r in records)


def _last_evaluation(records: list[dict]) -> dict:
    """The means of the last evaluation in the log (a resume with no round left to run)."""
    last = max((r["round"] for r in records if r["type"] == "eval"), default=None)
    evals = [r for r in records if r["type"] == "eval" and r["round"] == last]
    cross = next((r for r in records if r["type"] == "cross" and r["round"] == last), {})
    return {
        "mean_nll_personal": mean(r["nll_personal"] for r in evals) if evals else None,
        "mean_nll_global": mean(r["nll_global"] for r in evals) if evals else None,
        "delta_cross": cross.get("delta_cross"),
    }
