"""`ciders-cloud aggregate`: packet checks change nothing; a kill -9 at any moment is survivable."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import fast_run_config
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.prepare import STATE_DIR
from ciders_cloud.state import ServerState
from ciders_edge.bundle import Bundle
from ciders_edge.packet import Packet
from ciders_edge.train import train

runner = CliRunner()


@pytest.fixture(scope="module")
def round0(tmp_path_factory, demo_dir):
    """A fresh tiny run and two clients' round-0 packets, copied per test."""
    from ciders_cloud import prepare

    root = tmp_path_factory.mktemp("agg")
    run = fast_run_config(demo_dir, clients=["a", "b"], hyperparameters={"takd_steps": 3})
    prepare(run, root / "run")
    bundle = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
    for cid, fam in (("a", "dates"), ("b", "code")):
        train(bundle, demo_dir / fam / "train.jsonl", root / f"state-{cid}", root / f"{cid}.pkt", client_id=cid)
    return root


def _copy(round0, tmp_path):
    shutil.copytree(round0 / "run", tmp_path / "run")
    return tmp_path / "run", [str(round0 / "a.pkt"), str(round0 / "b.pkt")]


def _state_bytes(run):
    """Every tensor file byte for byte, and state.json less the summary (it names the run's path)."""
    out = {p.name: p.read_bytes() for p in sorted((run / STATE_DIR).iterdir()) if p.suffix == ".safetensors"}
    meta = json.loads((run / STATE_DIR / "state.json").read_text())
    meta.pop("last_summary")
    return {**out, "state.json": meta}


def _args(run, packets):
    return ["aggregate", "--run", str(run)] + [x for p in packets for x in ("--packets", p)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: Packet(p.client_id, 1, p.bundle_id, p.codec, p.num_examples, p.tensors), "is for round 1"),
        (lambda p: Packet(p.client_id, 0, "f" * 64, p.codec, p.num_examples, p.tensors), "trained on bundle ffff"),
        (lambda p: Packet("mallory", 0, p.bundle_id, p.codec, p.num_examples, p.tensors), "unknown client id"),
        (
            lambda p: Packet(
                p.client_id, 0, p.bundle_id, p.codec, p.num_examples, {k: v[:1] for k, v in p.tensors.items()}
            ),
            "has shape",
        ),
        (
            lambda p: Packet(
                p.client_id,
                0,
                p.bundle_id,
                p.codec,
                p.num_examples,
                {k: v * float("nan") for k, v in p.tensors.items()},
            ),
            "non-finite",
        ),
    ],
)
def test_bad_packet_changes_nothing(round0, tmp_path, mutate, message):
    run, packets = _copy(round0, tmp_path)
    before = _state_bytes(run)
    bad = tmp_path / "bad.pkt"
    mutate(Packet.load(packets[1])).save(bad)
    r = runner.invoke(cloud, _args(run, [packets[0], str(bad)]))
    assert r.exit_code == 1 and message in r.stderr and "Traceback" not in r.output
    assert _state_bytes(run) == before and not (run / "bundles" / "cpu-laptop" / "round-0001").exists()


def test_corrupt_and_duplicate_packets(round0, tmp_path):
    run, packets = _copy(round0, tmp_path)
    data = bytearray(open(packets[0], "rb").read())
    data[100] ^= 1
    (tmp_path / "c.pkt").write_bytes(bytes(data))
    r = runner.invoke(cloud, _args(run, [str(tmp_path / "c.pkt")]))
    assert r.exit_code == 1 and "integrity check failed" in r.stderr
    r = runner.invoke(cloud, _args(run, [packets[0], packets[0]]))
    assert r.exit_code == 1 and "a second packet from client 'a'" in r.stderr


def test_round_advances_and_absent_clients_keep_c_i(round0, tmp_path):
    run, packets = _copy(round0, tmp_path)
    r = runner.invoke(cloud, [*_args(run, packets[:1]), "--json"])
    assert r.exit_code == 0, r.output
    state = ServerState.load(run / STATE_DIR)
    assert state.round == 1 and set(state.clients) == {"a"}  # b was absent: no c_i entry changes
    pkt = Packet.load(packets[0])
    assert all(torch.equal(state.clients["a"][k], pkt.tensors[k]) for k in pkt.tensors)
    b1 = Bundle.load(run / "bundles" / "cpu-laptop" / "round-0001")
    assert b1.round == 1 and all(torch.equal(b1.consensus()[k], state.consensus[k]) for k in state.consensus)
    # frozen weights are shared with round 0, not rewritten
    b0 = run / "bundles" / "cpu-laptop" / "round-0000"
    assert (b1.path / "backbone.safetensors").samefile(b0 / "backbone.safetensors")
    again = runner.invoke(cloud, _args(run, packets[:1]))
    assert again.exit_code == 0 and "already aggregated" in again.stderr


def _round(run):
    try:
        return json.loads((run / STATE_DIR / "state.json").read_text())["round"]
    except (OSError, ValueError):
        return None


def _cli(run, packets):
    return [sys.executable, "-m", "ciders_cloud", *_args(run, packets)]


def test_kill_9_at_any_moment_then_rerun_equals_uninterrupted(round0, tmp_path):
    ref_run, packets = _copy(round0, tmp_path / "ref")
    subprocess.run(_cli(ref_run, packets), check=True, capture_output=True, timeout=300)
    expected = _state_bytes(ref_run)
    expected_bundle = Bundle.load(ref_run / "bundles" / "cpu-laptop" / "round-0001").manifest["files"]
    bundles_dir = "bundles/cpu-laptop"
    # kill points: while starting, while writing round 1's bundle, right after the state swap
    for i, when in enumerate(("start", "bundle", "state")):
        run, _ = _copy(round0, tmp_path / f"k{i}")
        proc = subprocess.Popen(_cli(run, packets), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if when == "start" and time.monotonic() > deadline - 298.5:
                break
            if when == "bundle" and any((run / bundles_dir).glob(".round-0001*")):
                break
            if when == "state" and _round(run) == 1:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rerun = subprocess.run(_cli(run, packets), capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stderr
        assert _state_bytes(run) == expected, when
        assert Bundle.load(run / bundles_dir / "round-0001").manifest["files"] == expected_bundle


def test_packet_trained_with_another_gamma_or_a_bad_id_is_refused(round0, tmp_path):
    run, packets = _copy(round0, tmp_path)
    p = Packet.load(packets[0])
    Packet(p.client_id, 0, p.bundle_id, p.codec, p.num_examples, p.tensors, {**p.metrics, "gamma": 0.5}).save(
        tmp_path / "g.pkt"
    )
    r = runner.invoke(cloud, _args(run, [str(tmp_path / "g.pkt")]))
    assert r.exit_code == 1 and "trained with gamma=0.5, round 0 uses 0.01" in r.stderr
    Packet("../../etc/x", 0, p.bundle_id, p.codec, p.num_examples, p.tensors).save(tmp_path / "x.pkt")
    r = runner.invoke(cloud, _args(run, [str(tmp_path / "x.pkt")]))
    assert r.exit_code == 1 and "is not a valid id" in r.stderr
