"""The fleet's parts without a network: bundle shipping, the edge's commit rule, the cloud's
packet checks and node identities, TLS material, and the commands' bad inputs."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import fast_run_config
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from safetensors.torch import save_file
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.fleet.certs import make_certs
from ciders_cloud.fleet.coordinator import Coordinator, Edge
from ciders_cloud.fleet.serve import ServeSettings, _wait_for_earlier, check_aggregation
from ciders_cloud.round.reports import edge_report
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.cli import app as edge_cli
from ciders_edge.errors import BundleError, ConfigError, PacketError, StateError
from ciders_edge.fleet.bundle_sync import files_to_ship, held_files, install_bundle
from ciders_edge.fleet.edge import PENDING, settle
from ciders_edge.fleet.keys import ensure_node_key
from ciders_edge.fleet.processes import flower_env
from ciders_edge.fleet.protocol import consensus_digest
from ciders_edge.formats.bundle import MANIFEST, Bundle
from ciders_edge.formats.checksums import hash_folder, sha256_file
from ciders_edge.formats.client_state import ClientState
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()


@pytest.fixture(scope="module")
def run0(tmp_path_factory, demo_dir):
    """A tiny run with two registered edges, and a round-0 packet from each."""
    from ciders_cloud import prepare

    root = tmp_path_factory.mktemp("fleet-parts")
    prepare(fast_run_config(demo_dir), root / "run")
    RunFolder(root / "run").nodes.mkdir()
    for cid in ("a", "b"):
        _, pub = ensure_node_key(root / f"edge-{cid}")
        shutil.copy(pub, RunFolder(root / "run").node_key(cid))
        bundle = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
        train(
            bundle,
            demo_dir / "dates" / "train.jsonl",
            root / f"state-{cid}",
            root / f"{cid}.pkt",
            RoundOptions(client_id=cid),
        )
    return root


def _bundle(run0) -> Bundle:
    return Bundle.load(run0 / "run" / "bundles" / "cpu-laptop" / "round-0000")


def _ship(bundle: Bundle, held: dict) -> dict[str, bytes]:
    return {rel: (bundle.path / rel).read_bytes() for rel in files_to_ship(bundle, held)}


def _next_bundle(src: Bundle, out) -> Bundle:
    """A copy of ``src`` whose consensus changed, as the next round's bundle would."""
    shutil.copytree(src.path, out)
    save_file({k: t + 1 for k, t in src.consensus().items()}, out / "consensus.safetensors")
    manifest = {**src.manifest, "round": src.round + 1, "files": hash_folder(out, exclude=MANIFEST)}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return Bundle.load(out)


# -- bundle shipping ---------------------------------------------------------------------------


def test_round_zero_ships_everything_and_later_rounds_only_what_changed(run0, tmp_path):
    src, target = _bundle(run0), tmp_path / "edge" / "bundle"
    assert held_files(target) == {}
    first = _ship(src, held_files(target))
    assert set(first) == set(src.manifest["files"])
    got = install_bundle(target, (src.path / MANIFEST).read_bytes(), first)
    assert got.bundle_id == src.bundle_id and Bundle.load(target).bundle_id == src.bundle_id

    nxt = _next_bundle(src, tmp_path / "next")
    delta = _ship(nxt, held_files(target))
    assert set(delta) == {"consensus.safetensors"}
    got = install_bundle(target, (nxt.path / MANIFEST).read_bytes(), delta)
    assert got.bundle_id == nxt.bundle_id and Bundle.load(target).round == 1


def test_a_corrupt_or_missing_file_is_refused_and_the_next_sync_asks_for_all(run0, tmp_path):
    src, target = _bundle(run0), tmp_path / "bundle"
    manifest = (src.path / MANIFEST).read_bytes()
    install_bundle(target, manifest, _ship(src, {}))
    nxt = _next_bundle(src, tmp_path / "next")
    with pytest.raises(BundleError, match="consensus.safetensors: neither sent by the cloud nor held"):
        install_bundle(target, (nxt.path / MANIFEST).read_bytes(), {})
    assert Bundle.load(target).bundle_id == src.bundle_id  # untouched
    bad = {"consensus.safetensors": b"not the file"}
    with pytest.raises(BundleError, match="checksum mismatch"):
        install_bundle(target, (nxt.path / MANIFEST).read_bytes(), bad)
    assert held_files(target) == {}  # dropped: the next round ships every file


def test_a_held_file_that_vanished_drops_the_local_copy(run0, tmp_path):
    src, target = _bundle(run0), tmp_path / "bundle"
    install_bundle(target, (src.path / MANIFEST).read_bytes(), _ship(src, {}))
    nxt = _next_bundle(src, tmp_path / "next")
    (target / "backbone.safetensors").unlink()  # still listed by the local manifest
    delta = _ship(nxt, held_files(target))
    with pytest.raises(BundleError, match="held file unreadable"):
        install_bundle(target, (nxt.path / MANIFEST).read_bytes(), delta)
    assert held_files(target) == {}


def test_a_manifest_path_outside_the_bundle_is_refused(tmp_path):
    manifest = json.dumps({"files": {"../escape.txt": "0" * 64}}).encode()
    with pytest.raises(BundleError, match="unsafe path"):
        install_bundle(tmp_path / "bundle", manifest, {"../escape.txt": b"x"})
    assert not (tmp_path / "escape.txt").exists()


# -- the edge commits a round only once the cloud took it --------------------------------------


def _states(tmp_path, run0):
    """An edge folder whose committed state is round -1's (none) and a pending round 0."""
    d = tmp_path / "edge"
    shutil.copytree(run0 / "state-a" / "current", d / PENDING / "current")
    return d, ClientState.load(d / PENDING)


def test_pending_round_is_committed_when_the_cloud_holds_its_c_i(tmp_path, run0):
    d, pending = _states(tmp_path, run0)
    got = settle(d, "a", consensus_digest(pending.c_i), cloud_round=1)
    assert got.round == 0 and torch.equal(next(iter(got.c_i.values())), next(iter(pending.c_i.values())))
    assert not (d / PENDING).exists() and ClientState.load(d).round == 0


def test_pending_round_is_dropped_when_the_cloud_went_on_without_it(tmp_path, run0):
    d, _ = _states(tmp_path, run0)
    assert settle(d, "a", "", cloud_round=0) is None  # a late message of the same round: keep it pending
    assert (d / PENDING).exists()
    digest = consensus_digest(ClientState.load(d / PENDING).c_i)
    with pytest.raises(StateError, match="differs from the cloud"):  # same round: not aggregated yet, not committed
        settle(d, "a", digest, cloud_round=0)
    assert (d / PENDING).exists()
    assert settle(d, "a", "", cloud_round=1) is None  # the cloud closed round 0 without our packet
    assert not (d / PENDING).exists() and ClientState.load(d) is None


def test_state_that_differs_from_the_cloud_is_refused(tmp_path, run0):
    d = tmp_path / "edge"
    shutil.copytree(run0 / "state-a" / "current", d / "current")
    with pytest.raises(StateError, match="differs from the cloud's copy"):
        settle(d, "a", "", cloud_round=1)
    with pytest.raises(StateError, match="belongs to client 'a'"):
        settle(d, "b", "", cloud_round=1)
    assert ClientState.load(d).round == 0  # nothing deleted


def test_consensus_digest_sees_every_bit():
    c = {"x": torch.zeros(3, 2), "y": torch.ones(4)}
    flipped = {"x": c["x"].clone(), "y": c["y"]}
    flipped["x"].view(torch.int32)[1, 1] ^= 1
    assert consensus_digest(c) == consensus_digest({k: v.clone() for k, v in c.items()})
    assert consensus_digest(c) != consensus_digest(flipped)
    assert consensus_digest(None) == consensus_digest({}) == ""


# -- the cloud: node identity and packet checks -------------------------------------------------


class _Node:
    def __init__(self, node_id: int, key_file):
        from cryptography.hazmat.primitives import serialization

        key = serialization.load_ssh_public_key(key_file.read_bytes())
        self.node_id = node_id
        fmt = serialization.PublicFormat.SubjectPublicKeyInfo
        self.public_key = key.public_bytes(serialization.Encoding.PEM, fmt)


def test_edges_are_known_by_their_registered_key_only(run0, tmp_path):
    co = Coordinator(run0 / "run")
    _, stranger = ensure_node_key(tmp_path / "stranger")
    nodes = [_Node(7, run0 / "edge-b" / "node-key.pub"), _Node(9, stranger), _Node(3, run0 / "edge-a" / "node-key.pub")]
    assert co.edges(nodes) == [Edge(3, "a"), Edge(7, "b")]


def test_a_round_samples_the_runs_clients_and_names_the_sampled_ones_not_online(run0):
    co = Coordinator(run0 / "run")
    both = [Edge(3, "a"), Edge(7, "b")]
    assert co.sample(both) == (both, []) and co.sample(both[:1]) == (both[:1], ["b"])  # participation 1: all
    co.run = co.run.replace(participation=0.5)  # fixed: one of the two, drawn afresh each round
    draws = [co.sample(both) for _ in range(64)]
    assert all(len(edges) == 1 and not offline for edges, offline in draws)
    assert {edges[0].client_id for edges, _ in draws} == {"a", "b"}
    assert {tuple(offline) for edges, offline in (co.sample(both[:1]) for _ in range(64)) if not edges} == {("b",)}


def test_packet_from_another_client_or_round_is_refused_and_changes_nothing(run0, tmp_path):
    shutil.copytree(run0 / "run", tmp_path / "run")
    co = Coordinator(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in RunFolder(tmp_path / "run").server_state.iterdir()}
    packet = (run0 / "a.pkt").read_bytes()
    co.check(Edge(3, "a"), packet)  # the right node: accepted
    with pytest.raises(PacketError, match="packet claims client 'a', the node is 'b'"):
        co.check(Edge(7, "b"), packet)
    co.close_round({Edge(3, "a"): packet})
    with pytest.raises(PacketError, match="packet is for round 0, the server is at round 1"):
        co.check(Edge(3, "a"), packet)
    after = {p.name: p.read_bytes() for p in RunFolder(tmp_path / "run").server_state.iterdir()}
    assert after != before and co.round == 1
    assert Coordinator(tmp_path / "run").round == 1


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("c.pub", "ssh-rsa garbage\n", "c.pub: not an OpenSSH public key"),
        ("bad id.pub", None, "'bad id' is not a client id of this run"),
        ("c.pub", None, "the same key as a.pub"),
    ],
)
def test_a_bad_node_key_file_is_refused(run0, tmp_path, name, content, message):
    shutil.copytree(run0 / "run", tmp_path / "run")
    nodes = RunFolder(tmp_path / "run").nodes
    (nodes / name).write_text(content if content is not None else (nodes / "a.pub").read_text())
    with pytest.raises(ConfigError, match=message):
        Coordinator(tmp_path / "run")


# -- TLS material and the commands' bad inputs --------------------------------------------------


def test_certs_make_a_ca_and_a_server_certificate_it_signed(tmp_path):
    s = make_certs(tmp_path / "certs", ["cloud.example", "10.0.0.5"])
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "certs" / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "cloud.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.5"}
    assert (tmp_path / "certs" / "server.key").stat().st_mode & 0o077 == 0
    with pytest.raises(ConfigError, match="already holds certificates"):
        make_certs(tmp_path / "certs", [])
    assert s["hosts"][:2] == ["localhost", "127.0.0.1"]
    assert not (tmp_path / "certs" / "ca.key").exists() and s["ca_key"] is None  # no CA key beside the server key


def test_the_ca_key_is_kept_only_outside_the_certificate_folder(tmp_path):
    with pytest.raises(ConfigError, match="lies inside --out"):
        make_certs(tmp_path / "certs", [], ca_key=tmp_path / "certs" / "ca.key")
    assert not (tmp_path / "certs").exists()
    make_certs(tmp_path / "certs", [], ca_key=tmp_path / "offline" / "ca.key")
    key = serialization.load_pem_private_key((tmp_path / "offline" / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.crt").read_bytes())
    assert key.public_key().public_numbers() == ca.public_key().public_numbers()
    assert (tmp_path / "offline" / "ca.key").stat().st_mode & 0o077 == 0


def test_node_key_is_made_once_and_kept_private(tmp_path):
    r = runner.invoke(edge_cli, ["keygen", "--state", str(tmp_path / "s"), "--json"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert first["line"].startswith("ecdsa-sha2-nistp384 ")
    digest = sha256_file(tmp_path / "s" / "node-key")
    runner.invoke(edge_cli, ["keygen", "--state", str(tmp_path / "s")])
    assert sha256_file(tmp_path / "s" / "node-key") == digest
    assert (tmp_path / "s" / "node-key").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "0 edge keys for --min-clients 3"),
        (["--min-clients", "2"], "make TLS material with `ciders-cloud certs"),
        (["--min-clients", "2", "--address", "nowhere"], "expected HOST:PORT"),
    ],
)
def test_serve_bad_inputs_are_one_line_errors(run0, tmp_path, args, message):
    shutil.copytree(run0 / "run", tmp_path / "run")
    if not args:
        shutil.rmtree(RunFolder(tmp_path / "run").nodes)
        args = ["--min-clients", "3"]
    r = runner.invoke(cloud, ["serve", "--run", str(tmp_path / "run"), "--rounds", "2", *args])
    assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "run" / "fleet").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "missing.jsonl"], "missing.jsonl: no such data file"),
        ([], "--root-certificates CA.crt is required"),
        (["--root-certificates", "nope.crt"], "nope.crt: no such CA certificate file"),
        (["--server", "cloud.example"], "--server 'cloud.example': expected HOST:PORT"),
    ],
)
def test_join_bad_inputs_are_one_line_errors(demo_dir, tmp_path, args, message):
    base = ["join", "--state", str(tmp_path / "s"), "--profile", "cpu-laptop"]
    if "--data" not in args:
        args = [*args, "--data", str(demo_dir / "dates" / "train.jsonl")]
    if "--server" not in args:
        args = [*args, "--server", "127.0.0.1:1"]
    r = runner.invoke(edge_cli, [*base, *args])
    assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output


def test_the_edge_summary_is_checked_before_it_is_logged():
    """An edge's summary is its claim: only scalar fields of a small JSON object reach fleet/log.jsonl."""
    good = edge_report(json.dumps({"loss_last": 0.5, "client": "a", "nested": {"x": 1}, "nan": float("nan")}))
    assert good == {"loss_last": 0.5, "client": "a"}
    for raw, message in [
        ("[1, 2]", "not a JSON object"),
        ("{", "not valid JSON"),
        ("[" * 50_000, "not valid JSON"),  # nesting beyond the parser's recursion limit
        ("x" * (1 << 17), "at most"),
        (5, "at most"),
    ]:
        with pytest.raises(PacketError, match=message):
            edge_report(raw)


@pytest.fixture
def tls_server(tmp_path):
    """A TLS server on a loopback port with the certificate `ciders-cloud certs` made (certs/), and
    a second, unrelated CA (other/): what an edge holds when it was given the wrong ca.crt."""
    import socket
    import ssl
    import threading

    make_certs(tmp_path / "certs", [])
    make_certs(tmp_path / "other", [])
    folder = RunFolder(tmp_path).certs
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder.server_cert, folder.server_key)
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass  # the client refused our certificate

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1], tmp_path
    listener.close()


def test_join_with_the_wrong_ca_names_the_tls_failure(tls_server, demo_dir):
    """A ca.crt from another `certs` run: one line naming the TLS check, before any SuperNode starts."""
    from ciders_edge.fleet.tls import check_server_certificate

    port, root = tls_server
    check_server_certificate("127.0.0.1", port, root / "certs" / "ca.crt")  # the right CA: no error
    args = ["join", "--state", str(root / "s"), "--profile", "cpu-laptop", "--server", f"127.0.0.1:{port}"]
    args += ["--data", str(demo_dir / "dates" / "train.jsonl"), "--root-certificates", str(root / "other" / "ca.crt")]
    r = runner.invoke(edge_cli, args)
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "TLS: the cloud at 127.0.0.1:" in out and "does not accept" in out, r.output
    assert "not registered" not in out
    (root / "junk.crt").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="not a PEM CA certificate"):
        check_server_certificate("127.0.0.1", port, root / "junk.crt")


def test_a_restarted_serve_waits_for_the_crashed_ones_flower_processes(tmp_path):
    """Processes left by an earlier serve of the run (their FLWR_HOME is the run's) hold its ports: serve
    waits for them to end, and names them if they do not."""
    home = tmp_path / "flower"
    home.mkdir()
    _wait_for_earlier(home, 0.0)  # none: no wait
    # it says so once it runs: right after exec, /proc/PID/environ can still read empty for a moment
    up = "import time; print('up', flush=True); time.sleep(300)"
    leftover = subprocess.Popen([sys.executable, "-c", up], env=flower_env(home), stdout=subprocess.PIPE, text=True)
    try:
        assert leftover.stdout.readline() == "up\n"
        with pytest.raises(StateError, match=rf"earlier serve of this run still run after 1 s \(pids {leftover.pid}\)"):
            _wait_for_earlier(home, 1.0)
    finally:
        leftover.kill()
        leftover.wait()
    _wait_for_earlier(home, 0.0)


# -- secure aggregation: what serve refuses -----------------------------------------------------


def test_serve_refuses_secure_aggregation_it_cannot_do_in_one_line(run0, tmp_path):
    shutil.copytree(run0 / "run", tmp_path / "run")
    serve = ["serve", "--run", str(tmp_path / "run"), "--rounds", "2"]
    for args, message in [
        (["--secure-aggregation", "--min-clients", "2"], "--secure-aggregation needs --min-clients 3 or more, got 2"),
        (["--secure-aggregation", "--min-clients", "3"], "2 edge keys; --secure-aggregation needs at least 3 edges"),
    ]:
        r = runner.invoke(cloud, [*serve, *args])
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.exit_code == 1 and len(lines) == 1 and message in lines[0], r.output
    folder = RunFolder(tmp_path / "run")
    state = ServerState.load(folder.server_state)
    state.summed = {"a": 0}
    state.save(folder.server_state)
    r = runner.invoke(cloud, [*serve, "--min-clients", "2"])
    assert r.exit_code == 1 and "rounds were securely aggregated" in r.stderr and "--secure-aggregation" in r.stderr
    assert not (tmp_path / "run" / "fleet").exists()


SECURE = dict(min_clients=3, secure_aggregation=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm": "fednest"}, "cannot serve fednest"),
        ({"algorithm": "localot"}, "cannot serve localot"),
        ({"client_ids": ["a", "b", "c"], "dp": {"clip": 1.0, "noise_multiplier": 1.0}}, "--dp-clip-on edge"),
        (
            {"profiles": ["cpu-laptop", "rpi5-8gb"], "profile_splits": {"rpi5-8gb": {"messenger_depth": 1}}},
            "different messenger layers",
        ),
    ],
)
def test_secure_aggregation_refuses_a_run_it_cannot_sum(demo_dir, tmp_path, overrides, message):
    run = fast_run_config(demo_dir, **overrides)
    with pytest.raises(ConfigError, match=message) as err:
        check_aggregation(run, ServerState(0, {}, {}, {}), ServeSettings(tmp_path, 1, **SECURE))
    assert "\n" not in str(err.value)
    plain = ServerState(1, {}, {}, {}, clients={"a": {}})  # the cloud holds c_i copies from plain rounds
    with pytest.raises(ConfigError, match="aggregated in the clear"):
        check_aggregation(fast_run_config(demo_dir), plain, ServeSettings(tmp_path, 1, **SECURE))


@pytest.mark.parametrize("algorithm", ["fednest", "localot"])
def test_a_fleet_refuses_an_algorithm_it_cannot_serve_before_anything_starts(demo_dir, tmp_path, algorithm):
    """FedNest's first exchange runs only in simulate; LocalOT serves in the clear (it sums nothing)."""
    run = fast_run_config(demo_dir, algorithm=algorithm)
    plain = ServeSettings(tmp_path, 1, min_clients=1)
    if algorithm == "fednest":
        with pytest.raises(ConfigError, match="fednest's first exchange .* runs in `ciders-cloud simulate`"):
            check_aggregation(run, ServerState(0, {}, {}, {}), plain)
    else:
        check_aggregation(run, ServerState(0, {}, {}, {}), plain)
    check_aggregation(fast_run_config(demo_dir, algorithm="lfednest"), ServerState(0, {}, {}, {}), plain)


def test_a_secure_round_commits_the_pending_state_its_sum_held_and_drops_one_it_did_not(run0, tmp_path):
    """The cloud holds no c_i to compare with: the round the secure sum held this client decides."""
    for summed, kept in ((0, True), (-1, False)):
        root = tmp_path / f"summed{summed}"
        root.mkdir()
        shutil.copytree(run0 / "state-a", root / PENDING)  # round 0 trained, not yet confirmed
        state = settle(root, "a", "", 1, summed_round=summed)  # no digest: the cloud has none
        assert not (root / PENDING).exists()
        assert (state is not None) is kept and (ClientState.load(root) is not None) is kept
        if kept:
            assert state.round == 0 and consensus_digest(state.c_i) == consensus_digest(
                ClientState.load(run0 / "state-a").c_i
            )
