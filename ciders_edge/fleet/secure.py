"""Secure aggregation on the edge (docs/privacy.md): Flower's SecAgg+ client mod answers the cloud's secure
rounds, and what it masks is this edge's displacement Delta_i (eq. 11 of its own decoded Δc).

The cloud then learns the mean of the round's displacements and nothing of one edge's: no Δc packet leaves
the edge, and the edge's c_i is the only copy (the cloud keeps, per client, the last round it summed).
The bundle rides in Flower's ``FitIns`` (its parameters: the files the edge lacks), as SecAgg+'s workflow sends it.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Parameters, Status, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from ciders_edge.tensors import Tensors

__all__ = ["secure_aggregation_mod", "is_secure", "secure_request", "secure_reply", "FILES_TYPE"]

FILES_TYPE = "ciders.bundle-files"  # FitIns.parameters.tensor_type: raw file bytes, in the order `files` lists


def secure_aggregation_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ mod for the messages of a secure round (they carry its configs); others pass by."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def is_secure(content: RecordDict) -> bool:
    """Whether a train message is a secure round's (SecAgg+ hands it on as FitIns)."""
    return "fitins.config" in content.config_records


def secure_request(content: RecordDict) -> tuple[dict, dict[str, bytes]]:
    """The round's request (as a plain round's ``ROUND`` record) and the bundle files, from the FitIns."""
    fitins = compat.recorddict_to_fitins(content, keep_input=True)
    config = dict(fitins.config)
    names = json.loads(str(config.pop("files")))
    files = dict(zip(names, fitins.parameters.tensors, strict=True))
    return config, files


def secure_reply(delta: Tensors, summary: dict) -> RecordDict:
    """The displacement as SecAgg+ masks it: one float64 array per tensor, in name order, weight 1 (a secure
    round weighs edges uniformly); the summary's scalars ride in the clear."""
    arrays = [delta[k].double().numpy() for k in sorted(delta)]
    parameters = Parameters(
        tensors=[ndarray_to_bytes(np.ascontiguousarray(a)) for a in arrays], tensor_type="numpy.ndarray"
    )
    res = FitRes(Status(Code.OK, "ok"), parameters, num_examples=1, metrics={"summary": json.dumps(summary)})
    return compat.fitres_to_recorddict(res, keep_input=True)
