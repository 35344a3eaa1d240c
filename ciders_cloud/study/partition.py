"""Split records over simulated clients: IID, Dirichlet label skew, one field value per client, or per file."""

from __future__ import annotations

import random

import numpy as np

from ciders_edge.errors import ConfigError

__all__ = ["partition", "parse_partition"]


def parse_partition(spec: str) -> tuple[str, dict]:
    """``iid`` | ``dirichlet:ALPHA[:FIELD]`` | ``by-field:FIELD`` | ``per-file``."""
    kind, _, rest = spec.partition(":")
    if kind in ("iid", "per-file") and not rest:
        return kind, {}
    if kind == "dirichlet":
        alpha, _, fld = rest.partition(":")
        try:
            a = float(alpha)
        except ValueError:
            a = -1.0
        if a <= 0:
            raise ConfigError(f"partition {spec!r}: Dirichlet alpha must be a positive number")
        return kind, {"alpha": a, "field": fld or "category"}
    if kind == "by-field" and rest:
        return kind, {"field": rest}
    raise ConfigError(f"unknown partition {spec!r}; use iid, dirichlet:ALPHA[:FIELD], by-field:FIELD or per-file")


def partition(records: list[dict], n_clients: int, spec: str, seed: int = 0) -> list[list[dict]]:
    """Assign every record to one of ``n_clients`` clients; every client gets at least one record."""
    kind, opts = parse_partition(spec)
    rng = random.Random(seed)
    if kind == "iid":
        order = list(range(len(records)))
        rng.shuffle(order)
        parts = [[records[i] for i in order[c::n_clients]] for c in range(n_clients)]
    elif kind == "by-field":
        values = sorted({str(r.get(opts["field"])) for r in records})
        if len(values) < n_clients:
            raise ConfigError(f"by-field:{opts['field']}: {len(values)} distinct values for {n_clients} clients")
        parts = [[r for r in records if str(r.get(opts["field"])) == v] for v in values[:n_clients]]
    elif kind == "dirichlet":
        parts = _dirichlet(records, n_clients, opts["alpha"], opts["field"], seed)
    else:
        raise ConfigError("per-file partition needs one --data file per client")
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise ConfigError(f"partition {spec!r} left client {empty[0]} without data; use fewer clients or more data")
    return parts


def _dirichlet(records: list[dict], n: int, alpha: float, fld: str, seed: int) -> list[list[dict]]:
    """Label-skew LDA: for each label, its records are split over clients by proportions ~ Dir(alpha)."""
    gen = np.random.default_rng(seed)
    by_label: dict[str, list[dict]] = {}
    for r in records:
        if fld not in r:
            raise ConfigError(f"dirichlet partition: record {r.get('_where', '?')} has no field {fld!r}")
        by_label.setdefault(str(r[fld]), []).append(r)
    parts: list[list[dict]] = [[] for _ in range(n)]
    for label in sorted(by_label):
        group = by_label[label]
        gen.shuffle(group)
        cuts = (np.cumsum(gen.dirichlet([alpha] * n)) * len(group)).astype(int)[:-1]
        for c, chunk in enumerate(np.split(np.array(group, dtype=object), cuts)):
            parts[c].extend(chunk.tolist())
    for c in range(n):  # a client Dir() left empty borrows one record from the largest
        if not parts[c]:
            donor = max(range(n), key=lambda i: len(parts[i]))
            parts[c].append(parts[donor].pop())
    return parts
