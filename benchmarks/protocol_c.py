"""Protocol C analog (paper §VI-D): label skew on Dolly, CIDERS-FO and -FD with the paper's gamma_t.

    python benchmarks/protocol_c.py --rounds 4 --out runs/protocol-c

Dolly-15k (``../shared/data/dolly15k``) split over 8 clients by a Dirichlet over ``category``
with concentration 0.1 (strong skew) and 0.4; gamma_t = max(0.01, 0.9 * 0.86^(t-1)) (docs/design.md §3).
Each of the four runs is one ``simulate``; ``ciders-cloud report`` over them draws the loss and
E-RAE curves and S-DR / S-PPR against gamma_t into ``results/protocol_c/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, data_dir, final_scores, run_simulate, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/protocol-c"))
    ap.add_argument("--alphas", default="0.1,0.4")
    ap.add_argument("--algorithms", default="ciders-fo,ciders-fd")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--max-records", type=int, default=120, help="training records per client")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--messenger-depth", type=int, default=6)
    args = ap.parse_args()
    dolly = data_dir("dolly15k") / "dolly15k.jsonl"
    from ciders_cloud.study.config import SimConfig
    from ciders_cloud.study.report import report

    runs, rows_out = [], []
    for alpha in args.alphas.split(","):
        for alg in args.algorithms.split(","):
            cfg = SimConfig(
                model=args.model,
                data=[str(dolly)],
                partition=f"dirichlet:{alpha}:category",
                clients=args.clients,
                rounds=args.rounds,
                local_steps=args.local_steps,
                algorithm=alg,
                gamma_schedule="protocol-c",
                eval_every=args.rounds,
                eval_examples=16,
                eval_generate=0,
                max_records=args.max_records,
                messenger_depth=args.messenger_depth,
                drop_ratio=0.2,
            )
            out = args.out / f"dir{alpha}-{alg}"
            rows = run_simulate(cfg, out)
            runs.append(out)
            rows_out.append(_row(alpha, alg, rows, args.rounds))
            print(rows_out[-1], flush=True)
    plots = report(runs, RESULTS / "protocol_c")
    header = ["Dirichlet", "algorithm", "NLL pers.", "NLL global", "E-RAE last", "S-DR last", "S-PPR last", "gamma"]
    header += ["PPR last (measured)", "Δcross", "s / round (median)"]
    table = [[_cell(r[k]) for k in r] for r in rows_out]
    notes = "Plots in results/protocol_c/: " + ", ".join(plots["files"])
    write_results("protocol_c", {"rows": rows_out, "args": vars(args) | {"out": str(args.out)}}, table, header, notes)


def _cell(x) -> str:
    if not isinstance(x, float):
        return str(x)
    return f"{x:.4f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _row(alpha: str, alg: str, rows: list[dict], rounds: int) -> dict:
    last = [r for r in rows if r["type"] == "client" and r["round"] == rounds - 1]
    scores = final_scores(rows)
    return {
        "dirichlet": alpha,
        "algorithm": alg,
        "nll_personal": scores["nll_personal"],
        "nll_global": scores["nll_global"],
        "e_rae": mean(r["E-RAE"] for r in last),
        "s_dr": mean(r["S-DR"] for r in last),
        "s_ppr": mean(r["S-PPR"] for r in last),
        "gamma": last[0]["gamma"],
        "ppr": mean(r["PPR"] for r in last),  # measured, against S-PPR's prediction
        "delta_cross": scores["delta_cross"],
        "round_wall_s": median(r["wall_s"] for r in rows if r["type"] == "round"),
    }


if __name__ == "__main__":
    main()
