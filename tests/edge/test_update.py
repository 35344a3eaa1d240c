"""The edge update (docs/design.md §3) on quadratic losses, where the paper's statements are exact."""

import pytest
import torch
from flat_objective import AsFlat

from ciders_cloud.strategies.aggregation import aggregate, participation_weights, reconstruct_displacement
from ciders_cloud.study.diagnostics import decompose, psi
from ciders_edge.formats.packet import Packet
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.schedule import warmup_cosine
from ciders_edge.tensors import add
from ciders_edge.training.equations import consensus_update, delta_c, displacement, trajectory_gradient
from ciders_edge.training.local_steps import local_update

torch.set_default_dtype(torch.float32)


class Quadratic:
    """L_i(x) = 0.5 * (x - b_i)^T A (x - b_i), one batch for all steps."""

    def __init__(self, b: dict, a: torch.Tensor | None = None) -> None:
        self.b, self.a = b, a

    def batch(self):
        return None

    def gradient(self, x, batch):
        r = {k: x[k] - self.b[k] for k in x}
        g = {k: (self.a @ r[k].flatten()).view_as(r[k]) if self.a is not None else r[k] for k in r}
        return float(0.5 * sum((r[k].flatten() @ g[k].flatten()) for k in r)), g


def _hp(**kw):
    base = dict(
        local_steps=1,
        eta=0.1,
        eta_in=0.05,
        optimizer="sgd",
        weight_decay=0.0,
        clip=0.0,
        warmup_steps=0,
        eps_prox=0.0,
        gamma=0.3,
        alpha=0.2,
        tau=1.0,
    )
    return RoundHyperparams(**{**base, **kw})


def test_prop2_dr_and_ppr_follow_psi_t():
    """Prop. 2: K=1, eps_prox=0, full participation, cold start: u_i^t = psi_t g_i + (1 - psi_t) G."""
    torch.manual_seed(0)
    n, dim = 4, 6
    hp = _hp()
    clients = [Quadratic({"w": torch.randn(dim, dtype=torch.float64)}) for _ in range(n)]
    v = {"w": torch.randn(dim, dtype=torch.float64)}
    c = {"w": torch.zeros(dim, dtype=torch.float64)}
    c_i = [dict(c) for _ in range(n)]
    for t in range(6):
        psi_t = psi(t, hp.gamma, hp.alpha)
        assert psi_t == pytest.approx((1 - hp.gamma) + hp.gamma * (1 - hp.alpha) ** t, abs=1e-15)
        # each client's FO direction at the look-ahead point from x_0 = v
        g = [q.gradient(add(v, q.gradient(v, None)[1], -hp.eta_in), None)[1]["w"] for q in clients]
        g_mean = sum(g) / n
        results = [local_update(v, c, c_i[i], AsFlat(clients[i], v), hp) for i in range(n)]
        deltas = []
        for i, r in enumerate(results):
            u = r.delta["w"]  # K=1, SGD: Delta_i is exactly the reference direction u_i^t
            ppr, dr = decompose(u.double(), g[i].double(), g_mean.double())
            assert ppr == pytest.approx(psi_t, abs=1e-6) and dr == pytest.approx(1 - psi_t, abs=1e-6)
            deltas.append(reconstruct_displacement(r.dc, c_i[i], c, hp.alpha, hp.gamma))
            c_i[i] = add(c_i[i], r.dc)
        v, c = aggregate(v, c, deltas, participation_weights([1] * n), hp.tau, hp.local_steps, hp.eta, hp.alpha)


def test_update_formulas_by_hand():
    x, v = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 0.0])}
    c, c_i, g = {"w": torch.tensor([0.2, -0.2])}, {"w": torch.tensor([0.1, 0.1])}, {"w": torch.tensor([3.0, 4.0])}
    gt = trajectory_gradient(g, x, v, c, c_i, gamma=0.5, eps_prox=0.1)["w"]
    assert torch.allclose(gt, torch.tensor([3.0 + 0.05 + 0.05, 4.0 - 0.15 + 0.2]))
    d = displacement(v, x, local_steps=2, eta=0.25)["w"]
    assert torch.allclose(d, torch.tensor([-1.0, -4.0]))
    new = consensus_update(c_i, {"w": d}, c, alpha=0.1, gamma=0.5)["w"]
    assert torch.allclose(new, 0.95 * c_i["w"] + 0.1 * d - 0.05 * c["w"])
    back = reconstruct_displacement(delta_c({"w": new}, c_i), c_i, c, alpha=0.1, gamma=0.5)["w"]
    assert torch.allclose(back, d, atol=1e-6)


def test_aggregate_weights_and_tau():
    v, c = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    d1, d2 = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 2.0])}
    p = participation_weights([30, 10])
    assert p == [0.75, 0.25]
    v2, c2 = aggregate(v, c, [d1, d2], p, tau=1.0, local_steps=4, eta=0.5, alpha=0.5)
    assert torch.allclose(v2["w"], -2.0 * torch.tensor([0.75, 0.5]))
    assert torch.allclose(c2["w"], 0.5 + 0.5 * torch.tensor([0.75, 0.5]))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_reconstruction_and_consensus_copies_over_five_rounds(codec):
    """Client and server copies of c_i stay bit-identical; eq. (11) on the decoded packet gives the
    displacement the client committed (bit-exact), which for fp32 equals its raw Delta_i to rounding."""
    torch.manual_seed(1)
    hp = _hp(local_steps=3, optimizer="adamw", eta=0.05, eps_prox=0.01)
    client = Quadratic({"w": torch.randn(5, 3)}, a=torch.eye(15) * 2.0)
    v, c = {"w": torch.randn(5, 3)}, {"w": torch.zeros(5, 3)}
    client_ci = server_ci = {"w": torch.zeros(5, 3)}
    for t in range(5):
        r = local_update(v, c, client_ci, AsFlat(client, v), hp)
        wire = Packet("c0", t, "b" * 64, codec, 10, r.dc).to_bytes()
        sent = Packet.from_bytes(wire).tensors
        client_view = reconstruct_displacement(sent, client_ci, c, hp.alpha, hp.gamma)
        client_ci = add(client_ci, sent)
        server_pkt = Packet.from_bytes(wire)  # the cloud's own decode
        delta = reconstruct_displacement(server_pkt.tensors, server_ci, c, hp.alpha, hp.gamma)
        server_ci = add(server_ci, server_pkt.tensors)
        assert torch.equal(client_ci["w"], server_ci["w"])
        assert torch.equal(delta["w"], client_view["w"])
        if codec == "fp32":
            assert torch.equal(server_pkt.tensors["w"], r.dc["w"])  # lossless on the wire
            assert torch.allclose(delta["w"], r.delta["w"], rtol=1e-4, atol=1e-5)
        v, c = aggregate(v, c, [delta], [1.0], hp.tau, hp.local_steps, hp.eta, hp.alpha)


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 0) == 1.0
    assert warmup_cosine(0, 10, 1) == 0.5
    assert warmup_cosine(1, 10, 1) == 1.0
    assert warmup_cosine(10, 10, 1) == pytest.approx(0.0)


def test_proximal_term_pulls_towards_v():
    """With a flat loss, only eps_prox moves x, and it moves it back towards v."""

    class Flat:
        def batch(self):
            return None

        def gradient(self, x, batch):
            return 0.0, {k: torch.zeros_like(t) for k, t in x.items()}

    v = {"w": torch.zeros(3)}
    c, c_i = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    r = local_update(v, c, c_i, AsFlat(Flat(), v), _hp(local_steps=5, gamma=0.5, eps_prox=0.5, eta_in=0.0))
    # gamma (c - c_i) pushes x negative, eps_prox (x - v) pulls it back: |x| < 5 * eta * gamma
    assert (r.x_final["w"] < 0).all() and (r.x_final["w"] > -5 * 0.1 * 0.5).all()
