"""``simulate --engine flower``: the fleet's ClientApp on Flower's Simulation Engine (Ray) runs the same
rounds as the in-process engine, to the bit, with client sampling, DP and ``--resume``."""

import json

import pytest
import torch
from tiny_runs import fast_study, moved, state_bytes
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.study import engines
from ciders_cloud.study.engines import EngineSettings
from ciders_cloud.study.resume import resume
from ciders_cloud.study.simulate import simulate
from ciders_edge.errors import ConfigError
from ciders_edge.fleet.virtual import StudyJob, Trained
from ciders_edge.formats.client_state import ClientState

runner = CliRunner()


def _metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # a clock


def test_the_flower_engine_runs_the_in_process_study_to_the_bit(demo_dir, tmp_path, one_thread):
    """Three rounds, a third of the clients left out each round, DP noise from the study's seed, clients
    choosing their deployed messenger again on each bundle (Flower's evaluate messages); the Flower study runs
    two rounds, then ``--resume`` takes it to three on the Flower engine again."""
    dp = {"clip": 1.0, "noise_multiplier": 1.0}
    cfg = fast_study(demo_dir, eval_generate=0, participation=0.67, dp=dp, max_records=20, val_fraction=0.1)
    cfg = cfg.replace(rechoose=True)
    simulate(cfg, tmp_path / "in-process")
    flower = EngineSettings("flower", actors=2)
    simulate(cfg.replace(rounds=2), tmp_path / "flower", engine=flower)
    resume(tmp_path / "flower", rounds=3, engine=flower)

    got, want = _metrics(tmp_path / "flower"), _metrics(tmp_path / "in-process")
    assert moved(got, want) is None
    assert sum(r["type"] == "client" for r in got) == 6 and any("privacy" in r for r in got)  # 2 of 3 a round, DP
    assert state_bytes(tmp_path / "flower" / "run") == state_bytes(tmp_path / "in-process" / "run")
    rechosen = [r for r in got if r["type"] == "rechoice"]
    assert {r["bundle_round"] for r in rechosen} == {1, 2, 3} and len(rechosen) >= 7  # 2, then 2 or 3, then 3
    for cid in ("client-00", "client-01", "client-02"):
        a, b = (ClientState.load(tmp_path / e / "clients" / cid) for e in ("flower", "in-process"))
        assert a.best_info == b.best_info and a.best_info["scored_round"] == 3  # the last bundle's, trained or not
        assert all(torch.equal(a.best[k], b.best[k]) for k in b.best)


def test_a_job_and_its_result_cross_the_wire_unchanged():
    job = StudyJob("client-07", "b", "d", "s", "p.pkt", profile="rpi5-8gb", probe_answer="h.safetensors", partition=7)
    assert StudyJob.from_record(job.to_record()) == job
    flat = torch.randn(12)  # a direction's tensors are views of one flat vector, which safetensors refuses as is
    trained = Trained({"loss_first": 1.5, "deployed": "global"}, {"a": flat[:4].view(2, 2)}, {"b": flat[4:].bfloat16()})
    back = Trained.from_record(trained.to_record())
    assert back.summary == trained.summary
    assert torch.equal(back.delta_sent["a"], flat[:4].view(2, 2))
    assert back.first_direction["b"].dtype == torch.bfloat16 and torch.equal(
        back.first_direction["b"], flat[4:].bfloat16()
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(name="spark"), "--engine 'spark': choose one of in-process, flower"),
        (dict(actors=2), "--actors, --gpus-per-client and --ray-address need --engine flower"),
        (dict(name="flower", actors=0), "--actors 0: at least 1"),
        (dict(name="flower", actors=2, ray_address="ray://head:10001"), "a cluster joined by --ray-address"),
        (dict(name="flower", cpus_per_client=4096), "--cpus-per-client 4096: this machine has"),
        (dict(name="flower", gpus_per_client=64), "--gpus-per-client 64: this machine has"),
    ],
)
def test_engine_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        EngineSettings(**settings)


def test_simulate_on_flower_without_ray_is_one_line_before_anything_is_written(demo_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    out = tmp_path / "study"
    data = [str(demo_dir / f / "train.jsonl") for f in ("arithmetic", "dates", "code")]
    args = [
        "simulate",
        "--model",
        "tiny",
        "--partition",
        "per-file",
        "--clients",
        "3",
        "--rounds",
        "1",
        "--out",
        str(out),
    ]
    result = runner.invoke(cloud, [*args, *(x for d in data for x in ("--data", d)), "--engine", "flower"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: --engine flower needs Ray: pip install 'ciders-toolkit[simulation]'"
    assert not out.exists()


def test_a_virtual_supernode_refuses_a_job_addressed_to_another_client(tmp_path, monkeypatch):
    from flwr.app import Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from ciders_edge.fleet.virtual import app

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 7)):  # what Flower sets in its own process
        monkeypatch.setattr(TaskIdentity, name, value)

    job = StudyJob("client-03", "b", "d", str(tmp_path / "s"), str(tmp_path / "p.pkt"), partition=3)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 4}, state=RecordDict(), run_config={})
    with pytest.raises(ConfigError, match="client-03's round reached partition 4"):
        app(Message(job.to_record(), 7, MessageType.TRAIN), context)
    assert not (tmp_path / "s").exists() and not (tmp_path / "p.pkt").exists()
