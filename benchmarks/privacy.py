"""What client-level differential privacy costs: matched-domain and global NLL against epsilon, CIDERS-FO and FedAvg.

    python benchmarks/privacy.py --clients 50 --rounds 10 --participation 0.2 --epsilons inf,8,2

SmolLM2-135M, five_domain: N clients, N/5 per domain, each with a few records of its domain's
``train.jsonl`` (disjoint shards) and scored on its domain's ``eval.jsonl``. Each (algorithm, epsilon)
is one ``simulate`` with Poisson sampling of rate q and delta = 1/N; epsilon = inf is the run without
DP. The clip bound C is the median displacement norm of the algorithm's non-private run (the clip
quantile 0.5 of adaptive clipping), so about half the displacements are clipped. Resumable: a finished
configuration is read back. Writes ``results/privacy.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, data_dir, domain_study, final_scores, run_simulate, write_results  # noqa: E402

DOMAINS = ("medical", "finance", "customer_support", "code", "general")


def shards(out: Path, clients: int, records: int) -> tuple[list[str], list[str]]:
    """Each client's training shard (``records`` of its domain's train.jsonl, disjoint) and eval file."""
    five = data_dir("five_domain")
    out.mkdir(parents=True, exist_ok=True)
    data, evals = [], []
    for i in range(clients):
        domain = DOMAINS[i % len(DOMAINS)]
        k = i // len(DOMAINS)
        lines = (five / domain / "train.jsonl").read_text().splitlines()[k * records : (k + 1) * records]
        if len(lines) < records:
            sys.exit(f"{domain}: too few records for {clients} clients of {records} each")
        path = out / f"client-{i:03d}-{domain}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        data.append(str(path))
        evals.append(str(five / domain / "eval.jsonl"))
    return data, evals


def clip_bound(out: Path) -> float:
    """The median displacement norm over the non-private run's rounds (each round summary's delta_norms)."""
    from ciders_cloud.run.folder import RunFolder
    from ciders_cloud.run.server_state import ServerState

    summary = ServerState.load(RunFolder(out / "run").server_state).last_summary
    return median(summary["delta_norms"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/privacy"))
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--records", type=int, default=16, help="training records per client")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--participation", type=float, default=0.2)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--eval-examples", type=int, default=8)
    ap.add_argument("--algorithms", default="ciders-fo,fedavg")
    ap.add_argument("--epsilons", default="inf,8,2")
    args = ap.parse_args()
    data, evals = shards(args.out / "shards", args.clients, args.records)
    rows = {}
    for algorithm in args.algorithms.split(","):
        clip = None
        for eps in sorted(map(float, args.epsilons.split(",")), key=math.isfinite):  # ε = ∞ first: it sets C
            out = args.out / f"{algorithm}-eps{eps:g}"
            dp = {} if math.isinf(eps) else {"clip": clip, "target_epsilon": eps}
            cfg = domain_study(
                DOMAINS,
                data=data,
                eval_data=evals,
                clients=args.clients,
                rounds=args.rounds,
                local_steps=args.local_steps,
                algorithm=algorithm,
                participation=args.participation,
                sampling="poisson",
                eval_examples=args.eval_examples,
                dp=dp,
            )
            metrics = run_simulate(cfg, out)
            if math.isinf(eps):
                clip = clip_bound(out)
            rounds = [r for r in metrics if r["type"] == "round"]
            spent = [r["privacy"] for r in rounds if "privacy" in r]
            sampled = sum(len(r["participants"]) for r in rounds)
            rows[algorithm, eps] = {
                **{k: v for k, v in final_scores(metrics).items() if k != "matrix"},
                "clip": dp.get("clip"),
                "noise_multiplier": spent[-1]["noise_multiplier"] if spent else None,
                "noise_std_of_mean": spent[-1]["noise_std_of_mean"] if spent else None,
                "epsilon_spent": spent[-1]["epsilon"] if spent else None,
                "clipped_share": sum(p["clipped"] for p in spent) / max(1, sampled) if spent else None,
                "wall_s": median(r["wall_s"] for r in metrics if r["type"] == "round"),
            }
            print(algorithm, eps, rows[algorithm, eps], flush=True)
    table = []
    for (algorithm, eps), r in rows.items():
        base = rows[algorithm, math.inf]
        table.append([
            algorithm, "∞" if math.isinf(eps) else f"{eps:g}", "-" if r["clip"] is None else f"{r['clip']:.3g}",
            "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3g}",
            f"{r['matched_nll']:.4f}", f"{r['matched_nll'] - base['matched_nll']:+.4f}",
            f"{r['nll_global']:.4f}", f"{r['nll_global'] - base['nll_global']:+.4f}",
        ])  # fmt: skip
    header = ["algorithm", "ε", "C", "z", "matched NLL (pers.)", "vs ε=∞", "global NLL", "vs ε=∞"]
    payload = {f"{a}-eps{e:g}": r for (a, e), r in rows.items()}
    write_results("privacy", {"rows": payload, "args": vars(args) | {"out": str(args.out)}}, table, header)
    plot(rows, RESULTS / "privacy.png")


def plot(rows: dict, path: Path) -> None:
    """Matched-domain NLL (personalized) and global NLL against epsilon, one line per algorithm (∞ at the right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    algorithms = sorted({a for a, _ in rows})
    finite = sorted({e for _, e in rows if not math.isinf(e)})
    at = {e: i for i, e in enumerate([*finite, math.inf])}
    for ax, key, title in zip(axes, ("matched_nll", "nll_global"), ("personalized, own domain", "global"), strict=True):
        for a in algorithms:
            pts = sorted((at[e], r[key]) for (b, e), r in rows.items() if b == a)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=a)
        ax.set_xticks(range(len(at)), [f"{e:g}" if not math.isinf(e) else "∞ (no DP)" for e in at])
        ax.set(title=f"held-out NLL, {title}", xlabel="ε (δ = 1/N)", ylabel="NLL")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(json.dumps({"plot": str(path)}))


if __name__ == "__main__":
    main()
