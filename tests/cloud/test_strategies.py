"""Each strategy's round, on tensors small enough to compute by hand: what it ships to edges, what its
server step makes of the displacements (eq. 12), and how much TAKD follows (eq. 13)."""

import pytest
import torch

from ciders_cloud.preparation import prepare
from ciders_cloud.round.bundles import bundle_takd_loss
from ciders_cloud.run.algorithms import ALGORITHMS
from ciders_cloud.run.config import RunConfig
from ciders_cloud.strategies import STRATEGIES, Strategy, check_run, get_strategy
from ciders_cloud.strategies.aggregation import layer_means
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.training.equations import consensus_update, displacement, trajectory_gradient

HP = RoundHyperparams(local_steps=2, eta=0.5, tau=0.1, alpha=0.2, gamma=0.05, eps_prox=0.0, takd_steps=3)


def t(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float64)}


def step(name: str, v, c, deltas, weights):
    s = get_strategy(name)
    return s.server_step(v, c, layer_means(deltas, weights, v), s.round_hyperparams(HP, 1, "constant"))


def test_ciders_moves_v_by_tau_k_eta_and_c_by_alpha():
    # p = (0.25, 0.75); sum p Delta = 0.25 * (4, 0) + 0.75 * (0, 8) = (1, 6)
    v, c = step("ciders-fo", t(1.0, 1.0), t(2.0, 0.0), [t(4.0, 0.0), t(0.0, 8.0)], [0.25, 0.75])
    assert torch.allclose(v["w"], torch.tensor([1.0 - 0.1 * 1, 1.0 - 0.1 * 6], dtype=torch.float64))  # tau K eta = 0.1
    assert torch.allclose(c["w"], torch.tensor([0.8 * 2 + 0.2 * 1, 0.2 * 6], dtype=torch.float64))
    fd = step("ciders-fd", t(1.0, 1.0), t(2.0, 0.0), [t(4.0, 0.0), t(0.0, 8.0)], [0.25, 0.75])
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(fd, (v, c), strict=True))  # FD differs on the edge only


def test_fedavg_averages_the_clients_models():
    """tau = 1: v becomes the weighted mean of the clients' x_K, whatever K and eta are."""
    v0 = t(0.0, 0.0)
    x = [t(1.0, 2.0), t(3.0, 6.0)]
    hp = get_strategy("fedavg").round_hyperparams(HP, 1, "constant")
    deltas = [displacement(v0, xk, hp.local_steps, hp.eta) for xk in x]
    v, _ = step("fedavg", v0, t(0.0, 0.0), deltas, [0.5, 0.5])
    assert torch.allclose(v["w"], torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert (hp.tau, hp.gamma, hp.eta_in, hp.eps_prox) == (1.0, 0.0, 0.0, 0.0)


def test_scaffold_is_ciders_with_gamma_and_alpha_one():
    """Option II control variates: the edge follows g - c_i + c, then c_i <- c_i - c + Delta_i; with full
    participation the server's c becomes mean Delta_i (Karimireddy et al., eq. 4-5)."""
    hp = get_strategy("scaffold").round_hyperparams(HP, 1, "constant")
    g, c, c_i, x, v = t(1.0, -2.0), t(0.5, 0.5), t(0.25, 1.0), t(3.0, 3.0), t(3.0, 3.0)
    assert torch.equal(trajectory_gradient(g, x, v, c, c_i, hp.gamma, hp.eps_prox)["w"], (g["w"] - c_i["w"] + c["w"]))
    delta = t(2.0, 4.0)
    assert torch.equal(consensus_update(c_i, delta, c, hp.alpha, hp.gamma)["w"], c_i["w"] - c["w"] + delta["w"])
    _, c_new = step("scaffold", v, c, [t(2.0, 4.0), t(0.0, 2.0)], [0.5, 0.5])
    assert torch.equal(c_new["w"], torch.tensor([1.0, 3.0], dtype=torch.float64))


def test_localot_aggregates_nothing_and_edges_continue_their_own_messenger():
    v, c = t(1.0, 2.0), t(0.5, 0.5)
    got_v, got_c = step("localot", v, c, [t(9.0, 9.0)], [1.0])
    assert got_v is v and got_c is c
    assert get_strategy("localot").round_hyperparams(HP, 1, "constant").start_from == "personalized"


@pytest.mark.parametrize(
    ("name", "shipped", "takd"),
    [
        ("ciders-fo", {"solver": "fo", "gamma": 0.05, "tau": 0.1}, (3, 1.0)),
        ("ciders-fd", {"solver": "fd", "gamma": 0.05}, (3, 1.0)),
        ("fedavg", {"solver": "fo", "gamma": 0.0, "tau": 1.0}, (0, 1.0)),
        ("scaffold", {"gamma": 1.0, "alpha": 1.0, "eta_in": 0.0}, (0, 1.0)),
        ("fedot", {"gamma": 0.0, "tau": 1.0}, (0, 1.0)),
        ("fedbiot", {"eps_prox": 0.01, "tau": 1.0}, (3, 0.0)),  # MSE + KL re-alignment, no task CE
        ("localot", {"start_from": "personalized"}, (0, 1.0)),
        ("fednest", {"solver": "svrg", "tau": 1.0, "bilevel": {"probe_batches": 4}}, (3, 1.0)),
        ("lfednest", {"solver": "fo", "bilevel": {"probe_batches": 4, "grad_y_in_packet": True}}, (3, 1.0)),
    ],
)
def test_what_each_strategy_ships_and_distils(name, shipped, takd):
    s = get_strategy(name)
    hp = s.round_hyperparams(HP, 1, "constant")
    assert {k: getattr(hp, k) for k in shipped} == shipped
    assert s.takd(hp.replace(takd_lambda_task=1.0)) == takd  # the paper's task CE, where a strategy keeps it
    assert s.needs_probe == (name == "fednest")
    assert ("bilevel" in hp.to_dict()) == name.endswith("fednest")  # no other bundle names FedNest's ask
    written = s.round_hyperparams(HP.replace(bilevel={"grad_y_in_packet": True}), 1, "constant")
    assert written.bilevel == hp.bilevel  # a hand-written ask reaches no bundle: the strategy decides it


def test_a_round_sets_its_takd_task_ce_weight_and_every_bundle_names_it():
    paper = HP.replace(takd_lambda_task=1.0)  # eq. (2) as written, in every round (the `paper` preset)
    assert HP.takd_lambda_task == 0.0 and HP.to_dict()["takd_lambda_task"] == 0.0  # the default: no task CE
    assert get_strategy("ciders-fo").takd(HP) == (3, 0.0) and get_strategy("fednest").takd(paper) == (3, 1.0)
    assert get_strategy("fedbiot").takd(HP.replace(takd_lambda_task=2.0)) == (3, 0.0)  # FedBiOT's is its own
    with pytest.raises(ConfigError, match="`takd_lambda_task` must be a non-negative number, got -1.0"):
        HP.replace(takd_lambda_task=-1.0)


def test_a_bundle_names_the_takd_loss_that_distilled_its_backbone():
    def task_ce(algorithm: str, round_: int, **hp) -> float:
        run = RunConfig(algorithm=algorithm, hyperparameters=HP.replace(**hp).to_dict())
        return bundle_takd_loss(run, round_).lambda_task

    assert task_ce("ciders-fo", 0) == 1.0 and task_ce("ciders-fo", 3) == 0.0  # prepare's bootstrap, then a round's
    assert task_ce("fedbiot", 0) == 1.0 and task_ce("fedbiot", 1) == 0.0  # round 0's backbone is the bootstrap's
    assert task_ce("ciders-fo", 2, takd_lambda_task=1.0) == 1.0  # the paper's (long_run.py's ciders-fo-task-ce)
    assert task_ce("fedavg", 5) == task_ce("ciders-fo", 5, takd_steps=0) == 1.0  # no TAKD ran: the bootstrap's


def test_protocol_c_schedules_gamma_and_an_unknown_name_is_refused():
    assert get_strategy("ciders-fo").round_hyperparams(HP, 0, "protocol-c").gamma == 0.9
    assert get_strategy("ciders-fo").round_hyperparams(HP, 3, "protocol-c").gamma == pytest.approx(0.9 * 0.86**2)
    assert (
        tuple(STRATEGIES)
        == ALGORITHMS
        == ("ciders-fo", "ciders-fd", "fedavg", "scaffold", "fedot", "fedbiot", "localot", "fednest", "lfednest")
    )  # the CLI's help lists the names
    with pytest.raises(ConfigError, match="unknown algorithm 'fedprox'"):
        get_strategy("fedprox")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_refuses_in_one_line_the_runs_it_cannot_serve(name):
    """The strategy owns its limits (no flag of it is read elsewhere): FedNest's family reads each client's
    own values, so no privacy and no secure sum, and its first exchange runs only in simulate; LocalOT
    releases and sums nothing."""
    private = RunConfig(algorithm=name, client_ids=["a", "b"], dp={"clip": 1.0, "noise_multiplier": 1.0})
    plain = RunConfig(algorithm=name)
    refusals = {
        "private": name in ("fednest", "lfednest", "localot"),
        "secure": name in ("fednest", "lfednest", "localot"),
        "fleet": name == "fednest",
    }
    for what, run, kwargs in (("private", private, {}), ("secure", plain, {"fleet": True, "secure": True}),
                              ("fleet", plain, {"fleet": True})):  # fmt: skip
        if refusals[what]:
            with pytest.raises(ConfigError) as err:
                check_run(run, **kwargs)
            assert name in str(err.value) and "\n" not in str(err.value)
        else:
            assert check_run(run, **kwargs) is run


def test_the_base_strategy_is_abstract_and_an_unknown_algorithm_is_refused_where_a_run_is_made(tmp_path):
    with pytest.raises(TypeError, match="abstract"):
        Strategy()
    with pytest.raises(ConfigError, match="unknown algorithm 'fedsgd'; choose one of ciders-fo"):
        prepare(RunConfig(algorithm="fedsgd"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_every_strategy_table_a_config_holds_is_a_strategys_settings():
    """A run's and a study's config hold each strategy family's table (``StrategyTables``) and pass them on
    without naming them: the tables there are exactly those the strategies read."""
    from dataclasses import fields

    from ciders_cloud.run.config import StrategyTables
    from ciders_cloud.strategies import SETTINGS_TABLES
    from ciders_cloud.study.config import SimConfig

    assert {f.name for f in fields(StrategyTables)} == set(SETTINGS_TABLES)
    assert all(SimConfig.TABLES[name] is table for name, table in SETTINGS_TABLES.items())
    run = RunConfig(fednest={"neumann_terms": 3})
    assert run.strategy_tables() == {"fednest": {"neumann_terms": 3}}
    assert get_strategy("fednest").for_run(run).settings.neumann_terms == 3
