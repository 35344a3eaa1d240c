"""Protocol B analog (paper §VI-E): one domain per client, every algorithm on the same seeds.

    python benchmarks/protocol_b.py --algorithms ciders-fo,fedbiot,fedavg,localot --out runs/protocol-b

Five clients = ``../shared/data/five_domain/{medical,finance,customer_support,code,general}``:
each trains on its domain's ``train.jsonl``, is scored on its ``eval.jsonl``; TAKD uses the five
``public.jsonl`` files together. SmolLM2-135M, messenger depth 6, drop ratio 0.2. Each algorithm
is one ``simulate`` run (the same code as the CLIs); the table holds the last round's 5x5
response-NLL matrix (rows: a client's personalized messenger, columns: the domain scored), the
mean matched-domain NLL (its diagonal) and Delta_cross (off-diagonal mean minus diagonal mean),
beside the round-0 AdapEmu's (the gain) and the same messengers on AdapFu (the full backbone)
against the base model. Hyperparameters and the bootstrap are the toolkit's defaults unless given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, data_dir, domain_study, final_scores, run_simulate, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "customer_support", "code", "general")
ALGORITHMS = ("ciders-fo", "ciders-fd", "fedbiot", "fedot", "localot", "fedavg", "fednest", "lfednest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/protocol-b"))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-steps", type=int, default=None, help="K (default: the toolkit's)")
    ap.add_argument("--max-records", type=int, default=200, help="training records per client")
    ap.add_argument("--eval-examples", type=int, default=24)
    ap.add_argument("--align-steps", type=int, default=None, help="prepare's stage 2 (default: prepare's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--neumann-terms", type=int, default=3, help="FedNest/LFedNest: N")
    ap.add_argument("--probe-batches", type=int, default=2, help="FedNest/LFedNest: batches behind grad f_i")
    args = ap.parse_args()
    data = data_dir("five_domain")
    from ciders_edge.formats.atomic import write_bytes

    public = args.out / "public.jsonl"  # the five domains' public splits, together
    if not public.is_file():
        write_bytes(public, b"".join((data / d / "public.jsonl").read_bytes() for d in DOMAINS))
    results = {}
    bilevel = {"neumann_terms": args.neumann_terms, "probe_batches": args.probe_batches}
    for alg in args.algorithms.split(","):
        cfg = domain_study(
            DOMAINS,
            rounds=args.rounds,
            **({"local_steps": args.local_steps} if args.local_steps else {}),
            algorithm=alg,
            seed=args.seed,
            eval_examples=args.eval_examples,
            max_records=args.max_records,
            public_data=str(public),
            align_steps=args.align_steps,
            fednest=bilevel if "nest" in alg else {},
        )
        rows = run_simulate(cfg, args.out / alg)  # resumable: a finished algorithm is read back
        scores = final_scores(rows)
        results[alg] = {
            "matrix": scores["matrix"],
            "baseline_emu": scores["baseline_emu"],
            "matched_nll": scores["matched_nll"],
            "baseline_full": scores["baseline_full"],
            "matched_nll_full": scores["matched_nll_full"],
            "delta_cross": scores["delta_cross"],
            "mean_nll_global": scores["nll_global"],
            "bytes_up_per_round": sum(r["bytes_up"] for r in rows if r["type"] == "round") / args.rounds,
            "round_wall_s": sum(r["wall_s"] for r in rows if r["type"] == "round"),
        }
        print(f"{alg}: matched NLL {results[alg]['matched_nll']:.4f}, Δcross {scores['delta_cross']:.4f}", flush=True)
    from ciders_cloud.study.report import report

    plots = report([args.out / alg for alg in results], RESULTS / "protocol_b")
    _write(args, results, plots["files"])


def _write(args, results: dict, plots: list[str]) -> None:
    from ciders_cloud.study.config import SimConfig

    header = ["algorithm", "matched-domain NLL (AdapEmu)", "gain over round 0", "AdapFu", "gain over base model",
              "Δcross", "global NLL", "bytes up / round", "rounds' wall s"]  # fmt: skip
    table = [
        [
            a,
            f"{r['matched_nll']:.4f}",
            f"{r['baseline_emu'] - r['matched_nll']:.3f}",
            f"{r['matched_nll_full']:.4f}",
            f"{r['baseline_full'] - r['matched_nll_full']:.3f}",
            f"{r['delta_cross']:.4f}",
            f"{r['mean_nll_global']:.4f}",
            f"{r['bytes_up_per_round']:,.0f}",
            f"{r['round_wall_s']:.0f}",
        ]
        for a, r in sorted(results.items(), key=lambda kv: kv[1]["matched_nll"])
    ]
    r0 = next(iter(results.values()))
    notes = [f"Round 0 (every algorithm): AdapEmu {r0['baseline_emu']:.4f}, base model {r0['baseline_full']:.4f}.", ""]
    notes += ["Plots in results/protocol_b/: " + ", ".join(plots), ""]
    notes += ["5x5 response-NLL matrices (row: client's personalized messenger; column: domain scored):", ""]
    for a, r in results.items():
        notes += [f"**{a}**", "", "| | " + " | ".join(DOMAINS) + " |", "|---" * (len(DOMAINS) + 1) + "|"]
        notes += [
            f"| {d} | " + " | ".join(f"{x:.3f}" for x in row) + " |"
            for d, row in zip(DOMAINS, r["matrix"], strict=True)
        ]
        notes.append("")
    payload = {
        "domains": DOMAINS,
        "rounds": args.rounds,
        "local_steps": args.local_steps or SimConfig.local_steps,
        "bilevel": {"neumann_terms": args.neumann_terms, "probe_batches": args.probe_batches},
        "results": results,
    }
    write_results("protocol_b", payload, table, header, "\n".join(notes))


if __name__ == "__main__":
    main()
