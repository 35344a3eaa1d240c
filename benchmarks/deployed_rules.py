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

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from deployed_judge import client_states, open_study  # noqa: E402

from ciders_edge.data.holdout import hold_out  # noqa: E402
from ciders_edge.data.records import load_examples  # noqa: E402
from ciders_edge.formats.bundle import Bundle  # noqa: E402
from ciders_edge.inference.evaluate import backbone_batches  # noqa: E402
from ciders_edge.model.adapfu import load_adapfu  # noqa: E402
from ciders_edge.profiles import load_profile  # noqa: E402
from ciders_edge.progress import progress_bar  # noqa: E402
from ciders_edge.training.round import round_hyperparams  # noqa: E402
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
    study, cfg, done = open_study(study_dir)
    bundle = Bundle.load(study.run.bundle(cfg.profile, done))
    edge = load_adapfu(bundle)
    seq_len = round_hyperparams(bundle, load_profile(cfg.profile), {}).seq_len
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    states, out, judged = client_states(study), {}, {}  # judged: the backbone pass of each eval file, once
    with progress_bar() as bar:
        task = bar.add_task("candidates", total=len(states), metrics="")
        for cid, state in states.items():
            _, slice_records = hold_out(load_examples(study.train_data(cid), edge.tokenizer, seq_len), cfg.val_fraction)
            digest = hashlib.sha256(study.eval_data(cid).read_bytes()).hexdigest()
            if digest not in judged:
                judged[digest] = backbone_batches(
                    edge, load_examples(study.eval_data(cid), edge.tokenizer, 512)[:judge_records]
                )
            x = {k: t.float() for k, t in state.personalized.items()}
            out[cid] = client_candidates(edge, slice_records, judged[digest], x, v, done)
            bar.update(task, advance=1, metrics=cid)
    return out


def judge_margin(candidates: dict[str, list[dict]], margin: float, tolerance: float) -> dict:
    """The targets' figures for the choice ``deployable`` makes at ``margin``."""
    gaps, over_base, picks = [], [], []
    for cands in candidates.values():
        choices = [Choice(c["name"], 0, nll=c["slice"], se=c["se"]) for c in cands]  # personalized first
        picked = cands[deployable(choices, margin)]
        judge = {c["name"]: c["judge"] for c in cands}
        gaps.append(picked["judge"] - min(judge["personalized"], judge["global"]))
        over_base.append(picked["judge"] - judge["base"])
        picks.append(picked["name"])
    n = len(gaps)
    return {
        "margin": margin,
        "within": sum(g <= tolerance for g in gaps),
        "clients": n,
        "mean_gap": sum(gaps) / n,
        "worst_gap": max(gaps),
        "worse_than_base": sum(d > 0 for d in over_base),
        "worse_than_base_beyond_tolerance": sum(d > tolerance for d in over_base),
        "picks": picks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", type=Path, required=True, help="a study folder (simulate with --val-fraction)")
    ap.add_argument("--judge-records", type=int, default=64, help="held-out records a client the choice is judged on")
    ap.add_argument("--tolerance", type=float, default=0.01)
    args = ap.parse_args()
    candidates = study_candidates(args.study, args.judge_records)
    rows = [judge_margin(candidates, m, args.tolerance) for m in MARGINS]
    table = [
        [
            f"{r['margin']:g}" + (" (the device's)" if r["margin"] == SE_MARGIN else ""),
            f"{r['within']}/{r['clients']} ({r['within'] / r['clients']:.0%})",
            f"{r['mean_gap']:+.4f}",
            f"{r['worst_gap']:+.4f}",
            f"{r['worse_than_base']} ({r['worse_than_base_beyond_tolerance']})",
            ", ".join(f"{p} {r['picks'].count(p)}" for p in sorted(set(r["picks"]))),
        ]
        for r in rows
    ]
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
