"""`ciders-edge train` on a tiny bundle: the messenger objective, state, packets, bad input."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from ciders_edge.cli import app as edge
from ciders_edge.data.records import load_examples
from ciders_edge.errors import ConfigError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.formats.client_state import ClientState
from ciders_edge.formats.packet import Packet
from ciders_edge.model.adapemu import load_edge_model
from ciders_edge.tensors import add
from ciders_edge.training.equations import fd_hessian_vector
from ciders_edge.training.local_steps import local_update
from ciders_edge.training.objective import MessengerObjective
from ciders_edge.training.round import RoundOptions, local_round, round_hyperparams
from ciders_edge.training.train import probe

runner = CliRunner()


@pytest.fixture
def bundle_dir(tiny_run):
    return tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"


@pytest.fixture
def edge_setup(bundle_dir, demo_dir):
    edge = load_edge_model(Bundle.load(bundle_dir))
    examples = load_examples(demo_dir / "arithmetic" / "train.jsonl", edge.tokenizer, 128)
    return edge, examples


def test_fd_matches_autograd_hvp(edge_setup):
    edge, examples = edge_setup
    edge.model.double()
    edge.model.get_base_model().set_attn_implementation("eager")  # SDPA on CPU has no double backward
    obj = MessengerObjective(edge, examples, batch_size=2, grad_accum=1, seed=0)
    torch.manual_seed(0)
    x = {k: (torch.randn_like(p) * 0.05).double() for k, p in obj.params.items()}
    u = {k: torch.randn_like(t) for k, t in x.items()}
    batch = obj.batch()
    eps = 1e-4
    hu_fd = fd_hessian_vector(obj.gradient(add(x, u, eps), batch)[1], obj.gradient(add(x, u, -eps), batch)[1], eps)
    # autograd: d/dx <grad L(x), u> with the same dropout masks
    obj.load(x)
    with torch.random.fork_rng():
        torch.manual_seed(batch.seed)
        loss = obj.loss(batch.micro[0])
        grads = torch.autograd.grad(loss, list(obj.params.values()), create_graph=True)
        dot = sum((g * u[k]).sum() for g, k in zip(grads, obj.params, strict=False))
        hvp = torch.autograd.grad(dot, list(obj.params.values()))
    num = sum(((hu_fd[k] - h) ** 2).sum() for k, h in zip(obj.params, hvp, strict=False)) ** 0.5
    den = sum((h**2).sum() for h in hvp) ** 0.5
    assert float(den) > 0 and float(num / den) < 1e-4  # O(eps^2) truncation


def test_training_lowers_the_local_loss(edge_setup):
    edge, examples = edge_setup
    hp = round_hyperparams(edge.bundle, None, {"local_steps": 25, "eta": 1e-2, "batch_size": 4, "gamma": 0.0})
    obj = MessengerObjective(edge, examples[:16], batch_size=16, grad_accum=1, seed=0)
    batch = obj.batch()
    v = edge.bundle.messenger_lora()
    zeros = {k: torch.zeros_like(t) for k, t in v.items()}
    before = obj.gradient(v, batch)[0]
    result = local_update(v, zeros, zeros, MessengerObjective(edge, examples, 4, 1, seed=1), hp)
    after = obj.gradient(result.x_final, batch)[0]
    assert after < before - 0.1, (before, after)


def test_train_round_state_follows_the_decoded_packet(edge_setup):
    edge, examples = edge_setup
    hp = round_hyperparams(edge.bundle, None, {"local_steps": 2, "eta": 1e-2, "solver": "fd"})
    out = local_round(edge, examples, None, hp, RoundOptions("c1", codec="int8"))
    assert out.state.round == 0 and out.state.bundle_id == edge.bundle.bundle_id
    for k, t in out.packet.tensors.items():
        assert torch.equal(out.state.c_i[k], t)  # cold start: c_i = 0 + decoded dc
    assert all("r_fd" in s for s in out.result.steps)
    assert len(out.packet_bytes) < out.packet.raw_bytes / 2


def _train(bundle, data, state, out, *extra):
    return runner.invoke(
        edge,
        [
            "train",
            "--bundle",
            str(bundle),
            "--data",
            str(data),
            "--state",
            str(state),
            "--out",
            str(out),
            "--steps",
            "2",
            "--lr",
            "1e-2",
            "--client-id",
            "c0",
            *extra,
        ],
    )


def test_cli_train_writes_packet_state_and_metrics(bundle_dir, demo_dir, tmp_path):
    r = _train(
        bundle_dir, demo_dir / "dates" / "train.jsonl", tmp_path / "s", tmp_path / "p.pkt", "--codec", "bf16", "--json"
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["round"] == 0 and s["codec"] == "bf16" and s["packet_bytes"] == (tmp_path / "p.pkt").stat().st_size
    pkt = Packet.load(tmp_path / "p.pkt")
    state = ClientState.load(tmp_path / "s")
    assert pkt.bundle_id == Bundle.load(bundle_dir).bundle_id and state.client_id == "c0"
    assert all(torch.equal(state.c_i[k], pkt.tensors[k]) for k in pkt.tensors)
    lines = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and {"loss", "grad_norm", "consensus_gap"} <= set(lines[0])
    # the same round again is refused: the state already holds it
    again = _train(bundle_dir, demo_dir / "dates" / "train.jsonl", tmp_path / "s", tmp_path / "q.pkt")
    assert again.exit_code == 1 and "already trained round 0" in again.stderr
    assert not (tmp_path / "q.pkt").exists()


def _one_line_error(result, fragment):
    assert result.exit_code == 1, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_cli_train_bad_data(bundle_dir, tmp_path):
    _one_line_error(_train(bundle_dir, tmp_path / "none.jsonl", tmp_path / "s", tmp_path / "p"), "no such data file")
    (tmp_path / "empty.jsonl").write_text("")
    _one_line_error(_train(bundle_dir, tmp_path / "empty.jsonl", tmp_path / "s", tmp_path / "p"), "empty file")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "a"}\n{"question": \n')
    _one_line_error(_train(bundle_dir, tmp_path / "bad.jsonl", tmp_path / "s", tmp_path / "p"), "bad.jsonl:2: bad JSON")
    assert not (tmp_path / "p").exists() and not (tmp_path / "s" / "current").exists()


def test_cli_train_corrupt_bundle(bundle_dir, demo_dir, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundle_dir, copy)
    with (copy / "adapter" / "adapter_model.safetensors").open("r+b") as f:
        f.seek(-3, 2)
        f.write(b"\xff")
    r = _train(copy, demo_dir / "dates" / "train.jsonl", tmp_path / "s", tmp_path / "p")
    _one_line_error(r, "adapter_model.safetensors: checksum mismatch")


def test_cli_train_state_for_another_model_or_newer_round(bundle_dir, demo_dir, tmp_path):
    data = demo_dir / "dates" / "train.jsonl"
    assert _train(bundle_dir, data, tmp_path / "s", tmp_path / "p").exit_code == 0
    before = (tmp_path / "s" / "current" / "consensus.safetensors").read_bytes()
    meta_path = tmp_path / "s" / "current" / "state.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "round": 4}))
    _one_line_error(
        _train(bundle_dir, data, tmp_path / "s", tmp_path / "p2"), "bundle round 0 is older than this state's round 4"
    )
    meta_path.write_text(json.dumps({**meta, "model_revision": "0" * 64}))
    _one_line_error(_train(bundle_dir, data, tmp_path / "s", tmp_path / "p2"), "made for another model or split")
    assert (tmp_path / "s" / "current" / "consensus.safetensors").read_bytes() == before
    assert not (tmp_path / "p2").exists()


def test_cli_train_refuses_non_finite_updates(bundle_dir, demo_dir, tmp_path):
    r = _train(bundle_dir, demo_dir / "dates" / "train.jsonl", tmp_path / "s", tmp_path / "p", "--eta-in", "1e30")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: non-finite values in delta_c tensor")
    assert not (tmp_path / "p").exists() and not (tmp_path / "s" / "current").exists()


def test_state_save_is_atomic(tmp_path, monkeypatch):
    s = ClientState("c0", "r" * 64, [0, 2, 5], 0, "b" * 64, "f" * 64, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    s.save(tmp_path)
    loaded = ClientState.load(tmp_path)
    assert loaded.round == 0 and torch.equal(loaded.c_i["w"], torch.ones(2))

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("ciders_edge.formats.statedir.write_json", crash)
    s.round, s.c_i = 1, {"w": torch.full((2,), 9.0)}
    with pytest.raises(OSError):
        s.save(tmp_path)
    again = ClientState.load(tmp_path)
    assert again.round == 0 and torch.equal(again.c_i["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["current"]


def test_state_survives_a_crash_between_the_two_renames(tmp_path):
    """replace_dir moves the old folder aside, then the new one in; a crash between leaves only
    `.current.old`: loading puts it back instead of starting from an empty state."""
    s = ClientState("c0", "r" * 64, [0, 2, 5], 3, "b" * 64, "f" * 64, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    s.save(tmp_path)
    (tmp_path / "current").rename(tmp_path / ".current.old")
    loaded = ClientState.load(tmp_path)
    assert loaded is not None and loaded.round == 3 and (tmp_path / "current").is_dir()


def test_a_crash_after_the_swap_leaves_nothing_aside(tmp_path):
    """A crash after the new folder moved in, while the old copy was being removed, leaves the new
    state and part of the old one aside: loading keeps the new state and removes the rest."""
    s = ClientState("c0", "r" * 64, [0, 2, 5], 3, "b" * 64, "f" * 64, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    s.save(tmp_path)
    shutil.copytree(tmp_path / "current", tmp_path / ".current.old")
    (tmp_path / ".current.old" / "consensus.safetensors").unlink()  # half removed
    s.round = 4
    s.save(tmp_path / "newer")
    shutil.rmtree(tmp_path / "current")
    (tmp_path / "newer" / "current").rename(tmp_path / "current")
    assert ClientState.load(tmp_path).round == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["current", "newer"]


def test_corrupt_state_file_is_a_state_error(tmp_path):
    from ciders_edge.errors import StateError

    s = ClientState("c0", "r" * 64, [0, 2, 5], 0, "b" * 64, "f" * 64, {"w": torch.ones(2)}, {"w": torch.zeros(2)})
    s.save(tmp_path)
    (tmp_path / "current" / "consensus.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(StateError, match="client state corrupt"):
        ClientState.load(tmp_path)


def test_a_round_that_asks_for_no_gradients_is_not_probed(bundle_dir, demo_dir, tmp_path):
    """Only FedNest's bundles carry a bilevel ask; probing a CIDERS round writes nothing."""
    with pytest.raises(ConfigError, match="round 0 asks for no gradients"):
        probe(bundle_dir, demo_dir / "units" / "train.jsonl", tmp_path / "s", tmp_path / "p.pkt", client_id="e1")
    assert not (tmp_path / "p.pkt").exists()
