"""``ciders-cloud report``: PNG plots and a markdown summary comparing simulation runs.

The report is drawn into a hidden folder beside ``--out`` and swapped in whole, so a failure leaves
the previous report (or none) and never a mix of old and new plots.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from statistics import mean

from ciders_cloud.run.folder import ReportFolder, StudyFolder
from ciders_edge.errors import ConfigError
from ciders_edge.formats.atomic import fsync_tree, replace_dir, staging_dir
from ciders_edge.progress import console

__all__ = ["report", "load_metrics"]


def load_metrics(run: Path, repair: bool = False) -> list[dict]:
    """The records of the study ``run`` (a ``simulate`` output folder); a line that is not a record is
    refused by its number, but for a last line cut short (:func:`_whole_lines`)."""
    path = StudyFolder(run).metrics
    if not path.is_file():
        raise ConfigError(f"{run}: no {path.name} (is it a `ciders-cloud simulate` output folder?)")
    records = []
    for number, line in enumerate(_whole_lines(path, repair), 1):
        if line.strip():
            if (record := _record(line)) is None:
                raise ConfigError(f"{path}, line {number}: not a JSON record; restore the study's {path.name}")
            records.append(record)
    return records


def _whole_lines(path: Path, repair: bool) -> list[bytes]:
    """The file's lines up to its last whole one: a last line cut short (what a crash while a record was
    appended leaves) is left out, and said so. With ``repair`` it is cut from the file too, so that the
    records appended next start on a line of their own."""
    data = path.read_bytes()
    whole, _, cut = data.rpartition(b"\n")  # cut: what follows the last newline (none when the file ends in one)
    if cut and _record(cut) is not None:  # a whole record but for its newline
        whole, cut = data, b""
        if repair:
            with path.open("ab") as f:
                f.write(b"\n")
    elif cut:
        lines = whole.splitlines()
        console.print(f"[yellow]notice:[/] {path}: its last line is cut short (a crash as it was written); "
                      f"read its {len(lines)} whole lines")  # fmt: skip
        if repair:
            os.truncate(path, len(data) - len(cut))
    return whole.splitlines()


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "type" in record else None


def _label(run: Path, rows: list[dict]) -> str:
    algo = next((r["algorithm"] for r in rows if r["type"] == "round"), "?")
    return algo if run.name == algo else f"{algo} ({run.name})"


def _per_round(rows: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    by = defaultdict(list)
    for r in rows:
        if r["type"] == kind and r.get(key) is not None and r[key] == r[key]:  # skip NaN
            by[r["round"]].append(r[key])
    rounds = sorted(by)
    return rounds, [mean(by[t]) for t in rounds]


def report(runs: list[str | Path], out: str | Path) -> dict:
    """Draw the plots for ``runs`` into ``out`` and write ``out/summary.md``; returns the file list.

    Raises:
        ConfigError: a run has no metrics, or ``out`` holds files a report did not write.
    """
    data = {Path(r): load_metrics(Path(r)) for r in runs}
    labels = {run: _label(run, rows) for run, rows in data.items()}
    out = Path(out)
    _check_out(out)
    staging = staging_dir(out)
    try:
        files = _draw(ReportFolder(staging), data, labels)
        fsync_tree(staging)
        replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"out": str(out), "files": files}


def _check_out(out: Path) -> None:
    """``out`` is new, empty or an earlier report: replacing it whole loses nothing else."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: is a file; choose a folder for --out")
    other = sorted(p.name for p in out.iterdir() if not ReportFolder.holds(p)) if out.is_dir() else []
    if other:
        raise ConfigError(f"{out}: holds {other[0]}, which `report` did not write; choose a new --out")


def _draw(out: ReportFolder, data: dict, labels: dict) -> list[str]:
    """Every plot and ``summary.md`` into ``out``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []

    def line_plot(name: str, kind: str, key: str, title: str, ylabel: str) -> None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, rows in data.items():
            x, y = _per_round(rows, kind, key)
            if x:
                ax.plot(x, y, marker="o", label=labels[run])
        ax.set(title=title, xlabel="round", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.plot(name), dpi=120)
        plt.close(fig)
        files.append(name)

    line_plot("loss.png", "client", "loss_last", "local training loss (mean over clients)", "loss")
    line_plot("e_rae.png", "client", "E-RAE", "E-RAE (measured vs Prop. 2 direction)", "E-RAE")
    line_plot("nll.png", "eval", "nll_personal", "held-out NLL, personalized messenger", "NLL / token")
    line_plot("bytes_up.png", "round", "bytes_up", "bytes uploaded per round (all clients)", "bytes")
    files.append(_gamma_plot(plt, out, data, labels))
    for run, rows in data.items():
        last = {}  # the last matrix, or in a mixed fleet each profile's (its messengers on its own backbone)
        for r in (r for r in rows if r["type"] == "cross"):
            last[r.get("profile")] = r
        for profile, cross in last.items():
            files.append(_heatmap(plt, out, run, cross, labels[run], profile))
    out.summary.write_text(_summary(data, labels))
    files.append(out.summary.name)
    return files


def _gamma_plot(plt, out: ReportFolder, data: dict, labels: dict) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run, rows in data.items():
        pts = [r for r in rows if r["type"] == "client"]
        g = [r["gamma"] for r in pts]
        ax.scatter(g, [r["S-PPR"] for r in pts], marker="^", label=f"S-PPR {labels[run]}")
        ax.scatter(g, [r["S-DR"] for r in pts], marker="v", label=f"S-DR {labels[run]}")
        ax.scatter(g, [r["PPR"] for r in pts], marker=".", alpha=0.5, label=f"PPR (measured) {labels[run]}")
    ax.set(title="S-DR and S-PPR against gamma", xlabel="gamma_t", ylabel="share")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.plot("sdr_sppr_gamma.png"), dpi=120)
    plt.close(fig)
    return "sdr_sppr_gamma.png"


def _heatmap(plt, out: ReportFolder, run: Path, cross: dict, label: str, profile: str | None = None) -> str:
    """The NLL matrix, coloured by each cell's difference to its column's mean: domains differ in
    difficulty far more than messengers do, so raw NLL colours would hide the personalization."""
    matrix = cross["matrix"]
    col_mean = [mean(col) for col in zip(*matrix, strict=True)]
    diff = [[v - m for v, m in zip(row, col_mean, strict=True)] for row in matrix]
    span = max(abs(d) for row in diff for d in row) or 1.0
    side = max(5.0, 0.75 * len(matrix) + 2.0)  # room for one "3.142" per cell
    fig, ax = plt.subplots(figsize=(side + 1.0, side))
    im = ax.imshow(diff, cmap="RdBu_r", vmin=-span, vmax=span)
    names = [f"{c}\n{d}" for c, d in zip(cross["clients"], cross["domains"], strict=True)]
    ax.set_xticks(range(len(names)), names, fontsize=6, rotation=45)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    for i, row in enumerate(cross["matrix"]):
        for j, v in enumerate(row):
            ink = "w" if abs(diff[i][j]) > 0.6 * span else "k"
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", color=ink, fontsize=7)
    title = f"NLL: model of row on data of column\n{label}" + (f", {profile} clients" if profile else "")
    ax.set(title=title, xlabel="eval data", ylabel="personalized model")
    fig.colorbar(im, ax=ax, label="NLL minus the column's mean")
    fig.tight_layout()
    name = f"nll_matrix_{run.name}{f'_{profile}' if profile else ''}.png"
    fig.savefig(out.plot(name), dpi=120)
    plt.close(fig)
    return name


def _summary(data: dict, labels: dict) -> str:
    lines = [
        "# CIDERS simulation report",
        "",
        "| run | rounds | round-0 AdapEmu NLL | final NLL personalized | final NLL global | "
        "AdapFu NLL personalized | Δcross | bytes up / round | bytes down / client / round | wall s / round | "
        "ε spent (δ) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, rows in data.items():
        evals = [r for r in rows if r["type"] == "eval"]
        last = max((r["round"] for r in evals), default=None)
        final = [r for r in evals if r["round"] == last]
        rounds = [r for r in rows if r["type"] == "round"]
        cross = [r for r in rows if r["type"] == "cross"]
        whole = cross and cross[-1]["delta_cross"] is not None and "profile" not in cross[-1]  # one matrix of all
        dc = cross[-1]["delta_cross"] if whole else float("nan")

        baseline = [r for r in rows if r["type"] == "baseline"]
        lines.append(
            f"| {labels[run]} | {len(rounds)} | {_mean(baseline, 'nll_emu')} | {_mean(final, 'nll_personal')} | "
            f"{_mean(final, 'nll_global')} | {_mean(final, 'nll_full_personal')} | {dc:.4f} | "
            f"{mean(r['bytes_up'] for r in rounds):,.0f} | {mean(r['bytes_down'] for r in rounds):,.0f} | "
            f"{mean(r['wall_s'] for r in rounds):.1f} | {_epsilon(rounds)} |"
        )
    for run, rows in data.items():
        lines += _by_client(labels[run], rows)
    lines += ["", "Plots: loss.png, e_rae.png, nll.png, bytes_up.png, sdr_sppr_gamma.png, nll_matrix_*.png.", ""]
    return "\n".join(lines)


def _by_client(label: str, rows: list[dict]) -> list[str]:
    """A mixed fleet's clients one by one, with their profiles: matched-domain NLL before any training and
    after the last round, on the AdapEmu and on AdapFu (the personalized messenger on the full backbone)."""
    if not any("profile" in r for r in rows):
        return []
    evals = [r for r in rows if r["type"] == "eval"]
    last = max(r["round"] for r in evals)
    before = {r["client"]: r for r in rows if r["type"] == "baseline"}
    lines = [
        "",
        f"### {label}: each client on its profile",
        "",
        "| client | profile | domain | AdapEmu NLL round 0 → personalized | AdapFu NLL base → personalized | EM |",
        "|---|---|---|---|---|---|",
    ]
    for r in (r for r in evals if r["round"] == last):
        b = before[r["client"]]
        full = f"{b['nll_full']:.4f} → {r['nll_full_personal']:.4f}" if "nll_full" in b else "-"
        em = "-" if r.get("exact_match") is None else f"{r['exact_match']:.2f}"
        lines.append(
            f"| {r['client']} | {r['profile']} | {r['domain']} | {b['nll_emu']:.4f} → {r['nll_personal']:.4f} | "
            f"{full} | {em} |"
        )
    return lines


def _epsilon(rounds: list[dict]) -> str:
    """The privacy its last round had spent: ``2.1 (δ 0.02)``, or ``∞`` for a run without DP."""
    spent = rounds[-1].get("privacy") if rounds else None
    if spent is None:
        return "∞ (no DP)"
    eps = spent["epsilon"]
    return f"{eps:.3g} (δ {spent['delta']:.2g})" if isinstance(eps, float | int) else f"∞ (δ {spent['delta']:.2g})"


def _mean(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{mean(values):.4f}" if values else "-"
