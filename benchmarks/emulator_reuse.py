"""What a study's actor saves by keeping the round's AdapEmu: a client's round on a fresh model against one on the
reused model (``RoundOptions.reuse_model``), side by side in one process.

    python benchmarks/emulator_reuse.py --bundle RUN/bundles/cpu-laptop/round-0000 --data SHARD.jsonl --clients 8

Clients alternate: one trains on a model of its own (built from the bundle, as ``ciders-edge train`` does), the
next on the cache's model (built by the first reuse job, then put back as loaded). Each is a new client (its own
state folder) on ``--data``, with the round's hyperparameters and no validation slice. The figures are medians of
wall seconds per client round, the reuse side without its first job (the one that builds); one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--clients", type=int, default=8, help="rounds on each side")
    args = ap.parse_args()
    from ciders_edge.cli_utils import quiet_libraries
    from ciders_edge.training.round import EMULATORS
    from ciders_edge.training.train import RoundOptions, train

    quiet_libraries()
    torch.set_num_threads(1)
    seconds: dict[str, list[float]] = {"fresh": [], "reused": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * args.clients):
            side = "reused" if i % 2 else "fresh"
            options = RoundOptions(client_id=f"c{i}", val_fraction=0.0, reuse_model=side == "reused")
            started = time.perf_counter()
            train(args.bundle, args.data, Path(tmp) / f"s{i}", Path(tmp) / f"p{i}.pkt", options)
            seconds[side].append(time.perf_counter() - started)
    EMULATORS.clear()
    fresh, reused = statistics.median(seconds["fresh"]), statistics.median(seconds["reused"][1:])
    row = [str(args.bundle), str(args.clients), f"{fresh:.2f}", f"{reused:.2f}", f"{reused / fresh:.2f}x"]
    header = ["bundle", "clients a side", "fresh model (s / client)", "reused model (s / client)", "reused / fresh"]
    payload = {"seconds": seconds, "median_fresh": fresh, "median_reused": reused, "ratio": reused / fresh}
    print(write_results("emulator_reuse", payload, [row], header))


if __name__ == "__main__":
    main()
