"""`--device auto|cpu|cuda` for the cloud's commands: the CPU is the bit-exact reference, a missing CUDA
device is refused before anything is written, and CUDA gives the CPU's results in meaning."""

import json

import pytest
import torch
from conftest import fast_run_config
from tiny_runs import prepare_args
from typer.testing import CliRunner

import ciders_cloud.models.bootstrap as bootstrap
from ciders_cloud import prepare
from ciders_cloud.cli import app as cloud
from ciders_cloud.models.device import CPU, autocast, cloud_device, to_cpu
from ciders_cloud.round.aggregate import aggregate_files
from ciders_cloud.run.folder import RunFolder
from ciders_cloud.run.server_state import ServerState
from ciders_edge.errors import ConfigError
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()
NO_CUDA = "--device cuda: no CUDA device here"


@pytest.fixture
def own_bootstrap_cache(tmp_path, monkeypatch):
    """Every prepare fits its own bootstrap layers: a shared cache would hand the second run the first's."""
    homes = iter(range(1000))
    monkeypatch.setattr(bootstrap, "ciders_home", lambda: tmp_path / f"home-{next(homes)}")


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as one without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _prepare_and_aggregate(demo_dir, root, device: str | None):
    """A fast tiny run prepared and aggregated once (one client's packet), ``device`` given or not."""
    kw = {} if device is None else {"device": device}
    run = fast_run_config(demo_dir, client_ids=["a"], hyperparameters={"takd_steps": 2})
    prepare(run, root / "run", **kw)
    bundle = RunFolder(root / "run").bundle("cpu-laptop", 0)
    train(bundle, demo_dir / "dates" / "train.jsonl", root / "state-a", root / "a.pkt", RoundOptions(client_id="a"))
    aggregate_files(root / "run", [root / "a.pkt"], **kw)
    return root / "run"


def _files(run_dir) -> dict:
    """Every file of a run folder by relative path, byte for byte; the state's summary less (it names paths)."""
    out = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(run_dir))
        if path.name == "state.json":
            meta = json.loads(path.read_text())
            meta.pop("last_summary")
            out[rel] = meta
        elif path.suffix != ".lock":
            out[rel] = path.read_bytes()
    return out


def _snapshot(folder) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_device_names(no_cuda):
    assert cloud_device("auto") == CPU and cloud_device("cpu") == CPU and cloud_device(CPU) == CPU
    with pytest.raises(ConfigError, match="no CUDA device here"):
        cloud_device("cuda")
    with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda, got 'tpu'"):
        cloud_device("tpu")


def test_cpu_computes_as_without_a_device():
    x = {"w": torch.arange(4.0)}
    with autocast(CPU):
        assert (x["w"] @ x["w"]).dtype == torch.float32  # no autocast on the CPU reference
    assert to_cpu(x)["w"].data_ptr() == x["w"].data_ptr()  # no copy of what is already there
    assert to_cpu(x, torch.bfloat16)["w"].dtype == torch.bfloat16


def test_device_cpu_is_bit_identical_to_no_device(demo_dir, tmp_path, own_bootstrap_cache):
    plain = _prepare_and_aggregate(demo_dir, tmp_path / "plain", None)
    cpu = _prepare_and_aggregate(demo_dir, tmp_path / "cpu", "cpu")
    a, b = _files(plain), _files(cpu)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    assert ServerState.load(RunFolder(cpu).server_state).round == 1


@pytest.mark.parametrize("command", ["prepare", "distill", "aggregate", "simulate"])
def test_device_cuda_without_cuda_is_refused_before_anything_is_written(command, demo_dir, tiny_run, tmp_path, no_cuda):
    run_dir, _ = tiny_run
    before = _snapshot(run_dir)
    out = tmp_path / "new"
    args = {
        "prepare": prepare_args(demo_dir, out),
        "distill": ["distill", "--run", str(run_dir), "--steps", "1"],
        "aggregate": ["aggregate", "--run", str(run_dir), "--packets", str(tmp_path / "a.pkt")],
        "simulate": ["simulate", "--out", str(out), "--model", "tiny", "--data", str(demo_dir / "public.jsonl")],
    }[command]
    r = runner.invoke(cloud, [*args, "--device", "cuda"])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [f"error: {NO_CUDA}"]
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert list(tmp_path.iterdir()) == [] and _snapshot(run_dir) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_in_meaning(demo_dir, tmp_path, own_bootstrap_cache):
    cpu = _prepare_and_aggregate(demo_dir, tmp_path / "cpu", "cpu")
    gpu = _prepare_and_aggregate(demo_dir, tmp_path / "gpu", "cuda")
    assert RunFolder(gpu).config.read_bytes() == RunFolder(cpu).config.read_bytes()  # the device is not the run
    s_cpu, s_gpu = (ServerState.load(RunFolder(r).server_state) for r in (cpu, gpu))
    assert s_gpu.round == s_cpu.round == 1 and s_gpu.takd_step == s_cpu.takd_step
    for part in ("messenger", "backbone", "consensus", "optimizer"):
        a, b = getattr(s_cpu, part), getattr(s_gpu, part)
        assert a.keys() == b.keys(), part
        for k in a:
            assert b[k].device.type == "cpu" and b[k].dtype == a[k].dtype, (part, k)
            assert torch.isfinite(b[k]).all(), (part, k)
        if part != "optimizer":  # Adam's moments of near-zero gradients are all rounding
            diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
            size = sum(float(a[k].norm() ** 2) for k in a) ** 0.5
            assert diff <= 0.1 * size + 1e-6, (part, diff, size)
    f_cpu, f_gpu = s_cpu.last_summary["fidelity"], s_gpu.last_summary["fidelity"]
    assert f_gpu["nll_emu"] == pytest.approx(f_cpu["nll_emu"], rel=0.02)
    assert f_gpu["nll_full"] == pytest.approx(f_cpu["nll_full"], rel=0.02)
    assert f_gpu["tokens"] == f_cpu["tokens"]
