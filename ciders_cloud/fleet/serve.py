"""``ciders-cloud serve``: run a fleet's rounds on a Flower SuperLink.

Starts the SuperLink (TLS, SuperNode authentication, its database under ``RUN/fleet``) unless
one is already running, registers the edges' public keys from ``RUN/nodes``, submits the
ServerApp with ``flwr run`` and streams its log until the run ends. The SuperLink is Flower's,
started by :mod:`.superlink` so that ``--address`` serves the Fleet API alone and the Control and
Runtime APIs listen on ``127.0.0.1:<port+1>`` only (:func:`control_address`); serve's own ``flwr``
commands (Flower's tools, with their documented flags) talk to that loopback address.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ciders_cloud.fleet.coordinator import node_keys
from ciders_cloud.fleet.secure import MIN_EDGES
from ciders_cloud.fleet.superlink import GRPC_SWITCHES, LOOPBACK
from ciders_cloud.privacy import PrivateRelease
from ciders_cloud.run.config import RunConfig, load_run
from ciders_cloud.run.folder import CertsFolder, RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_cloud.strategies import check_run
from ciders_edge.config import check_limit
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.fleet.lifetime import guarded
from ciders_edge.fleet.processes import flower_env, flower_processes, flower_tool, stop_on_sigterm
from ciders_edge.progress import console

__all__ = ["ServeSettings", "serve", "control_address"]

APP_DIR = Path(__file__).parent / "app"
CONNECTION = "ciders"
EARLIER_EXIT_S = 60.0  # how long a restarted serve waits for a crashed one's Flower processes to end


@dataclass(frozen=True)
class ServeSettings:
    """What ``serve`` runs: its flags on this side of ``flwr run``, its run config on the ServerApp's.

    :meth:`to_run_config` and :meth:`from_run_config` carry ``run_dir``, ``rounds``, ``min_clients``,
    ``round_timeout``, ``secure_aggregation`` and ``rechoose`` across (keys as in the app's pyproject.toml);
    the SuperLink's address, the certificates and ``connect`` concern serve alone, so the ServerApp sees
    their defaults.
    """

    run_dir: Path
    rounds: int  # total rounds of the run: a restarted serve goes on to the same number
    min_clients: int = 1
    address: str = "0.0.0.0:9092"  # where the SuperLink's Fleet API listens for edges (nothing else there)
    round_timeout: float = 600.0
    certs: Path | None = None  # default RUN/certs
    connect: bool = False  # use a SuperLink already running at `address`
    secure_aggregation: bool = False  # rounds summed by Flower's SecAgg+ (the cloud learns only their mean)
    rechoose: bool = False  # after each round, online edges choose their deployed messenger again on the new bundle

    def __post_init__(self) -> None:
        check_limit("rounds", self.rounds, "--rounds")
        check_limit("min_clients", self.min_clients, "--min-clients")
        if not 0 < self.round_timeout < math.inf:
            raise ConfigError(f"--round-timeout must be a positive number of seconds, got {self.round_timeout}")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--address {self.address!r}: expected HOST:PORT")
        if not 0 < int(port) < 65535:
            raise ConfigError(
                f"--address {self.address!r}: the port must be 1..65534 (the next one is the Control API's)"
            )

    def to_run_config(self) -> str:
        """The value of ``flwr run --run-config`` (TOML values; the run folder as an absolute path)."""
        return (
            f"run-dir={json.dumps(str(self.run_dir.resolve()))} rounds={self.rounds} "
            f"min-clients={self.min_clients} round-timeout={float(self.round_timeout)} "
            f"secure-aggregation={str(self.secure_aggregation).lower()} rechoose={str(self.rechoose).lower()}"
        )

    @classmethod
    def from_run_config(cls, rc) -> ServeSettings:
        """The settings from the ServerApp's ``context.run_config`` (what :meth:`to_run_config` sent)."""
        run_dir, rounds, min_clients = Path(str(rc["run-dir"])), int(rc["rounds"]), int(rc["min-clients"])
        secure, rechoose = bool(rc.get("secure-aggregation", False)), bool(rc.get("rechoose", False))
        timeout = float(rc["round-timeout"])
        return cls(run_dir, rounds, min_clients, round_timeout=timeout, secure_aggregation=secure, rechoose=rechoose)


def check_aggregation(run: RunConfig, state: ServerState, opts: ServeSettings) -> None:
    """Refuse, in one line and before anything starts, a run the fleet cannot serve: one whose algorithm
    refuses a fleet or a secure sum, or a secure-aggregation setting the run cannot take."""
    state.check_mode(opts.secure_aggregation, opts.run_dir)
    check_run(run, fleet=True, secure=opts.secure_aggregation)  # the algorithm's own refusal
    if not opts.secure_aggregation:
        return
    if opts.min_clients < MIN_EDGES:
        raise ConfigError(
            f"--secure-aggregation needs --min-clients {MIN_EDGES} or more, got {opts.min_clients} (with two edges, "
            "each could subtract its own displacement from the sum)"
        )
    why = None
    if run.is_mixed:
        why = "profiles that train different messenger layers (the edges' vectors would differ in shape)"
    elif (dp := run.privacy) is not None and dp.clip_on != "edge":
        why = "differential privacy clipped on the cloud, which sees no displacement: prepare with --dp-clip-on edge"
    if why is not None:
        raise ConfigError(f"--secure-aggregation cannot serve {why}")


def control_address(address: str) -> tuple[str, int]:
    """Where the SuperLink serving the Fleet API on ``address`` has its Control and Runtime APIs:
    loopback, the next port (9093 for the default 9092, Flower's own Control API port)."""
    return LOOPBACK, int(address.rpartition(":")[2]) + 1


def serve(opts: ServeSettings) -> dict:
    """Run the fleet until the run has ``opts.rounds`` completed rounds; returns the per-round bytes."""
    run_dir, folder = opts.run_dir, RunFolder(opts.run_dir)
    run, state = load_run(run_dir), ServerState.load(folder.server_state)
    start = state.round
    check_aggregation(run, state, opts)
    if (release := PrivateRelease.of(run)) is not None:  # before any edge trains a round the budget cannot pay
        release.check_rounds(opts.rounds)
    keys = node_keys(run_dir)
    if opts.secure_aggregation and len(keys) < MIN_EDGES:
        raise ConfigError(
            f"{folder.nodes}: {len(keys)} edge keys; --secure-aggregation needs at least {MIN_EDGES} edges"
        )
    if len(keys) < opts.min_clients:
        raise ConfigError(
            f"{folder.nodes}: {len(keys)} edge keys for --min-clients {opts.min_clients}; "
            "copy each edge's node-key.pub there as <client-id>.pub"
        )
    tls = _tls(opts)
    stop_on_sigterm()
    if start < opts.rounds:
        env = _flower_home(folder.flower_home, opts, tls)
        if not opts.connect:
            _wait_for_earlier(folder.flower_home, EARLIER_EXIT_S)
        with _superlink(opts, env, tls):
            _register(run_dir, env)
            _run_app(opts, env)
    summary = _summary(folder, start, opts.rounds)
    if not summary["complete"]:  # `flwr run --stream` exits 0 whatever became of the run
        raise StateError(
            f"the fleet stopped at round {summary['round']} of {opts.rounds} (the ServerApp's log is above and in "
            f"{folder.superlink_log}); run serve again to resume there"
        )
    return summary


def _tls(opts: ServeSettings) -> dict[str, Path]:
    certs = CertsFolder(opts.certs) if opts.certs else RunFolder(opts.run_dir).certs
    files = {"ca": certs.ca, "cert": certs.server_cert, "key": certs.server_key}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ConfigError(f"{missing[0]}: missing; make TLS material with `ciders-cloud certs --out {certs.root}`")
    return files


def _flower_home(home: Path, opts: ServeSettings, tls: dict[str, Path]) -> dict[str, str]:
    """A Flower home for this run whose one connection is our SuperLink; the env to run Flower's tools in."""
    home.mkdir(parents=True, exist_ok=True)
    host, port = control_address(opts.address)
    connection = {"address": f"{host}:{port}", "root-certificates": str(tls["ca"].resolve())}
    lines = ["[superlink]", f"default = {json.dumps(CONNECTION)}", "", f"[superlink.{CONNECTION}]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in connection.items()]  # JSON strings are TOML basic strings
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    env = flower_env(home)
    for name in GRPC_SWITCHES:  # Flower's switches for its old gRPC servers on 0.0.0.0: never on
        env.pop(name, None)
    return env


def _wait_for_earlier(home: Path, timeout: float) -> None:
    """A serve restarted right after a crash (``kill -9``, a lost host) waits for the crashed one's Flower
    processes to finish ending (each was signalled as its parent died; a graceful stop takes seconds,
    more on a loaded machine) instead of failing on the ports they still hold."""
    deadline = time.monotonic() + timeout
    while (left := flower_processes(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        pids = ", ".join(map(str, sorted(left)))
        raise StateError(
            f"processes of an earlier serve of this run still run after {timeout:g} s (pids {pids}); stop them"
        )


@contextmanager
def _superlink(opts: ServeSettings, env: dict[str, str], tls: dict[str, Path]) -> Iterator[None]:
    folder = RunFolder(opts.run_dir)
    host, _, port = opts.address.rpartition(":")
    chost, cport = control_address(opts.address)
    if opts.connect:
        _wait_for_port(chost, cport, 5.0, f"the running SuperLink's Control API (on {chost}:{cport})")
        yield
        return
    for h, p in ((host, int(port)), (chost, cport)):
        if _listening(h, p):
            raise StateError(f"{h}:{p}: something already listens there; stop it, or pass --connect to use it")
    cmd = [sys.executable, "-m", "ciders_cloud.fleet.superlink", "--public", opts.address]
    cmd += ["--host", chost, "--port", str(cport), "--enable-supernode-auth"]
    cmd += ["--database", str(folder.superlink_db.resolve()), "--disable-runtime-dependency-installation"]
    cmd += ["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"])]
    log = folder.superlink_log.open("ab")
    proc = subprocess.Popen(guarded(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)  # ends with serve
    try:
        what = f"the SuperLink (log: {folder.superlink_log})"
        _wait_for_port(chost, cport, 60.0, what, proc)
        _wait_for_port(host, int(port), 10.0, what, proc)
        console.print(
            f"SuperLink: Fleet API on {opts.address} (TLS, SuperNode authentication on); "
            f"Control and Runtime APIs on {chost}:{cport} only"
        )
        yield
    finally:
        proc.terminate()  # it stops the ServerApp processes it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((_local(host), port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _local(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host


def _wait_for_port(host: str, port: int, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StateError(f"{what} exited with code {proc.returncode}")
        if _listening(host, port):
            return
        time.sleep(0.3)
    raise StateError(f"{what} is not reachable on {_local(host)}:{port} after {timeout:g} s")


def _register(run_dir: Path, env: dict[str, str]) -> None:
    """Register every edge key of ``RUN/nodes`` with the SuperLink (a key registered before is fine)."""
    for pub in RunFolder(run_dir).node_keys():
        cmd = [
            flower_tool("flwr"),
            "supernode",
            "register",
            str(pub),
            CONNECTION,
            "--name",
            pub.stem,
            "--format",
            "json",
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0 and "already in use" not in out.stdout + out.stderr:
            raise StateError(f"{pub}: the SuperLink refused to register it: {_last_line(out.stdout + out.stderr)}")


def _run_app(opts: ServeSettings, env: dict[str, str]) -> None:
    """``flwr run`` the fleet app and stream its log until the run ends; fail if it did not finish."""
    cmd = [flower_tool("flwr"), "run", str(APP_DIR), CONNECTION, "--run-config", opts.to_run_config(), "--stream"]
    proc = subprocess.Popen(guarded(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip():
            console.print(line.rstrip(), highlight=False, markup=False)
    if proc.wait() != 0:
        raise StateError(f"flwr run exited with code {proc.returncode}; the run folder holds the last completed round")


def _summary(folder: RunFolder, start: int, rounds: int) -> dict:
    """What this serve did, from the run folder: the round reached and each client-round's bytes."""
    end = ServerState.load(folder.server_state).round
    log = folder.fleet_log
    records = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed ServerApp
            continue
    mine = [r for r in records if r["round"] >= start]
    return {
        "run": str(folder.root),
        "started_at_round": start,
        "round": end,
        "rounds": rounds,
        "complete": end >= rounds,
        "clients": [r for r in mine if r["type"] == "client"],
        "rounds_log": [r for r in mine if r["type"] == "round"],
    }


def _last_line(text: str) -> str:
    lines = [ln.strip(" │╭╮╰╯─") for ln in text.splitlines() if ln.strip(" │╭╮╰╯─")]
    return lines[-1] if lines else "no output"
