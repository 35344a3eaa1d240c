"""The cloud's step of a secure round (``aggregate_secure``), without the network: eq. (12) from the mean
SecAgg+ unmasks, the noise of a private run on the survivors' sum, and a run kept in one mode."""

import pytest
import torch
from conftest import fast_run_config
from tiny_runs import two_clients_round0

from ciders_cloud import prepare
from ciders_cloud.round.aggregate import aggregate_files, aggregate_packets
from ciders_cloud.round.secure import aggregate_secure
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import PacketError, StateError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.hyperparams import RoundHyperparams


def _mean(state: ServerState, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.01 * torch.randn(t.shape, generator=g) for k, t in state.messenger.items()}


def test_a_secure_round_steps_v_and_c_by_the_mean_and_notes_who_was_summed(demo_dir, tmp_path):
    prepare(fast_run_config(demo_dir), tmp_path / "run")
    folder = RunFolder(tmp_path / "run")
    before = ServerState.load(folder.server_state)
    mean = _mean(before)
    s = aggregate_secure(tmp_path / "run", mean, ["a", "b", "c"])
    after = ServerState.load(folder.server_state)
    hp = RoundHyperparams.from_dict(Bundle.load(folder.bundle("cpu-laptop", 0)).manifest["hyperparameters"])
    for k, v0 in before.messenger.items():  # eq. (12) with the mean as given
        assert torch.allclose(after.messenger[k], v0 - hp.tau * hp.local_steps * hp.eta * mean[k], atol=1e-7)
        assert torch.allclose(after.consensus[k], hp.alpha * mean[k], atol=1e-9)
    assert after.clients == {} and after.summed == {"a": 0, "b": 0, "c": 0}
    assert s["secure"] and s["clients"] == ["a", "b", "c"] and s["weights"] == pytest.approx([1 / 3] * 3)
    assert folder.bundle("cpu-laptop", 1).is_dir()
    aggregate_secure(tmp_path / "run", _mean(after, 1), ["b", "c"])
    assert ServerState.load(folder.server_state).summed == {"a": 0, "b": 1, "c": 1}  # a missed round 1
    with pytest.raises(StateError, match="securely aggregated, so the cloud holds no c_i"):
        aggregate_packets(tmp_path / "run", [])  # refused before any packet is read
    bad = {
        **_mean(after),
        next(iter(after.messenger)): torch.full_like(next(iter(after.messenger.values())), float("nan")),
    }
    with pytest.raises(PacketError, match="is not finite; nothing was written"):
        aggregate_secure(tmp_path / "run", bad, ["a", "b", "c"])
    assert ServerState.load(folder.server_state).round == 2


def test_a_private_secure_round_noises_the_sum_of_what_the_edges_clipped(demo_dir, tmp_path):
    dp = {"clip": 0.5, "noise_multiplier": 0.0, "clip_on": "edge"}  # no noise: the release is the sum over D
    run = fast_run_config(demo_dir, client_ids=["a", "b", "c", "d"], participation=0.75, dp=dp)
    prepare(run, tmp_path / "run")
    folder = RunFolder(tmp_path / "run")
    before = ServerState.load(folder.server_state)
    mean = _mean(before)
    s = aggregate_secure(tmp_path / "run", mean, ["a", "b"], sampled=["a", "b", "c"])  # D = 3, one dropped out
    after = ServerState.load(folder.server_state)
    hp = RoundHyperparams.from_dict(run.hyperparameters)
    for k, v0 in before.messenger.items():
        released = mean[k] * 2 / 3  # the survivors' sum over the fixed divisor
        assert torch.allclose(after.messenger[k], v0 - hp.tau * hp.local_steps * hp.eta * released, atol=1e-7)
    assert s["privacy"]["epsilon"] == "inf" and s["weights"] == pytest.approx([1 / 3, 1 / 3])
    assert Bundle.load(folder.bundle("cpu-laptop", 0)).manifest["hyperparameters"]["displacement_clip"] == 0.5


def test_a_run_stays_in_one_mode(demo_dir, tmp_path):
    root = two_clients_round0(fast_run_config(demo_dir), demo_dir, tmp_path)
    aggregate_files(root / "run", [root / "a.pkt", root / "b.pkt"])  # a plain round: the cloud holds c_i
    state = ServerState.load(RunFolder(root / "run").server_state)
    with pytest.raises(StateError, match="aggregated in the clear"):
        aggregate_secure(root / "run", _mean(state), ["a", "b", "c"])
