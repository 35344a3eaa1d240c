"""FedNest / LFedNest against a quadratic bilevel problem whose hypergradient and solution are known.

inner  g(x, y) = 1/2 y'Hy - y'Bx          y*(x) = H^-1 B x
outer  f_i(x, y) = 1/2 |y - b_i|^2 + mu/2 |x - a_i|^2
grad F(x) = mu (x - a) + B'H^-1 (y*(x) - b)      (a, b: the clients' weighted means)
"""

import pytest
import torch
from flat_objective import AsFlat

from ciders_cloud.strategies import get_strategy
from ciders_cloud.strategies.aggregation import layer_means
from ciders_cloud.strategies.fednest.hypergradient import (
    autograd_second_order,
    fd_second_order,
    indirect_term,
    neumann_ihgp,
    top_eigenvalue,
)
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.schedule import mean_lr_multiplier
from ciders_edge.tensors import add, norm, sub
from ciders_edge.training.local_steps import local_update

DX, DY, MU = 3, 5, 0.5


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(DY, DY, generator=gen, dtype=torch.float64))
    eig = torch.linspace(0.5, 2.0, DY, dtype=torch.float64)  # mu_g = 0.5, l = 2
    hess = q @ torch.diag(eig) @ q.T
    b_mat = 0.3 * torch.randn(DY, DX, generator=gen, dtype=torch.float64)
    clients = [
        (torch.randn(DX, generator=gen, dtype=torch.float64), torch.randn(DY, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    return hess, b_mat, clients


class Inner:
    def __init__(self, hess, b_mat):
        self.hess, self.b_mat = hess, b_mat

    def loss_at(self, x, y):
        xs = {"x": x["x"].detach().clone().requires_grad_(True)}
        ys = {"y": y["y"].detach().clone().requires_grad_(True)}
        yy, xx = ys["y"], xs["x"]
        return 0.5 * yy @ self.hess @ yy - yy @ self.b_mat @ xx, xs, ys


def _y_star(hess, b_mat, x):
    return torch.linalg.solve(hess, b_mat @ x)


def _exact_hypergradient(hess, b_mat, x, a, b):
    return MU * (x - a) + b_mat.T @ torch.linalg.solve(hess, _y_star(hess, b_mat, x) - b)


@pytest.mark.parametrize("method", ["autograd", "fd"])
def test_hypergradient_error_falls_with_the_number_of_neumann_terms(method):
    hess, b_mat, clients = _problem()
    a, b = clients[0]
    x = torch.randn(DX, dtype=torch.float64)
    y = _y_star(hess, b_mat, x)
    make = autograd_second_order if method == "autograd" else fd_second_order
    second = make(Inner(hess, b_mat), {"x": x}, {"y": y})
    exact = _exact_hypergradient(hess, b_mat, x, a, b)
    errors = []
    for terms in (1, 2, 4, 8, 16, 32, 64):
        q, info = indirect_term(second, {"y": y - b}, terms, lipschitz=2.0)
        h = MU * (x - a) + q["x"]
        errors.append(float((h - exact).norm() / exact.norm()))
        assert info["neumann_terms"] == terms
    assert all(e2 < e1 for e1, e2 in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 1e-6  # (1 - mu_g / l)^N = 0.75^64
    assert errors[0] > 0.1  # one term is far off: the test can tell


def test_neumann_series_is_the_paper_sum():
    """p_N = (1/l) sum_{n<N} (I - H/l)^n b, written out with matrix powers."""
    hess, _, _ = _problem()
    b = torch.randn(DY, dtype=torch.float64)
    lipschitz, n_terms = 2.5, 6
    step = torch.eye(DY, dtype=torch.float64) - hess / lipschitz
    expected = sum(torch.linalg.matrix_power(step, n) @ b for n in range(n_terms)) / lipschitz
    got = neumann_ihgp(lambda v: {"y": hess @ v["y"]}, {"y": b}, n_terms, lipschitz)
    torch.testing.assert_close(got["y"], expected)


def test_top_eigenvalue_sets_a_safe_step():
    hess, _, _ = _problem()
    value = top_eigenvalue(lambda v: {"y": hess @ v["y"]}, {"y": torch.zeros(DY, dtype=torch.float64)}, iters=50)
    assert value == pytest.approx(2.0, rel=1e-3)


class Client:
    """f_i(., y) for the messenger-side local steps: the exact gradient, no batches."""

    def __init__(self, a, b, y):
        self.a, self.b, self.y = a, b, y

    def batch(self):
        return None

    def gradient(self, x, batch):
        d = x["x"] - self.a
        return float(0.5 * MU * d @ d + 0.5 * (self.y - self.b) @ (self.y - self.b)), {"x": MU * d}


def _solution(hess, b_mat, clients):
    """argmin F: grad F(x) = 0 is linear in x."""
    a = sum(c[0] for c in clients) / len(clients)
    b = sum(c[1] for c in clients) / len(clients)
    m = torch.linalg.solve(hess, b_mat)  # dy*/dx
    return torch.linalg.solve(MU * torch.eye(DX, dtype=torch.float64) + m.T @ m, MU * a + m.T @ b)


def _run(algorithm, rounds=100, local_steps=5, inner_steps=20):
    """The simulate loop's order, on the quadratic: probe -> h (FedNest), local steps, server step,
    then inner steps on y (the TAKD of the LLM problem). K eta = 1 / (F's Lipschitz constant)."""
    hess, b_mat, clients = _problem()
    m = torch.linalg.solve(hess, b_mat)
    eta = 1.0 / (local_steps * float(torch.linalg.eigvalsh(MU * torch.eye(DX, dtype=torch.float64) + m.T @ m)[-1]))
    strategy = get_strategy(algorithm)
    base = RoundHyperparams(local_steps=local_steps, eta=eta, optimizer="sgd", clip=0.0, warmup_steps=0, alpha=1.0)
    neumann_terms = 48
    hp = strategy.round_hyperparams(base, 0, "constant")
    x = {"x": torch.zeros(DX, dtype=torch.float64)}
    y = {"y": torch.zeros(DY, dtype=torch.float64)}
    weights = [1.0 / len(clients)] * len(clients)
    inner = Inner(hess, b_mat)
    for _ in range(rounds):
        grad_y_f = {"y": sum(w * (y["y"] - b) for w, (_, b) in zip(weights, clients, strict=True))}
        q, _ = indirect_term(autograd_second_order(inner, x, y), grad_y_f, neumann_terms, 2.0)
        h = None
        if strategy.needs_probe:  # FedNest: the global hypergradient before the local steps
            h = add({"x": sum(w * MU * (x["x"] - a) for w, (a, _) in zip(weights, clients, strict=True))}, q)
        zero = {"x": torch.zeros(DX, dtype=torch.float64)}
        deltas = [local_update(x, zero, zero, AsFlat(Client(a, b, y["y"]), x), hp, control=h).delta for a, b in clients]
        if hp.grad_y_in_packet:  # LFedNest: the cloud adds the indirect term
            deltas = [add(d, q, mean_lr_multiplier(hp)) for d in deltas]
        x, _ = strategy.server_step(x, zero, layer_means(deltas, weights, x), hp)
        for _ in range(inner_steps):  # gradient descent on g(x, .): y -> y*(x)
            y = {"y": y["y"] - 0.5 * (hess @ y["y"] - b_mat @ x["x"])}
    return x["x"], _solution(hess, b_mat, clients)


def test_both_variants_converge_to_the_bilevel_solution():
    """FedNest's svrg steps reach argmin F; LFedNest's plain local steps shrink the direct term
    by (1 - (1 - eta mu)^K) / (K eta mu) against the indirect one, so it stops near it."""
    errors = {}
    for algorithm in ("fednest", "lfednest"):
        x, x_star = _run(algorithm)
        errors[algorithm] = float((x - x_star).norm() / x_star.norm())
        early, _ = _run(algorithm, rounds=2)
        assert float((early - x_star).norm() / x_star.norm()) > 0.05  # not trivially there
    assert errors["fednest"] < 1e-4
    assert errors["lfednest"] < 0.02
    assert errors["fednest"] < errors["lfednest"]


def test_fednest_svrg_step_is_the_paper_correction():
    """h_i,nu = grad f_i(x_i,nu) - grad f_i(x) + h: with h = grad f_i(x), plain gradient descent."""
    hess, b_mat, clients = _problem()
    a, b = clients[0]
    hp = get_strategy("fednest").round_hyperparams(
        RoundHyperparams(local_steps=4, eta=0.1, optimizer="sgd", clip=0.0, warmup_steps=0), 0, "constant"
    )
    assert hp.solver == "svrg"
    x = {"x": torch.ones(DX, dtype=torch.float64)}
    zero = {"x": torch.zeros(DX, dtype=torch.float64)}
    client = Client(a, b, torch.zeros(DY, dtype=torch.float64))
    own = {"x": MU * (x["x"] - a)}
    svrg = local_update(x, zero, zero, AsFlat(client, x), hp, control=own).x_final
    plain = local_update(x, zero, zero, AsFlat(client, x), hp.replace(solver="fo")).x_final
    torch.testing.assert_close(svrg["x"], plain["x"])
    moved = add(own, {"x": torch.ones(DX, dtype=torch.float64)})
    shifted = local_update(x, zero, zero, AsFlat(client, x), hp, control=moved)
    assert norm(sub(shifted.x_final, plain)) > 0.1
    with pytest.raises(ConfigError, match="svrg solver needs the round.s control h"):
        local_update(x, zero, zero, AsFlat(client, x), hp)
