"""Wall time per ``simulate`` round against the number of clients, side by side in one run.

    python benchmarks/simulate_scaling.py --clients 1,2,4 --rounds 2

SmolLM2-135M, CIDERS-FO, clients drawn from five_domain (one domain each), K local steps; each
client count is one ``simulate``; the figure is the median wall time of its rounds (training,
packets, aggregation, TAKD; evaluation excluded), and its ratio to the first count's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from common import domain_study, run_simulate, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "customer_support", "code", "general")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/simulate-scaling"))
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=3)
    args = ap.parse_args()
    rows = {}
    for n in map(int, args.clients.split(",")):
        cfg = domain_study(
            DOMAINS[:n],
            rounds=args.rounds,
            local_steps=args.local_steps,
            eval_examples=2,
            max_records=100,
            align_steps=1,
        )
        metrics = run_simulate(cfg, args.out / f"clients-{n}")
        walls = [r["wall_s"] for r in metrics if r["type"] == "round"]
        rows[n] = {"wall_s_per_round": median(walls), "walls": walls}
        print(n, rows[n], flush=True)
    base = next(iter(rows.values()))["wall_s_per_round"]
    header = ["clients", "wall s / round (median)", "vs first", "s per client-round"]
    table = [
        [str(n), f"{r['wall_s_per_round']:.1f}", f"{r['wall_s_per_round'] / base:.2f}x",
         f"{r['wall_s_per_round'] / n:.1f}"]
        for n, r in rows.items()
    ]  # fmt: skip
    write_results("simulate_scaling", {"rows": rows, "local_steps": args.local_steps}, table, header)


if __name__ == "__main__":
    main()
