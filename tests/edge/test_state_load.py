"""Issue 16, item 10: damaged client and server state is a one-line StateError naming the file and
field, never a traceback (a missing file, a mistyped field, a tensor of no client)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from ciders_cloud.run.server_state import ServerState
from ciders_edge.cli import app as edge
from ciders_edge.errors import StateError
from ciders_edge.formats.client_state import ClientState


def _client(tmp_path) -> ClientState:
    s = ClientState("c0", "r" * 64, [0, 2, 5], 3, "b" * 64, "f" * 64, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    s.rng = torch.get_rng_state()
    s.save(tmp_path)
    return s


def _edit_json(path, **changes):
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps({k: v for k, v in meta.items() if v is not ...}))


def test_client_state_round_trips(tmp_path):
    saved = _client(tmp_path)
    loaded = ClientState.load(tmp_path)
    assert loaded.round == 3 and loaded.kept_layers == [0, 2, 5] and torch.equal(loaded.rng, saved.rng)


@pytest.mark.parametrize("name", ["rng.safetensors", "consensus.safetensors", "state.json"])
def test_a_missing_client_file_is_named(tmp_path, name):
    _client(tmp_path)
    (tmp_path / "current" / name).unlink()
    with pytest.raises(StateError, match=rf"current: client state incomplete \({name} missing\)"):
        ClientState.load(tmp_path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"round": "3"}, "round"),
        ({"round": True}, "round"),
        ({"kept_layers": "0,2,5"}, "kept_layers"),
        ({"kept_layers": [0, "2"]}, "kept_layers"),
        ({"client_id": 7}, "client_id"),
        ({"counters": []}, "counters"),
        ({"counters": {"rounds": 1, "steps": "2", "examples_seen": 3}}, "counters"),
        ({"bundle_id": ...}, "bundle_id"),
        ({"model_revision": None}, "model_revision"),
    ],
)
def test_a_mistyped_client_field_is_named(tmp_path, changes, field):
    _client(tmp_path)
    _edit_json(tmp_path / "current" / "state.json", **changes)
    with pytest.raises(StateError, match=rf"current/state\.json: client state .*'{field}'"):
        ClientState.load(tmp_path)


def test_client_state_json_that_is_no_object_or_no_generator(tmp_path):
    from safetensors.torch import save_file

    _client(tmp_path)
    (tmp_path / "current" / "state.json").write_text("[1, 2]")
    with pytest.raises(StateError, match=r"state\.json: client state corrupt \(not a JSON object\)"):
        ClientState.load(tmp_path)
    _client(tmp_path)
    save_file({"torch": torch.zeros(3)}, tmp_path / "current" / "rng.safetensors")
    _edit_json(tmp_path / "current" / "state.json", sha256=...)  # no checksums (older states): content checks hold
    with pytest.raises(StateError, match=r"rng\.safetensors: client state corrupt"):
        ClientState.load(tmp_path)


def test_cli_names_the_broken_field_in_one_line(tiny_run, demo_dir, tmp_path):
    from ciders_edge.formats.bundle import Bundle

    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    m = Bundle.load(bundle).manifest
    _client(tmp_path / "s")  # a state of this bundle's model and split, whose only fault is the type of `round`
    revision, kept = m["base_model"]["revision"], m["split"]["kept"]
    _edit_json(tmp_path / "s" / "current" / "state.json", round="-1", model_revision=revision, kept_layers=kept)
    args = ["--bundle", str(bundle), "--data", str(demo_dir / "dates" / "train.jsonl"), "--state", str(tmp_path / "s")]
    r = CliRunner().invoke(edge, ["train", *args, "--out", str(tmp_path / "p")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "state.json: client state field 'round' must be an integer" in lines[0], r.stderr


def _server(path) -> ServerState:
    t = torch.ones
    s = ServerState(2, {"v": t(2)}, {"b": t(2)}, {"c": t(2)}, {"a": {"w": t(2)}, "b.x": {"w": t(2)}}, {"0.m": t(2)}, 7)
    s.save(path)
    return s


def test_server_state_round_trips(tmp_path):
    _server(tmp_path)
    s = ServerState.load(tmp_path)
    assert s.round == 2 and s.takd_step == 7 and set(s.clients) == {"a", "b.x"} and "0.m" in s.optimizer


@pytest.mark.parametrize("name", ["takd_optimizer.safetensors", "client_consensus.safetensors"])
def test_a_missing_server_file_is_named(tmp_path, name):
    _server(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(StateError, match=rf"server state incomplete \({name} missing\)"):
        ServerState.load(tmp_path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"round": "2"}, "round"),
        ({"takd_step": None}, "takd_step"),
        ({"clients": "a"}, "clients"),
        ({"clients": [1]}, "clients"),
        ({"rng": []}, "rng"),
        ({"last_round_digests": [1]}, "last_round_digests"),
        ({"round": ...}, "round"),
    ],
)
def test_a_mistyped_server_field_is_named(tmp_path, changes, field):
    _server(tmp_path)
    _edit_json(tmp_path / "state.json", **changes)
    with pytest.raises(StateError, match=rf"state\.json: server state .*'{field}'"):
        ServerState.load(tmp_path)


@pytest.mark.parametrize(
    ("name", "tensors"),
    [
        ("client_consensus.safetensors", {"nobody": torch.ones(1)}),
        ("client_consensus.safetensors", {"z/w": torch.ones(1)}),
        ("takd_optimizer.safetensors", {"exp_avg": torch.ones(1)}),
    ],
)
def test_a_tensor_of_no_client_or_moment_is_named(tmp_path, name, tensors):
    from safetensors.torch import save_file

    _server(tmp_path)
    save_file(tensors, tmp_path / name)
    _edit_json(tmp_path / "state.json", sha256=...)  # no checksums (older states): content checks hold
    with pytest.raises(StateError, match=rf"{name}: server state corrupt"):
        ServerState.load(tmp_path)
