import pytest

from ciders_cloud.study.partition import parse_partition, partition
from ciders_edge.errors import ConfigError


def _records(n_per_label=20, labels=("a", "b", "c", "d")):
    return [{"category": lab, "i": i} for lab in labels for i in range(n_per_label)]


def test_iid_covers_everything_once():
    recs = _records()
    parts = partition(recs, 3, "iid", seed=1)
    assert sorted(r["i"] + 100 * "abcd".index(r["category"]) for p in parts for r in p) == list(range(20)) + [
        x + 100 * k for k in range(1, 4) for x in range(20)
    ]
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_by_field_gives_one_value_per_client():
    parts = partition(_records(), 4, "by-field:category")
    assert [{r["category"] for r in p} for p in parts] == [{"a"}, {"b"}, {"c"}, {"d"}]
    with pytest.raises(ConfigError, match="4 distinct values for 5 clients"):
        partition(_records(), 5, "by-field:category")


def test_dirichlet_skew_grows_as_alpha_shrinks():
    recs = _records(200)

    def skew(alpha):
        parts = partition(recs, 4, f"dirichlet:{alpha}:category", seed=0)
        assert sum(len(p) for p in parts) == len(recs) and all(parts)
        shares = [max(sum(r["category"] == lab for r in p) for lab in "abcd") / len(p) for p in parts]
        return sum(shares) / len(shares)

    assert skew(0.1) > skew(100.0) + 0.2
    assert partition(recs, 4, "dirichlet:0.4:category", seed=3) == partition(recs, 4, "dirichlet:0.4:category", seed=3)


@pytest.mark.parametrize("spec", ["dirichlet", "dirichlet:-1", "dirichlet:x", "zipf", "by-field"])
def test_bad_specs(spec):
    with pytest.raises(ConfigError):
        parse_partition(spec)
