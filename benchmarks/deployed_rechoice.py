"""Should a device that was not sampled choose again when a newer bundle arrives? Issue 58's re-choice, judged.

    python benchmarks/deployed_rechoice.py --study runs/deployed-choice/partial/ciders-fo

Under partial participation a client trains once in several rounds, and its deployed messenger was chosen
against the global messenger of the bundle it last trained from. After the study's last round every client
that holds a choice scores, on its validation slice and AdapFu, what ``ciders-edge validate`` scores: its kept
best, the newest global messenger, its latest personalized one, their mixtures and the base model. Each rule
(which candidate is the reference a rival must beat by ``margin`` paired standard errors; :func:`~ciders_edge.
training.validation.rechoose` takes the kept best) is judged on ``--judge-records`` held-out records against
issue 58's targets: within ``--tolerance`` nats of the better of {latest personalized, newest global}, and
not worse than the base model. The first row keeps the choice as it is (no re-choice); the next rows add the
base model's test (:func:`~ciders_edge.training.validation.deployable`'s ``base_margin``); the last one takes
the fleet's evidence (:mod:`ciders_edge.training.fleet_evidence`), pooled here from every client's slice on
this one bundle, where a bundle carries the last round's sampled clients' reports. ``--saved`` judges the
rules again on a results file's per-record slice losses and judge NLLs, without running a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from deployed_judge import StudyClients, judge_parser, open_study  # noqa: E402
from deployed_rules import cells, targets  # noqa: E402

from ciders_edge.inference.evaluate import backbone_batches  # noqa: E402
from ciders_edge.training.fleet_evidence import FleetEvidence  # noqa: E402
from ciders_edge.training.validation import (  # noqa: E402
    BASE_MARGIN,
    SE_MARGIN,
    Choice,
    Scores,
    deployable,
    messenger_scores,
    paired_se,
    rivals_of,
)

DEVICE = ("kept", SE_MARGIN, BASE_MARGIN)  # reference, margin, base margin: ``ciders-edge validate``'s rule
FLEET = ("fleet", SE_MARGIN, BASE_MARGIN)  # ... with a bundle's evidence: the fleet picks the reference
RULES = (
    *(("kept", m, None) for m in (0.0, SE_MARGIN, 2.0)),
    ("global", SE_MARGIN, None),
    ("personalized", SE_MARGIN, None),
    *(("kept", SE_MARGIN, b) for b in sorted({0.0, 1.0, 2.0, BASE_MARGIN})),
    ("global", SE_MARGIN, BASE_MARGIN),
    FLEET,
)


@torch.no_grad()
def client_candidates(edge, slice_records: list, batches: list, candidates: list) -> list[dict]:
    """Each candidate's slice loss record by record (any rule's standard error comes from them) and its NLL
    on the judge's ``batches``."""
    slice_batches = backbone_batches(edge, slice_records)
    out = []
    for name, tensors in candidates:
        edge.use_messenger(tensors)
        s = messenger_scores(edge, slice_batches)
        judged = messenger_scores(edge, batches).nll
        out.append({"name": name, "slice": s.nll, "nll": s.record_nll.tolist(), "tokens": s.record_tokens.tolist()})
        out[-1]["judge"] = judged
    return out


def study_candidates(study_dir: Path, judge_records: int) -> dict[str, dict]:
    """Per client that holds a choice, after the study's last round: its candidates on the newest bundle."""
    clients = StudyClients(study_dir, judge_records)
    out = {}
    for cid, state, slice_records, batches in clients:
        x = {k: t.float() for k, t in state.personalized.items()}
        kept = {k: t.float() for k, t in state.best.items()}
        named = [("kept", kept)] + [(c.name, t) for c, t in rivals_of(x, clients.v, (clients.done, state.round))]
        out[cid] = {
            "stale_rounds": clients.done - 1 - state.round,
            "kept": state.best_info["messenger"],
            "candidates": client_candidates(clients.edge, slice_records, batches, named),
        }
    return out


def _scores(c: dict) -> Scores:
    return Scores(c["slice"], None, 0, torch.tensor(c["nll"], dtype=torch.float64), torch.tensor(c["tokens"]).double())


def pick(
    cands: list[dict],
    reference: str | None,
    margin: float,
    base_margin: float | None,
    fleet: FleetEvidence | None = None,
) -> dict:
    """The candidate a rule deploys: ``reference`` (None: keep the kept best as it is) unless a rival's slice
    NLL is lower by more than ``margin`` standard errors of its gap to the reference; then, unless
    ``base_margin`` is None, the base model unless the pick beats it by that many standard errors (of the
    posterior, with the ``fleet``'s prior)."""
    by_name = {c["name"]: c for c in cands}
    if reference is None:
        return by_name["kept"]
    ordered = [by_name[reference]] + [c for c in cands if c["name"] != reference]
    scores = [_scores(c) for c in ordered]
    base = scores[ordered.index(by_name["base"])]
    choices = [
        Choice(
            "base" if c["name"] == "base" else "messenger", 0, nll=c["slice"],
            se=paired_se(scores[0], s), base_se=paired_se(s, base),
        )
        for c, s in zip(ordered, scores, strict=True)
    ]  # fmt: skip
    return ordered[deployable(choices, margin, base_margin, fleet)]


def fleet_of(clients: dict[str, dict]) -> FleetEvidence | None:
    """The evidence the clients' reports would pool to: each one's personalized − global gap, and the gap to
    the base model of what it deploys by the device's own rule."""
    reports = []
    for c in clients.values():
        by = {x["name"]: x for x in c["candidates"]}
        personalized, global_, base = (_scores(by[n]) for n in ("personalized", "global", "base"))
        report = {
            "val_gap_personalized_global": personalized.nll - global_.nll,
            "val_se_personalized_global": paired_se(personalized, global_),
        }
        deployed = pick(c["candidates"], *DEVICE)
        if deployed["name"] != "base" and deployed["slice"] != by["base"]["slice"]:
            own = _scores(deployed)
            report |= {"val_gap_deployed_base": own.nll - base.nll, "val_se_deployed_base": paired_se(own, base)}
        reports.append(report)
    return FleetEvidence.pool(reports, -1)


def judge_rule(clients: dict[str, dict], rule: tuple[str | None, float, float | None], tolerance: float) -> dict:
    """The targets' figures for the choices of ``rule`` (reference, margin, base margin), and how many of the
    stale clients' are within."""
    reference, margin, base_margin = rule
    fleet = fleet_of(clients) if reference == "fleet" else None
    if reference == "fleet":
        reference = "global" if fleet and fleet.global_first else "kept"
    picked = [(pick(c["candidates"], reference, margin, base_margin, fleet), c["candidates"]) for c in clients.values()]
    row = {"reference": rule[0], "margin": margin, "base_margin": base_margin, **targets(picked, tolerance)}
    if fleet is not None:
        row["fleet"] = {**fleet.to_dict(), "reference": reference}
    stale = [gap <= tolerance for c, gap in zip(clients.values(), row["gaps"], strict=True) if c["stale_rounds"] > 0]
    return {**row, "stale_within": sum(stale), "stale": len(stale)}


def _label(r: dict) -> str:
    if r["reference"] is None:
        return "no re-choice (the kept best)"
    rule = (r["reference"], r["margin"], r.get("base_margin"))
    device = {DEVICE: " (`ciders-edge validate` alone)", FLEET: " (`ciders-edge validate` with a bundle's evidence)"}
    base = "" if r.get("base_margin") is None else f", beats base by {r['base_margin']:g} SE"
    if r["reference"] == "fleet":  # the reference the evidence picked, and why
        f = r.get("fleet") or {}
        why = (
            "no evidence"
            if not f
            else f"{f['reference']}: personalized − global {f['personalized_gap']:+.4f} ± {f['personalized_se']:.4f}"
        )
        return f"fleet's reference ({why}), margin {r['margin']:g} SE{base}{device[rule]}"
    return f"reference {r['reference']}, margin {r['margin']:g} SE{base}{device.get(rule, '')}"


def main() -> None:
    ap = judge_parser(__doc__.splitlines()[0])
    ap.add_argument("--saved", type=Path, help="a results JSON of this benchmark: judge the rules on its figures")
    ap.add_argument("--results", default="deployed_rechoice", help="the results file's name in benchmarks/results")
    args = ap.parse_args()
    if args.saved:
        clients = json.loads(args.saved.read_text())["clients"]
    else:
        clients = study_candidates(args.study, args.judge_records)
    rows = [judge_rule(clients, rule, args.tolerance) for rule in ((None, 0.0, None), *RULES)]
    table = [[_label(r), (c := cells(r))[0], f"{r['stale_within']}/{r['stale']}", *c[1:]] for r in rows]
    header = [
        "rule", f"within {args.tolerance} of min(personalized, newest global)", "of them, not sampled last round",
        "mean gap", "worst gap", f"worse than base (> {args.tolerance})", "chosen",
    ]  # fmt: skip
    _, _, done = open_study(args.study)
    notes = (
        f"After round {done - 1} of `{args.study}`: each client's candidates scored on its validation slice and "
        f"on AdapFu with the newest (round {done}) bundle's global messenger, judged on {args.judge_records} "
        "held-out records."
    )
    print(write_results(args.results, {"rows": rows, "clients": clients}, table, header, notes))


if __name__ == "__main__":
    main()
