"""Processes on loopback for the fleet tests: a cloud (`ciders-cloud serve`) and edges (`ciders-edge join`),
each in its own process group so a test can kill one the way a crash would, and bounded waits."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ciders_cloud.fleet.certs import make_certs
from ciders_cloud.run.folder import RunFolder
from ciders_edge.fleet.keys import ensure_node_key

BIN = Path(sys.executable).parent


def _ephemeral_ports() -> range:
    """The ports the kernel hands out to outgoing connections (every edge's, every test's): a server port
    taken from there can be grabbed by a client socket between the check and serve's bind."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port_pair() -> int:
    """A free port whose next one is free too, both outside the ephemeral range: `serve` puts the Fleet
    API on the first and its loopback-only Control and Runtime APIs on the next."""
    ephemeral, rng = _ephemeral_ports(), random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, 65_534)
        if port in ephemeral or port + 1 in ephemeral:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise AssertionError("no two free ports in a row outside the ephemeral range")


class Fleet:
    """One run folder served on 127.0.0.1 with TLS, and its edges' state folders under ``root``."""

    def __init__(self, run_dir: Path, root: Path) -> None:
        self.run_dir, self.root = run_dir, root
        self.port = free_port_pair()
        self.procs: dict[str, subprocess.Popen] = {}
        if not (run_dir / "certs").exists():
            make_certs(run_dir / "certs", [])

    def state(self, cid: str) -> Path:
        return self.root / cid

    def register(self, cid: str) -> None:
        """Make the edge's node key and give its public key to the cloud."""
        _, public = ensure_node_key(self.state(cid))
        RunFolder(self.run_dir).nodes.mkdir(exist_ok=True)
        shutil.copy(public, RunFolder(self.run_dir).node_key(cid))

    def serve(self, rounds: int, min_clients: int, timeout: float, *extra, name: str = "cloud") -> None:
        cmd = [BIN / "ciders-cloud", "serve", "--run", self.run_dir, "--rounds", rounds, "--min-clients", min_clients]
        cmd += ["--address", f"127.0.0.1:{self.port}", "--round-timeout", timeout, *extra]
        self._start(name, cmd)

    def join(self, cid: str, data: Path, *extra, profile: str = "cpu-laptop") -> None:
        cmd = [BIN / "ciders-edge", "join", "--server", f"127.0.0.1:{self.port}", "--state", self.state(cid), *extra]
        cmd += ["--val-fraction", "0"] if "--val-fraction" not in extra else []  # as simulate's clients (its default)
        cmd += ["--data", data, "--profile", profile, "--root-certificates", self.run_dir / "certs" / "ca.crt"]
        self._start(cid, cmd)

    def _start(self, name: str, cmd: list) -> None:
        log = (self.root / f"{name}.log").open("ab")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.procs[name] = subprocess.Popen(
            [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def kill(self, name: str) -> None:
        """SIGKILL the process and everything it started (its process group), like a crash."""
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s\n{self.log(name)[-4000:]}") from None

    def wait_for_round(self, round_: int, timeout: float) -> None:
        """Until the server state has ``round_`` completed rounds."""
        state = self.run_dir / "server" / "state.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if json.loads(state.read_text())["round"] >= round_:
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None and name == "cloud":
                    raise AssertionError(f"the cloud exited with {proc.returncode}\n{self.log(name)[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"round {round_} not reached in {timeout} s\n{self.log('cloud')[-4000:]}")

    def log(self, name: str) -> str:
        """The process's output, with rich's line wrapping undone."""
        path = self.root / f"{name}.log"
        return " ".join(path.read_text(errors="replace").split()) if path.exists() else ""

    def fleet_log(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "fleet" / "log.jsonl").read_text().splitlines()]

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)


def wait_for(condition, timeout: float, what):
    """Poll ``condition()`` until it returns something true; its value. An AssertionError after ``timeout``
    says ``what`` (or what ``what()`` says then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what() if callable(what) else what}: not within {timeout} s")


def fleet_config(demo_dir: Path, clients: int):
    """`test_simulate`'s fast tiny study, with the first ``clients`` of its data files."""
    from tiny_runs import fast_study as sim_cfg

    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code")[:clients]]
    return sim_cfg(demo_dir, clients=clients, data=data)


def equal_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_edges_agree(fleet: Fleet, ids: list[str], server) -> None:
    """After the run each edge has committed its last round, and its c_i is the cloud's copy."""
    from ciders_edge.fleet.edge import PENDING
    from ciders_edge.formats.client_state import ClientState

    for cid in ids:
        edge = ClientState.load(fleet.state(cid))
        assert not (fleet.state(cid) / PENDING).exists()
        assert equal_tensors(edge.c_i, server.clients[cid]), cid
