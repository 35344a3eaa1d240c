"""What runs a round on the edge, in place of Flower's SuperExec: this toolkit's ClientApp, and nothing else.

``join`` starts the SuperNode with ``--isolation process``, so the SuperNode itself runs no app: it
queues each message it pulls from the SuperLink as a task on its Runtime API (on 127.0.0.1) and
waits for the reply. :func:`serve_tasks` takes those tasks and runs each in a fresh process
(:func:`run_task`) that pulls the message, the run and its FAB (Flower App Bundle), and replies with
the installed :mod:`.client_app` only when the FAB is the toolkit's fleet app: a ``pyproject.toml``
alone (no code) naming our components (:func:`fab_refusal`). Any other app, an AgentApp included,
gets an error reply and runs nothing. The FAB is never unpacked, installed or imported, so no code
the SuperLink sends is run here; Flower 1.42's own guard (``flower-supernode --trusted-entities``)
accepts only FABs signed through Flower Hub, which a local ``flwr run`` never is.

    python -m ciders_edge.fleet.executor loop --runtime-api-address 127.0.0.1:PORT [--parent-pid PID]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from logging import ERROR, INFO

from ciders_edge.fleet.lifetime import guarded

# The fleet app ``ciders-cloud serve`` submits (ciders_cloud/fleet/app/pyproject.toml; the edge
# never imports the cloud, so its identity is written here too and a test holds the two together).
APP_NAME = "ciders-fleet"
APP_PUBLISHER = "ciders"
APP_COMPONENTS = {"serverapp": "ciders_cloud.fleet.server_app:app", "clientapp": "ciders_edge.fleet.client_app:app"}
FAB_FILES = {"pyproject.toml", ".info/CONTENT"}  # what `flwr build` puts in a FAB of a folder with no code
TASK_TYPES = ("flwr-clientapp", "flwr-agentapp")  # what a SuperNode makes of the messages it pulls
POLL_S = 0.5


def fab_refusal(content: bytes) -> str | None:
    """Why the FAB ``content`` is not the toolkit's fleet app, or None when it is."""
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as z:
            names = set(z.namelist())
            config = tomllib.loads(z.read("pyproject.toml").decode("utf-8"))
    except (zipfile.BadZipFile, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError) as e:
        return f"the FAB is not a readable Flower App Bundle ({e})"
    app = config.get("tool", {}).get("flwr", {}).get("app", {})
    name = config.get("project", {}).get("name")
    if name != APP_NAME or app.get("publisher") != APP_PUBLISHER:
        return f"the app is {app.get('publisher')}/{name}, not {APP_PUBLISHER}/{APP_NAME}"
    if app.get("components") != APP_COMPONENTS:
        return f"the app's components are {app.get('components')}, not {APP_COMPONENTS}"
    if names != FAB_FILES:
        odd = sorted(names - FAB_FILES) or sorted(FAB_FILES - names)
        return f"the FAB holds {', '.join(odd[:5])}; the CIDERS fleet app is a pyproject.toml and no code"
    return None


def _client(address: str, token: str | None):
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec" if token is None else "flwr-clientapp")]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=True,  # the SuperNode's Runtime API: plain HTTP on loopback, as Flower's SuperExec uses it
        root_certificates=None,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def serve_tasks(address: str, parent_pid: int | None = None) -> None:
    """Run each task the SuperNode at ``address`` queues, one fresh process each, until stopped."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.app_utils import start_parent_process_monitor

    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)  # SIGINT here when the SuperNode is gone
    host, _, port = address.rpartition(":")
    client = None
    tasks: list[subprocess.Popen] = []
    try:
        while True:  # until the SuperNode's Runtime API is up
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError:
                time.sleep(0.2)
        client = _client(address, None)
        while True:
            tasks = [t for t in tasks if t.poll() is None]  # reap the finished ones
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=TASK_TYPES))
            if res.HasField("task") and res.token:
                cmd = [sys.executable, "-m", "ciders_edge.fleet.executor", "task", "--runtime-api-address", address]
                cmd += ["--token", res.token, "--parent-pid", str(os.getpid())]
                tasks.append(subprocess.Popen(guarded(cmd)))  # ends with this loop, even on kill -9
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # the SuperNode is gone, or join stops us
        pass
    finally:
        if client is not None:
            client.close()


def run_task(address: str, token: str) -> int:
    """Pull one task's input and answer it with the toolkit's ClientApp, or refuse it; the exit status."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.common.logger import log
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _client(address, token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    sub_status, details, code = SubStatus.FAILED, "the task did not finish", 1
    try:
        message, context, run, fab = pull_task_input(client)
        refusal = fab_refusal(fab.content)
        if refusal is not None:
            log(ERROR, f"refusing run {run.run_id} ({run.fab_id} {run.fab_version}): {refusal}")
            details = f"this edge runs only the CIDERS fleet app: {refusal}"
            reply = Message(Error(code=ErrorCode.INVALID_FAB, reason=details), reply_to=message)
            code = 2
        else:
            from ciders_edge.fleet.client_app import app

            log(
                INFO,
                f"run {run.run_id}: the CIDERS fleet app ({run.fab_id} {run.fab_version}, FAB {fab.hash_str[:12]})",
            )
            reply = app(message=message, context=context)
            sub_status, details, code = SubStatus.COMPLETED, "", 0
    except Exception as ex:  # as Flower's flwr-clientapp: the error goes back to the cloud as the reply
        log(ERROR, "ClientApp raised an exception", exc_info=ex)
        details = str(type(ex)) + ":<'" + str(ex) + "'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        finally:
            push_task_output(client=client, context=context, sub_status=sub_status, details=details)
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    loop = sub.add_parser("loop", help="take the SuperNode's tasks until stopped")
    task = sub.add_parser("task", help="run one task")
    task.add_argument("--token", required=True)
    for p in (loop, task):
        p.add_argument("--runtime-api-address", required=True)
        p.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "loop":
        serve_tasks(args.runtime_api_address, args.parent_pid)
        return 0
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)
    try:
        return run_task(args.runtime_api_address, args.token)
    except KeyboardInterrupt:  # the loop is gone, or the SuperNode dropped the task
        return 130


if __name__ == "__main__":
    sys.exit(main())
