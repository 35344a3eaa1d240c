"""`report` draws real PNGs from real metrics; `--config` TOML keys mirror the flags."""

import json

import pytest
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.cli.config_file import load_toml_config
from ciders_cloud.run.config import TakdConfig
from ciders_cloud.study.config import SimConfig
from ciders_cloud.study.report import report
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory, demo_dir):
    out = tmp_path_factory.mktemp("sim") / "run"
    cfg = tmp_path_factory.mktemp("cfg") / "sim.toml"
    data = ", ".join(f'"{demo_dir / f / "train.jsonl"}"' for f in ("units", "strings"))
    cfg.write_text(
        f'model = "tiny"\ndata = [{data}]\nclients = 2\nrounds = 1\nlocal_steps = 2\nmax_records = 10\n'
        "eval_examples = 2\neval_generate = 0\nlayer_steps = 5\nalign_steps = 1\n"
        "messenger_depth = 2\ndrop_ratio = 0.5\n"
        'algorithm = "fedavg"\n[hyperparameters]\neta = 0.01\ntakd_steps = 1\n[takd]\nseq_len = 64\n'
    )
    # the flag overrides the file's algorithm and rounds
    r = runner.invoke(
        cloud,
        ["simulate", "--config", str(cfg), "--algorithm", "ciders-fo", "--rounds", "2", "--out", str(out), "--json"],
    )
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout.strip().splitlines()[-1])


def test_config_file_and_flags(sim_run):
    out, summary = sim_run
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == "ciders-fo" and saved["rounds"] == 2 and saved["clients"] == 2
    assert saved["hyperparameters"]["eta"] == 0.01
    run = json.loads((out / "run" / "run.json").read_text())
    assert run["algorithm"] == "ciders-fo" and run["hyperparameters"]["takd_steps"] == 1
    assert summary["rounds"] == 2 and summary["mean_nll_personal"] > 0


def test_report_draws_pngs_and_a_summary(sim_run, tmp_path):
    out, _ = sim_run
    result = report([out], tmp_path / "rep")
    for name in ("loss.png", "e_rae.png", "nll.png", "bytes_up.png", "sdr_sppr_gamma.png", "nll_matrix_run.png"):
        data = (tmp_path / "rep" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| ciders-fo (run) | 2 |" in md and "summary.md" in result["files"]


def test_report_refuses_a_folder_without_metrics(tmp_path):
    r = runner.invoke(cloud, ["report", "--run", str(tmp_path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no metrics.jsonl" in r.stderr


def test_paper_preset_and_bad_config(tmp_path):
    paper = load_toml_config("paper")
    assert paper["hyperparameters"]["tau"] == 0.02 and paper["gamma_schedule"] == "protocol-c"
    cfg = SimConfig.from_dict({**paper, "data": ["x.jsonl"]})
    assert cfg.rounds == 150 and cfg.clients == 5
    takd = TakdConfig().replace(**cfg.takd)  # eq. (2) as the paper writes it, whatever the defaults are
    assert (takd.hidden_loss, takd.lambda_hidden, takd.lambda_out, takd.lambda_task) == ("mse", 1.0, 0.5, 1.0)
    assert takd.task_loss == "ce"
    hp = RoundHyperparams.from_dict(paper["hyperparameters"])
    assert (hp.eta, hp.tau, cfg.local_steps) == (1e-4, 0.02, 10)
    bad = tmp_path / "b.toml"
    bad.write_text("rounds = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml_config(str(bad))
    with pytest.raises(ConfigError, match="no such config file or preset"):
        load_toml_config("nope")
