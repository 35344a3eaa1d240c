"""``simulate --engine flower``: a study's clients as virtual SuperNodes of Flower's Simulation Engine.

One virtual SuperNode per client (partition id i is the study's i-th client, its data and its state
folder); the study's ClientApp (:mod:`ciders_edge.fleet.virtual`) runs each in a Ray actor. The
ServerApp is the study's own round loop (:func:`.round_loop.run_rounds`, as in-process) with
:class:`GridEngine` carrying its jobs: sampling, aggregation, DP noise and evaluation stay with the
cloud, in this process. Actors hold no client between messages: each job reads its client's state
from the study folder and writes it back, so a population of thousands costs the actors' memory, not
thousands of models. A Ray cluster joined by ``--ray-address`` must mount the study at the same path.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

from flwr.app import Message, MessageType, RecordDict
from flwr.common.logger import LOGGER_NAME
from flwr.serverapp import Grid, ServerApp

from ciders_edge.errors import CidersError, ConfigError
from ciders_edge.fleet.virtual import PARTITION, StudyJob, Trained
from ciders_edge.progress import progress_bar

__all__ = ["GridEngine", "run_on_flower"]

PULL_INTERVAL = 0.05  # seconds between polls of the in-memory SuperLink
REGISTER_TIMEOUT = 300.0  # seconds for the Simulation Engine to register the virtual SuperNodes (Ray starts)


class ClientFailed(CidersError):
    """A virtual SuperNode's job failed: its client, round and the edge's own error."""


class GridEngine:
    """Round jobs as Flower messages, each to its client's virtual SuperNode; replies as they arrive."""

    def __init__(self, grid: Grid, ids: list[str]) -> None:
        self.grid = grid
        self.partition = {cid: i for i, cid in enumerate(ids)}
        self.node_of = _nodes_by_partition(grid, len(ids))

    def run(self, t: int, jobs: list[StudyJob], labels: dict[str, str]) -> dict[str, Trained]:
        what = "probe" if jobs and jobs[0].probe else "re-choose" if jobs and jobs[0].rechoose else "train"
        kind = MessageType.EVALUATE if what == "re-choose" else MessageType.TRAIN  # Flower's federated evaluation
        by_id = {}
        for job in jobs:
            job = replace(job, partition=self.partition[job.client_id])
            msg = Message(job.to_record(), self.node_of[job.partition], kind, group_id=str(t))
            (mid,) = self.grid.push_messages([msg])
            by_id[mid] = job.client_id
        out: dict[str, Trained] = {}
        with progress_bar() as bar:
            task = bar.add_task(f"round {t} {what}", total=len(by_id), metrics="")
            for cid, reply in _replies(self.grid, by_id):
                if reply.has_error():
                    raise ClientFailed(f"round {t}: {cid} failed on its virtual SuperNode: {reply.error.reason}")
                out[cid] = Trained.from_record(reply.content)
                bar.update(task, advance=1, metrics=cid)
        return out


def run_on_flower(backend: dict, ids: list[str], rounds: Callable[[GridEngine], dict]) -> dict:
    """``rounds(engine)`` as the ServerApp of a Flower simulation with one virtual SuperNode per client on
    Flower's Ray ``backend`` config; returns what it returned (an error in it is raised here, as in-process)."""
    from flwr.simulation import run_simulation  # imports Ray's glue only now

    from ciders_edge.fleet.virtual import app as client_app

    result: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context) -> None:
        result["last"] = rounds(GridEngine(grid, ids))

    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.setLevel(logging.ERROR)  # Flower's INFO lines and run_simulation's deprecation notice; errors still show
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="ray")  # a notice about GPUs env vars
            run_simulation(server_app, client_app, len(ids), backend_config=backend)
    finally:
        logger.setLevel(level)
    return result["last"]


def _nodes_by_partition(grid: Grid, n: int) -> dict[int, int]:
    """Each virtual SuperNode's node id by its partition id (the study's client index)."""
    deadline = time.monotonic() + REGISTER_TIMEOUT
    while len(nodes := list(grid.get_node_ids())) < n and time.monotonic() < deadline:
        time.sleep(PULL_INTERVAL)  # the engine registers its nodes beside the ServerApp, which starts first
    if len(nodes) != n:
        raise ConfigError(f"the simulation has {len(nodes)} virtual SuperNodes for {n} clients")
    asks = {}
    for node in nodes:
        (mid,) = grid.push_messages([Message(RecordDict(), node, MessageType.QUERY)])
        asks[mid] = node
    return {int(reply.content.config_records[PARTITION]["id"]): node for node, reply in _replies(grid, asks)}


def _replies(grid: Grid, pending: dict[str, object]) -> Iterator[tuple[object, Message]]:
    """(what each message was for, its reply) as the replies arrive."""
    pending = dict(pending)
    while pending:
        replies = list(grid.pull_messages(list(pending)))
        for reply in replies:
            yield pending.pop(reply.metadata.reply_to_message_id), reply
        if not replies:
            time.sleep(PULL_INTERVAL)
