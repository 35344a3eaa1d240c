"""The cloud's last check before eq. (12): a reconstructed displacement that is not finite, or whose norm is
over MAX_DELTA_RATIO times the round's scale, is refused with its reason; computed here by hand."""

from types import SimpleNamespace

import torch

from ciders_cloud.round.intake import MAX_DELTA_RATIO, check_displacements


def received(*clients: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(where=f"{c}.pkt", packet=SimpleNamespace(client_id=c)) for c in clients]


def state(v_norm: float = 1.0, last: dict | None = None) -> SimpleNamespace:
    summary = {"delta_norms": last} if last is not None else None
    return SimpleNamespace(messenger={"w": torch.tensor([v_norm, 0.0])}, last_summary=summary, round=4)


def delta(n: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([0.6 * n, 0.8 * n])}  # norm n


def test_with_fewer_than_three_displacements_the_scale_is_the_norm_of_v():
    assert MAX_DELTA_RATIO == 20.0
    bad = check_displacements(received("a", "b"), [delta(19.0), delta(21.0)], state(v_norm=1.0))
    assert list(bad) == [1]
    assert "b.pkt: client 'b'" in bad[1] and "over 20x |v| (1.000e+00) in round 4; refused as an outlier" in bad[1]


def test_with_three_or_more_the_scale_is_the_median_of_this_and_the_last_round():
    # this round 1, 2, 100 and last round 3: median of (1, 2, 100, 3) = 2.5 -> the bound is 50
    bad = check_displacements(
        received("a", "b", "c"), [delta(1.0), delta(2.0), delta(100.0)], state(v_norm=1e6, last={"x": 3.0})
    )
    assert list(bad) == [2] and "the median displacement (2.500e+00)" in bad[2]
    under = [delta(1.0), delta(2.0), delta(49.0)]  # median 2.5 again: 49 is under the bound
    assert check_displacements(received("a", "b", "c"), under, state(v_norm=1e6, last={"x": 3.0})) == {}


def test_a_displacement_that_is_not_finite_is_refused_and_left_out_of_the_scale():
    nan = {"w": torch.tensor([float("nan"), 0.0])}
    bad = check_displacements(received("a", "b", "c", "d"), [delta(1.0), delta(1.0), nan, delta(30.0)], state())
    assert bad[2] == "c.pkt: client 'c''s reconstructed displacement is not finite"
    assert "over 20x the median displacement (1.000e+00)" in bad[3] and set(bad) == {2, 3}  # median of 1, 1, 30


def test_non_finite_names_the_first_bad_tensor_nested_or_not():
    """The one finiteness check behind a packet's, an update's and the server state's refusals."""
    from ciders_edge.tensors import non_finite

    ok, bad = torch.zeros(2), torch.tensor([0.0, float("inf")])
    assert non_finite({"a": ok, "b": {"c": ok}}) is None
    assert non_finite({"a": ok, "b": bad}) == "b"
    assert non_finite({"v": {"a": ok}, "c": {"x": ok, "y": torch.tensor([float("nan")])}}) == "c y"
