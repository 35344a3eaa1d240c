"""Shared by the benchmarks: machine facts, medians, and writing JSON + a markdown table."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    import torch  # here, not at the top: scaling.py's parent process imports this module and must stay small

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def commit() -> str:
    if sha := os.environ.get("CIDERS_COMMIT"):  # a copy of the tree without its .git (a lent GPU machine)
        return sha
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        dirty = subprocess.run(
            # results rewritten by a read-back do not make the commit dirty
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)benchmarks/results"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def this_call() -> dict:
    """This process's command line and the commit it ran at: what a result file records it came from."""
    return {"command": " ".join(shlex.quote(a) for a in sys.argv), "commit": commit()}


def write_results(name: str, payload: dict, table: list[list[str]], header: list[str], notes: str = "") -> Path:
    """Write ``results/NAME.json`` and ``results/NAME.md`` with commit, machine and command line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {**this_call(), "machine": machine()}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, **payload}, indent=2) + "\n")
    lines = [
        f"# {name}",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: {meta['commit']}",
        f"- machine: {meta['machine']}",
        "",
    ]
    lines += markdown_table(header, table)
    if notes:
        lines += ["", notes]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# the real data the benchmarks read (never copied into the repository): $CIDERS_DATA, by default the
# shared data folder beside this checkout
DATA = Path(os.environ.get("CIDERS_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def data_dir(sub: str) -> Path:
    """A folder of the benchmark data (:data:`DATA`); exits with a clear line when this machine lacks it."""
    path = DATA / sub
    if not path.exists():
        sys.exit(f"{path}: not there (set CIDERS_DATA to the data folder, see its README.md); this benchmark needs it")
    return path


def run_simulate(cfg, out: Path, engine=None, device: str = "cpu") -> list[dict]:
    """One ``simulate`` run (the CLIs' code; its clients on ``engine``, an ``EngineSettings``, default
    in-process; the cloud's work on ``device``); returns its ``metrics.jsonl`` records.

    Resumable: a run that finished in ``out`` with the same config is read back, not run again. Else the
    study is made by a one-round ``simulate`` (a study is kept only once its first call ends) and grown by
    ``simulate --resume``, which a rerun after a stop continues from the last round committed (the metrics
    then also hold round 0's evaluation); a study of other settings in ``out`` starts over."""
    from ciders_cloud.study.report import load_metrics
    from ciders_cloud.study.resume import resume
    from ciders_cloud.study.simulate import simulate
    from ciders_edge.cli_utils import quiet_libraries

    if "target_epsilon" in cfg.dp and "rounds" not in cfg.dp:  # the budget lasts the study, not its first call
        cfg = cfg.replace(dp={**cfg.dp, "rounds": cfg.rounds})
    if _finished(cfg, out):
        print(f"{out}: finished before, read back", flush=True)
        return load_metrics(out)
    quiet_libraries()
    if _same_study(cfg, out):
        print(f"{out}: unfinished, resumed", flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)
        simulate(cfg.replace(rounds=1), out, device, engine)
    resume(out, cfg.rounds, device, engine)
    return load_metrics(out)


def saved_settings(out: Path) -> dict | None:
    """The settings of the study in ``out`` as this version reads them (a setting added since it was made
    takes its default, which is what the study ran with), as JSON; None when ``out`` holds no study."""
    from ciders_cloud.study.config import SimConfig

    try:
        saved = SimConfig.from_dict(json.loads((out / "config.json").read_text()), where=str(out / "config.json"))
    except (OSError, ValueError):  # ConfigError is a ValueError
        return None
    return json.loads(json.dumps(saved.to_dict()))


def _same_study(cfg, out: Path, rounds: bool = False) -> bool:
    """``out`` holds a study of ``cfg``'s settings (and of its rounds, with ``rounds``)."""
    if (saved := saved_settings(out)) is None:
        return False
    want = json.loads(json.dumps(cfg.to_dict()))
    return saved == want if rounds else {**saved, "rounds": None} == {**want, "rounds": None}


def _finished(cfg, out: Path) -> bool:
    """Same config, and the last round's evaluation is in the metrics (``simulate`` writes it last)."""
    from ciders_cloud.study.report import load_metrics

    try:
        rows = load_metrics(out)
    except (OSError, ValueError):  # ConfigError (no metrics) is a ValueError
        return False
    last = cfg.rounds - 1
    return _same_study(cfg, out, rounds=True) and any(r["type"] == "cross" and r["round"] == last for r in rows)


def final_scores(rows: list[dict]) -> dict:
    """The last evaluation: mean personalized and global NLL over clients, the NLL matrix, its mean
    diagonal (matched-domain NLL), Delta_cross, the same matched NLL on AdapFu, and the round-0
    baseline (AdapEmu and base model) every gain is measured from."""
    last = max(r["round"] for r in rows if r["type"] == "eval")
    evals = [r for r in rows if r["type"] == "eval" and r["round"] == last]
    matrix = next(r for r in rows if r["type"] == "cross" and r["round"] == last)
    baseline = [r for r in rows if r["type"] == "baseline"]
    mean = lambda rs, k: statistics.mean(r[k] for r in rs) if rs and rs[0].get(k) is not None else None  # noqa: E731
    return {
        "nll_personal": statistics.mean(r["nll_personal"] for r in evals),
        "nll_global": statistics.mean(r["nll_global"] for r in evals),
        "matrix": matrix["matrix"],
        "matched_nll": statistics.mean(row[i] for i, row in enumerate(matrix["matrix"])),
        "matched_nll_full": mean(evals, "nll_full_personal"),
        "baseline_emu": mean(baseline, "nll_emu"),
        "baseline_full": mean(baseline, "nll_full"),
        "delta_cross": matrix["delta_cross"],
    }


def trainable_lines(path: Path, wanted: int | None = None) -> list[str]:
    """The first ``wanted`` lines (default: all) of ``path`` whose response starts within the run's
    sequence length: the records training keeps (of five_domain's finance train.jsonl, 80 of 1000 lines)."""
    from ciders_edge.data.records import IGNORE, encode, to_chat
    from ciders_edge.hyperparams import RoundHyperparams
    from ciders_edge.model.sources import load_tokenizer, resolve_model

    tok, max_len = load_tokenizer(resolve_model("smollm2-135m")), RoundHyperparams().seq_len
    kept = []
    for line in path.read_text().splitlines():
        _, labels = encode(tok, *to_chat(json.loads(line)), max_len)
        if any(x != IGNORE for x in labels[1:]):
            kept.append(line)
        if len(kept) == wanted:
            break
    return kept


def domain_study(domains: tuple[str, ...], **overrides):
    """A ``simulate`` config with one five_domain domain per client: it trains on the domain's
    ``train.jsonl`` and is scored on its ``eval.jsonl``; SmolLM2, messenger depth 6, drop 0.2,
    evaluated after the last round only."""
    from ciders_cloud.study.config import SimConfig

    five = data_dir("five_domain")
    base = {
        "model": "smollm2-135m",
        "data": [str(five / d / "train.jsonl") for d in domains],
        "eval_data": [str(five / d / "eval.jsonl") for d in domains],
        "partition": "per-file",
        "clients": len(domains),
        "eval_examples": 16,
        "eval_generate": 0,
        "messenger_depth": 6,
        "drop_ratio": 0.2,
    }
    base["eval_every"] = overrides.get("rounds", 1)
    return SimConfig(**{**base, **overrides})
