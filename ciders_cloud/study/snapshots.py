"""Each participant's state as it was before the round, kept until the round commits.

A study stopped mid-round (a kill, a lost host) has clients that trained the round and a cloud that
never aggregated it: their states already hold the round, so training it again would be refused.
``simulate --resume`` puts back the states kept here and runs the round again from the start, which
gives the same round a run without the stop would have had (every seed is the round's).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ciders_cloud.run.folder import StudyFolder
from ciders_edge.errors import StateError
from ciders_edge.formats.atomic import fsync_dir, staging_dir
from ciders_edge.formats.client_state import ClientState

__all__ = ["keep_state", "round_committed", "restore_uncommitted", "check_resumable"]

NO_STATE = "no-state"  # the marker of a client that had no state yet before the round


def keep_state(study: StudyFolder, round_: int, client: str) -> None:
    """Keep ``client``'s state folder as it is before it trains ``round_`` (once: a kept copy stays)."""
    kept = study.snapshot(round_, client)
    if kept.exists():
        return
    tmp = staging_dir(kept)
    state = study.client_state(client)
    if state.is_dir():
        shutil.copytree(state, tmp, dirs_exist_ok=True)
    else:
        (tmp / NO_STATE).touch()
    tmp.rename(kept)
    fsync_dir(kept.parent)


def round_committed(study: StudyFolder, round_: int) -> None:
    """The cloud committed ``round_``: its kept states are history."""
    shutil.rmtree(study.round_snapshots(round_), ignore_errors=True)


def check_resumable(study: StudyFolder, ids: list[str], next_round: int) -> None:
    """Before a resumed round trains anyone: every state it starts from (a client's kept copy, else its
    own folder) loads whole (checksums: a damaged or edited copy is named now, not after others retrained),
    and none already holds the round (its copy from before the round was removed)."""
    pending = study.round_snapshots(next_round)
    for cid in ids:
        kept = pending / cid
        state = ClientState.load(kept if kept.is_dir() else study.client_state(cid))
        if state is not None and state.round >= next_round:
            raise StateError(
                f"{study.client_state(cid)}: client {cid} holds round {state.round}, which the cloud never "
                f"aggregated, and its copy from before that round is gone ({pending}); the study cannot run "
                f"round {next_round} again: put that folder back, or make the study again"
            )


def restore_uncommitted(study: StudyFolder, next_round: int) -> list[str]:
    """Put back the states kept for ``next_round`` (trained, never aggregated); drop those of rounds the
    cloud committed. Returns the clients put back."""
    restored, pending = [], study.round_snapshots(next_round)
    for folder in sorted(study.snapshots.glob("round-*")):
        if folder == pending:
            for kept in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):  # not a half-made copy
                _put_back(kept, study.client_state(kept.name))
                restored.append(kept.name)
        shutil.rmtree(folder)
    return restored


def _put_back(kept: Path, state: Path) -> None:
    shutil.rmtree(state, ignore_errors=True)
    if not (kept / NO_STATE).exists():
        state.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(kept, state)
