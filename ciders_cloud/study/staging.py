"""A study is built in a hidden folder beside ``--out`` and renamed into place after its last round.

So a failed run leaves no ``--out`` to block its rerun. The hidden folder holds the run lock
(:mod:`ciders_cloud.run.lock`) while its process lives: a killed run's folder has a lock nobody holds,
and the next run for the same ``--out`` sweeps it.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ciders_cloud.run.config import load_run
from ciders_cloud.run.folder import LOCK_FILE, StudyFolder
from ciders_cloud.run.lock import run_lock
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.formats.atomic import fsync_dir, staging_dir, write_json

__all__ = ["staged"]


@contextmanager
def staged(out: Path) -> Iterator[StudyFolder]:
    """A fresh folder beside ``out``, renamed to ``out`` when the block succeeds and removed when it
    fails. It holds the run lock while the process lives, so the stale folder of a killed run is
    recognized and swept by the next one."""
    _refuse_filled(out)
    _sweep(out)
    study = StudyFolder(staging_dir(out))
    with run_lock(study.root, "simulate"):
        try:
            yield study
        except BaseException:
            shutil.rmtree(study.root, ignore_errors=True)
            raise
        study.lock.unlink()  # still held through the open descriptor; a sweep no longer sees it
        _publish(study, out)


def _refuse_filled(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out")


def _sweep(out: Path) -> None:
    """Remove the staging folders that killed runs left for ``out`` (their lock died with them)."""
    for lock in out.parent.glob(f".{glob.escape(out.name)}.*/{LOCK_FILE}"):
        try:
            with run_lock(lock.parent, "sweep"):
                shutil.rmtree(lock.parent, ignore_errors=True)
        except StateError:
            pass  # a live run's


def _publish(study: StudyFolder, out: Path) -> None:
    """Point the run at its data's published path, then rename the study into place."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: was filled while simulate ran; the finished study is in {study.root}")
    run = load_run(study.run.root)
    if Path(run.public_data).absolute() == study.public_data.absolute():  # the default: a sample of client data
        public = StudyFolder(out.absolute()).public_data
        write_json(study.run.config, run.replace(public_data=str(public)).to_dict())
    if out.exists():
        out.rmdir()
    os.replace(study.root, out)
    fsync_dir(out.absolute().parent)
