"""Shared fixtures: the `tiny` model, demo data, and one prepared tiny run (built once per session)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CIDERS_EXPORTS"] = tempfile.mkdtemp(prefix="ciders-exports-")  # infer's default exports: not the user's
atexit.register(shutil.rmtree, os.environ["CIDERS_EXPORTS"], True)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: one thread per worker (and its subprocesses), or the
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers' thread pools fight for the cores and each runs slower

import pytest  # noqa: E402

from ciders_edge.cli_utils import quiet_libraries  # noqa: E402

quiet_libraries()

# Files whose tests mostly wait on processes (a fleet's rounds, llama.cpp, bench's fresh processes): run
# first, so that with `pytest -n` (make test) their waits overlap the CPU-bound files instead of trailing.
FIRST = (
    "test_fleet_recovery.py",
    "test_fleet.py",
    "test_gguf_export.py",
    "test_fleet_security.py",
    "test_cli_tables.py",
    "test_export.py",
    "test_families.py",  # CPU-bound, but the longest file: started last, it would trail the rest
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_path():
    from ciders_edge.model.sources import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    from ciders_edge.model.sources import load_model

    return load_model(tiny_path)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from ciders_edge.model.sources import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from ciders_edge.data.demo import write_demo_data

    out = tmp_path_factory.mktemp("demo")
    write_demo_data(out, n_train=40, n_public=24, n_eval=8)
    return out


def fast_run_config(demo_dir, **overrides):
    """A tiny run that prepares in seconds: messenger depth 2, drop ratio 0.5, one TAKD step."""
    from ciders_cloud import RunConfig

    hp = {"takd_steps": 1, "local_steps": 2, "eta": 1e-2, **overrides.pop("hyperparameters", {})}
    return RunConfig(
        **{
            "model": "tiny",
            "messenger_depth": 2,
            "drop_ratio": 0.5,
            "public_data": str(demo_dir / "public.jsonl"),
            "layer_steps": 2,
            "align_steps": 1,
            "takd": {"seq_len": 64, "batch_size": 2},
            "hyperparameters": hp,
            **overrides,
        }
    )


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, demo_dir):
    """A prepared run on `tiny`: 8 layers, messenger depth 2, drop ratio 0.5 -> kept [0, 2, 5]; frozen weights
    stored in fp32, so tests can compare the edge's models with the cloud's exactly (int8 is tested apart)."""
    from ciders_cloud import RunConfig, prepare

    out = tmp_path_factory.mktemp("runs") / "tiny"
    run = RunConfig(
        model="tiny",
        profiles=["cpu-laptop"],
        messenger_depth=2,
        drop_ratio=0.5,
        public_data=str(demo_dir / "arithmetic" / "public.jsonl"),
        layer_steps=20,
        align_steps=3,
        takd={"lr": 3e-3, "batch_size": 4, "seq_len": 128},
        storage="fp32",
    )
    summary = prepare(run, out)
    return out, summary


@pytest.fixture(scope="session")
def quantized_bundles(tmp_path_factory, demo_dir):
    """Round-0 bundles of a tiny run with frozen weights stored int8 and int4 (``{"int8": path, ...}``),
    for tests that tamper with quantized weights: copy one before changing it."""
    from ciders_cloud import prepare

    out = {}
    for storage in ("int8", "int4"):
        root = tmp_path_factory.mktemp(f"q-{storage}")
        prepare(fast_run_config(demo_dir, storage=storage), root / "run")
        out[storage] = root / "run" / "bundles" / "cpu-laptop" / "round-0000"
    return out


@pytest.fixture(scope="module")
def trained(tiny_run, demo_dir, tmp_path_factory):
    """A bundle and a client state that trained one round on it (the export tests' personalized model)."""
    from tiny_runs import train_once

    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    return bundle, train_once(
        bundle, demo_dir / "units" / "train.jsonl", tmp_path_factory.mktemp("edge"), "e1", local_steps=3
    )


@pytest.fixture
def fleet_factory(tmp_path):
    """``make(cfg) -> (Fleet, client ids)``: a prepared study served on loopback (tests/fleet_harness.py),
    its edges registered; every process it started is killed at the end of the test."""
    from fleet_harness import Fleet

    from ciders_cloud.study.simulate import prepare_study

    fleets = []

    def make(cfg):
        run_dir, ids, _ = prepare_study(cfg, tmp_path / "fleet")
        fleet = Fleet(run_dir, tmp_path / "edges")
        (tmp_path / "edges").mkdir()
        for cid in ids:
            fleet.register(cid)
        fleets.append(fleet)
        return fleet, ids

    yield make
    for f in fleets:
        f.close()


@pytest.fixture
def one_thread():
    """Bit-for-bit figures need one reduction order: xdist's workers already run one thread; serial runs too
    (and Ray's actors, which hold one CPU each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
