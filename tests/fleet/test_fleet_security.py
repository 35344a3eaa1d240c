"""Who can do what to a fleet (issue 16): on `serve`'s address only the Fleet API answers, so a process
holding the public ca.crt can neither list, submit nor stop runs; and an edge runs only the toolkit's
own ClientApp. A SuperLink started the way `serve` starts it, Flower's own `flwr` from other processes,
and a real `ciders-edge join`."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fleet_harness import BIN, Fleet

from ciders_cloud.fleet import serve as serve_mod
from ciders_cloud.fleet.serve import APP_DIR, CONNECTION, ServeSettings, control_address
from ciders_cloud.fleet.superlink import fleet_paths
from ciders_edge.fleet.executor import APP_COMPONENTS, APP_NAME, APP_PUBLISHER, fab_refusal
from ciders_edge.fleet.processes import flower_env

GATE = "this address serves only the Fleet API"


@pytest.fixture
def superlink(tmp_path):
    """A SuperLink as `serve` starts it (serve's own code) for a bare run folder; the operator's Flower
    home (serve's, on the loopback Control API) and a Fleet harness for edges."""
    run_dir = tmp_path / "run"
    fleet = Fleet(run_dir, tmp_path)  # TLS material in RUN/certs, two free ports in a row
    opts = ServeSettings(run_dir, rounds=1, address=f"127.0.0.1:{fleet.port}")
    tls = serve_mod._tls(opts)
    (run_dir / "fleet").mkdir()
    env = serve_mod._flower_home(run_dir / "fleet" / "flwr", opts, tls)
    try:
        with serve_mod._superlink(opts, env, tls):
            yield SimpleNamespace(fleet=fleet, opts=opts, env=env, ca=tls["ca"])
    finally:
        fleet.close()


def _flwr(args: list, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "flwr"), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
    )


def _outsider(home: Path, address: str, ca: Path) -> dict:
    """A Flower home whose one connection, `public`, is serve's address with the public CA."""
    home.mkdir(parents=True)
    conf = f'[superlink]\ndefault = "public"\n\n[superlink.public]\naddress = "{address}"\nroot-certificates = "{ca}"\n'
    (home / "config.toml").write_text(conf)
    return flower_env(home)


def _runs(env: dict) -> list[dict]:
    out = _flwr(["ls", CONNECTION, "--format", "json"], env)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)["runs"]


def _foreign_app(root: Path) -> Path:
    """A Flower app that is not ours: its ServerApp writes `server-marker`, waits `sleep` seconds, then
    queries every node and writes the replies to `out`; its ClientApp writes `client-marker`."""
    app = root / "foreign"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "foreign"
        version = "1.0.0"
        description = "not the CIDERS fleet app"
        license = "Apache-2.0"
        dependencies = ["flwr>=1.42.0"]

        [tool.flwr.app]
        publisher = "mallory"

        [tool.flwr.app.components]
        serverapp = "foreign_app:server"
        clientapp = "foreign_app:client"

        [tool.flwr.app.config]
        server-marker = ""
        client-marker = ""
        out = ""
        sleep = 0
        """)
    )
    (app / "foreign_app.py").write_text(
        textwrap.dedent("""\
        import json
        import time
        from pathlib import Path

        from flwr.app import ConfigRecord, Message, MessageType, RecordDict
        from flwr.clientapp import ClientApp
        from flwr.serverapp import ServerApp

        server = ServerApp()
        client = ClientApp()


        @server.main()
        def main(grid, context):
            rc = context.run_config
            Path(rc["server-marker"]).write_text("ran")
            end = time.time() + int(rc["sleep"])  # or until the test leaves <server-marker>.stop
            while time.time() < end and not Path(rc["server-marker"] + ".stop").exists():
                time.sleep(0.2)
            if Path(rc["server-marker"] + ".stop").exists():
                return
            nodes, deadline = [], time.time() + 60
            while not nodes and time.time() < deadline:
                nodes = list(grid.get_node_ids())
                time.sleep(0.5)
            msgs = [Message(RecordDict({"q": ConfigRecord({"x": 1})}), n, MessageType.QUERY) for n in nodes]
            replies = list(grid.send_and_receive(msgs, timeout=90))
            Path(rc["out"]).write_text(json.dumps([r.error.reason if r.has_error() else "ok" for r in replies]))


        @client.query()
        def query(msg, context):
            Path(context.run_config["client-marker"]).write_text("ran")
            return Message(RecordDict(), reply_to=msg)
        """)
    )
    return app


def _config(**kv) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in kv.items())


def test_the_fab_check_accepts_only_the_toolkit_app(tmp_path):
    """`fab_refusal` on FABs built by Flower's own `flwr build` code: ours passes; another app, ours
    with code added, and junk do not. The edge's copy of the app's identity is the cloud's pyproject."""
    from flwr.cli.build import build_fab_from_disk

    app = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    assert app["project"]["name"] == APP_NAME
    assert app["tool"]["flwr"]["app"]["publisher"] == APP_PUBLISHER
    assert app["tool"]["flwr"]["app"]["components"] == APP_COMPONENTS
    assert fab_refusal(build_fab_from_disk(APP_DIR)) is None

    assert "mallory/foreign" in fab_refusal(build_fab_from_disk(_foreign_app(tmp_path)))
    ours_with_code = tmp_path / "ours-with-code"
    ours_with_code.mkdir()
    (ours_with_code / "pyproject.toml").write_text((APP_DIR / "pyproject.toml").read_text())
    (ours_with_code / "ciders_edge.py").write_text("import os\n")
    assert "ciders_edge.py" in fab_refusal(build_fab_from_disk(ours_with_code))
    assert "not a readable" in fab_refusal(b"PK\x03\x04 not a zip")


def test_only_the_fleet_api_answers_on_the_serve_address(superlink, tmp_path):
    """`flwr ls`, `flwr run` of a foreign app and `flwr stop` from another process against serve's
    address are refused, while the same commands work on the loopback Control API."""
    public = superlink.opts.address
    operator, outsider = superlink.env, _outsider(tmp_path / "outsider", public, superlink.ca)
    foreign = _foreign_app(tmp_path)

    # a run for the outsider to try to stop: the foreign app, started on the loopback API, sleeping
    config = _config(**{"server-marker": str(tmp_path / "operator-run"), "sleep": 300})
    started = _flwr(["run", foreign, CONNECTION, "--run-config", config, "--format", "json"], operator)
    assert started.returncode == 0 and json.loads(started.stdout)["success"], started.stdout + started.stderr
    run_id = json.loads(started.stdout)["run-id"]

    try:
        outsider_config = _config(**{"server-marker": str(tmp_path / "outsider-run")})
        refused = {
            "ls": ["ls", "public"],
            "run": ["run", foreign, "public", "--run-config", outsider_config],
            "stop": ["stop", run_id, "public"],
        }
        for what, args in refused.items():
            out = _flwr([*args, "--format", "json"], outsider)
            answer = json.loads(out.stdout)
            assert answer["success"] is False, f"`flwr {what}` on {public} was not refused:\n{out.stdout}{out.stderr}"
            assert "404" in answer["error-message"] or "Not Found" in answer["error-message"], answer

        runs = _runs(operator)  # nothing the outsider did took effect
        assert [r["run-id"] for r in runs] == [run_id]
        assert "stopped" not in runs[0]["status"], runs[0]
        deadline = time.monotonic() + 60  # the operator's run does start: a refused run would too, if submitted
        while not (tmp_path / "operator-run").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / "operator-run").exists()
        assert not (tmp_path / "outsider-run").exists()

        # the raw HTTP view: on serve's address, Control, Runtime and the docs get the gate's 404 and a
        # Fleet route reaches Flower; on the loopback address Flower answers everything
        host, port = control_address(public)
        with httpx.Client(verify=str(superlink.ca), timeout=10) as http:
            for path in ("/v1/control/list-runs", "/v1/control/stop-run", "/v1/runtime/pull-messages", "/docs"):
                r = http.post(f"https://{public}{path}", content=b"")
                assert r.status_code == 404 and GATE in r.text, (path, r.status_code, r.text)
                assert GATE not in http.post(f"https://{host}:{port}{path}", content=b"").text
            for path in sorted(fleet_paths()):
                assert GATE not in http.post(f"https://{public}{path}", content=b"").text, path

        stopped = _flwr(["stop", run_id, CONNECTION, "--format", "json"], operator)
        assert stopped.returncode == 0 and json.loads(stopped.stdout)["success"], stopped.stdout + stopped.stderr
        assert "stopped" in _runs(operator)[0]["status"]
    finally:
        (tmp_path / "operator-run.stop").touch()  # the foreign ServerApp returns


def test_an_edge_refuses_a_foreign_app(superlink, tmp_path):
    """A foreign app run on the SuperLink (here by the operator: the Control API is loopback-only) gets
    an error reply from the edge, and its ClientApp never runs there."""
    fleet, out = superlink.fleet, tmp_path / "replies.json"
    fleet.register("edge")
    serve_mod._register(fleet.run_dir, superlink.env)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n')
    fleet.join("edge", data)

    markers = {"server-marker": str(tmp_path / "server-ran"), "client-marker": str(tmp_path / "client-ran")}
    config = _config(**markers, out=str(out))
    started = _flwr(
        ["run", _foreign_app(tmp_path), CONNECTION, "--run-config", config, "--format", "json"], superlink.env
    )
    assert started.returncode == 0 and json.loads(started.stdout)["success"], started.stdout + started.stderr
    deadline = time.monotonic() + 180
    while not out.exists() and time.monotonic() < deadline:
        assert fleet.procs["edge"].poll() is None, fleet.log("edge")[-3000:]
        time.sleep(0.5)
    assert out.exists(), fleet.log("edge")[-3000:]
    replies = json.loads(out.read_text())
    assert len(replies) == 1 and "this edge runs only the CIDERS fleet app" in replies[0], replies
    assert "mallory/foreign" in replies[0]
    assert not (tmp_path / "client-ran").exists()
    assert "refusing run" in fleet.log("edge")
    assert fleet.procs["edge"].poll() is None  # the edge is still there for the real rounds
