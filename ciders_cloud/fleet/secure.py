"""A secure fleet round (``serve --secure-aggregation``): Flower's SecAgg+ workflow sums the sampled edges'
displacements, and the cloud learns their mean, never one edge's (docs/privacy.md).

Flower ships SecAgg+ as a workflow of its legacy strategy API; :class:`_Round` is the two calls it makes
of a strategy (who trains on what; the unmasked result), so Flower's protocol runs unchanged: Shamir
shares of each edge's keys, pairwise masks, and the unmasking that removes a dropped edge's masks as long
as ``THRESHOLD`` of the sampled edges' shares (and at least ``MIN_EDGES``) come back. Edges weigh 1 each: the
mean is uniform. The cloud is trusted to follow the protocol (honest but curious): Flower's SecAgg+ has no
consistency round, so a ServerApp that told an edge's neighbours different dropout lists could unmask that edge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from ciders_edge.fleet.secure import FILES_TYPE
from ciders_edge.tensors import Tensors

__all__ = ["SecureSum", "secure_sum", "fit_ins", "CountingGrid", "THRESHOLD", "MIN_EDGES", "CLIP_RANGE", "QUANTIZATION"]

THRESHOLD = 0.5  # of the shares (every sampled edge holds one of every other's keys) needed to unmask
MIN_EDGES = 3  # in a sum, and shares to unmask one: with two, each edge could subtract its own displacement
CLIP_RANGE = 8.0  # each element of a displacement is clipped to [-R, R] before quantization (without DP; DP: C)
QUANTIZATION = 1 << 22  # quantization levels over [-R, R] (Flower's default): the mean's error is at most 2R/Q


@dataclass
class _Proxy:
    """What SecAgg+'s workflow knows of an edge: its node id."""

    node_id: int


@dataclass
class SecureSum:
    """A secure round's outcome: the mean of the summed edges' displacements (``None``: the protocol stopped,
    too few edges answered) and what each summed edge said in the clear (its training summary)."""

    mean: Tensors | None
    summed: list[int] = field(default_factory=list)  # node ids
    summaries: dict[int, str] = field(default_factory=dict)


class _Round:
    """The legacy strategy SecAgg+'s workflow calls: the round's train requests, then the unmasked mean."""

    def __init__(self, requests: dict[int, FitIns], like: Tensors) -> None:
        self.requests, self.like = requests, like
        self.result = SecureSum(None)

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Proxy(nid), ins) for nid, ins in self.requests.items()]

    def aggregate_fit(self, server_round, results, failures):
        if results:
            arrays = parameters_to_ndarrays(results[0][1].parameters)  # each result carries the unmasked mean
            mean = {
                k: torch.from_numpy(np.asarray(a)).to(self.like[k].dtype)
                for k, a in zip(sorted(self.like), arrays, strict=True)  # the edges send them in name order
            }
            summaries = {proxy.node_id: str(res.metrics.get("summary", "")) for proxy, res in results}
            self.result = SecureSum(mean, [proxy.node_id for proxy, _ in results], summaries)
        return None, {}


def fit_ins(config: dict, files: dict[str, bytes]) -> FitIns:
    """A plain round's train request (``ROUND``'s keys and the bundle files) as the FitIns SecAgg+ forwards."""
    names = sorted(files)
    return FitIns(Parameters([files[n] for n in names], FILES_TYPE), {**config, "files": json.dumps(names)})


def secure_sum(
    grid: Grid,
    context: Context,
    round_: int,
    requests: dict[int, FitIns],
    like: Tensors,
    clip_range: float,
    timeout: float,
) -> SecureSum:
    """Run Flower's SecAgg+ over the edges of ``requests`` (node id -> train request) and return the mean of
    their displacements over ``like``'s tensors (v), in name order as the edges send them."""
    strategy = _Round(requests, like)
    threshold = max(MIN_EDGES, math.ceil(THRESHOLD * len(requests)))  # so no sum of fewer than MIN_EDGES unmasks
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = SecAggPlusWorkflow(
        num_shares=1.0,  # every sampled edge holds a share of every other's keys
        reconstruction_threshold=threshold,
        max_weight=1.0,  # every edge weighs 1
        clipping_range=clip_range,
        quantization_range=QUANTIZATION,
        timeout=timeout,
    )
    workflow(grid, LegacyContext(context, strategy=strategy))  # type: ignore[arg-type]
    if len(strategy.result.summed) < MIN_EDGES:  # never release the mean of fewer
        return SecureSum(None)
    return strategy.result


class CountingGrid:
    """A ``Grid`` that counts the payload bytes of what it sends and receives (SecAgg+'s four stages)."""

    def __init__(self, grid: Grid) -> None:
        self.grid, self.sent, self.received = grid, 0, 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += sum(payload_bytes(m.content) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.received += sum(payload_bytes(r.content) for r in replies if not r.has_error())
        return replies

    def __getattr__(self, name):
        return getattr(self.grid, name)


def payload_bytes(content) -> int:
    """The bytes a message's records carry: array data, and the byte and text values of its config records."""
    arrays = sum(len(a.data) for record in content.array_records.values() for a in record.values())
    values = [v for record in content.config_records.values() for v in record.values()]
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return arrays + sum(len(x) for x in flat if isinstance(x, bytes | str))
