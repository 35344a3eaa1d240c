"""The end every cloud round shares, plain or secure: eq. (12) from the round's mean, eq. (13) on every
learnable backbone, then the commit: round t+1's bundles first (unreferenced until the state says so),
then the server state, swapped in atomically."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ciders_cloud.models.backbones import pack
from ciders_cloud.models.teacher import CloudModels
from ciders_cloud.round.bundles import write_bundles
from ciders_cloud.round.distill import check_finite, distill_backbone, takd_log
from ciders_cloud.run.config import RunConfig
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.logs import write_round_log
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import round_takd, strategy_for
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.tensors import Tensors, norm

__all__ = ["commit_round"]


def commit_round(
    run_dir: Path,
    run: RunConfig,
    state: ServerState,
    new: ServerState,
    hp: RoundHyperparams,
    backbones: dict[str, CloudModels],
    mean: Tensors,
    round_: dict,
    closing: dict,
) -> dict:
    """Eq. (12) from the round's mean, eq. (13) on every backbone, then the commit: round t+1's bundles
    first (unreferenced until the state says so), then ``new`` (its clients, digests or sums already set)
    as the server state. Returns the round's summary: ``round_`` and ``closing`` around the step's figures."""
    strategy = strategy_for(run)
    v, c = strategy.server_step(state.messenger, state.consensus, mean, hp)  # (12), per layer
    check_finite({"v": v, "c": c}, f"round {state.round}")
    steps, loss = round_takd(run, state.round)
    takd = {name: distill_backbone(models, v, run, state, steps, loss) for name, models in backbones.items()}  # (13)
    reference = takd[next(iter(takd))]
    summary = {
        "round": state.round,
        "next_round": state.round + 1,
        "algorithm": run.algorithm,
        **round_,
        "v_change": norm({k: v[k] - state.messenger[k] for k in v}),
        "c_norm": norm(c),
        "takd_steps": len(reference.records),
        "takd_last": reference.records[-1] if reference.records else None,
        "fidelity": reference.fidelity.to_dict() if reference.fidelity else None,
        **closing,
    }
    if len(takd) > 1:  # the cost and fidelity of each backbone's TAKD
        summary["backbones"] = {name: t.summary() for name, t in takd.items()}
    first = next(iter(takd))
    new = replace(
        new,
        round=state.round + 1,
        messenger=v,
        backbone=pack({name: m.backbone_state() for name, m in backbones.items()}, first),
        consensus=c,
        optimizer=pack({name: t.optimizer for name, t in takd.items()}, first),
        takd_step=takd[first].step,
        last_summary=summary,
    )
    fidelities = {name: t.fidelity for name, t in takd.items()}
    bundles = write_bundles(run_dir, run, backbones, new, run.device_profiles(), fidelities)
    summary["bundles"] = {k: str(b.path) for k, b in bundles.items()}
    summary["bytes_down"] = {k: b.new_bytes for k, b in bundles.items()}
    folder = RunFolder(run_dir)
    write_round_log(folder.distill_log, state, takd_log(run, state, takd))
    new.save(folder.server_state)  # the commit point
    return summary
