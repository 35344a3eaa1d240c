"""Is the messenger a device deploys never worse than the global one? Issue 58's study.

    python benchmarks/deployed_choice.py --rounds 8 --out runs/deployed-choice   # stop it and rerun at will
    python benchmarks/deployed_choice.py --report-only --out runs/deployed-choice

The long run's two settings where the global messenger beat the personalized ones (``long_run.py``):
``partial`` (20 clients, 5 sampled a round) and ``c0.1`` (Dolly over 8 clients by a Dirichlet(0.1)),
CIDERS-FO with the round defaults, each client training as a device does: a validation slice of its own
records held out (``--val-fraction``), the best messenger on it kept (:mod:`ciders_edge.training.validation`).
Each evaluation scores, on every client's held-out eval set and on AdapFu (the backbone ``rpi5-8gb``
deploys), the messenger the client deploys beside its latest personalized one, the global one and the base
model. Studies grow ``--step`` rounds a pass with ``simulate --resume`` (``long_run.grow_in_passes``); after each pass
the judge (:mod:`deployed_judge`) scores the same four on ``--judge-records`` held-out records a client, since the
study's own 8 cannot resolve 0.01 nats, and ``results/deployed_choice.{json,md}`` hold every evaluated round and
the issue's two targets:
- the deployed choice within ``--tolerance`` nats of the better of {latest personalized, global} on at
  least 90% of the clients that deploy one (a client never sampled has no state and runs the global one);
- on no client worse than the base model (counted as measured, beyond the tolerance, and beyond two paired
  standard errors: what the judge's records can tell from noise).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from deployed_judge import judged  # noqa: E402
from long_run import _metrics, grow_in_passes, study_config  # noqa: E402

SETTINGS = ("partial", "c0.1")
ALGORITHM = "ciders-fo"
SHARE_TARGET = 0.9  # of the clients that deploy a messenger of their own choice


def clients_at(rows: list[dict]) -> dict[int, list[dict]]:
    """Per evaluated round, the eval records of the clients that hold a deployed choice."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        if r["type"] == "eval" and "nll_full_deployed" in r:
            out.setdefault(r["round"], []).append(r)
    return out


JUDGED_AS = {"deployed": "deployed", "latest": "personal", "global": "global", "base": "base"}  # judge: study


def score_round(records: list[dict], tolerance: float) -> dict:
    """The targets' figures over one round's clients, from the study's own evaluation."""
    rows = [
        {
            "deployed": r["deployed"],
            "gap": r["nll_full_deployed"] - min(r["nll_full_personal"], r["nll_full_global"]),
            "over_base": r["nll_full_deployed"] - r["nll_full_base"],
            **{f"nll_{k}": r[f"nll_full_{n}"] for k, n in JUDGED_AS.items()},
        }
        for r in records
    ]
    return score(rows, tolerance)


def score(rows: list[dict], tolerance: float) -> dict:
    """Over one round's clients: the share within ``tolerance`` of the better of {latest, global}; how many
    are worse than the base model, as measured, beyond ``tolerance`` and (the judge's rows) beyond two paired
    standard errors; the mean NLLs."""
    within = sum(r["gap"] <= tolerance for r in rows)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["deployed"]] = kinds.get(r["deployed"], 0) + 1
    judged = all("over_base_se" in r for r in rows)
    held = sum(r["gap_held"] <= tolerance for r in rows) if all("gap_held" in r for r in rows) else None
    return {
        "clients": len(rows),
        "within": within,
        "share_within": within / len(rows),
        "within_of_held": held,  # against the global each client holds (the judge's rows)
        "worst_gap": max(r["gap"] for r in rows),
        "worse_than_base": sum(r["over_base"] > 0 for r in rows),
        "worse_than_base_beyond_tolerance": sum(r["over_base"] > tolerance for r in rows),
        "worse_than_base_beyond_2se": sum(r["over_base"] > 2 * r["over_base_se"] for r in rows) if judged else None,
        "worst_vs_base": max(r["over_base"] for r in rows),
        **{k: mean(r[f"nll_{k}"] for r in rows) for k in JUDGED_AS},
        "kinds": kinds,
    }


def report(args: argparse.Namespace) -> None:
    """``results/deployed_choice.{json,md}`` from the studies under ``--out``: per evaluated round, the
    study's own evaluation (``eval_examples`` records a client) and the judge's (``--judge-records``)."""
    payload: dict = {"settings": {}, "val_fraction": args.val_fraction, "tolerance": args.tolerance}
    table = []
    for setting in args.settings.split(","):
        out = args.out / setting / ALGORITHM
        by_round = dict(sorted(clients_at(_metrics(out)).items()))
        rounds = {t: score_round(recs, args.tolerance) for t, recs in by_round.items()}
        judge = judged(out)
        verdicts = {t: score(list(j["clients"].values()), args.tolerance) for t, j in judge.items()}
        payload["settings"][setting] = {"rounds": rounds, "clients": by_round, "judged": verdicts}
        for t in sorted(set(rounds) | set(verdicts)):
            if t in rounds:
                table.append(_row(setting, t, f"study ({study_records(out)})", rounds[t]))
            if t in verdicts:
                table.append(_row(setting, t, f"judge ({judged_records(judge[t])})", verdicts[t]))
    header = [
        "setting", "round", "scored by (eval records a client)", "clients deploying", "deployed NLL",
        "latest personalized", "global", "base model", f"within {args.tolerance} of min(latest, global)",
        "... of the global it holds", "worst gap",
        f"worse than base (> {args.tolerance}; > 2 SE)", "deployed", "targets",
    ]  # fmt: skip
    notes = (
        f"AdapFu NLL on each client's held-out eval set (means over the clients that hold a deployed choice: a client "
        f"never sampled has none), CIDERS-FO, `--val-fraction {args.val_fraction}`. Targets (issue 58): within "
        f"{args.tolerance} nats on >= {SHARE_TARGET:.0%} of clients, worse than the base model on none. Each round has "
        "the study's own evaluation and, where judged, the judge's on more records (`deployed_judge.py`)."
    )
    path = write_results(args.results, payload, table, header, notes)
    print(f"wrote {path}")


def judged_records(verdict: dict) -> str:
    """The records the judge scored a client: ``--judge-records``, or the range its clients held where fewer
    (a study judged before eval sets were topped up, or a client whose partition runs short)."""
    held = sorted({c.get("records", verdict["records"]) for c in verdict["clients"].values()})
    if held[-1] >= verdict["records"] or held[0] == held[-1]:
        return str(held[-1])
    return f"{held[0]}-{held[-1]}"


def study_records(out: Path) -> int | str:
    """How many eval records a client the study's own evaluation scores."""
    config = out / "config.json"
    return json.loads(config.read_text())["eval_examples"] if config.is_file() else "?"


def _row(setting: str, t: int, scored_by: str, s: dict) -> list[str]:
    passes = s["share_within"] >= SHARE_TARGET and s["worse_than_base"] == 0
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["kinds"].items()))
    beyond_se = "-" if s["worse_than_base_beyond_2se"] is None else s["worse_than_base_beyond_2se"]
    over_base = f"{s['worse_than_base']} ({s['worse_than_base_beyond_tolerance']}; {beyond_se})"
    return [
        setting, str(t), scored_by, str(s["clients"]), f"{s['deployed']:.4f}", f"{s['latest']:.4f}",
        f"{s['global']:.4f}", f"{s['base']:.4f}", f"{s['within']}/{s['clients']} ({s['share_within']:.0%})",
        "-" if s["within_of_held"] is None else f"{s['within_of_held']}/{s['clients']}", f"{s['worst_gap']:+.4f}",
        f"{over_base}, worst {s['worst_vs_base']:+.4f}",
        kinds, "pass" if passes else "**fail**",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/deployed-choice"))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--step", type=int, default=4, help="rounds every study gains a pass")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="each client's validation slice")
    ap.add_argument("--tolerance", type=float, default=0.01, help="nats the deployed choice may trail the better one")
    ap.add_argument("--local-steps", type=int, default=5, help="K")
    ap.add_argument("--profile", default="rpi5-8gb", help="every client's device profile")
    ap.add_argument("--max-records", type=int, default=64, help="records per client, the validation slice's included")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-examples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="tiny for a quick try of the script")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--judge-records", type=int, default=64, help="held-out records a client judged (0: none)")
    ap.add_argument(
        "--rechoose",
        action="store_true",
        help="clients choose again on each new bundle (simulate --rechoose); new --out",
    )
    ap.add_argument("--results", default="deployed_choice", help="the results file's name in benchmarks/results")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time box's stop unwinds: grow notes its rounds
    if not args.report_only:
        from ciders_edge.cli_utils import quiet_libraries

        quiet_libraries()
        studies = [
            (
                study_config(s, ALGORITHM, args).replace(val_fraction=args.val_fraction, rechoose=args.rechoose),
                args.out / s / ALGORITHM,
            )
            for s in args.settings.split(",")
        ]
        judge_and_report = lambda: (judge(studies, args), report(args))  # noqa: E731
        judge(studies, args)  # the round a study stopped at, if not judged yet
        grow_in_passes(studies, args.rounds, args.step, args.device, judge_and_report)
    report(args)


def judge(studies: list, args: argparse.Namespace) -> None:
    """The judge's verdict on every study's last round, where it has one to judge."""
    from deployed_judge import judge_round

    for _, out in studies if args.judge_records else []:
        if (out / "config.json").is_file() and (path := judge_round(out, args.judge_records, args.device)):
            print(f"judged: {path}")


if __name__ == "__main__":
    main()
