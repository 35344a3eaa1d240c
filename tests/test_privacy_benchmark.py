"""benchmarks/privacy.py's trend: the population at which differential privacy's cost in matched NLL would
fall to 0.1 nats, read from the runs' own losses against their noise (issue 61)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import privacy  # noqa: E402


def _rows(*finite: tuple[float, float, float]) -> dict:
    """ε = ∞ at matched NLL 2.0, and (ε, noise std on the mean, matched NLL) for each finite ε."""
    rows = {("ciders-fo", math.inf, 1.0): {"matched_nll": 2.0, "noise_std_of_mean": None}}
    for eps, sigma, nll in finite:
        rows["ciders-fo", eps, 1.0] = {"matched_nll": nll, "noise_std_of_mean": sigma}
    return rows


def test_the_population_follows_the_measured_power_law():
    """Losses 0.4 at sigma 1 and 1.6 at sigma 2: loss ~ sigma^2, so 0.1 nats at sigma 0.5, which 1,000
    clients reach at 2x (ε = 8) and 4x (ε = 2) as many, the noise std on the mean falling as 1/N."""
    need = privacy.population_needed(_rows((8.0, 1.0, 2.4), (2.0, 2.0, 3.6)), 1000)["ciders-fo"]
    assert need["k"] == pytest.approx(2.0) and need["sigma_star"] == pytest.approx(0.5)
    assert need["clients"] == pytest.approx({"8": 2000.0, "2": 4000.0})
    note = privacy.needed_note({"ciders-fo": need}, 1000)
    assert "ε = 8: 2,000, ε = 2: 4,000 (loss ~ noise std^2.00)" in note


def test_an_epsilon_within_the_tolerance_is_met_and_no_trend_is_said_so():
    need = privacy.population_needed(_rows((8.0, 1.0, 2.05), (2.0, 2.0, 2.8)), 1000)["ciders-fo"]
    assert need["clients"]["8"] == 1000.0 and need["clients"]["2"] > 1000
    flat = privacy.population_needed(_rows((8.0, 1.0, 2.5), (2.0, 2.0, 2.4)), 1000)["ciders-fo"]
    assert flat["k"] is None and flat["clients"] == {"8": None, "2": None}
    assert "ε = 8: no trend" in privacy.needed_note({"ciders-fo": flat}, 1000)
    one = privacy.population_needed(_rows((2.0, 2.0, 3.0)), 1000)["ciders-fo"]
    assert one["k"] is None and one["clients"] == {"2": None}


def test_the_gpu_route_runs_the_study_as_the_cpu_did_with_its_clients_on_the_gpu():
    """``gpu.py --privacy`` hands privacy.py these flags: each must be one privacy.py takes, with the CPU run's
    population and messenger (RESULTS.md), the cloud on CUDA and a quarter GPU a client."""
    import gpu

    args = privacy.parser().parse_args(gpu.PRIVACY)
    assert (args.clients, args.participation, args.records, args.messenger_depth) == (1000, 0.1, 3, 2)
    assert (args.device, args.profile, args.engine, args.gpus_per_client) == ("cuda", "cuda-24gb", "flower", 0.25)
