"""Every path of a run folder, a ``simulate`` study and a ``report``, in one place.

A run folder, made by ``ciders-cloud prepare --out RUN`` (:class:`RunFolder`)::

    RUN/
      run.json                            RunConfig: what prepare decided             .config
      aligned_layers.safetensors          the AdapEmu layers the bootstrap trained    .aligned
                                          (a second backbone's as "drop0.5/<name>": backbones.py)
      distill.jsonl                       TAKD and fidelity records                   .distill_log
      server/                             ServerState, swapped in whole per round     .server_state
        state.json                          round, client ids, RNG, last summary
        messenger_lora.safetensors          v                                         MESSENGER_LORA
        backbone_lora.safetensors           the learnable backbones' LoRA             BACKBONE_LORA
        consensus.safetensors               c                                         CONSENSUS
        client_consensus.safetensors        every c_i, as "<client>/<tensor>" (its layers)   CLIENT_CONSENSUS
        takd_optimizer.safetensors          TAKD's AdamW moments, per backbone        TAKD_OPTIMIZER
      bundles/<profile>/round-XXXX/       what edges train on in round XXXX           .bundle(profile, round_)
      keys/<client>.key                   optional: <client>'s packets must carry its tag   .key_file(c), .key_files()
      <answers>/round-XXXX.safetensors    a strategy's answer to round XXXX's probes   .probe_answer(round_, answers)
                                          (the folder is the strategy's: Strategy.probe_answers)
      nodes/<client>.pub                  the edges a fleet admits                    .nodes, .node_keys()
      certs/                              serve's default TLS material (CertsFolder)  .certs
      fleet/                              serve's side of Flower                      .fleet
        log.jsonl                           one record per client-round and round     .fleet_log
        serverapp.lock                      one ServerApp per run                     .serverapp_lock
        flwr/                               the Flower home of serve's flwr commands  .flower_home
        superlink.db, superlink.log         the SuperLink serve starts                .superlink_db, .superlink_log
      .lock                               one writer at a time (ciders_cloud.run.lock)    .lock

A study, made by ``ciders-cloud simulate --out OUT`` (:class:`StudyFolder`)::

    OUT/
      config.json                         SimConfig                                   .config
      run/                                the run folder above                        .run
      data/public.jsonl                   TAKD data, when none was given              .public_data
      data/<client>/train.jsonl           a client's training records                 .train_data(client)
      data/<client>/eval.jsonl            its held-out records                        .eval_data(client)
      clients/<client>/                   its edge state folder                       .client_state(client)
      packets/round-XXXX/<client>.pkt     its Δc packet of round XXXX                 .packet(round_, client)
      packets/round-XXXX/<client>.probe.pkt   its probe packet (gradients)        .probe_packet(round_, client)
      metrics.jsonl                       client, round, eval records (report's input)   .metrics
      snapshots/round-XXXX/<client>/      its state before round XXXX, until that round    .snapshot(round_, client)
                                          commits (``simulate --resume`` puts it back)

A report, made by ``ciders-cloud report --out OUT`` (:class:`ReportFolder`): ``summary.md`` and PNGs.
Changing a name here changes the on-disk layout: old runs must still load, so don't.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ciders_edge.formats.lock import LOCK_FILE  # in a run folder, and in the hidden folder a study is built in

__all__ = [
    "RunFolder",
    "StudyFolder",
    "ReportFolder",
    "CertsFolder",
    "LOCK_FILE",
    "MESSENGER_LORA",
    "BACKBONE_LORA",
    "CONSENSUS",
    "CLIENT_CONSENSUS",
    "TAKD_OPTIMIZER",
]

MESSENGER_LORA = "messenger_lora.safetensors"  # the server state's files
BACKBONE_LORA = "backbone_lora.safetensors"
CONSENSUS = "consensus.safetensors"
CLIENT_CONSENSUS = "client_consensus.safetensors"
TAKD_OPTIMIZER = "takd_optimizer.safetensors"


def _round(round_: int) -> str:
    return f"round-{round_:04d}"


@dataclass(frozen=True)
class CertsFolder:
    """``ciders-cloud certs --out``: the CA certificate the edges trust, and the SuperLink's own pair."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def ca(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        """Where the CA key once lay: never written now (it stays offline), so a folder holding it is refused."""
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"


@dataclass(frozen=True)
class RunFolder:
    """The paths of the run folder at ``root`` (see the module docstring for the tree)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "run.json"

    @property
    def aligned(self) -> Path:
        return self.root / "aligned_layers.safetensors"

    @property
    def distill_log(self) -> Path:
        return self.root / "distill.jsonl"

    @property
    def server_state(self) -> Path:
        return self.root / "server"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    def bundle(self, profile: str, round_: int) -> Path:
        return self.root / "bundles" / profile / _round(round_)

    def key_file(self, client: str) -> Path:
        return self.root / "keys" / f"{client}.key"

    def key_files(self) -> list[Path]:
        """The clients' packet keys in ``keys/``, sorted by file name (so by client id)."""
        return sorted((self.root / "keys").glob("*.key"))

    def probe_answer(self, round_: int, answers: str) -> Path:
        """Round ``round_``'s answer to its probes, in the strategy's folder ``answers``."""
        return self.root / answers / f"{_round(round_)}.safetensors"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    def node_key(self, client: str) -> Path:
        return self.nodes / f"{client}.pub"

    def node_keys(self) -> list[Path]:
        """The edges' public keys in ``nodes/``, sorted by file name (so by client id)."""
        return sorted(self.nodes.glob("*.pub"))

    @property
    def certs(self) -> CertsFolder:
        return CertsFolder(self.root / "certs")

    @property
    def fleet(self) -> Path:
        return self.root / "fleet"

    @property
    def fleet_log(self) -> Path:
        return self.fleet / "log.jsonl"

    @property
    def serverapp_lock(self) -> Path:
        return self.fleet / "serverapp.lock"

    @property
    def flower_home(self) -> Path:
        return self.fleet / "flwr"

    @property
    def superlink_db(self) -> Path:
        return self.fleet / "superlink.db"

    @property
    def superlink_log(self) -> Path:
        return self.fleet / "superlink.log"


@dataclass(frozen=True)
class StudyFolder:
    """The paths of a ``simulate`` study at ``root`` (see the module docstring for the tree)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def run(self) -> RunFolder:
        return RunFolder(self.root / "run")

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def public_data(self) -> Path:
        return self.root / "data" / "public.jsonl"

    def train_data(self, client: str) -> Path:
        return self.root / "data" / client / "train.jsonl"

    def eval_data(self, client: str) -> Path:
        return self.root / "data" / client / "eval.jsonl"

    def client_state(self, client: str) -> Path:
        return self.root / "clients" / client

    def packet(self, round_: int, client: str) -> Path:
        return self.root / "packets" / _round(round_) / f"{client}.pkt"

    def probe_packet(self, round_: int, client: str) -> Path:
        return self.root / "packets" / _round(round_) / f"{client}.probe.pkt"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    def round_snapshots(self, round_: int) -> Path:
        return self.snapshots / _round(round_)

    def snapshot(self, round_: int, client: str) -> Path:
        return self.round_snapshots(round_) / client


@dataclass(frozen=True)
class ReportFolder:
    """``ciders-cloud report --out``: ``summary.md`` and one PNG per plot, nothing else."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def summary(self) -> Path:
        return self.root / "summary.md"

    def plot(self, name: str) -> Path:
        return self.root / name

    @staticmethod
    def holds(path: Path) -> bool:
        """Whether ``path`` is a file a report writes (so replacing the folder loses nothing else)."""
        return path.is_file() and (path.suffix == ".png" or path.name == "summary.md")
