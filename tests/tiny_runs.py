"""Tiny runs and studies that tests in several folders build: prepare's CLI arguments, a run of a given
split, a fast simulate config, a server state's bytes, where two studies' metrics differ."""

import json
import math
from pathlib import Path

from ciders_cloud import RunConfig, prepare
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.study.config import SimConfig
from ciders_edge.formats.bundle import Bundle
from ciders_edge.training.train import RoundOptions, train

FAST = dict(
    model="tiny",
    partition="per-file",
    clients=3,
    rounds=3,
    local_steps=2,
    max_records=14,
    eval_examples=2,
    eval_generate=1,
    layer_steps=5,
    align_steps=1,
    messenger_depth=2,
    drop_ratio=0.5,
    takd={"seq_len": 64, "batch_size": 2},
)


def prepare_args(demo_dir, out, *extra):
    return [
        "prepare",
        "--model",
        "tiny",
        "--profile",
        "cpu-laptop",
        "--messenger-depth",
        "2",
        "--drop-ratio",
        "0.5",
        "--public-data",
        str(demo_dir / "units" / "public.jsonl"),
        "--layer-steps",
        "5",
        "--align-steps",
        "2",
        "--seq-len",
        "96",
        "--out",
        str(out),
        *extra,
    ]


def prepare_tiny(tmp_path, demo_dir, depth, drop, profile="cpu-laptop", storage="fp32"):
    """A tiny run; fp32 storage by default, so AdapFu can be compared with the base model exactly."""
    run = RunConfig(model="tiny", profiles=[profile], messenger_depth=depth, drop_ratio=drop, layer_steps=3,
                    align_steps=1, public_data=str(demo_dir / "public.jsonl"), takd={"seq_len": 64},
                    storage=storage)  # fmt: skip
    out = tmp_path / f"run-{depth}-{drop}-{storage}"
    prepare(run, out)
    return Bundle.load(out / "bundles" / Path(profile).stem / "round-0000")


def fast_study(demo_dir, **kw):
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code")]
    hp = {"eta": 1e-2, "takd_steps": 1, **kw.pop("hyperparameters", {})}
    return SimConfig(**{**FAST, "data": data, "hyperparameters": hp, **kw})


def state_bytes(run):
    """Every tensor file byte for byte, and state.json less the summary (it names the run's path)."""
    out = {p.name: p.read_bytes() for p in sorted(RunFolder(run).server_state.iterdir()) if p.suffix == ".safetensors"}
    meta = json.loads((RunFolder(run).server_state / "state.json").read_text())
    meta.pop("last_summary")
    return {**out, "state.json": meta}


def train_once(
    bundle, data, root: Path, client_id: str, val_fraction: float = 0.0, reuse_model: bool = False, **overrides
) -> Path:
    """One round of ``client_id`` on ``data``: its state folder ``root/state`` (the packet: ``root/p.pkt``).
    Every record trains (no validation slice) unless ``val_fraction``: the fixtures' models, and what the
    export tests measured on them, stay those of every record (tests/edge/test_validation.py covers the slice)."""
    options = RoundOptions(client_id=client_id, overrides=overrides, val_fraction=val_fraction, reuse_model=reuse_model)
    train(bundle, data, root / "state", root / "p.pkt", options)
    return root / "state"


def two_clients_round0(run: RunConfig, demo_dir, root: Path) -> Path:
    """``run`` prepared at ``root/run``, and clients a (dates) and b (code) trained on its round 0: their
    packets ``root/a.pkt``, ``root/b.pkt`` and states ``root/state-a``, ``root/state-b``."""
    prepare(run, root / "run")
    bundle = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
    for cid, fam in (("a", "dates"), ("b", "code")):
        train(bundle, demo_dir / fam / "train.jsonl", root / f"state-{cid}", root / f"{cid}.pkt", RoundOptions(cid))
    return root


def moved(got, want, where: str = "") -> str | None:
    """Where ``got`` differs from ``want`` (``None``: nowhere). Numbers match to 1e-12 relative: the float64
    diagnostics (S-DR, E-RAE) move in the 16th digit with their tensors' memory alignment, which depends on
    what ran before in the process; a change of behaviour moves them far more. NaN matches NaN."""
    if isinstance(got, float) or isinstance(want, float):
        same = (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300)
        return (
            None
            if isinstance(got, int | float) and isinstance(want, int | float) and same
            else f"{where}: {got} != {want}"
        )
    if isinstance(got, dict) and isinstance(want, dict):
        if got.keys() != want.keys():
            return f"{where}: keys {sorted(got)} != {sorted(want)}"
        return next((m for k in got if (m := moved(got[k], want[k], f"{where}.{k}"))), None)
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return f"{where}: {len(got)} items != {len(want)}"
        return next(
            (m for i, (g, w) in enumerate(zip(got, want, strict=True)) if (m := moved(g, w, f"{where}[{i}]"))), None
        )
    return None if got == want else f"{where}: {got!r} != {want!r}"
