"""`ciders-cloud aggregate`: packet checks change nothing; a kill -9 at any moment is survivable."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import fast_run_config
from forgery import claiming_2gib, like
from tiny_runs import state_bytes, two_clients_round0
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.round.aggregate import aggregate_packets
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.lock import run_lock
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import StateError
from ciders_edge.faults import CRASH_ENV
from ciders_edge.formats import packet as packet_module
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.packet import Packet
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()


@pytest.fixture(scope="module")
def round0(tmp_path_factory, demo_dir):
    """A fresh tiny run and two clients' round-0 packets, copied per test."""
    run = fast_run_config(demo_dir, client_ids=["a", "b"], hyperparameters={"takd_steps": 3})
    return two_clients_round0(run, demo_dir, tmp_path_factory.mktemp("agg"))


def _copy(round0, tmp_path):
    shutil.copytree(round0 / "run", tmp_path / "run")
    return tmp_path / "run", [str(round0 / "a.pkt"), str(round0 / "b.pkt")]


def _args(run, packets):
    return ["aggregate", "--run", str(run)] + [x for p in packets for x in ("--packets", p)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: like(p, round=1), "is for round 1"),
        (lambda p: like(p, bundle_id="f" * 64), "trained on bundle ffff"),
        (lambda p: like(p, client_id="mallory"), "unknown client id"),
        (lambda p: like(p, tensors={k: v[:1] for k, v in p.tensors.items()}), "has shape"),
        (lambda p: like(p, tensors=dict(list(p.tensors.items())[1:])), "is missing (expected shape"),
        (lambda p: like(p, tensors={k: v * float("nan") for k, v in p.tensors.items()}), "non-finite"),
        # finite but huge: eq. (11) divides by alpha and overflows; v and c would be Inf for every edge
        (lambda p: like(p, tensors={k: torch.full_like(v, 3e38) for k, v in p.tensors.items()}), "not finite"),
        (lambda p: like(p, tensors={k: v * 1e6 for k, v in p.tensors.items()}), "refused as an outlier"),
        (lambda p: like(p, metrics={k: v for k, v in p.metrics.items() if k != "alpha"}), "which alpha"),
        (lambda p: like(p, metrics={**p.metrics, "c_i_digest": "0" * 64}), "is not the cloud's copy"),
    ],
)
def test_bad_packet_changes_nothing(round0, tmp_path, mutate, message):
    run, packets = _copy(round0, tmp_path)
    before = state_bytes(run)
    bad = tmp_path / "bad.pkt"
    mutate(Packet.load(packets[1])).save(bad)
    r = runner.invoke(cloud, _args(run, [packets[0], str(bad)]))
    assert r.exit_code == 1 and message in r.stderr and "Traceback" not in r.output
    assert state_bytes(run) == before and not (run / "bundles" / "cpu-laptop" / "round-0001").exists()


def test_a_packet_that_claims_gigabytes_is_refused_before_decompressing(round0, tmp_path, monkeypatch):
    """Names and shapes are checked against the LoRA the client's profile trains before any payload is
    decompressed: a refusal in one line naming the packet and tensor, the state unchanged, and no
    decompression beyond an honest packet's size (counted, not timed)."""
    run, packets = _copy(round0, tmp_path)
    before = state_bytes(run)
    bad, name = claiming_2gib(packets[1], tmp_path / "claims.pkt")
    sizes, decompress = [], packet_module._decompress
    monkeypatch.setattr(packet_module, "_decompress", lambda f, n, w: sizes.append(n) or decompress(f, n, w))
    r = runner.invoke(cloud, _args(run, [packets[0], bad]))
    honest = sum(t.numel() * 4 for t in Packet.load(packets[0]).tensors.values())
    assert r.exit_code == 1 and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.output
    assert re.search(rf"claims.pkt: tensor {re.escape(name)} has shape \(536870912,\), expected \(\d+, \d+\)", r.stderr)
    assert max(sizes) <= honest < 1 << 20 and state_bytes(run) == before
    assert not (run / "bundles" / "cpu-laptop" / "round-0001").exists()


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
    state = ServerState.load(RunFolder(run).server_state)
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


def _summary(run):
    return json.loads((RunFolder(run).server_state / "state.json").read_text())["last_summary"]


def _cli(run, packets):
    return [sys.executable, "-m", "ciders_cloud", *_args(run, packets)]


# the steps where aggregate's writes can be cut: round 1's bundle staged, then the server
# state (the commit point) staged, its old copy set aside, the new one in place with the old one still there
KILL_POINTS = ("staged:round-0001", "staged:server", "aside:server", "swapped:server")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_at_any_step_then_rerun_equals_uninterrupted(round0, reference_round, tmp_path, point):
    """SIGKILL at a named step (CIDERS_CRASH_AT, no timing): the rerun ends where an uninterrupted
    run ends, and no hidden folder of the interrupted swap is left behind."""
    ref = reference_round
    run, packets = _copy(round0, tmp_path)
    killed = subprocess.run(_cli(run, packets), capture_output=True, timeout=300, env={**os.environ, CRASH_ENV: point})
    assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
    if point.endswith(":server") and point != "staged:server":  # the case CI met: the old state left aside
        assert (run / ".server.old").is_dir(), point
    rerun = subprocess.run(_cli(run, packets), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert state_bytes(run) == ref["state"], point
    assert Bundle.load(run / "bundles" / "cpu-laptop" / "round-0001").manifest["files"] == ref["bundle_files"]
    # the rerun's record is the uninterrupted one's: every TAKD step logged once, bytes down against round 0
    assert (run / "distill.jsonl").read_text() == ref["log"], point
    assert _summary(run)["bytes_down"] == ref["bytes_down"], point
    assert not [p for p in run.rglob(".*") if p.name != ".lock"], point  # no staging or aside copy left


@pytest.fixture(scope="module")
def reference_round(round0, tmp_path_factory):
    """An uninterrupted aggregate of the two packets: what every interrupted one must end as."""
    ref_run, packets = _copy(round0, tmp_path_factory.mktemp("ref"))
    subprocess.run(_cli(ref_run, packets), check=True, capture_output=True, timeout=300)
    files = Bundle.load(ref_run / "bundles" / "cpu-laptop" / "round-0001").manifest["files"]
    log, down = (ref_run / "distill.jsonl").read_text(), _summary(ref_run)["bytes_down"]
    return {"run": ref_run, "state": state_bytes(ref_run), "log": log, "bytes_down": down, "bundle_files": files}


@pytest.mark.parametrize("point", ["staged:current", "aside:current", "swapped:current", "committed:state"])
def test_train_killed_at_a_swap_step_leaves_no_hidden_folder(round0, reference_round, demo_dir, tmp_path, point):
    """SIGKILL at a named step of the edge state's swap in round 1: the next `train` on that state
    takes its lock, finishes or removes what the swap left, and trains; a state committed before the
    kill is not trained again: the round's packet, kept beside it, is sent."""
    state = tmp_path / "state"
    shutil.copytree(round0 / "state-a", state)
    bundle = reference_round["run"] / "bundles" / "cpu-laptop" / "round-0001"
    packet = tmp_path / "a1.pkt"
    cmd = [sys.executable, "-m", "ciders_edge", "train", "--bundle", str(bundle), "--state", str(state)]
    cmd += ["--data", str(demo_dir / "dates" / "train.jsonl"), "--out", str(packet)]
    killed = subprocess.run(cmd, capture_output=True, timeout=300, env={**os.environ, CRASH_ENV: point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not packet.exists(), point  # no packet without its state
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    committed = point in ("swapped:current", "committed:state")
    assert rerun.returncode == 0 and ("its packet never left" in rerun.stderr) == committed, rerun.stderr
    assert ClientState.load(state).round == 1 and Packet.load(packet).round == 1
    assert not (state / "unsent.pkt").exists()
    assert sorted(p.name for p in state.iterdir() if p.name.startswith(".")) == [".lock"], point


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


def test_a_client_with_a_key_file_is_aggregated_only_with_its_tag(round0, tmp_path):
    """``RUN/keys/<client>.key``: that client's packets must carry its tag; a bad key file is named, nothing written."""
    run, packets = _copy(round0, tmp_path)
    key, keys = b"k" * 32, run / "keys"
    keys.mkdir()
    (keys / "a.key").write_bytes(key)
    before = state_bytes(run)
    r = runner.invoke(cloud, _args(run, packets))  # a's packet has no tag
    assert r.exit_code == 1 and "a.pkt: authentication tag failed" in r.stderr
    tagged = tmp_path / "a-tagged.pkt"
    tagged.write_bytes(Packet.load(packets[0]).to_bytes(key))
    (keys / "b.key").write_bytes(b"short")
    r = runner.invoke(cloud, _args(run, [str(tagged), packets[1]]))
    assert r.exit_code == 1 and "b.key: a client key needs at least 16 bytes, got 5" in r.stderr
    assert state_bytes(run) == before
    (keys / "b.key").unlink()
    r = runner.invoke(cloud, _args(run, [str(tagged), packets[1]]))
    assert r.exit_code == 0, r.output
    assert ServerState.load(RunFolder(run).server_state).round == 1


def test_a_second_writer_is_refused_while_the_run_is_locked(round0, tmp_path):
    """aggregate and distill each read the state, work, and commit: while one holds the run, another
    is refused at once, naming the holder, and writes nothing; a killed holder leaves no stale lock."""
    run, packets = _copy(round0, tmp_path)
    before = state_bytes(run)
    with run_lock(run, "aggregate"):
        agg = runner.invoke(cloud, _args(run, packets))
        dist = runner.invoke(cloud, ["distill", "--run", str(run), "--steps", "1"])
    for r in (agg, dist):
        assert r.exit_code == 1 and f"in use by `aggregate` (PID {os.getpid()}," in r.stderr, r.output
    assert state_bytes(run) == before and not (run / "bundles" / "cpu-laptop" / "round-0001").exists()
    holder = "import os, sys\nfrom ciders_cloud.run.lock import run_lock\n"
    holder += "with run_lock(sys.argv[1], 'x'):\n    os.kill(os.getpid(), 9)"
    assert subprocess.run([sys.executable, "-c", holder, str(run)]).returncode == -signal.SIGKILL
    r = runner.invoke(cloud, _args(run, packets))
    assert r.exit_code == 0, r.output


def test_edge_and_cloud_copies_of_c_i_cannot_diverge(round0, tmp_path, demo_dir):
    """A lost edge state (a fresh c_i = 0 for a client the cloud has aggregated) is refused by the
    cloud; a damaged state file, or a state of another run, is refused by `train` itself."""
    run, packets = _copy(round0, tmp_path)
    assert runner.invoke(cloud, _args(run, packets)).exit_code == 0
    bundle = run / "bundles" / "cpu-laptop" / "round-0001"
    train_file = demo_dir / "dates" / "train.jsonl"
    train(bundle, train_file, tmp_path / "lost", tmp_path / "lost.pkt", RoundOptions(client_id="a"))  # a fresh state
    r = runner.invoke(cloud, _args(run, [str(tmp_path / "lost.pkt")]))
    assert r.exit_code == 1 and "client 'a' trained from a c_i" in r.stderr and "not the cloud's copy" in r.stderr

    damaged = tmp_path / "damaged"
    shutil.copytree(round0 / "state-a", damaged)
    c_i = damaged / "current" / "consensus.safetensors"
    raw = bytearray(c_i.read_bytes())
    raw[-3] ^= 1  # one bit of one float: still loads, but is not the c_i the cloud holds
    c_i.write_bytes(bytes(raw))
    with pytest.raises(StateError, match="fails its checksum"):
        train(bundle, train_file, damaged, tmp_path / "d.pkt", RoundOptions(client_id="a"))

    foreign = tmp_path / "foreign"
    shutil.copytree(round0 / "state-a", foreign)
    meta = json.loads((foreign / "current" / "state.json").read_text())
    (foreign / "current" / "state.json").write_text(json.dumps({**meta, "run_id": "f" * 32}))
    with pytest.raises(StateError, match="this state belongs to run ffffffffffff"):
        train(bundle, train_file, foreign, tmp_path / "f.pkt", RoundOptions(client_id="a"))


def test_the_fleet_drops_an_outlier_and_aggregates_the_others(round0, tmp_path):
    """With drop_outliers (what the fleet's coordinator asks for) a poisoned packet is left out with its
    reason, its client's c_i is not advanced, and the round equals one aggregated without it."""
    run, packets = _copy(round0, tmp_path)
    ref, _ = _copy(round0, tmp_path / "ref")
    bad = like(Packet.load(packets[1]), tensors={k: v * 1e6 for k, v in Packet.load(packets[1]).tensors.items()})
    items = [(packets[0], open(packets[0], "rb").read()), ("b-poisoned", bad.to_bytes())]
    summary = aggregate_packets(run, items, drop_outliers=True)
    assert list(summary["dropped"]) == ["b"] and "refused as an outlier" in summary["dropped"]["b"]
    assert summary["clients"] == ["a"] and set(ServerState.load(RunFolder(run).server_state).clients) == {"a"}
    aggregate_packets(ref, items[:1])
    got, expected = state_bytes(run), state_bytes(ref)
    for name in ("consensus.safetensors", "messenger_lora.safetensors", "client_consensus.safetensors"):
        assert got[name] == expected[name], name
