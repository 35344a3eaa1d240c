"""What client-level differential privacy costs: matched-domain and global NLL against epsilon, CIDERS-FO and FedAvg.

    python benchmarks/privacy.py --clients 50 --rounds 5 --participation 0.2 --epsilons inf,8,2
    python benchmarks/privacy.py --clients 1000 --participation 0.1 --records 3 --messenger-depth 2 \
        --domains medical,customer_support,code,general --engine flower --actors 2 --name privacy_population \
        --algorithms ciders-fo --rounds 3 --local-steps 2 --layer-steps 50 --align-steps 20

SmolLM2-135M, five_domain: N clients, N/5 per domain, each with a few records of its domain's
``train.jsonl`` (disjoint shards) and scored on its domain's ``eval.jsonl``. Each (algorithm, epsilon)
is one ``simulate`` with Poisson sampling of rate q and delta = 1/N; epsilon = inf is the run without
DP. The clip bound C is the median displacement norm of the algorithm's non-private run (the clip
quantile 0.5 of adaptive clipping), so about half the displacements are clipped; ``--clip-scales 1,0.1``
also runs each finite epsilon at C = 0.1 x that median (less noise, smaller steps). Resumable: a finished
configuration is read back, an unfinished one goes on from its last round. Writes ``results/NAME.{json,md,png}``
(``--name``, default privacy), with, where a finite epsilon loses more than 0.1 nats of matched NLL, the
population the measured trend needs (:func:`population_needed`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median

from ciders_cloud.study.engines import EngineSettings

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RESULTS,
    data_dir,
    domain_study,
    final_scores,
    run_simulate,
    trainable_lines,
    write_results,
)

DOMAINS = ("medical", "finance", "customer_support", "code", "general")
TOLERANCE = 0.1  # nats of matched NLL a private run may lose against epsilon = inf (issue 61)


def shards(out: Path, clients: int, records: int, domains: tuple[str, ...] = DOMAINS) -> tuple[list[str], list[str]]:
    """Each client's training shard (``records`` of its domain's train.jsonl, disjoint, each with a
    response within the sequence length, so every shard trains) and eval file."""
    five = data_dir("five_domain")
    out.mkdir(parents=True, exist_ok=True)
    fitting = {d: trainable_lines(five / d / "train.jsonl", (clients // len(domains) + 1) * records) for d in domains}
    data, evals = [], []
    for i in range(clients):
        domain = domains[i % len(domains)]
        k = i // len(domains)
        lines = fitting[domain][k * records : (k + 1) * records]
        if len(lines) < records:
            sys.exit(f"{domain}: too few records for {clients} clients of {records} each")
        path = out / f"client-{i:03d}-{domain}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        data.append(str(path))
        evals.append(str(five / domain / "eval.jsonl"))
    return data, evals


def clip_bound(out: Path) -> float:
    """The median displacement norm of the non-private run's last round (its summary's delta_norms)."""
    from ciders_cloud.run.folder import RunFolder
    from ciders_cloud.run.server_state import ServerState

    summary = ServerState.load(RunFolder(out / "run").server_state).last_summary
    return median(summary["delta_norms"].values())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/privacy"))
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--records", type=int, default=8, help="training records per client")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--participation", type=float, default=0.2)
    ap.add_argument("--local-steps", type=int, default=4)
    ap.add_argument("--eval-examples", type=int, default=4)
    ap.add_argument("--algorithms", default="ciders-fo,fedavg")
    ap.add_argument("--epsilons", default="inf,8,2")
    ap.add_argument("--clip-scales", default="1", help="C as multiples of the median norm, for each finite epsilon")
    ap.add_argument("--engine", default="in-process", help="in-process, or flower (Flower's Simulation Engine)")
    ap.add_argument("--actors", type=int, default=None, help="--engine flower: Ray actors on this machine")
    ap.add_argument("--gpus-per-client", type=float, default=0.0, help="--engine flower: a client's share of a GPU")
    ap.add_argument("--device", default="cpu", help="the cloud's TAKD and evaluation: cpu, cuda or auto")
    ap.add_argument("--profile", default=None, help="every client's device profile (cuda-24gb on a GPU)")
    ap.add_argument("--domains", default=",".join(DOMAINS), help="five_domain's (finance has 80 trainable records)")
    ap.add_argument("--messenger-depth", type=int, default=6)
    ap.add_argument("--layer-steps", type=int, default=None, help="the bootstrap's stage 1 (default: prepare's)")
    ap.add_argument("--align-steps", type=int, default=None, help="the bootstrap's stage 2 (default: prepare's)")
    ap.add_argument("--name", default="privacy", help="the results files' name")
    return ap


def main() -> None:
    args = parser().parse_args()
    domains = tuple(args.domains.split(","))
    data, evals = shards(args.out / "shards", args.clients, args.records, domains)
    study = {
        "data": data,
        "eval_data": evals,
        "clients": args.clients,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "participation": args.participation,
        "sampling": "poisson",
        "eval_examples": args.eval_examples,
        "messenger_depth": args.messenger_depth,
        **{k: getattr(args, k) for k in ("layer_steps", "align_steps", "profile") if getattr(args, k) is not None},
    }
    engine = EngineSettings(args.engine, actors=args.actors, gpus_per_client=args.gpus_per_client)  # refused here
    epsilons = sorted(map(float, args.epsilons.split(",")), key=math.isfinite)  # ε = ∞ first: it sets C
    scales = [float(x) for x in args.clip_scales.split(",")]
    rows = {}
    for algorithm in args.algorithms.split(","):
        median_norm = None
        for eps in epsilons:
            for scale in [1.0] if math.isinf(eps) else scales:
                dp = {} if math.isinf(eps) else {"clip": scale * median_norm, "target_epsilon": eps}
                name = f"{algorithm}-eps{eps:g}" + (f"-clip{scale:g}" if scale != 1 else "")
                cfg = domain_study(domains, algorithm=algorithm, dp=dp, **study)
                metrics = run_simulate(cfg, args.out / name, engine, args.device)
                if math.isinf(eps):
                    median_norm = clip_bound(args.out / name)
                rows[algorithm, eps, scale] = row(metrics, dp)
                print(name, rows[algorithm, eps, scale], flush=True)
    header = ["algorithm", "ε", "C", "z", "noise std / element", "clipped", "matched NLL (pers.)", "vs ε=∞"]
    header += ["global NLL", "vs ε=∞"]
    payload = {f"{a}-eps{e:g}-clip{c:g}": r for (a, e, c), r in rows.items()}
    needed = population_needed(rows, args.clients)
    payload = {"rows": payload, "population_needed": needed, "args": vars(args) | {"out": str(args.out)}}
    write_results(args.name, payload, table(rows), header, needed_note(needed, args.clients))
    plot(rows, RESULTS / f"{args.name}.png")


def row(metrics: list[dict], dp: dict) -> dict:
    """One configuration's final scores, its mechanism (the last round's) and its median round time."""
    rounds = [r for r in metrics if r["type"] == "round"]
    spent = [r["privacy"] for r in rounds if "privacy" in r]
    sampled = sum(len(r["participants"]) for r in rounds)
    last = spent[-1] if spent else {}
    return {
        **{k: v for k, v in final_scores(metrics).items() if k != "matrix"},
        "clip": dp.get("clip"),
        "noise_multiplier": last.get("noise_multiplier"),
        "noise_std_of_mean": last.get("noise_std_of_mean"),
        "epsilon_spent": last.get("epsilon"),
        "clipped_share": sum(p["clipped"] for p in spent) / max(1, sampled) if spent else None,
        "sampled": sampled,
        "wall_s": median(r["wall_s"] for r in rounds),
    }


def table(rows: dict) -> list[list[str]]:
    """The markdown table's rows, each against its algorithm's non-private run."""
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    out = []
    for (algorithm, eps, _), r in rows.items():
        base = rows[algorithm, math.inf, 1.0]
        out.append([
            algorithm, "∞" if math.isinf(eps) else f"{eps:g}", fmt(r["clip"], ".3g"), fmt(r["noise_multiplier"], ".3g"),
            fmt(r["noise_std_of_mean"], ".3g"), fmt(r["clipped_share"], ".0%"),
            f"{r['matched_nll']:.4f}", f"{r['matched_nll'] - base['matched_nll']:+.4f}",
            f"{r['nll_global']:.4f}", f"{r['nll_global'] - base['nll_global']:+.4f}",
        ])  # fmt: skip
    return out


def plot(rows: dict, path: Path) -> None:
    """Matched-domain NLL (personalized) and global NLL against epsilon, one line per algorithm and clip
    scale (∞ at the right, shared by every scale), the round-0 model's NLL dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    finite = sorted({e for _, e, _ in rows if not math.isinf(e)})
    at = {e: i for i, e in enumerate([*finite, math.inf])}
    lines = sorted({(a, c) for a, e, c in rows if not math.isinf(e)})
    for ax, key, title in zip(axes, ("matched_nll", "nll_global"), ("personalized, own domain", "global"), strict=True):
        for a, c in lines:
            pts = sorted((at[e], r[key]) for (b, e, s), r in rows.items() if b == a and (s == c or math.isinf(e)))
            label = a + ("" if c == 1 else f", C = {c:g} x median")
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        base = next(iter(rows.values()))["baseline_emu"]
        ax.axhline(base, color="gray", linestyle=":", label="round 0 (no training)")
        ax.set_xticks(range(len(at)), [f"{e:g}" if not math.isinf(e) else "∞ (no DP)" for e in at])
        ax.set(title=f"held-out NLL, {title}", xlabel="ε (δ = 1/N)", ylabel="NLL", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(json.dumps({"plot": str(path)}))


def population_needed(rows: dict, clients: int) -> dict[str, dict]:
    """Per algorithm and finite epsilon, the population at which its matched-NLL loss against epsilon = inf
    would be ``TOLERANCE``.

    The trend is measured, not assumed: the loss against the noise std on the mean, log-log through the
    finite epsilons run here (two or more), loss ~ sigma^k; sigma* is where it meets the tolerance. The noise
    std scales as 1/N at a fixed sampling rate and noise multiplier (delta = 1/N moves z a little: ignored),
    so each epsilon needs N x sigma / sigma*, or N itself where its loss is within the tolerance already.
    No trend (``k`` None) from one point, or from losses that do not grow with the noise."""
    out = {}
    for algorithm in sorted({a for a, _, _ in rows}):
        base = rows[algorithm, math.inf, 1.0]["matched_nll"]
        pts = {
            e: (r["noise_std_of_mean"], r["matched_nll"] - base)
            for (a, e, c), r in rows.items()
            if a == algorithm and math.isfinite(e) and c == 1.0 and r["noise_std_of_mean"]
        }
        (s0, l0), (s1, l1) = min(pts.values()), max(pts.values())  # the least and the most noise
        k = math.log(l1 / l0) / math.log(s1 / s0) if len(pts) > 1 and min(l0, l1) > 0 and s1 > s0 else None
        if k is not None and k <= 0:
            k = None
        sigma_star = s1 * (TOLERANCE / l1) ** (1 / k) if k else None
        need = {
            f"{e:g}": float(clients) if loss <= TOLERANCE else (clients * s / sigma_star if sigma_star else None)
            for e, (s, loss) in sorted(pts.items(), reverse=True)
        }
        out[algorithm] = {"k": k, "sigma_star": sigma_star, "clients": need}
    return out


def needed_note(needed: dict[str, dict], clients: int) -> str:
    """The markdown note under the table: the population each finite epsilon needs to lose at most 0.1 nats."""
    parts = []
    for algorithm, n in needed.items():
        each = ", ".join(
            f"ε = {e}: " + ("met" if c is not None and c <= clients else "no trend" if c is None else f"{c:,.0f}")
            for e, c in n["clients"].items()
        )
        trend = f" (loss ~ noise std^{n['k']:.2f})" if n["k"] else ""
        parts.append(f"{algorithm}: {each}{trend}")
    return (
        f"Clients needed for a finite ε to lose at most {TOLERANCE} nats of matched NLL against ε = ∞ (N = {clients} "
        f"here; the noise std on the mean scales as 1/N at this sampling rate): " + "; ".join(parts) + "."
    )


if __name__ == "__main__":
    main()
