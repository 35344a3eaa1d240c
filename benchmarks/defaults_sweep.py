"""Which learning rate, local steps and server step personalize in a few rounds (SmolLM2, five_domain).

    python benchmarks/defaults_sweep.py --out runs/defaults-sweep

The paper's eta 1e-4, K = 10, tau = 0.02 assume 150 rounds; a user runs a few. This sweep runs
CIDERS-FO for 2 rounds on five clients, one ``five_domain`` domain each (120 training records, scored
on 16 records of the domain's ``eval.jsonl``), SmolLM2-135M at depth 6, drop 0.2, in three stages:
eta at K = 10 and tau = 0.02; K at the best eta; tau at the best (eta, K). Every run starts from the
same round-0 bundle (the bootstrap is cached). Per setting: the round-0 AdapEmu's matched-domain NLL,
the personalized messengers' matched-domain NLL on the AdapEmu and on AdapFu, Delta_cross, wall time.
"Best" is the lowest matched-domain NLL on AdapFu, the model a device deploys.
Writes results/defaults_sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import data_dir, domain_study, final_scores, run_simulate, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "customer_support", "code", "general")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/defaults-sweep"))
    ap.add_argument("--etas", default="1e-4,1e-3,3e-3", help="stage 1, at the first K and tau")
    ap.add_argument("--local-steps", default="10,20", help="K values (stage 2)")
    ap.add_argument("--taus", default="0.02,0.2,1.0", help="server steps (stage 3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-records", type=int, default=120)
    args = ap.parse_args()
    five = data_dir("five_domain")
    from ciders_edge.formats.atomic import write_bytes

    public = args.out / "public.jsonl"  # the five public splits together, as protocol_b.py uses them
    if not public.is_file():
        write_bytes(public, b"".join((five / d / "public.jsonl").read_bytes() for d in DOMAINS))
    results: dict[str, dict] = {}

    def run(eta: float, k: int, tau: float) -> dict:
        name = f"eta{eta:g}-K{k}-tau{tau:g}"
        if name not in results:
            cfg = domain_study(DOMAINS, rounds=args.rounds, local_steps=k, max_records=args.max_records,
                               public_data=str(public), hyperparameters={"eta": eta, "tau": tau})  # fmt: skip
            rows = run_simulate(cfg, args.out / name)
            s = final_scores(rows)
            wall = sum(r["wall_s"] for r in rows if r["type"] == "round") / args.rounds
            results[name] = {
                "eta": eta,
                "local_steps": k,
                "tau": tau,
                **{x: s[x] for x in SCORES},
                "round_wall_s": wall,
            }
            r = results[name]
            print(f"{name}: AdapEmu {r['baseline_emu']:.4f} -> {r['matched_nll']:.4f}, "
                  f"AdapFu {r['matched_nll_full']:.4f}, Δcross {r['delta_cross']:.4f}", flush=True)  # fmt: skip
        return results[name]

    best = lambda rs: min(rs, key=lambda r: r["matched_nll_full"])  # noqa: E731
    ks, taus = [int(k) for k in args.local_steps.split(",")], [float(t) for t in args.taus.split(",")]
    eta = best([run(float(e), ks[0], taus[0]) for e in args.etas.split(",")])["eta"]
    k = best([run(eta, k, taus[0]) for k in ks])["local_steps"]
    chosen = best([run(eta, k, t) for t in taus])
    _write(args, results, chosen)


SCORES = ("baseline_emu", "baseline_full", "matched_nll", "matched_nll_full", "nll_global", "delta_cross")


def _write(args, results: dict, chosen: dict) -> None:
    header = ["eta", "K", "tau", "round-0 AdapEmu NLL", "personalized AdapEmu NLL", "gain", "base model NLL",
              "personalized AdapFu NLL", "gain", "Δcross", "s / round"]  # fmt: skip
    table = [
        [f"{r['eta']:g}", str(r["local_steps"]), f"{r['tau']:g}", f"{r['baseline_emu']:.4f}",
         f"{r['matched_nll']:.4f}", f"{r['baseline_emu'] - r['matched_nll']:.3f}", f"{r['baseline_full']:.4f}",
         f"{r['matched_nll_full']:.4f}", f"{r['baseline_full'] - r['matched_nll_full']:.3f}",
         f"{r['delta_cross']:.4f}", f"{r['round_wall_s']:.0f}"]
        for r in results.values()
    ]  # fmt: skip
    notes = (
        f"Chosen (lowest AdapFu matched-domain NLL): eta {chosen['eta']:g}, K {chosen['local_steps']}, "
        f"tau {chosen['tau']:g}. Gains are in nats against the round-0 model of the same backbone."
    )
    payload = {"rounds": args.rounds, "max_records": args.max_records, "results": results, "chosen": chosen}
    write_results("defaults_sweep", payload, table, header, notes)


if __name__ == "__main__":
    main()
