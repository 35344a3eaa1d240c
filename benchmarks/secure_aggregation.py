"""What secure aggregation costs a fleet round: seconds and bytes per round, with and without SecAgg+, side by side.

    python benchmarks/secure_aggregation.py --edges 4,16 --rounds 3

Real fleets on loopback, as a user runs them: `ciders-cloud serve [--secure-aggregation]` and one
`ciders-edge join` per edge, TLS and node keys on, the `tiny` model (the protocol's cost, not a model's:
on 2 cores sixteen SmolLM2 edges would measure their training). Figures are from `RUN/fleet/log.jsonl`:
the median wall time of the rounds after round 0 (round 0 ships the whole bundle) and the bytes per
round, all edges together; the ratio is SecAgg+'s over plain at the same edge count. Resumable: a
configuration whose fleet finished is read back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

BIN = Path(sys.executable).parent
FAMILIES = ("arithmetic", "dates", "code", "units", "strings")


def free_port() -> int:
    """A free port whose next one is free too (serve's Control API takes it), below the ephemeral range."""
    for _ in range(200):
        port = random.randrange(10_000, 30_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    sys.exit("no two free ports in a row")


def prepare_fleet(out: Path, edges: int, data: Path) -> tuple[Path, list[str]]:
    """A tiny study's run for ``edges`` clients (the demo data, iid), TLS material and every edge's node key."""
    from ciders_cloud.fleet.certs import make_certs
    from ciders_cloud.run.folder import RunFolder
    from ciders_cloud.study.config import SimConfig
    from ciders_cloud.study.simulate import prepare_study
    from ciders_edge.fleet.keys import ensure_node_key

    files = [str(data / f / "train.jsonl") for f in FAMILIES]
    cfg = SimConfig(model="tiny", data=files, clients=edges, rounds=1, local_steps=2, max_records=20,
                    layer_steps=5, align_steps=1, messenger_depth=2, drop_ratio=0.5, eval_examples=2,
                    takd={"seq_len": 64, "batch_size": 2}, hyperparameters={"takd_steps": 1})  # fmt: skip
    run, ids, _ = prepare_study(cfg, out / "study")
    make_certs(run / "certs", [])
    RunFolder(run).nodes.mkdir(exist_ok=True)
    for cid in ids:
        _, public = ensure_node_key(out / "edges" / cid)
        shutil.copy(public, RunFolder(run).node_key(cid))
    return run, ids


def run_fleet(out: Path, edges: int, rounds: int, secure: bool, data: Path) -> list[dict]:
    """Serve ``rounds`` rounds to ``edges`` edges; the fleet log's records."""
    run, ids = prepare_fleet(out, edges, data)
    port, procs = free_port(), []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def start(name: str, cmd: list) -> subprocess.Popen:
        log = (out / f"{name}.log").open("ab")
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        procs.append(proc)
        return proc

    serve = [BIN / "ciders-cloud", "serve", "--run", run, "--rounds", rounds, "--min-clients", edges]
    serve += ["--address", f"127.0.0.1:{port}", "--round-timeout", 300] + (["--secure-aggregation"] if secure else [])
    cloud = start("cloud", serve)
    ca = run / "certs" / "ca.crt"
    for cid in ids:
        join = [BIN / "ciders-edge", "join", "--server", f"127.0.0.1:{port}", "--state", out / "edges" / cid]
        join += [
            "--data",
            run.parent / "data" / cid / "train.jsonl",
            "--root-certificates",
            ca,
            "--profile",
            "cpu-laptop",
        ]
        start(cid, join)
    try:
        code = cloud.wait(timeout=3600)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if code != 0:
        sys.exit(f"serve exited with {code}; see {out / 'cloud.log'}")
    return [json.loads(line) for line in (run / "fleet" / "log.jsonl").read_text().splitlines()]


def figures(records: list[dict]) -> dict:
    rounds = [r for r in records if r["type"] == "round"]
    later = [r for r in rounds if r["round"] > 0] or rounds
    return {
        "wall_s": median(r["wall_s"] for r in later),
        "bytes_up": median(r["bytes_up"] for r in later),
        "bytes_down": median(r["bytes_down"] for r in later),
        "round0_wall_s": rounds[0]["wall_s"],
        "round0_bytes_down": rounds[0]["bytes_down"],
        "clients": [r["clients"] for r in rounds],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/secure-aggregation"))
    ap.add_argument("--edges", default="4,16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from ciders_edge.data.demo import write_demo_data

    data = args.out / "data"
    if not (data / "public.jsonl").is_file():
        write_demo_data(data, n_train=200, n_public=24, n_eval=8)
    rows = {}
    for edges in map(int, args.edges.split(",")):
        for secure in (False, True):
            out = args.out / f"{edges}-{'secagg' if secure else 'plain'}"
            done = out / "figures.json"
            if done.is_file():
                rows[edges, secure] = json.loads(done.read_text())
                print(f"{out}: finished before, read back", flush=True)
                continue
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            started = time.monotonic()
            rows[edges, secure] = figures(run_fleet(out, edges, args.rounds, secure, data))
            rows[edges, secure]["total_s"] = time.monotonic() - started
            done.write_text(json.dumps(rows[edges, secure]))
            print(edges, secure, rows[edges, secure], flush=True)
    header = [
        "edges",
        "aggregation",
        "wall s / round",
        "vs plain",
        "bytes up / round",
        "vs plain",
        "bytes down / round",
    ]
    table = []
    for (edges, secure), r in rows.items():
        plain = rows[edges, False]
        table.append([
            str(edges), "SecAgg+" if secure else "plain", f"{r['wall_s']:.1f}", f"{r['wall_s'] / plain['wall_s']:.2f}x",
            f"{r['bytes_up']:,.0f}", f"{r['bytes_up'] / plain['bytes_up']:.2f}x", f"{r['bytes_down']:,.0f}",
        ])  # fmt: skip
    payload = {f"{e}-{'secagg' if s else 'plain'}": r for (e, s), r in rows.items()}
    write_results("secure_aggregation", {"rows": payload, "rounds": args.rounds}, table, header)


if __name__ == "__main__":
    main()
