"""A study's jobs share one AdapEmu per bundle (RoundOptions.reuse_model): a client trained after another on the
reused model writes, byte for byte, the packet and state it writes on a model of its own."""

import pytest
import torch
from tiny_runs import train_once

from ciders_edge.formats.bundle import Bundle
from ciders_edge.model.adapemu import EmulatorCache, load_edge_model
from ciders_edge.training.round import EMULATORS


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("val_fraction", [0.0, 0.1])
def test_a_client_on_the_reused_emulator_trains_as_on_its_own(tiny_run, demo_dir, tmp_path, val_fraction):
    """The first client moves the messenger LoRA; the second starts from the bundle's model all the same, and a new
    client's RNG from its own seed, not from what the process drew before. With a validation slice on AdapFu (the
    tiny run deploys it) the AdapEmu is let go first, as on a device: nothing is kept to reuse."""
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    dates, code = demo_dir / "dates" / "train.jsonl", demo_dir / "code" / "train.jsonl"
    EMULATORS.clear()
    alone = train_once(bundle, code, tmp_path / "alone", "b", val_fraction)
    train_once(bundle, dates, tmp_path / "a", "a", val_fraction, reuse_model=True)
    model = EMULATORS._edge
    after = train_once(bundle, code, tmp_path / "after", "b", val_fraction, reuse_model=True)
    assert (model is not None and EMULATORS._edge is model) if val_fraction == 0 else model is None
    assert (tmp_path / "after" / "p.pkt").read_bytes() == (tmp_path / "alone" / "p.pkt").read_bytes()
    assert {k: v for k, v in _files(after).items() if k != ".lock"} == {
        k: v for k, v in _files(alone).items() if k != ".lock"
    }
    EMULATORS.clear()


def test_the_cache_hands_back_the_model_as_loaded(tiny_run):
    """Whatever a job did to it (every LoRA tensor overwritten, train mode, gradients switched), the next get is
    the model load_edge_model builds; another bundle's settings build a new one."""
    b = Bundle.load(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000")
    cache = EmulatorCache()
    edge = cache.get(b, None, False, False)
    with torch.no_grad():
        for name, p in edge.model.named_parameters():
            if ".lora_" in name:
                p.add_(1.0)
            p.requires_grad_(".lora_" not in name)
    edge.model.train()
    again = cache.get(b, None, False, False)
    fresh = load_edge_model(b)
    assert again is edge and not again.model.training
    theirs = dict(fresh.model.named_parameters())
    for name, p in again.model.named_parameters():
        assert torch.equal(p, theirs[name]) and p.requires_grad == theirs[name].requires_grad, name
    assert cache.get(b, None, True, False) is not edge  # a live backbone LoRA is another model
