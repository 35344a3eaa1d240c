"""A study's virtual edge: one sampled client's round on files the cloud and the edge share.

``ciders-cloud simulate`` runs its clients through this one function whichever engine carries them: in
its own process, or as Flower messages to :data:`app` on virtual SuperNodes of Flower's Simulation
Engine (``--engine flower``), whose Ray actors may sit on other machines that mount the study. A
:class:`StudyJob` names the files (bundle, data, state folder, packet) and the round's options;
:func:`run_job` trains through :func:`ciders_edge.training.train.train`, as ``ciders-edge train`` and
the fleet's edge do, or probes (a strategy's first exchange), or chooses the deployed messenger again on a
newer bundle (``ciders-edge validate``, Flower's evaluate messages), and returns what the cloud reads.

:data:`app` is a ClientApp of its own, not the fleet's (:mod:`.client_app`): a job names paths to read
and write, which a real edge must never take from the network.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from safetensors.torch import load, load_file, save

from ciders_edge.errors import ConfigError
from ciders_edge.fleet.protocol import bytes_record, record_bytes
from ciders_edge.tensors import Tensors
from ciders_edge.training.rechoice import choose_again
from ciders_edge.training.train import RoundOptions, probe, train

__all__ = ["StudyJob", "Trained", "run_job", "app", "JOB", "TRAINED", "TENSORS", "PARTITION"]

JOB = "ciders.study_job"  # ConfigRecord: the job as JSON
PARTITION = "ciders.partition"  # ConfigRecord: which of the study's clients a virtual SuperNode is
TRAINED = "ciders.trained"  # ConfigRecord: the round's summary as JSON
TENSORS = "ciders.trained_tensors"  # ArrayRecord: the displacement sent and the first direction, as safetensors


@dataclass(frozen=True)
class StudyJob:
    """One client's part of a study round: paths on the shared file system, and the round's options."""

    client_id: str
    bundle: str
    data: str
    state: str
    packet: str
    profile: str | None = None
    codec: str = "fp32"
    frozen_weights: str | None = None
    val_fraction: float = 0.1
    probe_answer: str | None = None  # the cloud's answer to the round's probes (the svrg direction's h), a file
    probe: bool = False  # a strategy's first exchange: gradients at the bundle's point, the state unchanged
    rechoose: bool = False  # no training: choose the deployed messenger again on a newer bundle (`validate`)
    partition: int | None = None  # the virtual SuperNode it is meant for (Flower's partition id)

    def to_record(self) -> RecordDict:
        return RecordDict({JOB: ConfigRecord({"json": json.dumps(asdict(self))})})

    @classmethod
    def from_record(cls, content: RecordDict) -> StudyJob:
        return cls(**json.loads(str(content.config_records[JOB]["json"])))


@dataclass
class Trained:
    """What the cloud reads of a client's round besides its packet (which is on disk)."""

    summary: dict = field(default_factory=dict)
    delta_sent: Tensors = field(default_factory=dict)  # eq. (11) of the decoded packet
    first_direction: Tensors = field(default_factory=dict)  # the direction at x_0, for the diagnostics

    def to_record(self) -> RecordDict:
        tensors = {"delta_sent": _saved(self.delta_sent), "first_direction": _saved(self.first_direction)}
        return RecordDict({TRAINED: ConfigRecord({"json": json.dumps(self.summary)}), TENSORS: bytes_record(tensors)})

    @classmethod
    def from_record(cls, content: RecordDict) -> Trained:
        tensors = record_bytes(content.array_records[TENSORS])
        summary = json.loads(str(content.config_records[TRAINED]["json"]))
        return cls(summary, load(tensors["delta_sent"]), load(tensors["first_direction"]))


def run_job(job: StudyJob) -> Trained:
    """Train (or probe, or choose again) one client's round on the study's files."""
    if job.rechoose:
        return Trained(choose_again(job.bundle, job.data, job.state, job.profile, job.val_fraction, job.frozen_weights))
    if job.probe:
        summary = probe(
            job.bundle, job.data, job.state, job.packet,
            client_id=job.client_id, profile=job.profile, frozen_weights=job.frozen_weights,
        )  # fmt: skip
        return Trained(summary)
    options = RoundOptions(
        client_id=job.client_id,
        profile=job.profile,
        codec=job.codec,
        frozen_weights=job.frozen_weights,
        val_fraction=job.val_fraction,
        control=load_file(job.probe_answer) if job.probe_answer else None,
        reuse_model=True,  # the process's next client on this bundle reuses the AdapEmu
    )
    out = train(job.bundle, job.data, job.state, job.packet, options)
    return Trained(out.summary, out.delta_sent, out.result.first_direction)


def _saved(tensors: Tensors) -> bytes:
    """safetensors bytes of tensors that may be views of one flat vector (which safetensors refuses)."""
    return save({k: t.detach().clone().contiguous() for k, t in tensors.items()})


app = ClientApp()  # the Simulation Engine's virtual SuperNodes


@app.query()
def partition(msg: Message, context: Context) -> Message:
    """Which of the study's clients this virtual SuperNode is (its partition id)."""
    node = int(context.node_config["partition-id"])
    return Message(RecordDict({PARTITION: ConfigRecord({"id": node})}), reply_to=msg)


@app.train()
def study_round(msg: Message, context: Context) -> Message:
    """One client's round of the study, on the files its folder shares."""
    return _run_here(msg, context)


@app.evaluate()
def study_rechoice(msg: Message, context: Context) -> Message:
    """Federated evaluation: a client not training chooses its deployed messenger again on the newer bundle."""
    return _run_here(msg, context)


def _run_here(msg: Message, context: Context) -> Message:
    job = StudyJob.from_record(msg.content)
    if job.partition != int(context.node_config["partition-id"]):
        raise ConfigError(f"{job.client_id}'s round reached partition {context.node_config['partition-id']}")
    return Message(run_job(job).to_record(), reply_to=msg)
