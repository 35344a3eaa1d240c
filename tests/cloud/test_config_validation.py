"""Config files are checked by type at load: one line naming the file, `table.key`, the expected type
and the allowed values; unknown keys are errors; the paper preset works for every command taking it."""

import json

import pytest
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.cli.config_file import load_config
from ciders_cloud.preparation import prepare
from ciders_cloud.run.config import RunConfig, TakdConfig, load_run
from ciders_cloud.strategies import FedNestSettings, round_hyperparams_for, round_takd
from ciders_edge.cli import app as edge
from ciders_edge.config import check_value
from ciders_edge.errors import ConfigError
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.profiles import DeviceProfile

runner = CliRunner()

BAD = [
    ('data = "f"\n', "`data` must be a list of strings; got 'f'"),
    ("rounds = 1.5\n", "`rounds` must be an integer; got 1.5"),
    ("rounds = true\n", "`rounds` must be an integer; got True"),
    ("local_step = 3\n", "unknown key `local_step`; did you mean `local_steps`?"),
    ('[takd]\nhidden_loss = "l2"\n', "`takd.hidden_loss` must be a string, one of 'relative', 'mse'; got 'l2'"),
    ("[takd]\ntask_loss = 1\n", "`takd.task_loss` must be a string, one of 'excess', 'ce'; got 1"),
    ('[hyperparameters]\neta = "fast"\n', "`hyperparameters.eta` must be a number; got 'fast'"),
    (
        "[hyperparameters]\nlocal_step = 3\n",
        "unknown key `hyperparameters.local_step`; did you mean `hyperparameters.local_steps`?",
    ),
    ('codec = "fp16"\n', "`codec` must be a string, one of 'fp32', 'bf16', 'int8'; got 'fp16'"),
    ('algorithm = "fedsgd"\n', "`algorithm` must be a string, one of 'ciders-fo', "),
    ("takd = 3\n", "`takd` must be a table; got 3"),
    ('[lora]\nrank = "4"\n', "`lora.rank` must be an integer; got '4'"),
    ("client_ids = [1, 2]\n", "`client_ids` must be a list of strings; got [1, 2]"),
    ("clients = 99999999999\n", "`clients` must be an integer from 1 to 1,000; got 99999999999"),
    (
        "[hyperparameters]\nlocal_steps = 99999999999999999999\n",
        "`hyperparameters.local_steps` must be an integer from 1 to 100,000; got 99999999999999999999",
    ),
    ("[takd]\nbatch_size = 0\n", "`takd.batch_size` must be an integer from 1 to 4,096; got 0"),
    ("[lora]\nrank = 100000\n", "`lora.rank` must be an integer from 1 to 1,024; got 100000"),
    ("[hyperparameters]\nneumann_terms = 3\n", "`hyperparameters.neumann_terms` is now a key of the `fednest` table"),
    ('[fednest]\nhvp = "exact"\n', "`fednest.hvp` must be a string, one of 'auto', 'autograd', 'fd'; got 'exact'"),
    ("[fednest]\nprobe_batches = 0\n", "`fednest.probe_batches` must be an integer from 1 to 10,000; got 0"),
]


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("command", ["prepare", "simulate"])
@pytest.mark.parametrize(("text", "message"), BAD)
def test_a_bad_key_is_one_line_with_file_key_type_and_choices(tmp_path, command, text, message):
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, command)
    line = str(err.value)
    assert line.startswith(f"{path}: ") and message in line and "\n" not in line


def test_types_follow_the_dataclass_hints():
    assert check_value(1, float) and check_value(1.5, float) and check_value(None, float | None)
    assert not check_value(True, float) and not check_value(True, int) and not check_value(1.0, int)
    assert check_value(["a"], list[str]) and not check_value("a", list[str]) and not check_value([1], list[str])
    assert not check_value("x", float | None) and check_value(False, bool) and not check_value(0, bool)


def test_ints_pass_for_numbers_and_good_files_load(tmp_path):
    path = _toml(tmp_path, "participation = 1\ndrop_ratio = 0\n[hyperparameters]\neta = 1\n[takd]\nlr = 1\n")
    got = load_config(path, "simulate")
    assert got == {"participation": 1, "drop_ratio": 0, "hyperparameters": {"eta": 1}, "takd": {"lr": 1}}
    assert RoundHyperparams.from_dict(got["hyperparameters"]).eta == 1


def test_fednest_settings_left_the_round_hyperparameters():
    """A run.json from before keeps its FedNest settings (now the `fednest` table); an old manifest's
    hyperparameters load without them; only FedNest's bundles ask edges for gradients."""
    old = {"algorithm": "fednest", "hyperparameters": {"eta": 0.1, "neumann_terms": 3, "send_grad_y": False}}
    run = RunConfig.from_dict(old)
    assert run.fednest == {"neumann_terms": 3} and "neumann_terms" not in run.hyperparameters
    hp = round_hyperparams_for(run, 0)
    assert hp.eta == 0.1 and hp.ask.probe_batches == 4 and not hp.grad_y_in_packet
    assert "bilevel" not in round_hyperparams_for(RunConfig(), 0).to_dict()
    assert RoundHyperparams.from_dict({"hvp": "auto", "probe_batches": 4}) == RoundHyperparams()


def test_a_tables_own_checks_run_at_load_with_the_file_named(tmp_path):
    path = _toml(tmp_path, "[hyperparameters]\neta = -1\n")
    with pytest.raises(ConfigError, match=r"c\.toml: \[hyperparameters\] `eta` must be positive, got -1"):
        load_config(path, "prepare")


def test_a_tables_error_names_its_table_on_the_command_line(demo_dir, tmp_path):
    """Rich took ``[hyperparameters]`` in an error for markup and printed the line without it."""
    path = _toml(tmp_path, "[hyperparameters]\ntakd_lambda_task = -1\n")
    args = ["prepare", "--config", path, "--model", "tiny", "--public-data", str(demo_dir / "public.jsonl")]
    r = runner.invoke(cloud, [*args, "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and not (tmp_path / "out").exists()
    assert r.stderr.strip().endswith(
        "c.toml: [hyperparameters] `takd_lambda_task` must be a non-negative number, got -1."
    )


def test_paper_preset_means_the_same_to_prepare_and_simulate():
    sim = load_config("paper", "simulate")
    assert (sim["clients"], sim["rounds"], sim["local_steps"]) == (5, 150, 10)
    prep = load_config("paper", "prepare")
    assert not {"clients", "rounds", "local_steps"} & set(prep)  # simulate's study size is not a run's
    assert prep["hyperparameters"]["local_steps"] == 10 and prep["hyperparameters"]["tau"] == 0.02
    assert (prep["takd"]["hidden_loss"], prep["takd"]["task_loss"], prep["gamma_schedule"]) == (
        "mse",
        "ce",
        "protocol-c",
    )
    run = RunConfig.from_dict({**prep, "public_data": "p.jsonl"}, strict=True)  # every key is the run's
    assert run.client_ids == [] and round_hyperparams_for(run, 0).local_steps == 10  # what round 0 ships


def test_prepare_takes_client_ids_and_simulate_refuses_prepare_keys(tmp_path):
    path = _toml(tmp_path, 'clients = 2\nclient_ids = ["a", "b"]\nprofile = "cpu-laptop"\nrounds = 4\n')
    assert load_config(path, "prepare") == {"client_ids": ["a", "b"], "profiles": ["cpu-laptop"]}
    with pytest.raises(ConfigError, match="`client_ids` is a key of `prepare`; `simulate` does not take it"):
        load_config(path, "simulate")


def test_a_saved_run_json_of_wrong_types_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^run\.json: `clients` must be a list of strings; got 5$"):
        RunConfig.from_dict({"clients": 5}, where="run.json")
    with pytest.raises(ConfigError, match=r"`hyperparameters\.local_steps` must be an integer; got 1\.5"):
        RunConfig.from_dict({"hyperparameters": {"local_steps": 1.5}}, where="run.json")
    with pytest.warns(UserWarning, match="unknown keys ignored: written_by_a_newer_version"):
        RunConfig.from_dict({"written_by_a_newer_version": 1})  # saved JSON: a newer writer's keys only warn


@pytest.mark.parametrize(
    ("command", "text"),
    [
        ("simulate", "rounds = 1.5\n"),
        ("simulate", 'data = "f"\n'),
        ("prepare", 'layer_steps = "5"\n'),
    ],
)
def test_a_bad_config_fails_in_one_line_and_writes_no_out(demo_dir, tmp_path, command, text):
    data = f'data = ["{demo_dir / "units" / "train.jsonl"}"]\n' if "data" not in text else ""
    path = _toml(tmp_path, data + f'public_data = "{demo_dir / "public.jsonl"}"\nmodel = "tiny"\n' + text)
    out = tmp_path / "out"
    r = runner.invoke(cloud, [command, "--config", path, "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and path in r.stderr and "Traceback" not in r.output
    assert not out.exists()


def test_prepare_with_the_paper_preset_then_aggregate(demo_dir, tmp_path):
    """`clients = 5` used to land in run.json as an int, and aggregate then failed with a TypeError."""
    run = tmp_path / "run"
    fast = ["--messenger-depth", "2", "--drop-ratio", "0.5", "--layer-steps", "2", "--align-steps", "1"]
    args = ["prepare", "--config", "paper", "--model", "tiny", "--public-data", str(demo_dir / "public.jsonl")]
    r = runner.invoke(cloud, [*args, *fast, "--seq-len", "64", "--takd-batch-size", "2", "--out", str(run)])
    assert r.exit_code == 0, r.output
    saved = json.loads((run / "run.json").read_text())
    assert saved["client_ids"] == [] and saved["hyperparameters"]["local_steps"] == 10
    assert saved["hyperparameters"]["takd_lambda_task"] == 1.0  # eq. (2) as written in every round's TAKD too
    assert (saved["takd"]["hidden_loss"], saved["takd"]["task_loss"], saved["gamma_schedule"]) == (
        "mse",
        "ce",
        "protocol-c",
    )
    bundle = run / "bundles" / "cpu-laptop" / "round-0000"
    packet = tmp_path / "a.pkt"
    train = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "dates" / "train.jsonl")]
    r = runner.invoke(
        edge, [*train, "--state", str(tmp_path / "a"), "--client-id", "a", "--steps", "1", "--out", str(packet)]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(cloud, ["aggregate", "--run", str(run), "--packets", str(packet), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["clients"] == ["a"] and summary["next_round"] == 1 and summary["takd_steps"] == 5
    manifest = json.loads((run / "bundles" / "cpu-laptop" / "round-0001" / "manifest.json").read_text())
    assert (manifest["takd_loss"]["task_loss"], manifest["takd_loss"]["lambda_task"]) == ("ce", 1.0)


def test_a_rounds_takd_drops_the_task_ce_and_a_run_from_before_keeps_it(demo_dir, tmp_path):
    """run.json names the round's task-CE weight; one written before the default became 0 (it named none)
    ran its rounds' TAKD at ``takd.lambda_task`` and, resumed, goes on so."""
    run = RunConfig(model="tiny", messenger_depth=2, drop_ratio=0.5, layer_steps=1, align_steps=1,
                    public_data=str(demo_dir / "public.jsonl"), takd={"seq_len": 64, "lambda_task": 0.5},
                    hyperparameters={"local_steps": 1})  # fmt: skip
    prepare(run, tmp_path / "new")
    assert round_takd(load_run(tmp_path / "new"), 1)[1].lambda_task == 0.0
    saved = json.loads((tmp_path / "new" / "run.json").read_text())
    assert saved["hyperparameters"]["local_steps"] == 1 and saved["hyperparameters"]["takd_lambda_task"] == 0.0
    del saved["hyperparameters"]["takd_lambda_task"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run.json").write_text(json.dumps(saved))
    assert round_takd(load_run(tmp_path / "old"), 1)[1].lambda_task == 0.5


def test_simulate_with_the_paper_preset(demo_dir, tmp_path):
    out = tmp_path / "sim"
    data = [a for f in ("units", "strings") for a in ("--data", str(demo_dir / f / "train.jsonl"))]
    small = ["--clients", "2", "--rounds", "1", "--local-steps", "1", "--partition", "per-file", "--max-records", "8"]
    fast = ["--messenger-depth", "2", "--drop-ratio", "0.5", "--layer-steps", "2", "--align-steps", "1"]
    evals = ["--eval-examples", "1", "--eval-generate", "0"]
    args = ["simulate", "--config", "paper", "--model", "tiny", *data, *small, *fast, *evals, "--out", str(out)]
    r = runner.invoke(cloud, [*args, "--json"])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert (config["clients"], config["rounds"], config["gamma_schedule"]) == (2, 1, "protocol-c")
    run = json.loads((out / "run" / "run.json").read_text())
    assert run["client_ids"] == ["client-00", "client-01"] and run["hyperparameters"]["local_steps"] == 1
    assert (run["hyperparameters"]["eta"], run["takd"]["hidden_loss"], run["takd"]["task_loss"]) == (1e-4, "mse", "ce")
    assert run["hyperparameters"]["takd_lambda_task"] == 1.0
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["gamma"] for r in rounds if r["type"] == "round"] == [0.9]  # protocol C's gamma_0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RoundHyperparams(solver="newton"), "`solver` must be one of fo, fd, svrg, got 'newton'."),
        (lambda: RunConfig(gamma_schedule="cosine"), "`gamma_schedule` must be one of constant, protocol-c, got"),
        (lambda: RunConfig(storage="int3"), '`storage` must be one of "", fp32, bf16, int8, int4, got'),
        (lambda: TakdConfig(hidden_loss="l1"), "`hidden_loss` must be one of relative, mse, got 'l1'."),
        (lambda: FedNestSettings(hvp="exact"), "`hvp` must be one of auto, autograd, fd, got 'exact'."),
        (lambda: DeviceProfile(target="tpu"), "profile 'custom': `target` must be one of cpu, cuda, jetson, got"),
    ],
)
def test_a_config_made_in_code_checks_its_choices_once_for_all(make, message):
    """ConfigMixin checks every CHOICES field where a config is made, as where a file is read."""
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value)


def test_simulate_rechoose_without_a_validation_slice_is_one_line(demo_dir, tmp_path):
    args = ["simulate", "--model", "tiny", "--data", str(demo_dir / "units" / "train.jsonl"), "--rechoose"]
    r = runner.invoke(cloud, [*args, "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.strip() == "error: `rechoose` needs `val_fraction`: a client chooses again on its validation slice"
    assert not (tmp_path / "out").exists()
