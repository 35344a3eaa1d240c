"""``ciders-edge join``: run this device's Flower SuperNode in a fleet.

The SuperNode authenticates with the state folder's node key (made on first use), trusts the
cloud's CA over TLS, and hands every round to the ClientApp with this device's settings. It runs
with ``--isolation process`` and its Runtime API on 127.0.0.1: the tasks it queues are run by
:mod:`.executor`, which answers with the toolkit's own ClientApp and refuses any other app.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ciders_edge.data.holdout import VAL_FRACTION, check_val_fraction
from ciders_edge.errors import ConfigError, StateError
from ciders_edge.fleet.edge import EdgeConfig
from ciders_edge.fleet.keys import ensure_node_key
from ciders_edge.fleet.lifetime import guarded
from ciders_edge.fleet.processes import flower_env, flower_tool, stop_on_sigterm
from ciders_edge.fleet.tls import check_server_certificate
from ciders_edge.profiles import load_profile
from ciders_edge.progress import console, status

__all__ = ["join"]

NOT_ADMITTED = 305  # flower-supernode: the SuperLink refused to activate this node
EXIT_CODE = re.compile(r"Exit Code: (\d+)")


def join(
    server: str,
    state: Path,
    data: Path,
    profile: str = "auto",
    *,
    root_certificates: Path | None = None,
    codec: str = "fp32",
    key: Path | None = None,
    admit_wait: float = 60.0,
    val_fraction: float = VAL_FRACTION,
) -> dict:
    """Run the SuperNode until it stops; returns why it stopped. A node the SuperLink does not
    admit is retried for ``admit_wait`` seconds (``serve`` registers keys once the SuperLink is up)."""
    address = _address(server)
    if not data.is_file():
        raise ConfigError(f"{data}: no such data file")
    if root_certificates is None:
        raise ConfigError("--root-certificates CA.crt is required: the cloud's ca.crt (from `ciders-cloud certs`)")
    if not root_certificates.is_file():
        raise ConfigError(f"{root_certificates}: no such CA certificate file")
    if key is not None and not key.is_file():
        raise ConfigError(f"{key}: no such key file")
    name = load_profile(profile).name  # resolve `auto` once, here
    state.mkdir(parents=True, exist_ok=True)
    private, public = ensure_node_key(state)
    cfg = EdgeConfig(
        state.resolve(), data.resolve(), name, codec, key.resolve() if key else None, check_val_fraction(val_fraction)
    )
    cmd = [flower_tool("flower-supernode"), "--superlink", server]
    cmd += ["--auth-supernode-private-key", str(private.resolve())]
    runtime = f"127.0.0.1:{_free_port()}"  # the SuperNode's Runtime API, for the executor only
    cmd += ["--node-config", cfg.to_node_config(), "--isolation", "process"]
    cmd += ["--host", "127.0.0.1", "--port", runtime.rpartition(":")[2]]
    cmd += ["--root-certificates", str(root_certificates)]
    env = flower_env(state / "flwr")
    console.print(f"joining {server} as this device's SuperNode (profile {name}); node key {public}", soft_wrap=True)
    _wait_for_server(address, server)
    check_server_certificate(*address, root_certificates)
    stop_on_sigterm()
    deadline = time.monotonic() + admit_wait
    while True:
        code, flower_code = _run_supernode(cmd, env, runtime)
        if flower_code != NOT_ADMITTED or time.monotonic() > deadline:
            break
        console.print("not admitted yet (the cloud may still be registering this key); trying again")
        time.sleep(3.0)
    if flower_code == NOT_ADMITTED:
        raise StateError(
            f"the SuperLink at {server} did not admit this node: its key {public} is not registered "
            "(the cloud copies it to RUN/nodes/<client-id>.pub)"
        )
    if code != 0:
        raise StateError(f"the SuperNode exited with code {flower_code or code}")
    return {"server": server, "state": str(state), "profile": name}


def _run_supernode(cmd: list[str], env: dict[str, str], runtime: str) -> tuple[int, int | None]:
    """Run the SuperNode and the executor of its tasks (:mod:`.executor`, on its Runtime API at
    ``runtime``), passing their logs through; returns the SuperNode's exit status and the Flower exit
    code it logged (``Exit Code: N``, Flower's documented reason; the status itself is only 0 or 1)."""
    proc = subprocess.Popen(guarded(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    executor = subprocess.Popen(
        guarded([sys.executable, "-m", "ciders_edge.fleet.executor", "loop", "--runtime-api-address", runtime])
        + ["--parent-pid", str(proc.pid)],
        env=env,
    )
    codes: list[int] = []

    def relay() -> None:  # a thread: the SuperNode's helper processes may keep the pipe open after it exits
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)
            if m := EXIT_CODE.search(line):
                codes.append(int(m.group(1)))

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see ``stop_on_sigterm``): stop the SuperNode too
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        _stop(executor)
    reader.join(timeout=2.0)
    return code, codes[-1] if codes else None


def _stop(proc: subprocess.Popen) -> None:
    """Stop the executor loop (SIGINT; a task process it started stops with it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _address(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--server {server!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _wait_for_server(address: tuple[str, int], server: str) -> None:
    """Wait until the cloud accepts connections: an edge may well start before it, and the SuperNode
    itself gives up on a first connection after a few seconds."""
    with status(f"reaching the cloud at {server}"):
        while True:
            try:
                socket.create_connection(address, timeout=5.0).close()
                return
            except OSError:
                time.sleep(2.0)


def _free_port() -> int:
    """A local port for the SuperNode's ClientApp API (several edges may share a host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
