"""``ciders-cloud simulate``: the cloud and N edges in one process, through the same code as the CLIs.

Each round, every sampled client runs :func:`ciders_edge.training.train.train` (``ciders-edge train``)
on its own data and state folder and writes a real packet; the cloud runs
:func:`ciders_cloud.rounds.aggregate_files` (``ciders-cloud aggregate``) on those packets. The
algorithm is the run's strategy; diagnostics and evaluations go to ``RUN/metrics.jsonl``.

The study is built in a hidden folder beside ``--out`` and renamed into place after its last round:
a failed run leaves no ``--out`` to block its rerun, and a killed one's folder is swept by the next.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from ciders_cloud.config import GAMMA_SCHEDULES, RunConfig, TakdConfig
from ciders_cloud.lock import LOCK_FILE, run_lock
from ciders_cloud.prepare import RUN_CONFIG, append_log, bundle_path, load_run, prepare
from ciders_cloud.rounds import aggregate_files, hypergradient_packets
from ciders_cloud.strategies import STRATEGIES, get_strategy, round_hyperparams_for
from ciders_cloud.study.diagnostics import client_diagnostics
from ciders_cloud.study.evaluation import evaluate_baseline, evaluate_round
from ciders_cloud.study.partition import partition
from ciders_edge.config import ConfigMixin, RoundHyperparams
from ciders_edge.data.records import read_jsonl
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.atomic import fsync_dir, staging_dir, write_bytes, write_json
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.packet import CODECS
from ciders_edge.profiles import load_profile
from ciders_edge.progress import console
from ciders_edge.training.train import probe, train

__all__ = ["SimConfig", "simulate", "prepare_study", "METRICS"]

METRICS = "metrics.jsonl"


@dataclass
class SimConfig(ConfigMixin):
    """Everything ``simulate`` takes; TOML keys equal these names, CLI flags override them."""

    CHOICES = {"algorithm": tuple(STRATEGIES), "gamma_schedule": GAMMA_SCHEDULES, "codec": CODECS}
    TABLES = {"hyperparameters": RoundHyperparams, "takd": TakdConfig}

    model: str = "tiny"
    data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)  # per-file: each client's own evaluation file
    clients: int = 3
    rounds: int = 3
    local_steps: int = 20  # K, as RoundHyperparams
    algorithm: str = "ciders-fo"
    partition: str = "iid"  # iid | dirichlet:ALPHA[:FIELD] | by-field:FIELD | per-file
    participation: float = 1.0
    seed: int = 0
    eval_every: int = 1
    eval_examples: int = 16  # held-out records per client scored for NLL
    eval_generate: int = 4  # held-out records per client answered for ROUGE-L / exact match
    holdout: float = 0.1
    max_records: int = 0  # cap per client (0: all)
    public_data: str = ""  # TAKD data; default: a sample of the clients' training data
    profile: str = "cpu-laptop"
    messenger_depth: int | None = None
    drop_ratio: float | None = None
    layer_steps: int | None = None  # prepare's bootstrap (None: the defaults of `prepare`)
    align_steps: int | None = None
    codec: str = "fp32"
    gamma_schedule: str = "constant"
    hyperparameters: dict = field(default_factory=dict)  # RoundHyperparams overrides
    takd: dict = field(default_factory=dict)  # TakdConfig overrides

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("simulate needs at least one --data file")
        if self.clients < 1 or self.rounds < 1 or self.local_steps < 1:
            raise ConfigError("`clients`, `rounds` and `local_steps` must be positive")
        if not 0.0 < self.participation <= 1.0:
            raise ConfigError(f"`participation` must be in (0, 1], got {self.participation}")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"`holdout` must be in (0, 1), got {self.holdout}")
        if self.eval_data and (self.partition != "per-file" or len(self.eval_data) != len(self.data)):
            raise ConfigError("`eval_data` takes one evaluation file per --data file, with the per-file partition")
        get_strategy(self.algorithm)


def client_ids(n: int) -> list[str]:
    return [f"client-{i:02d}" for i in range(n)]


def simulate(cfg: SimConfig, out: str | Path) -> dict:
    """Run ``cfg.rounds`` rounds; returns the last evaluation and where everything is.

    Raises:
        ConfigError: ``out`` exists and is not empty.
    """
    out = Path(out)
    with _staged(out) as root:
        ids, domains = _build_study(cfg, root)
        last_eval = _run_rounds(cfg, root, ids, domains)
    return {
        "out": str(out),
        "run": str(out / "run"),
        "algorithm": cfg.algorithm,
        "rounds": cfg.rounds,
        "clients": cfg.clients,
        **{k: v for k, v in last_eval.items() if k != "records"},
    }


def prepare_study(cfg: SimConfig, out: str | Path) -> tuple[Path, list[str], dict[str, str]]:
    """The study before round 0: ``config.json``, each client's ``data/<id>/{train,eval}.jsonl`` and
    the prepared ``run``. Deterministic in ``cfg``, so a fleet started on a second copy
    (``ciders-cloud serve``) can be checked against ``simulate`` bit for bit."""
    out = Path(out)
    with _staged(out) as root:
        ids, domains = _build_study(cfg, root)
    return out / "run", ids, domains


def _build_study(cfg: SimConfig, root: Path) -> tuple[list[str], dict[str, str]]:
    write_json(root / "config.json", cfg.to_dict())
    ids = client_ids(cfg.clients)
    domains = _materialize_data(cfg, root / "data", ids)
    prepare(_run_config(cfg, ids, root / "data"), root / "run")
    return ids, domains


def _run_rounds(cfg: SimConfig, out: Path, ids: list[str], domains: dict[str, str]) -> dict:
    """The rounds of a built study in ``out``; returns the last evaluation."""
    run_dir = out / "run"
    rng = random.Random(cfg.seed)
    strategy = get_strategy(cfg.algorithm)
    last_eval: dict = {}
    down = Bundle.load(bundle_path(run_dir, cfg.profile, 0)).delta_bytes(None)  # round 0: the whole bundle
    append_log(out / METRICS, evaluate_baseline(bundle_path(run_dir, cfg.profile, 0), out, ids, domains, cfg))
    for t in range(cfg.rounds):
        started = time.perf_counter()
        participants = sorted(rng.sample(ids, max(1, round(cfg.participation * len(ids)))))
        bundle = bundle_path(run_dir, cfg.profile, t)
        probe = _probe(run_dir, out, t, bundle, participants, cfg) if strategy.probes else {}
        packets, outputs = [], {}
        for cid in participants:
            console.print(f"[bold]round {t}[/] {cid} ({strategy.name})")
            packet = out / "packets" / f"round-{t:04d}" / f"{cid}.pkt"
            outputs[cid] = train(
                bundle,
                out / "data" / cid / "train.jsonl",
                out / "clients" / cid,
                packet,
                profile=cfg.profile,
                codec=cfg.codec,
                client_id=cid,
                hypergradient=probe.get("h"),
            )
            packets.append(packet)
        agg = aggregate_files(run_dir, packets)
        hp = round_hyperparams_for(load_run(run_dir), t)
        deltas = {cid: o.delta_sent for cid, o in outputs.items()}
        weights = dict(zip(agg["clients"], agg["weights"], strict=True))
        diag = client_diagnostics(
            deltas, {c: o.result.first_direction for c, o in outputs.items()}, weights, t, hp.gamma, hp.alpha
        )
        wall = time.perf_counter() - started
        probe_up, probe_down = probe.get("bytes_up", {}), probe.get("bytes_down", 0)
        records = [
            _client_record(t, cid, hp, outputs[cid].summary, diag[cid], down + probe_down, probe_up.get(cid, 0))
            for cid in participants
        ]
        records.append(
            {
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
                **(probe.get("bilevel") or agg.get("bilevel") or {}),  # FedNest / LFedNest's hypergradient
            }
        )
        down = agg["bytes_down"][cfg.profile]  # what each client fetches for the next round
        if (t + 1) % cfg.eval_every == 0 or t == cfg.rounds - 1:
            last_eval = evaluate_round(bundle_path(run_dir, cfg.profile, t + 1), out, ids, domains, cfg)
            records += last_eval["records"]
        append_log(out / METRICS, records)
    return last_eval


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh folder beside ``out``, renamed to ``out`` when the block succeeds and removed when it
    fails. It holds the run lock while the process lives, so the stale folder of a killed run is
    recognized and swept by the next one."""
    _refuse_filled(out)
    _sweep(out)
    root = staging_dir(out)
    with run_lock(root, "simulate"):
        try:
            yield root
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        (root / LOCK_FILE).unlink()  # still held through the open descriptor; a sweep no longer sees it
        _publish(root, out)


def _refuse_filled(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")


def _sweep(out: Path) -> None:
    """Remove the staging folders that killed runs left for ``out`` (their lock died with them)."""
    for lock in out.parent.glob(f".{glob.escape(out.name)}.*/{LOCK_FILE}"):
        try:
            with run_lock(lock.parent, "sweep"):
                shutil.rmtree(lock.parent, ignore_errors=True)
        except StateError:
            pass  # a live run's


def _publish(root: Path, out: Path) -> None:
    """Point the run at its data's published path, then rename the study into place."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: was filled while simulate ran; the finished study is in {root}")
    run = load_run(root / "run")
    if Path(run.public_data) == root / "data" / "public.jsonl":  # the default: a sample of client data
        public = out.absolute() / "data" / "public.jsonl"
        write_json(root / "run" / RUN_CONFIG, run.replace(public_data=str(public)).to_dict())
    if out.exists():
        out.rmdir()
    os.replace(root, out)
    fsync_dir(out.absolute().parent)


def _probe(run_dir: Path, out: Path, t: int, bundle: Path, ids: list[str], cfg: SimConfig) -> dict:
    """FedNest's first exchange: every client's gradient packet, then the cloud's hypergradient h."""
    paths = []
    for cid in ids:
        console.print(f"[bold]round {t}[/] {cid} probe")
        path = out / "packets" / f"round-{t:04d}" / f"{cid}.probe.pkt"
        data, state = out / "data" / cid / "train.jsonl", out / "clients" / cid
        probe(bundle, data, state, path, client_id=cid, profile=cfg.profile)
        paths.append(path)
    summary = hypergradient_packets(run_dir, [(str(p), p.read_bytes()) for p in paths])
    return {**summary, "h": load_file(summary["path"])}


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


def _materialize_data(cfg: SimConfig, root: Path, ids: list[str]) -> dict[str, str]:
    """Write each client's train/eval JSONL; returns each client's domain label (for the NLL matrix)."""
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
    public = []
    evals = [read_jsonl(f) for f in cfg.eval_data] or [None] * len(parts)
    for cid, part, held in zip(ids, parts, evals, strict=True):
        part = list(part)
        rng.shuffle(part)
        if cfg.max_records:
            part = part[: cfg.max_records]
        if held is None:  # hold out a share of the client's own records
            n_eval = max(1, int(len(part) * cfg.holdout))
            if len(part) <= n_eval:
                raise ConfigError(f"{cid} has {len(part)} records: too few to hold out {n_eval} for evaluation")
            held, part = part[:n_eval], part[n_eval:]
        _write_jsonl(root / cid / "eval.jsonl", held)
        _write_jsonl(root / cid / "train.jsonl", part)
        public += part[:40]
    if not cfg.public_data:
        _write_jsonl(root / "public.jsonl", public)
    return dict(zip(ids, labels, strict=True))


def _label(records: list[dict], default: str) -> str:
    """A client's majority domain/category, for naming the rows of the NLL matrix."""
    for fld in ("domain", "category"):
        values = [str(r[fld]) for r in records if fld in r]
        if values:
            return max(set(values), key=values.count)
    return default


def _run_config(cfg: SimConfig, ids: list[str], data_root: Path) -> RunConfig:
    hp = RoundHyperparams(local_steps=cfg.local_steps).replace(**cfg.hyperparameters)
    prof = load_profile(cfg.profile)
    return RunConfig(
        model=cfg.model,
        profiles=[cfg.profile],
        seed=cfg.seed,
        messenger_depth=cfg.messenger_depth if cfg.messenger_depth is not None else prof.messenger_depth,
        drop_ratio=cfg.drop_ratio if cfg.drop_ratio is not None else prof.drop_ratio,
        public_data=cfg.public_data or str(data_root / "public.jsonl"),
        **{k: getattr(cfg, k) for k in ("layer_steps", "align_steps") if getattr(cfg, k) is not None},
        takd=TakdConfig().replace(**cfg.takd).to_dict(),
        hyperparameters=hp.to_dict(),
        algorithm=cfg.algorithm,
        gamma_schedule=cfg.gamma_schedule,
        clients=ids,
    )


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    clean = [{k: v for k, v in r.items() if k != "_where"} for r in rows]
    write_bytes(path, "".join(json.dumps(r) + "\n" for r in clean).encode())
