"""The packet codec's cost in quality: the same CIDERS-FO study with fp32, bf16 and int8 Δc packets.

    python benchmarks/codec_nll.py --rounds 2 --out runs/codec-nll
    python benchmarks/codec_nll.py --rounds 2 --algorithm fedavg --out runs/codec-nll-fedavg

Three five_domain clients (medical, finance, code), the same seed for every codec; the table gives
each codec's median packet size per client-round, its ratio to fp32, and the matched-domain NLL
after the last round (and its difference to fp32's). ``packet_codecs.py`` re-encodes one set of
packets for the sizes and errors alone. CIDERS' server step moves v by tau = 0.02 of the mean
displacement, which also scales down the codec's error; FedAvg (tau = 1) shows it undamped.
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
    ap.add_argument("--out", type=Path, default=Path("runs/codec-nll"))
    ap.add_argument("--codecs", default="fp32,bf16,int8")
    ap.add_argument("--algorithm", default="ciders-fo")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--max-records", type=int, default=120)
    args = ap.parse_args()
    rows = {}
    for codec in args.codecs.split(","):
        cfg = domain_study(
            DOMAINS,
            rounds=args.rounds,
            local_steps=args.local_steps,
            max_records=args.max_records,
            codec=codec,
            algorithm=args.algorithm,
        )
        metrics = run_simulate(cfg, args.out / codec)
        scores = final_scores(metrics)
        rows[codec] = {
            "packet_bytes": median(r["bytes_up"] for r in metrics if r["type"] == "client"),
            "matched_nll": scores["matched_nll"],
            "nll_global": scores["nll_global"],
        }
        print(codec, rows[codec], flush=True)
    ref = rows.get("fp32", next(iter(rows.values())))
    header = ["codec", "packet bytes (median)", "vs fp32", "matched NLL", "Δ NLL vs fp32", "global NLL"]
    table = [
        [c, f"{r['packet_bytes']:,.0f}", f"{r['packet_bytes'] / ref['packet_bytes']:.2f}x", f"{r['matched_nll']:.4f}",
         f"{r['matched_nll'] - ref['matched_nll']:+.1e}", f"{r['nll_global']:.4f}"]
        for c, r in rows.items()
    ]  # fmt: skip
    name = "codec_nll" if args.algorithm == "ciders-fo" else f"codec_nll_{args.algorithm}"
    write_results(name, {"rows": rows, "domains": DOMAINS, "rounds": args.rounds}, table, header)


if __name__ == "__main__":
    main()
