"""Which margin should a device's choice of messenger use? Issue 58's rule, judged on many held-out records.

    python benchmarks/deployed_rules.py --study runs/deployed-choice/partial/ciders-fo

For every client of a study that has trained, after the study's last round: the device's validation as
``train`` runs it (:func:`~ciders_edge.training.validation.validate`: its slice, the newest bundle's global
messenger, its latest personalized one, the mixtures and the base model, on AdapFu), then every candidate on
``--judge-records`` of its held-out records. Each margin's choice (:func:`~ciders_edge.training.validation.
deployable`: a rival must beat the personalized messenger by that many paired standard errors) is held to
issue 58's targets on those records: within ``--tolerance`` nats of the better of {personalized, global},
and not worse than the base model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from deployed_judge import StudyClients, judge_parser  # noqa: E402

from ciders_edge.training.validation import (  # noqa: E402
    SE_MARGIN,
    Choice,
    deployable,
    messenger_scores,
    rivals_of,
    validate,
)

MARGINS = (0.0, 0.5, SE_MARGIN, 1.5, 2.0)


@torch.no_grad()
def client_candidates(edge, slice_records, batches: list, x: dict, v: dict, t: int) -> list[dict]:
    """Every candidate's slice scores (as the device computes them) and its NLL on the judge's ``batches``."""
    validation = validate(edge, slice_records, v, x, None, (t, t))
    tensors = {choice.name: tensor for choice, tensor in rivals_of(x, v, (t, t))}
    out = []
    for choice in validation.scores:
        edge.use_messenger(tensors[choice.name])
        judged = messenger_scores(edge, batches).nll
        out.append({"name": choice.name, "slice": choice.nll, "se": choice.se, "judge": judged})
    return out


def study_candidates(study_dir: Path, judge_records: int) -> dict[str, list[dict]]:
    """Per client that has trained: its candidates (:func:`client_candidates`) after the study's last round."""
    clients = StudyClients(study_dir, judge_records)
    edge, v, done = clients.edge, clients.v, clients.done
    return {
        cid: client_candidates(
            edge, slice_records, batches, {k: t.float() for k, t in state.personalized.items()}, v, done
        )
        for cid, state, slice_records, batches in clients
    }


def judge_margin(candidates: dict[str, list[dict]], margin: float, tolerance: float) -> dict:
    """The targets' figures for the choice ``deployable`` makes at ``margin``."""
    picked = []
    for cands in candidates.values():
        choices = [Choice(c["name"], 0, nll=c["slice"], se=c["se"]) for c in cands]  # personalized first
        picked.append((cands[deployable(choices, margin, base_margin=None)], cands))  # the rule without base's test
    return {"margin": margin, **targets(picked, tolerance)}


def targets(picked: list[tuple[dict, list[dict]]], tolerance: float) -> dict:
    """Issue 58's figures for each client's (picked candidate, candidates), all judged: how many are within
    ``tolerance`` of the better of {personalized, global}, the gaps, how many trail the base model."""
    gaps, over_base = [], []
    for choice, cands in picked:
        judge = {c["name"]: c["judge"] for c in cands}
        gaps.append(choice["judge"] - min(judge["personalized"], judge["global"]))
        over_base.append(choice["judge"] - judge["base"])
    return {
        "within": sum(g <= tolerance for g in gaps),
        "clients": len(gaps),
        "mean_gap": sum(gaps) / len(gaps),
        "worst_gap": max(gaps),
        "worse_than_base": sum(d > 0 for d in over_base),
        "worse_than_base_beyond_tolerance": sum(d > tolerance for d in over_base),
        "picks": [choice["name"] for choice, _ in picked],
        "gaps": gaps,
    }


def cells(r: dict) -> list[str]:
    """A row's figures as its table cells, after the rule's name."""
    return [
        f"{r['within']}/{r['clients']} ({r['within'] / r['clients']:.0%})",
        f"{r['mean_gap']:+.4f}",
        f"{r['worst_gap']:+.4f}",
        f"{r['worse_than_base']} ({r['worse_than_base_beyond_tolerance']})",
        ", ".join(f"{p} {r['picks'].count(p)}" for p in sorted(set(r["picks"]))),
    ]


def main() -> None:
    args = judge_parser(__doc__.splitlines()[0]).parse_args()
    candidates = study_candidates(args.study, args.judge_records)
    rows = [judge_margin(candidates, m, args.tolerance) for m in MARGINS]
    table = [[f"{r['margin']:g}" + (" (the device's)" if r["margin"] == SE_MARGIN else ""), *cells(r)] for r in rows]
    header = [
        "margin (SE)", f"within {args.tolerance} of min(personalized, global)", "mean gap", "worst gap",
        f"worse than base (> {args.tolerance})", "chosen",
    ]  # fmt: skip
    notes = (
        f"Each client's candidates scored on its validation slice (as `train` does) and judged on {args.judge_records} "
        "held-out records, AdapFu, after the study's last round, against the newest global messenger."
    )
    print(write_results("deployed_rules", {"rows": rows, "candidates": candidates}, table, header, notes))


if __name__ == "__main__":
    main()
