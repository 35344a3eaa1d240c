"""A round at a population: round time and peak memory against clients, engine and Ray actors, side by side.

    python benchmarks/population.py --clients 100,1000 --setups in-process,flower:1,flower:2

Each (clients, setup) is one ``simulate`` of one round on ``tiny`` in its own process (so Ray starts afresh
and the memory is its own): every client trains (participation 1), ``--records`` records each, drawn iid
from the demo task families. The round's time is its ``wall_s`` in ``metrics.jsonl`` (every client's
training, the packets, aggregation and TAKD; the evaluations before and after it excluded). The memory is
the peak, sampled every 0.2 s from the start until the round is logged, of the summed RSS of the process
and all its descendants (Ray's raylet, GCS and actors), and of their summed PSS (shared pages counted once):
what the machine holds. The study is stopped there: its evaluation after the round scores every client's
messenger on every client's held-out set (the cross-domain matrix), N^2 passes: more than 20 minutes at 1,000.
Setups: ``in-process`` (the default engine) or ``flower:A`` (Flower's Simulation Engine, A actors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

FAMILIES = 5  # the demo data's task families


def tree_memory() -> tuple[float, float]:
    """(summed RSS, summed PSS) in MiB of this process and its descendants."""
    me = psutil.Process()
    rss = pss = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            full = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + full.rss, pss + full.pss
    return rss / 2**20, pss / 2**20


class PeakSampler(threading.Thread):
    """The peaks of :func:`tree_memory` every ``interval`` seconds, from the study's start until ``done()``
    returns the round's record; then the figures go to stdout."""

    def __init__(self, done, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.done, self.interval, self.peak_rss, self.peak_pss = done, interval, 0.0, 0.0

    def run(self) -> None:
        while (record := self.done()) is None:
            rss, pss = tree_memory()
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            time.sleep(self.interval)
        trained = len(record["participants"])
        print(json.dumps({"round_s": record["wall_s"], "clients_trained": trained,
                          "peak_rss_mib": self.peak_rss, "peak_pss_mib": self.peak_pss}), flush=True)  # fmt: skip


def one(args: argparse.Namespace) -> None:
    """One (clients, setup): its figures as a JSON line on stdout once the round is logged; the parent then
    stops the study (its evaluation would score every client's messenger on every client's held-out set)."""
    from ciders_cloud.study.config import SimConfig
    from ciders_cloud.study.engines import EngineSettings
    from ciders_cloud.study.simulate import simulate
    from ciders_edge.data.demo import write_demo_data

    data = args.out / "data"
    if not data.exists():  # enough records that every client holds --records after the held-out one
        write_demo_data(data, n_train=args.clients * (args.records + 1) // FAMILIES + 1, n_public=24, n_eval=8)
    name, _, actors = args.setup.partition(":")
    engine = EngineSettings(name, actors=int(actors) if actors else None)
    cfg = SimConfig(
        model="tiny", data=[str(p) for p in sorted(data.glob("*/train.jsonl"))], partition="iid",
        clients=args.clients, rounds=1, local_steps=args.local_steps, max_records=args.records + 1,
        holdout=0.25, eval_examples=1, eval_generate=0, layer_steps=5, align_steps=1, messenger_depth=2,
        drop_ratio=0.5, takd={"seq_len": 64, "batch_size": 2}, hyperparameters={"takd_steps": 1},
    )  # fmt: skip
    out = args.out / f"{args.clients}-{args.setup.replace(':', '-')}"
    for stale in out.parent.glob(f".{out.name}.*"):  # an earlier measurement's study, stopped after its round
        shutil.rmtree(stale)
    sampler = PeakSampler(lambda: _round_record(out))
    sampler.start()
    simulate(cfg, out, engine=engine)


def _round_record(out: Path) -> dict | None:
    """Round 0's record in the study's metrics, once logged (the study is built in a hidden folder beside ``out``)."""
    for path in out.parent.glob(f".{out.name}.*/metrics.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return next((r for r in rows if r["type"] == "round"), None)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/population"))
    ap.add_argument("--clients", default="100,1000")
    ap.add_argument("--setups", default="in-process,flower:1,flower:2")
    ap.add_argument("--records", type=int, default=3, help="training records per client")
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--append", action="store_true", help="keep results/population.json's rows of other client counts")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.clients = int(args.clients)
        return one(args)
    counts = [int(n) for n in args.clients.split(",")]
    rows = [r for r in _saved_rows() if r["clients"] not in counts] if args.append else []
    for n in counts:
        base = None
        for setup in args.setups.split(","):
            cmd = [sys.executable, __file__, "--one", "--clients", str(n), "--setup", setup,
                   "--out", str(args.out / str(n)), "--records", str(args.records),
                   "--local-steps", str(args.local_steps)]  # fmt: skip
            log = args.out / str(n) / f"{setup.replace(':', '-')}.log"
            r = {"clients": n, "setup": setup, **_run_until_round(cmd, f"{n} clients, {setup}", log)}
            base = base or r["round_s"]
            rows.append({**r, "vs_first": r["round_s"] / base})
            print(json.dumps(rows[-1]), flush=True)
    header = ["clients", "setup", "round s", "vs first setup", "s per client", "peak RSS MiB (tree)", "peak PSS MiB"]
    table = [
        [str(r["clients"]), r["setup"], f"{r['round_s']:.1f}", f"{r['vs_first']:.2f}x",
         f"{r['round_s'] / r['clients_trained']:.3f}", f"{r['peak_rss_mib']:.0f}", f"{r['peak_pss_mib']:.0f}"]
        for r in rows
    ]  # fmt: skip
    notes = (
        "tiny (random weights), one round, every client trains; round s excludes the evaluations; memory is the "
        "peak summed over the process tree (Ray's processes included) from the start to the round's end (the study "
        "stops there, before its N^2 cross-domain evaluation). Target (issue 61): "
        "1,000 virtual tiny clients run a round in <= 4 GB peak RSS."
    )
    write_results("population", {"rows": rows, "records": args.records, "local_steps": args.local_steps}, table,
                  header, notes)  # fmt: skip


def _run_until_round(cmd: list[str], what: str, log: Path) -> dict:
    """Run ``--one`` until it prints its figures, then stop it and every process it started (Ray's)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    for line in proc.stdout:
        if line.startswith("{"):
            tree = psutil.Process(proc.pid).children(recursive=True)
            for p in [psutil.Process(proc.pid), *tree]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            return json.loads(line)
    sys.exit(f"{what}: failed; see {log}\n{log.read_text()[-3000:]}")


def _saved_rows() -> list[dict]:
    path = Path(__file__).parent / "results" / "population.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else []


if __name__ == "__main__":
    main()
