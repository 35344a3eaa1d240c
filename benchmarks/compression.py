"""Compression sweep (the paper's Table V layout): messenger depth x drop ratio against NLL and payload.

    python benchmarks/compression.py --rounds 2 --out runs/compression

For each messenger depth (2, 4, 6) and drop ratio (0.2, 0.5), one CIDERS-FO ``simulate`` on three
five_domain clients (medical, finance, code) with the same seed: the AdapEmu's size (the round-0
bundle an edge downloads) and its ratio to the full model's fp32 weights, the Δc payload per
client-round, and the matched-domain NLL after the last round. Sizes are exact; NLLs are on each
domain's ``eval.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from common import domain_study, final_scores, run_simulate, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "code")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/compression"))
    ap.add_argument("--depths", default="2,4,6")
    ap.add_argument("--drops", default="0.2,0.5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--max-records", type=int, default=120)
    args = ap.parse_args()
    from ciders_edge.model.sources import resolve_model

    full = sum(f.stat().st_size for f in resolve_model("smollm2-135m").glob("*.safetensors"))  # the fp32 teacher
    rows = []
    for depth in map(int, args.depths.split(",")):
        for drop in map(float, args.drops.split(",")):
            cfg = domain_study(
                DOMAINS,
                rounds=args.rounds,
                local_steps=args.local_steps,
                max_records=args.max_records,
                messenger_depth=depth,
                drop_ratio=drop,
            )
            metrics = run_simulate(cfg, args.out / f"a{depth}-drop{drop}")
            clients = [r for r in metrics if r["type"] == "client"]
            scores = final_scores(metrics)
            rows.append(
                {
                    "depth": depth,
                    "drop": drop,
                    "adapemu_bytes": clients[0]["bytes_down"],  # round 0: the whole bundle
                    "dc_bytes": median(r["bytes_up"] for r in clients),
                    "matched_nll": scores["matched_nll"],
                    "delta_cross": scores["delta_cross"],
                    "nll_global": scores["nll_global"],
                }
            )
            print(rows[-1], flush=True)
    header = [
        "depth a",
        "drop",
        "AdapEmu MiB",
        "vs full model",
        "Δc bytes / client-round",
        "matched NLL (mean)",
        "Δcross",
        "global NLL",
    ]
    table = [
        [str(r["depth"]), f"{r['drop']:g}", f"{r['adapemu_bytes'] / 2**20:.1f}", f"{r['adapemu_bytes'] / full:.2f}x",
         f"{r['dc_bytes']:,.0f}",
         f"{r['matched_nll']:.4f}", f"{r['delta_cross']:.4f}", f"{r['nll_global']:.4f}"]
        for r in rows
    ]  # fmt: skip
    payload = {"rows": rows, "domains": DOMAINS, "rounds": args.rounds, "full_model_bytes": full}
    write_results("compression", payload, table, header)


if __name__ == "__main__":
    main()
