"""Where a study's clients train: the round loop hands each round's jobs to an engine.

Both engines run the same job (:func:`ciders_edge.fleet.virtual.run_job`, ``ciders-edge train``'s code) on
the same files, and the round loop around them (:mod:`.round_loop`) is one: sampling, aggregation, DP and
evaluation do not know which engine carried the clients.

- :class:`InProcess` (the default): one client after another in this process.
- ``flower`` (:mod:`.flower_engine`): the study's ClientApp (:mod:`ciders_edge.fleet.virtual`) on virtual
  SuperNodes of Flower's Simulation Engine, in Ray actors over this machine's cores and GPUs or a Ray cluster.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ciders_edge.errors import ConfigError
from ciders_edge.fleet.virtual import StudyJob, Trained, run_job
from ciders_edge.progress import console

__all__ = ["Engine", "EngineSettings", "InProcess", "ENGINES", "run_with"]

ENGINES = ("in-process", "flower")


class Engine(Protocol):
    def run(self, t: int, jobs: list[StudyJob], labels: dict[str, str]) -> dict[str, Trained]:
        """Run round ``t``'s jobs; what each client returned, by client id. ``labels``: what to show."""
        ...


class InProcess:
    """Each client in this process, one after another."""

    def run(self, t: int, jobs: list[StudyJob], labels: dict[str, str]) -> dict[str, Trained]:
        out = {}
        for job in jobs:
            console.print(f"[bold]round {t}[/] {job.client_id} ({labels[job.client_id]})")
            out[job.client_id] = run_job(job)
        return out


@dataclass(frozen=True)
class EngineSettings:
    """``simulate --engine``'s choice and the Flower backend's resources (not part of the study: its
    results do not depend on them)."""

    name: str = "in-process"
    actors: int | None = None  # Ray actors on this machine (None: as many as the cores allow)
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0
    ray_address: str | None = None  # join this Ray cluster instead of starting one here

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ConfigError(f"--engine {self.name!r}: choose one of {', '.join(ENGINES)}")
        if self.name == "in-process" and (self.actors or self.ray_address or self.gpus_per_client):
            raise ConfigError("--actors, --gpus-per-client and --ray-address need --engine flower")
        if self.actors is not None and self.actors < 1:
            raise ConfigError(f"--actors {self.actors}: at least 1")
        if self.cpus_per_client <= 0 or self.gpus_per_client < 0:
            raise ConfigError("--cpus-per-client must be > 0 and --gpus-per-client >= 0")
        if self.ray_address and self.actors:
            raise ConfigError("--actors sizes a Ray started here; a cluster joined by --ray-address has its own")
        if self.name == "flower" and not (self.actors or self.ray_address):
            self._check_fits_here()
        if self.name == "flower" and importlib.util.find_spec("ray") is None:
            raise ConfigError("--engine flower needs Ray: pip install 'ciders-toolkit[simulation]'")

    def backend_config(self) -> dict:
        """Flower's Ray backend: each client's resources; a Ray started here sized for ``actors`` actors."""
        init: dict = {"address": self.ray_address} if self.ray_address else {}
        if self.actors:
            init["num_cpus"] = self.actors * self.cpus_per_client
            init["num_gpus"] = self.actors * self.gpus_per_client
        resources = {"num_cpus": self.cpus_per_client, "num_gpus": self.gpus_per_client}
        return {"client_resources": resources, "init_args": init}

    def describe(self) -> str:
        if self.ray_address:
            return f"on the Ray cluster at {self.ray_address}"
        per = f"{self.cpus_per_client:g} CPU" + (f", {self.gpus_per_client:g} GPU" if self.gpus_per_client else "")
        return f"{self.actors or 'as many'} actors ({per} each)"

    def _check_fits_here(self) -> None:
        """A Ray started here sized by the machine must fit one client, or Flower's actor pool stays empty."""
        cpus, gpus = os.cpu_count() or 1, torch.cuda.device_count()
        if self.cpus_per_client > cpus:
            raise ConfigError(f"--cpus-per-client {self.cpus_per_client:g}: this machine has {cpus} cores")
        if self.gpus_per_client > gpus:
            raise ConfigError(f"--gpus-per-client {self.gpus_per_client:g}: this machine has {gpus} GPUs")


def run_with(settings: EngineSettings | None, ids: list[str], rounds: Callable[[Engine], dict]) -> dict:
    """``rounds(engine)`` on the engine ``settings`` name, for a study of clients ``ids``."""
    if settings is None or settings.name == "in-process":
        return rounds(InProcess())
    from ciders_cloud.study.flower_engine import run_on_flower  # Flower's simulation glue only when asked for

    console.print(f"Flower Simulation Engine: {len(ids)} virtual SuperNodes, {settings.describe()}")
    return run_on_flower(settings.backend_config(), ids, rounds)
