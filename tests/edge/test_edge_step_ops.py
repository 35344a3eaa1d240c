"""The edge step on flat buffers (issue 19): the same numbers as the per-tensor dict update, and an
op count that does not grow with the number of LoRA tensors."""

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ciders_edge.data.records import batch_stream, load_examples
from ciders_edge.formats.bundle import Bundle
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.model.adapemu import load_edge_model
from ciders_edge.model.forward import messenger_loss, run_backbone
from ciders_edge.model.lora import MESSENGER_ADAPTER, bind_flat, copy_into, is_bound, lora_parameters
from ciders_edge.schedule import lr_multiplier
from ciders_edge.tensors import FlatLayout, add, norm, sub
from ciders_edge.training.equations import (
    consensus_update,
    delta_c,
    displacement,
    fd_hessian_vector,
    fd_surrogate,
    look_ahead,
    trajectory_gradient,
)
from ciders_edge.training.local_steps import local_update
from ciders_edge.training.objective import Batch, MessengerObjective
from ciders_edge.training.round import round_hyperparams


class _DictMessengerObjective:
    """The messenger objective as it was before issue 19: separate LoRA tensors, a forked RNG and
    a host read of the loss per gradient."""

    def __init__(self, edge, examples, batch_size, seed):
        self.edge, self.params = edge, lora_parameters(edge.model, MESSENGER_ADAPTER)
        self.rng = random.Random(seed)
        self.stream = batch_stream(examples, batch_size, self.rng, edge.tokenizer.pad_token_id)
        edge.model.requires_grad_(False)
        for p in self.params.values():
            p.requires_grad_(True)
        edge.model.train()

    def batch(self):
        with torch.no_grad():
            micro = [run_backbone(self.edge.model, next(self.stream), self.edge.split.n_kept)]
        return Batch(micro, self.rng.getrandbits(63))

    def gradient(self, x, batch):
        copy_into(self.params, x)
        for p in self.params.values():
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(batch.seed)
            loss = messenger_loss(self.edge.model, batch.micro[0], self.edge.split.n_kept)
            loss.backward()
        return float(loss.detach()), {k: p.grad.detach().clone() for k, p in self.params.items()}


def _dict_update(v, c, c_i, obj, hp):
    """The local update as it was before issue 19: per-tensor dict arithmetic and per-tensor AdamW."""
    params = {k: torch.nn.Parameter(t.detach().clone()) for k, t in v.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=hp.eta, weight_decay=hp.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, hp))
    losses = []
    for _ in range(hp.local_steps):
        x = {k: p.detach() for k, p in params.items()}
        batch = obj.batch()
        loss, g0 = obj.gradient(x, batch)
        losses.append(loss)
        _, g = obj.gradient(look_ahead(x, g0, hp.look_ahead), batch)
        if hp.solver == "fd":
            g_plus = obj.gradient(add(x, g, hp.eps_fd), batch)[1]
            g_minus = obj.gradient(add(x, g, -hp.eps_fd), batch)[1]
            g = fd_surrogate(g, fd_hessian_vector(g_plus, g_minus, hp.eps_fd), hp.eta_hvp)
        g_traj = trajectory_gradient(g, x, v, c, c_i, hp.gamma, hp.eps_prox)
        for k, p in params.items():
            p.grad = g_traj[k].clone()
        torch.nn.utils.clip_grad_norm_(list(params.values()), hp.clip)
        opt.step()
        sched.step()
    x_final = {k: p.detach().clone() for k, p in params.items()}
    delta = displacement(v, x_final, hp.local_steps, hp.eta)
    c_i_new = consensus_update(c_i, delta, c, hp.alpha, hp.gamma)
    return x_final, delta, c_i_new, delta_c(c_i_new, c_i), losses


def _close(a, b, rel=1e-5):
    return norm(sub(a, b)) <= rel * norm(b)


@pytest.mark.parametrize("solver", ["fo", "fd"])
def test_flat_update_matches_the_dict_update(tiny_run, demo_dir, solver):
    """x_K, Delta_i and c_i from the flat loop equal the per-tensor ones, K = 3, with consensus,
    proximal pull, clipping and dropout all active."""
    bundle = Bundle.load(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000")
    overrides = {"local_steps": 3, "eta": 1e-2, "solver": solver, "gamma": 0.3, "eps_prox": 0.1, "clip": 0.05}
    hp = round_hyperparams(bundle, None, overrides)
    v = {k: t.float() for k, t in bundle.messenger_lora().items()}
    gen = torch.Generator().manual_seed(0)
    c = {k: 0.01 * torch.randn(t.shape, generator=gen) for k, t in v.items()}
    c_i = {k: 0.01 * torch.randn(t.shape, generator=gen) for k, t in v.items()}
    runs = []
    for flat in (False, True):
        edge = load_edge_model(bundle)
        examples = load_examples(demo_dir / "arithmetic" / "train.jsonl", edge.tokenizer, 64)
        torch.manual_seed(0)
        rng = torch.get_rng_state()
        if flat:
            r = local_update(v, c, c_i, MessengerObjective(edge, examples, 2, 1, seed=0), hp)
            runs.append((r.x_final, r.delta, r.c_i_new, r.dc, [s["loss"] for s in r.steps]))
        else:
            runs.append(_dict_update(v, c, c_i, _DictMessengerObjective(edge, examples, 2, seed=0), hp))
        assert torch.equal(torch.get_rng_state(), rng)  # the dropout reseeding leaves the caller's RNG alone
    (x_old, d_old, ci_old, dc_old, loss_old), (x_new, d_new, ci_new, dc_new, loss_new) = runs
    assert list(x_new) == list(v) and all(x_new[k].shape == v[k].shape for k in v)
    assert norm(sub(x_old, v)) > 0 and _close(x_new, x_old) and _close(d_new, d_old)
    assert _close(ci_new, ci_old) and _close(dc_new, dc_old)
    assert loss_new == pytest.approx(loss_old, rel=1e-6)


def test_flat_layout_round_trip():
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.A": (2, 5), "a.B": (3, 2), "b.A": (2, 5), "b.B": (3, 2), "c.A": (2, 7)}
    t = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    layout = FlatLayout.of(t)
    assert len(layout.blocks) == 3 and layout.numel == sum(x.numel() for x in t.values())
    reordered = dict(reversed(list(t.items())))
    assert layout.matches(reordered) and not layout.matches({**t, "c.A": torch.zeros(7, 2)})
    flat = layout.flatten(reordered, dtype=torch.float64)
    back = layout.unflatten(flat)
    assert flat.dtype == torch.float64 and list(back) == list(t)
    assert all(torch.equal(back[k], t[k].double()) for k in t)
    back["b.A"].zero_()  # views of flat
    assert float(flat.abs().sum()) < float(layout.flatten(t).abs().sum())


def test_bound_parameters_share_one_buffer_and_rebind(tiny_run):
    edge = load_edge_model(Bundle.load(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"))
    params = lora_parameters(edge.model, MESSENGER_ADAPTER)
    for p in params.values():
        p.requires_grad_(True)
    before = {k: p.detach().clone() for k, p in params.items()}
    layout = FlatLayout.of(params)
    flat, grad = bind_flat(params, layout)
    assert is_bound(params, flat, grad) and all(torch.equal(p, before[k]) for k, p in params.items())
    flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in params.values())  # one copy loads every tensor
    loss = sum((p * p).sum() + p.sum() for p in params.values())
    loss.backward()
    assert torch.equal(grad, torch.ones_like(grad))  # backward accumulated into the flat gradient
    next(iter(params.values())).grad = None
    assert not is_bound(params, flat, grad)


class _FlatQuadratic:
    """L(x) = |x - b|^2 / 2 on flat points: no per-tensor work of its own."""

    def __init__(self, v):
        self.layout, self.device = FlatLayout.of(v), torch.device("cpu")
        self.b = torch.ones(self.layout.numel)

    def batch(self):
        return None

    def flat_gradient(self, x, batch):
        r = x - self.b
        return 0.5 * (r * r).sum(), r

    def rng_scope(self):
        return torch.random.fork_rng(devices=[])


def _update_ops(n_tensors: int, solver: str) -> int:
    v = {f"layer{i}.lora_A": torch.zeros(4, 8) for i in range(n_tensors)}
    zero = {k: torch.zeros_like(t) for k, t in v.items()}
    hp = RoundHyperparams(local_steps=2, eta=0.1, solver=solver, warmup_steps=0)
    obj = _FlatQuadratic(v)
    local_update(v, zero, zero, obj, hp)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        local_update(v, zero, zero, obj, hp)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


@pytest.mark.parametrize("solver", ["fo", "fd"])
def test_update_ops_do_not_grow_with_the_number_of_lora_tensors(solver):
    """No per-tensor loop is left in the step: 8 or 80 LoRA tensors of one shape dispatch as many ops."""
    assert _update_ops(8, solver) == _update_ops(80, solver)
