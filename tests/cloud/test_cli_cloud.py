"""The CLIs through their real entry points: JSON summaries, one-line errors, nothing left behind."""

import json
import os
import subprocess
import sys

import pytest
from tiny_runs import prepare_args
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_edge.cli import app as edge
from ciders_edge.formats.bundle import Bundle

runner = CliRunner()


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_prepare_then_distill(demo_dir, tmp_path):
    out = tmp_path / "run"
    s = _json(runner.invoke(cloud, [*prepare_args(demo_dir, out), "--json"]))
    assert s["kept_layers"] == [0, 2, 5] and s["takd_steps"] == 2
    bundle = Bundle.load(s["bundles"]["cpu-laptop"])
    d = _json(runner.invoke(cloud, ["distill", "--run", str(out), "--steps", "3", "--json"]))
    assert d["takd_steps"] == 3
    log = [json.loads(line) for line in (out / "distill.jsonl").read_text().splitlines()]
    layer = [r for r in log if r["type"] == "layer"]
    takd = [r for r in log if r["type"] in ("align", "takd")]
    fidelity = [r for r in log if r["type"] == "fidelity"]
    assert len(layer) == 5 and [r["step"] for r in takd] == [1, 2, 1, 2, 3]  # bootstrap, then distill's LoRA
    assert {"hidden", "kl", "ce", "loss"} <= set(takd[0])
    assert [r["takd_step"] for r in fidelity] == [0, 3] and d["fidelity"]["nll_ratio"] == fidelity[-1]["nll_ratio"]
    assert s["fidelity"]["records"] == Bundle.load(s["bundles"]["cpu-laptop"]).manifest["fidelity"]["records"] > 0
    after = Bundle.load(d["bundles"]["cpu-laptop"])
    assert after.manifest["takd_step"] == 3
    assert after.manifest["fidelity"] == {
        k: v for k, v in fidelity[-1].items() if k not in ("type", "round", "takd_step")
    }
    assert (
        after.manifest["files"]["backbone_adapter/adapter_model.safetensors"]
        != bundle.manifest["files"]["backbone_adapter/adapter_model.safetensors"]
    )
    # frozen base weights are not rewritten: the same inode is reused
    assert (after.path / "backbone.safetensors").stat().st_nlink >= 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--messenger-depth", "8"], "messenger depth must be in 1..7"),
        (["--drop-ratio", "1"], "`drop_ratio` must be in [0, 1)"),
        (["--profile", "nope"], "unknown profile 'nope'"),
    ],
)
def test_prepare_bad_input_is_one_line(demo_dir, tmp_path, extra, message):
    out = tmp_path / "run"
    args = prepare_args(demo_dir, out)
    # replace earlier occurrences of the same flag
    for i in range(0, len(extra), 2):
        j = args.index(extra[i])
        args[j + 1] = extra[i + 1]
    result = runner.invoke(cloud, args)
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output
    assert not out.exists()


def test_prepare_refuses_a_model_that_does_not_fit(demo_dir, tmp_path):
    small = tmp_path / "small.toml"
    small.write_text('name = "small"\nmemory_budget_gb = 0.001\nmessenger_depth = 2\ndrop_ratio = 0.5\n')
    out = tmp_path / "run"
    args = prepare_args(demo_dir, out)
    args[args.index("cpu-laptop")] = str(small)
    result = runner.invoke(cloud, args)
    assert result.exit_code == 1
    assert "does not fit profile small: needs" in result.stderr and "budget" in result.stderr
    assert not out.exists()


def test_prepare_refuses_an_existing_run(tiny_run):
    result = runner.invoke(cloud, ["prepare", "--model", "tiny", "--public-data", "x.jsonl", "--out", str(tiny_run[0])])
    assert result.exit_code == 1 and "already exists" in result.stderr


def test_a_second_prepare_of_the_same_out_is_one_line_at_once(demo_dir, tmp_path):
    """The loser of two `prepare --out R` used to bootstrap in full, then fail with `OSError [Errno 39]`."""
    from ciders_cloud.run.lock import claim_new_run

    out = tmp_path / "run"
    with claim_new_run(out):  # the first prepare, still bootstrapping
        r = runner.invoke(cloud, prepare_args(demo_dir, out))
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
        assert (
            r.stderr.strip() == f"error: {out} is being written by another prepare; wait for it or choose another --out"
        )
        assert out.is_dir() and not any(out.iterdir())  # the first one's claim is left alone


def test_bad_public_data_names_the_line(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n{broken\n')
    result = runner.invoke(
        cloud,
        [
            "prepare",
            "--model",
            "tiny",
            "--messenger-depth",
            "2",
            "--drop-ratio",
            "0.5",
            "--public-data",
            str(data),
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code == 1 and "p.jsonl:2: bad JSON" in result.stderr


def test_edge_profiles_and_verify(tiny_run):
    listed = _json(runner.invoke(edge, ["profiles", "--json"]))
    assert {p["name"] for p in listed["profiles"]} >= {"rpi5-8gb", "cuda-24gb"}
    shown = _json(runner.invoke(edge, ["profiles", "jetson-agx-orin-64gb", "--json"]))
    assert shown["profile"]["target"] == "jetson"
    v = _json(runner.invoke(edge, ["verify", "--bundle", str(tiny_run[0] / "bundles/cpu-laptop/round-0000"), "--json"]))
    assert v["kept_layers"] == [0, 2, 5] and v["files"] >= 10


def test_console_script_exit_code_and_stderr(tmp_path):
    """The installed entry point: no traceback, exit 1, one line on stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "ciders_edge", "verify", "--bundle", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path}: not a bundle (no manifest.json)"]


def test_prepare_from_a_config_file_with_flag_overrides(demo_dir, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'model = "tiny"\npublic_data = "{demo_dir / "public.jsonl"}"\nmessenger_depth = 3\ndrop_ratio = 0.5\n'
        'layer_steps = 5\nalign_steps = 1\nclient_ids = ["a", "b"]\nalgorithm = "fedavg"\n[takd]\nseq_len = 64\n'
        "[hyperparameters]\nlocal_steps = 4\n"
    )
    s = _json(
        runner.invoke(
            cloud, ["prepare", "--config", str(cfg), "--messenger-depth", "2", "--out", str(tmp_path / "r"), "--json"]
        )
    )
    assert s["messenger_depth"] == 2 and s["kept_layers"] == [0, 2, 5]
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["client_ids"] == ["a", "b"] and run["algorithm"] == "fedavg" and run["takd"]["seq_len"] == 64
    manifest = Bundle.load(s["bundles"]["cpu-laptop"]).manifest
    # fedavg's round hyperparameters: no consensus correction, no look-ahead, plain averaging
    hp = manifest["hyperparameters"]
    assert hp["local_steps"] == 4 and hp["gamma"] == 0.0 and hp["eta_in"] == 0.0 and hp["tau"] == 1.0
