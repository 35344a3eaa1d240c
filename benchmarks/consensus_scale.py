"""How large is the consensus correction against the gradient it corrects? (eq. 8, under AdamW)

    python benchmarks/consensus_scale.py runs/long-run/b/ciders-fo runs/long-run/b/scaffold

For each study given (a ``simulate`` folder), at its latest bundle and for each client: the per-element RMS
of the raw mini-batch gradient of the messenger LoRA at v (eq. 4's g0, on ``--batches`` batches), against
that of ``c - c_i`` and of the correction ``gamma * (c - c_i)`` that eq. (8) adds to it. Delta_i (eq. 9) is a
displacement over K*eta, which is a gradient only for SGD: AdamW's steps are about eta per element whatever
the gradient's size, so c and c_i are about 1 per element while the gradients are about 1e-3. The ratio says
whether a study's gamma makes the correction matter. Writes ``results/consensus_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402


def rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def client_scales(study: Path, cid: str, batches: int) -> dict:
    """The RMS figures of one client of ``study`` at the study's latest bundle."""
    from ciders_edge.formats.bundle import Bundle
    from ciders_edge.formats.client_state import ClientState
    from ciders_edge.training.objective import MessengerObjective
    from ciders_edge.training.round import load_round

    state = ClientState.load(study / "clients" / cid)
    profile = json.loads((study / "config.json").read_text())["profile"]
    bundle = Bundle.load(max((study / "run" / "bundles" / profile).iterdir()))
    hp, edge, examples = load_round(bundle, study / "data" / cid / "train.jsonl", profile, {})
    objective = MessengerObjective(edge, examples, hp.batch_size, hp.grad_accum, seed=0)
    v = {k: t.float() for k, t in bundle.messenger_lora().items() if edge.split.trains(k)}
    flatten = objective.layout.flatten
    with objective.rng_scope():
        grads = torch.stack([objective.flat_gradient(flatten(v), objective.batch())[1] for _ in range(batches)])
    c = flatten({k: t.float() for k, t in bundle.consensus().items() if k in v})
    gap = c - flatten({k: state.c_i[k] for k in v})
    return {
        "round": bundle.round,
        "client": cid,
        "gamma": hp.gamma,
        "grad_rms": rms(grads),
        "c_rms": rms(c),
        "gap_rms": rms(gap),
        "correction_rms": hp.gamma * rms(gap),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", type=Path)
    ap.add_argument("--batches", type=int, default=4, help="mini-batches behind each gradient's RMS")
    args = ap.parse_args()
    from ciders_edge.cli_utils import quiet_libraries

    quiet_libraries()
    rows, table = [], []
    for study in args.studies:
        for cid in sorted(p.name for p in (study / "clients").iterdir()):
            r = {"study": str(study), **client_scales(study, cid, args.batches)}
            rows.append(r)
            table.append([
                f"{study.parent.name}/{study.name}", cid, str(r["round"]), f"{r['gamma']:g}", f"{r['grad_rms']:.2e}",
                f"{r['c_rms']:.2e}", f"{r['gap_rms']:.2e}", f"{r['correction_rms']:.2e}",
                f"{r['correction_rms'] / r['grad_rms']:.3g}",
            ])  # fmt: skip
    header = ["study", "client", "bundle round", "gamma", "RMS gradient", "RMS c", "RMS (c - c_i)"]
    header += ["RMS gamma (c - c_i)", "correction / gradient"]
    write_results("consensus_scale", {"rows": rows}, table, header)


if __name__ == "__main__":
    main()
