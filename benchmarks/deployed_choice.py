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
``results/deployed_choice.{json,md}`` hold every evaluated round and the issue's two targets:
- the deployed choice within ``--tolerance`` nats of the better of {latest personalized, global} on at
  least 90% of the clients that deploy one (a client never sampled has no state and runs the global one);
- on no client worse than the base model.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
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


def score_round(records: list[dict], tolerance: float) -> dict:
    """The targets' figures over one round's clients."""
    gaps = [r["nll_full_deployed"] - min(r["nll_full_personal"], r["nll_full_global"]) for r in records]
    over_base = [r["nll_full_deployed"] - r["nll_full_base"] for r in records]
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["deployed"]] = kinds.get(r["deployed"], 0) + 1
    return {
        "clients": len(records),
        "within": sum(g <= tolerance for g in gaps),
        "share_within": sum(g <= tolerance for g in gaps) / len(records),
        "worst_gap": max(gaps),
        "worse_than_base": sum(d > 0 for d in over_base),
        "worst_vs_base": max(over_base),
        "deployed": mean(r["nll_full_deployed"] for r in records),
        "latest": mean(r["nll_full_personal"] for r in records),
        "global": mean(r["nll_full_global"] for r in records),
        "base": mean(r["nll_full_base"] for r in records),
        "kinds": kinds,
    }


def report(args: argparse.Namespace) -> None:
    """``results/deployed_choice.{json,md}`` from the studies under ``--out``."""
    payload: dict = {"settings": {}, "val_fraction": args.val_fraction, "tolerance": args.tolerance}
    table = []
    for setting in args.settings.split(","):
        out = args.out / setting / ALGORITHM
        by_round = dict(sorted(clients_at(_metrics(out)).items()))
        rounds = {t: score_round(recs, args.tolerance) for t, recs in by_round.items()}
        payload["settings"][setting] = {"rounds": rounds, "clients": by_round}
        for t, s in rounds.items():
            passes = s["share_within"] >= SHARE_TARGET and s["worse_than_base"] == 0
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["kinds"].items()))
            table.append([
                setting, str(t), str(s["clients"]), f"{s['deployed']:.4f}", f"{s['latest']:.4f}", f"{s['global']:.4f}",
                f"{s['base']:.4f}", f"{s['within']}/{s['clients']} ({s['share_within']:.0%})", f"{s['worst_gap']:+.4f}",
                f"{s['worse_than_base']} (worst {s['worst_vs_base']:+.4f})", kinds, "pass" if passes else "**fail**",
            ])  # fmt: skip
    header = [
        "setting", "round", "clients deploying", "deployed NLL", "latest personalized", "global", "base model",
        f"within {args.tolerance} of min(latest, global)", "worst gap", "worse than base", "deployed", "targets",
    ]  # fmt: skip
    notes = (
        f"AdapFu NLL on each client's held-out eval set (means over the clients that hold a deployed choice: a client "
        f"never sampled has none), CIDERS-FO, `--val-fraction {args.val_fraction}`. Targets (issue 58): within "
        f"{args.tolerance} nats on >= {SHARE_TARGET:.0%} of clients, worse than the base model on none."
    )
    path = write_results("deployed_choice", payload, table, header, notes)
    print(f"wrote {path}")


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
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time box's stop unwinds: grow notes its rounds
    if not args.report_only:
        from ciders_edge.cli_utils import quiet_libraries

        quiet_libraries()
        studies = [
            (study_config(s, ALGORITHM, args).replace(val_fraction=args.val_fraction), args.out / s / ALGORITHM)
            for s in args.settings.split(",")
        ]
        grow_in_passes(studies, args.rounds, args.step, args.device, lambda: report(args))
    report(args)


if __name__ == "__main__":
    main()
