"""Does CIDERS beat FedAvg over many rounds? Six algorithms on three kinds of heterogeneity, a few rounds at a time.

    python benchmarks/long_run.py --settings b --rounds 20 --out runs/long-run   # stop it and rerun at will
    python benchmarks/long_run.py --settings b --algorithms ciders-fo-no-takd    # an ablation arm beside them
    python benchmarks/long_run.py --report-only --out runs/long-run              # tables and curves of what ran

Settings (every algorithm shares each one's data, seeds, device profile and K):
  b        Protocol B: five clients, one five_domain domain each, all in every round.
  c0.1     Protocol C: Dolly split over 8 clients by a Dirichlet(0.1) over ``category`` (strong skew).
  c1.0     the same with Dirichlet(1.0).
  partial  20 clients, four per five_domain domain (disjoint records), 5 sampled a round (fixed).

Every client runs ``--profile`` (default ``rpi5-8gb``: messenger depth 2, drop ratio 0.5, four sequences a
step), the smallest edge and the cheapest to simulate for many rounds. Each (setting,
algorithm) is one ``simulate`` study, grown ``--step`` rounds a pass with ``simulate --resume`` until
``--rounds``, the given settings' studies to the same round before any goes further, so that their curves
grow together and a stop loses at most the round in flight. After each pass it writes, over the studies
under ``--out`` of the settings it names or its report already holds, ``results/long_run.{json,md}`` and per
setting ``results/long_run/<setting>.png``
(matched-domain NLL on the AdapEmu and on AdapFu, the global messenger's on both, Delta_cross against rounds,
matched NLL against bytes); the table says of each curve whether it has reached its plateau
(:data:`PLATEAU_ROUNDS`, :data:`PLATEAU_NATS`). A study whose folder is gone (machines are not kept between
sessions) keeps the curves the last report recorded for it, with the command and commit that ran it.

On a GPU (``--device cuda``) the cloud's TAKD and evaluation run there, and so do the edges: every client runs
a copy of ``--profile`` that targets the GPU (same depth, drop ratio, rank, batches and dtype). Its results go
to their own report (``--results long_run_cuda``); ``benchmarks/long_run_gpu.sh`` runs the settings side by side
on one lent GPU in a time box.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RESULTS,
    data_dir,
    markdown_table,
    saved_settings,
    this_call,
    trainable_lines,
    write_results,
)

from ciders_edge.formats.atomic import write_bytes, write_json  # noqa: E402  (studies grown side by side share files)

DOMAINS = ("medical", "finance", "customer_support", "code", "general")
ALGORITHMS = ("ciders-fo", "ciders-fd", "fedavg", "scaffold", "fedbiot", "localot")
SETTINGS = ("b", "c0.1", "c1.0", "partial")
SOURCE = "long_run_source.json"  # in each study: the calls that grew it (command, commit, rounds)
# A curve has reached its plateau when its last PLATEAU_ROUNDS rounds lower its best matched NLL by less than
# PLATEAU_NATS: below the 0.03-0.05 nats that the 6-8 records scored a client move from one evaluation to the next.
PLATEAU_ROUNDS, PLATEAU_NATS = 8, 0.02
# The ablation: CIDERS-FO without one of what sets it apart from FedAvg (which is CIDERS-FO without all of
# them), to find which part pays for its cost. Each arm is CIDERS-FO with these round hyperparameters.
# The rounds' TAKD has had no task CE by default since `-no-task-ce` showed, on B, c0.1, c1.0 and partial, that
# it only costs AdapFu; the studies begun before keep it (their run.json says so), and `-task-ce` is that CIDERS-FO.
ABLATIONS = {
    "ciders-fo-no-takd": {"takd_steps": 0},  # no TAKD of the learnable backbone after each round (eq. 13)
    "ciders-fo-no-task-ce": {"takd_lambda_task": 0.0},  # that TAKD without task CE (eq. 2), as FedBiOT's
    "ciders-fo-task-ce": {"takd_lambda_task": 1.0},  # with it, as the paper's eq. (2) and the old default
    "ciders-fo-no-look-ahead": {"eta_in": 0.0},  # the gradient at x_k, not at the look-ahead point (eq. 5-6)
    "ciders-fo-no-consensus": {"gamma": 0.0},  # no consensus correction in the local steps (eq. 8)
    "ciders-fo-no-prox": {"eps_prox": 0.0},  # no proximal pull to the round's messenger (eq. 8)
}


def study_config(setting: str, algorithm: str, args: argparse.Namespace):
    """The ``simulate`` config of one (setting, algorithm), at ``--rounds``."""
    from ciders_cloud.study.config import SimConfig

    shared = {
        "model": args.model,
        "profile": edge_profile(args),
        "algorithm": "ciders-fo" if algorithm in ABLATIONS else algorithm,
        "hyperparameters": ABLATIONS.get(algorithm, {}),
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "eval_every": args.eval_every,
        "eval_examples": args.eval_examples,
        "eval_generate": 0,
        "max_records": args.max_records,
        "seed": args.seed,
    }
    five = data_dir("five_domain")
    if setting.startswith("c"):
        dolly = data_dir("dolly15k") / "dolly15k.jsonl"
        return SimConfig(
            **shared, data=[str(dolly)], partition=f"dirichlet:{setting[1:]}:category", clients=8,
            public_data=str(dolly_public(args.out, dolly)),
        )  # fmt: skip
    per_domain = 1 if setting == "b" else 4
    clients = [DOMAINS[i % len(DOMAINS)] for i in range(len(DOMAINS) * per_domain)]
    data = [str(shard(args.out, d, i // len(DOMAINS), per_domain)) for i, d in enumerate(clients)]
    evals = [str(five / d / "eval.jsonl") for d in clients]
    partial = {"participation": 0.25, "sampling": "fixed"} if setting == "partial" else {}
    return SimConfig(
        **shared, data=data, eval_data=evals, partition="per-file", clients=len(clients), **partial,
        public_data=str(public_data(args.out)),
    )  # fmt: skip


def edge_profile(args: argparse.Namespace) -> str:
    """``--profile``, or off the CPU a copy of it that targets ``--device``: only where the edges compute changes,
    not what they train (a Raspberry Pi's profile would keep them on the CPU beside the GPU)."""
    if args.device == "cpu":
        return args.profile
    from ciders_edge.model.sources import ciders_home
    from ciders_edge.profiles import load_profile

    prof = load_profile(args.profile)
    path = ciders_home() / "profiles" / f"{prof.name}-{args.device}.toml"  # a name, as a simulation needs
    if not path.is_file():  # JSON's strings, numbers and lists of strings are TOML's too
        fields = prof.to_dict() | {"name": path.stem, "target": args.device}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()).encode())
    return path.stem


def shard(out: Path, domain: str, k: int, of: int) -> Path:
    """Client k's of ``of`` disjoint shares of ``domain``'s train.jsonl, of the records that fit the
    sequence length (so that every client trains, finance's too)."""
    path = out / "shards" / f"{domain}-{k}-of-{of}.jsonl"
    if not path.is_file():
        lines = trainable_lines(data_dir("five_domain") / domain / "train.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, ("\n".join(lines[k::of]) + "\n").encode())
    return path


def public_data(out: Path) -> Path:
    """TAKD's data for the five_domain settings: the five domains' public.jsonl together (as protocol_b.py)."""
    path = out / "public.jsonl"
    if not path.is_file():
        five = data_dir("five_domain")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, b"".join((five / d / "public.jsonl").read_bytes() for d in DOMAINS))
    return path


def dolly_public(out: Path, dolly: Path) -> Path:
    """TAKD's data for both Dirichlet settings: every 15th Dolly record (about 1,000, all categories). One file
    for both, so that they share one bootstrap; like simulate's default (a sample of the clients' own
    records), it may hold a few records some client also trains on."""
    path = out / "dolly-public.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, "".join(dolly.read_text().splitlines(keepends=True)[::15]).encode())
    return path


def grow(cfg, out: Path, rounds: int, device: str = "cpu") -> bool:
    """Bring the study in ``out`` to ``rounds`` rounds: made by ``simulate``'s first round (a study is kept only
    once its first call ends: a stop in a longer one would lose every round of it), then ``simulate --resume``;
    the call is noted in the study (:data:`SOURCE`) for the report. Whether it ran a round: a call that resumes
    studies further on passes their earlier targets without running one."""
    from ciders_cloud.study.resume import resume
    from ciders_cloud.study.simulate import simulate

    before = _rounds_noted(out)  # a call killed (SIGKILL) noted nothing: its rounds go to the call that ends them
    try:
        if not (out / "config.json").is_file():
            simulate(cfg.replace(rounds=1), out, device)
        saved = saved_settings(out)
        if {**saved, "rounds": None} != {**json.loads(json.dumps(cfg.to_dict())), "rounds": None}:
            sys.exit(f"{out}: a study with other settings; choose another --out")
        if saved["rounds"] <= rounds:  # at it already: resume only finishes a round or an evaluation cut short
            resume(out, rounds, device)
    finally:  # also when stopped (SIGTERM, as `timeout` sends, or Ctrl-C): the rounds it finished are its own
        if (after := _rounds_done(out)) > before:  # atomically: a torn write would lose the history
            write_json(out / SOURCE, [*_sources(out), {**this_call(), "rounds": [before + 1, after]}])
    return after > before


def grow_in_passes(studies: list, rounds: int, step: int, device: str, after_pass) -> None:
    """Grow every (config, folder) of ``studies`` ``step`` rounds a pass until ``rounds``, all to the same
    round before any goes further (a stop loses at most the round in flight); ``after_pass()`` after each
    pass that ran a round."""
    for target in range(min(step, rounds), rounds + step, step):
        grew = False
        for cfg, out in studies:
            grew |= grow(cfg, out, min(target, rounds), device)
        if grew:
            after_pass()


def _sources(out: Path) -> list[dict]:
    """The calls that grew a study, oldest first (a study grown before they were listed has its last one)."""
    if not (out / SOURCE).is_file():
        return []
    saved = json.loads((out / SOURCE).read_text())
    return saved if isinstance(saved, list) else [saved]


def _rounds_noted(out: Path) -> int:
    """The last round a noted call ran (0: none noted; a call noted without its rounds ran every round done)."""
    sources = _sources(out)
    if any("rounds" not in s for s in sources):
        return _rounds_done(out)
    return max((s["rounds"][1] for s in sources), default=0)


def _rounds_done(out: Path) -> int:
    return len({r["round"] for r in _metrics(out) if r["type"] == "round"})


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def curves(out: Path) -> dict:
    """One study's curves: from round 0, per evaluated round its matched-domain NLL (the matrix's diagonal),
    global NLL, Delta_cross and the bytes moved so far (after round 0's download of the whole bundle, which
    every algorithm shares); and its median seconds and bytes per round."""
    rows = _metrics(out)
    rounds = [r for r in rows if r["type"] == "round"]
    cum, total = {}, 0
    for r in rounds:
        total += _moved(r) if r["round"] else r["bytes_up"]
        cum[r["round"]] = total
    base = [r for r in rows if r["type"] == "baseline"]
    emu, full = (mean(r[k] for r in base) for k in ("nll_emu", "nll_full")) if base else (None, None)
    first = {"round": 0, "matched": emu, "adapfu": full, "global": emu, "adapfu_global": full, "delta_cross": 0.0}
    points = [{**first, "bytes": 0}] if base else []
    for cross in (r for r in rows if r["type"] == "cross"):
        t = cross["round"]
        evals = [r for r in rows if r["type"] == "eval" and r["round"] == t]
        matched = mean(row[i] for i, row in enumerate(cross["matrix"]))
        points.append({
            "round": t + 1, "matched": matched, "adapfu": mean(r["nll_full_personal"] for r in evals),
            "global": mean(r["nll_global"] for r in evals), "adapfu_global": mean(r["nll_full_global"] for r in evals),
            "delta_cross": cross["delta_cross"], "bytes": cum.get(t, 0),
        })  # fmt: skip
    return {
        "points": points,
        "round0_matched": emu,
        "round0_adapfu": full,  # the base model
        "wall_s": median(r["wall_s"] for r in rounds) if rounds else None,
        "bytes_per_round": median(_moved(r) for r in rounds) if rounds else None,
        "sources": _sources(out),
    }


def _moved(r: dict) -> int:
    """A round record's bytes: every packet up, and the bundle (or its delta) down to each participant."""
    return r["bytes_up"] + r["bytes_down"] * len(r["participants"])


def report(args: argparse.Namespace) -> None:
    """The table (each study at the six algorithms' last common evaluation, against FedAvg's there), the
    ablation's (each arm at its last evaluation, against CIDERS-FO's and FedAvg's there) and the curves."""
    table, ablation, payload = [], [], {}
    recorded, here = _recorded(args.results), this_call()
    for setting in _reported(args, recorded):  # each of their algorithms that has run, whichever this call grew
        runs = {a: _latest(curves(args.out / setting / a), recorded.get(setting, {}).get(a), here) for a in
                (*ALGORITHMS, *ABLATIONS)}  # fmt: skip
        runs = {a: c for a, c in runs.items() if c is not None}
        payload[setting] = runs
        if not runs:
            continue
        last = {a: c["points"][-1]["round"] for a, c in runs.items()}
        common = min((t for a, t in last.items() if a in ALGORITHMS), default=max(last.values()))
        for a, c in runs.items():
            if a in ALGORITHMS and _at(c, common):
                table.append(_row(setting, a, runs, common))
            elif a in ABLATIONS:
                ablation.append(_ablation_row(setting, a, runs, min(last[a], common)))
        plot(setting, runs, RESULTS / args.results / f"{setting}.png")
    header = ["setting", "algorithm", "round", "matched NLL (pers.)", "vs FedAvg", "best (round)"]
    header += [f"gain, last {PLATEAU_ROUNDS} rounds"]
    header += ["AdapFu matched NLL (pers.)", "vs FedAvg", "global NLL", "AdapFu global NLL", "Δcross"]
    header += ["s / round", "vs FedAvg", "MB / round"]
    notes = [
        f"A curve's gain over its last {PLATEAU_ROUNDS} rounds is how much they lowered its best matched NLL; "
        f"under {PLATEAU_NATS} nats it has reached its plateau.",
        "",
    ]
    if ablation:
        head = ["setting", "arm", "round", "matched NLL (pers.)", "vs CIDERS-FO", "vs FedAvg"]
        head += ["AdapFu matched NLL (pers.)", "vs CIDERS-FO", "vs FedAvg", "s / round", "vs CIDERS-FO"]
        notes += ["## Ablation of CIDERS-FO", "", *markdown_table(head, ablation), ""]
    notes += ["## Where each setting's studies ran", ""]
    notes += [f"- {setting}: {_calls(runs)}" for setting, runs in payload.items() if runs]
    notes = "\n".join(notes)
    write_results(
        args.results, {"settings": payload, "args": vars(args) | {"out": str(args.out)}}, table, header, notes
    )


def _reported(args: argparse.Namespace, recorded: dict) -> list[str]:
    """The settings a report covers: those it holds studies of and those this call names. Not every setting with
    studies under ``--out``: a report of partial participation stays one, beside B's studies in the same folder."""
    named = args.settings.split(",")
    return [s for s in SETTINGS if s in named or recorded.get(s)]  # a report once held every setting, most empty


def _recorded(name: str) -> dict:
    """The curves the last report wrote (``results/<name>.json``), each with the command and commit it
    came from: a study folder lost with its machine keeps its place in the report."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    old = {"command": saved["command"], "commit": saved["commit"]}  # before curves carried their own

    def listed(c: dict) -> dict:  # a curve recorded with its one call ("source") before they were listed
        c = dict(c)
        one = c.pop("source", old)
        return {**c, "sources": c.get("sources") or [one]}

    return {s: {a: listed(c) for a, c in runs.items()} for s, runs in saved["settings"].items()}


def _calls(runs: dict) -> str:
    """The calls that grew a setting's studies, each with the rounds it ran, oldest first."""
    spans: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for c in runs.values():
        for s in c["sources"]:
            spans.setdefault((s["command"], s["commit"]), set()).update([tuple(s["rounds"])] if "rounds" in s else [])

    def text(cmd: str, sha: str) -> str:
        rounds = ", ".join(f"{a}-{b}" for a, b in sorted(spans[cmd, sha]))
        return f"`{cmd}` at {sha}" + (f" (rounds {rounds})" if rounds else "")

    return "; ".join(text(*call) for call in sorted(spans, key=lambda k: (min(spans[k], default=(0, 0)), k)))


def _latest(live: dict, recorded: dict | None, here: dict) -> dict | None:
    """A study's curves: those of its folder under ``--out``, unless the report's record of it reaches
    further (its folder was lost, or started over)."""
    if len(live["points"]) > 1 and (recorded is None or live["points"][-1]["round"] >= recorded["points"][-1]["round"]):
        return {**live, "sources": live["sources"] or [here]}
    return recorded


def _row(setting: str, a: str, runs: dict, t: int) -> list[str]:
    """One algorithm's row of the table at round ``t``, against FedAvg's there."""
    c, p, ref = runs[a], _at(runs[a], t), _at(runs.get("fedavg"), t)
    best = min(c["points"], key=lambda q: q["matched"])
    return [
        setting, a, str(t), f"{p['matched']:.4f}", _vs(p, ref, "matched"), f"{best['matched']:.4f} ({best['round']})",
        _recent_gain(c, t), f"{p['adapfu']:.4f}", _vs(p, ref, "adapfu"),
        f"{p['global']:.4f}", f"{p['adapfu_global']:.4f}" if p.get("adapfu_global") is not None else "-",
        f"{p['delta_cross']:.4f}" if p["delta_cross"] is not None else "-",
        f"{c['wall_s']:.0f}", _ratio(c, runs.get("fedavg")), f"{c['bytes_per_round'] / 1e6:.2f}",
    ]  # fmt: skip


def _recent_gain(c: dict, t: int) -> str:
    """How much the last :data:`PLATEAU_ROUNDS` rounds up to ``t`` lowered the curve's best matched NLL, and
    whether that is its plateau ("-": it has not run that long)."""
    before = [p["matched"] for p in c["points"] if p["round"] <= t - PLATEAU_ROUNDS]
    since = [p["matched"] for p in c["points"] if t - PLATEAU_ROUNDS < p["round"] <= t]
    if not before or not since:
        return "-"
    gain = min(before) - min(since)
    return f"{gain:+.4f}" + (" (plateau)" if gain < PLATEAU_NATS else "")


def _ablation_row(setting: str, a: str, runs: dict, t: int) -> list[str]:
    """One ablation arm's row at round ``t``, against CIDERS-FO's and FedAvg's there."""
    c, p = runs[a], _at(runs[a], t)
    fo, ref = _at(runs.get("ciders-fo"), t), _at(runs.get("fedavg"), t)
    return [
        setting, a, str(t), f"{p['matched']:.4f}", _vs(p, fo, "matched"), _vs(p, ref, "matched"),
        f"{p['adapfu']:.4f}", _vs(p, fo, "adapfu"), _vs(p, ref, "adapfu"),
        f"{c['wall_s']:.0f}", _ratio(c, runs.get("ciders-fo")),
    ]  # fmt: skip


def _at(c: dict | None, round_: int) -> dict | None:
    """A study's evaluation at ``round_`` (None: it has none there)."""
    return next((p for p in c["points"] if p["round"] == round_), None) if c else None


def _vs(p: dict, ref: dict | None, key: str) -> str:
    return f"{p[key] - ref[key]:+.4f}" if ref else "-"


def _ratio(c: dict, ref: dict | None) -> str:
    return f"{c['wall_s'] / ref['wall_s']:.2f}x" if ref else "-"


def plot(setting: str, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6))
    panels = [("round", "matched", "matched-domain NLL (personalized)")]
    panels += [("round", "adapfu", "on AdapFu (full backbone); dotted: global"), ("round", "global", "global NLL")]
    panels += [("round", "delta_cross", "Δcross"), ("bytes", "matched", "matched-domain NLL against bytes")]
    scale = {"round": 1, "bytes": 1e6}
    for ax, (x, y, title) in zip(axes, panels, strict=True):
        for a, c in runs.items():
            pts = [(p[x] / scale[x], p[y]) for p in c["points"] if p[y] is not None]
            style = "--" if a in ABLATIONS else "-"
            (line,) = ax.plot([u for u, _ in pts], [v for _, v in pts], style, marker=".", label=a)
            if y == "adapfu":  # the global messenger on AdapFu beside it: does personalizing pay on the device?
                pts = [(p["round"], p["adapfu_global"]) for p in c["points"] if p.get("adapfu_global") is not None]
                ax.plot([u for u, _ in pts], [v for _, v in pts], ":", color=line.get_color())
        base = next(iter(runs.values()))["round0_adapfu" if y == "adapfu" else "round0_matched"]
        if y in ("matched", "adapfu") and base is not None:
            ax.axhline(base, color="gray", linestyle=":", label="round 0" if y == "matched" else "base model")
        if y != "delta_cross" and base is not None:
            _off_the_chart(ax, base)
        ax.set(
            title=f"{setting}: {title}",
            xlabel="MB moved after round 0's bundle (up + down)" if x == "bytes" else "rounds",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _off_the_chart(ax, base: float, diverged: float = 0.5) -> None:
    """Leave out of an NLL panel's range the studies that diverged (rose ``diverged`` nats above round 0's:
    SCAFFOLD under AdamW), which would flatten every other curve into one line. Their legend entry says so."""
    lines = [line for line in ax.get_lines() if len(line.get_ydata()) > 1]
    out = [line for line in lines if max(line.get_ydata()) > base + diverged]
    if not out or len(out) == len(lines):
        return
    kept = [v for line in lines if line not in out for v in line.get_ydata()] + [base]
    pad = 0.08 * (max(kept) - min(kept)) or 0.05  # or a flat panel (one study, still at round 0)
    ax.set_ylim(min(kept) - pad, max(kept) + pad)
    for line in out:
        line.set_label(f"{line.get_label()} (off the chart)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/long-run"))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"also: {', '.join(ABLATIONS)}")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--step", type=int, default=2, help="rounds every study gains a pass")
    ap.add_argument("--local-steps", type=int, default=5, help="K, shared by every algorithm")
    ap.add_argument("--profile", default="rpi5-8gb", help="every client's device profile (its depth and drop ratio)")
    ap.add_argument("--max-records", type=int, default=64, help="training records per client")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--eval-examples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="tiny for a quick try of the script")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the cloud and the edges compute")
    ap.add_argument("--results", default="long_run", help="the report's name: results/<name>.{json,md}, <name>/*.png")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument(
        "--no-report",
        action="store_true",
        help="no report after each pass (for studies grown side by "
        "side in several processes: one --report-only call after them)",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time box's stop unwinds: grow notes its rounds
    if not args.report_only:
        from ciders_edge.cli_utils import quiet_libraries

        quiet_libraries()
        studies = [
            (study_config(setting, algorithm, args), args.out / setting / algorithm)
            for setting in args.settings.split(",")
            for algorithm in args.algorithms.split(",")
        ]
        after_pass = (lambda: None) if args.no_report else (lambda: report(args))  # the results so far
        grow_in_passes(studies, args.rounds, args.step, args.device, after_pass)
    if args.report_only or not args.no_report:
        report(args)


if __name__ == "__main__":
    main()
