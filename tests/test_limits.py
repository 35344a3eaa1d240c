"""Every count a user, a config file or a bundle sets is bounded (ciders_edge.config.LIMITS): one line
naming the key and the allowed range, before anything runs; and bad values of other kinds (NaN, a
non-UTF-8 file) are one line too."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.cli.config_file import ConfigFile
from ciders_cloud.run.config import RunConfig, TakdConfig
from ciders_cloud.study.config import SimConfig
from ciders_edge.cli import app as edge
from ciders_edge.config import ConfigMixin
from ciders_edge.errors import BundleError, ConfigError
from ciders_edge.formats.bundle import Bundle
from ciders_edge.hyperparams import RoundHyperparams
from ciders_edge.inference.generation import GenerationSettings
from ciders_edge.model.lora import LoraSettings
from ciders_edge.profiles import DeviceProfile

runner = CliRunner()
HUGE = 99999999999999999999

SETTINGS = [RoundHyperparams, TakdConfig, RunConfig, SimConfig, ConfigFile, LoraSettings, GenerationSettings]


@pytest.mark.parametrize("cls", [*SETTINGS, DeviceProfile], ids=lambda c: c.__name__)
def test_every_integer_setting_has_a_range(cls: type[ConfigMixin]):
    from ciders_edge.config import LIMITS

    unbounded = [k for k, hint in cls.field_types().items() if "int" in str(hint) and k not in LIMITS]
    assert unbounded == []
    for key in (k for k, hint in cls.field_types().items() if "int" in str(hint)):
        low, high = LIMITS[key]
        with pytest.raises(ConfigError, match=rf"`{key}` must be an integer from {low:,} to {high:,}; got {high + 1}"):
            cls.from_dict({key: high + 1}, where="f")


def _one_line(r, fragment):
    assert isinstance(r.exception, SystemExit), r.exception  # not a traceback
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and fragment in lines[0], r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "99999999999"], "`clients` must be an integer from 1 to 1,000; got 99999999999"),
        (["--profile-mix", "cpu-laptop:99999999999"], "--profile-mix cpu-laptop's count must be an integer from 1"),
        (["--profile-mix", "cpu-laptop:" + "9" * 5000], "--profile-mix takes PROFILE:COUNT"),
        (["--profile-mix", "cpu-laptop:²"], "--profile-mix takes PROFILE:COUNT"),
        (["--rounds", "1000000000"], "`rounds` must be an integer from 1 to 100,000"),
        (["--local-steps", str(HUGE)], f"`local_steps` must be an integer from 1 to 100,000; got {HUGE}"),
        (["--eval-every", "0"], "`eval_every` must be an integer from 1 to 100,000; got 0"),
    ],
    ids=lambda v: "".join(c for c in "_".join(v)[:40] if c.isascii() and c != " ") if isinstance(v, list) else "",
)
def test_simulate_refuses_unbounded_counts_before_anything_runs(demo_dir, tmp_path, args, message):
    out = tmp_path / "sim"
    r = runner.invoke(cloud, ["simulate", "--data", str(demo_dir / "units" / "train.jsonl"), *args, "--out", str(out)])
    _one_line(r, message)
    assert not out.exists()


def test_a_config_files_huge_local_steps_never_reaches_a_bundle(demo_dir, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f"[hyperparameters]\nlocal_steps = {HUGE}\n")
    out = tmp_path / "run"
    args = ["prepare", "--config", str(config), "--model", "tiny", "--public-data", str(demo_dir / "public.jsonl")]
    r = runner.invoke(cloud, [*args, "--out", str(out)])
    _one_line(r, f"c.toml: `hyperparameters.local_steps` must be an integer from 1 to 100,000; got {HUGE}")
    assert not out.exists()


@pytest.fixture
def bundle_with(tiny_run, tmp_path):
    """A copy of the tiny run's bundle with manifest hyperparameters changed (as a tampered bundle)."""

    def make(**hp):
        copy = tmp_path / "bundle"
        shutil.copytree(tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000", copy)
        m = json.loads((copy / "manifest.json").read_text())
        m["hyperparameters"].update(hp)
        (copy / "manifest.json").write_text(json.dumps(m))
        return copy

    return make


def test_a_bundle_whose_hyperparameters_are_out_of_range_is_refused(bundle_with, demo_dir, tmp_path):
    """It used to load, and `train` looped for ever."""
    bundle = bundle_with(local_steps=HUGE)
    with pytest.raises(BundleError, match=r"'hyperparameters': `local_steps` must be an integer from 1 to 100,000"):
        Bundle.load(bundle)
    args = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "units" / "train.jsonl")]
    r = runner.invoke(edge, [*args, "--state", str(tmp_path / "s"), "--out", str(tmp_path / "p")])
    _one_line(r, "`local_steps` must be an integer from 1 to 100,000")
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "1000000000"], "flags: `local_steps` must be an integer from 1 to 100,000; got 1000000000"),
        (["--batch-size", "0"], "flags: `batch_size` must be an integer from 1 to 4,096; got 0"),
        (["--grad-accum", str(HUGE)], "flags: `grad_accum` must be an integer from 1 to 1,024"),
    ],
    ids=lambda v: "".join(c for c in "_".join(v)[:40] if c.isascii() and c != " ") if isinstance(v, list) else "",
)
def test_train_flags_out_of_range(tiny_run, demo_dir, tmp_path, args, message):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    base = ["train", "--bundle", str(bundle), "--data", str(demo_dir / "units" / "train.jsonl")]
    r = runner.invoke(edge, [*base, "--state", str(tmp_path / "s"), "--out", str(tmp_path / "p"), *args])
    _one_line(r, message)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "nan"], "flags: `temperature` must be a number; got nan"),
        (["--top-p", "inf"], "flags: `top_p` must be a number; got inf"),
        (["--max-new-tokens", "999999999"], "`max_new_tokens` must be an integer from 1 to 32,768; got 999999999"),
        (["--seed", "-1"], "`seed` must be an integer from 0 to"),
    ],
    ids=lambda v: "".join(c for c in "_".join(v)[:40] if c.isascii() and c != " ") if isinstance(v, list) else "",
)
def test_infer_refuses_bad_generation_settings(tiny_run, args, message):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    _one_line(runner.invoke(edge, ["infer", "--prompt", "hi", "--bundle", str(bundle), "--global", *args]), message)


def test_evaluate_and_distill_and_demo_data_bound_their_counts(tiny_run, tmp_path):
    bundle = tiny_run[0] / "bundles" / "cpu-laptop" / "round-0000"
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n')
    base = ["evaluate", "--bundle", str(bundle), "--global", "--data", str(data)]
    _one_line(runner.invoke(edge, [*base, "--limit", "0"]), "--limit must be an integer from 1 to 1,000,000,000; got 0")
    _one_line(runner.invoke(edge, [*base, "--max-new-tokens", str(10**9)]), "--max-new-tokens must be an integer")
    r = runner.invoke(cloud, ["distill", "--run", str(tiny_run[0]), "--steps", str(HUGE)])
    _one_line(r, f"--steps must be an integer from 0 to 100,000; got {HUGE}")
    r = runner.invoke(cloud, ["demo-data", "--out", str(tmp_path / "demo"), "--n-train", str(10**12)])
    _one_line(r, "--n-train must be an integer from 0 to 1,000,000")
    assert not (tmp_path / "demo").exists()
    r = runner.invoke(cloud, ["certs", "--out", str(tmp_path / "certs"), "--days", str(10**9)])
    _one_line(r, "--days must be an integer from 1 to 36,500")


def test_serve_and_bench_settings_are_bounded(tmp_path):
    from ciders_cloud.fleet.serve import ServeSettings
    from export.bench import BenchSettings

    with pytest.raises(ConfigError, match="--rounds must be an integer from 1 to 100,000"):
        ServeSettings(tmp_path, HUGE)
    with pytest.raises(ConfigError, match="--min-clients must be an integer from 1"):
        ServeSettings(tmp_path, 3, min_clients=0)
    with pytest.raises(ConfigError, match="--round-timeout must be a positive number of seconds, got nan"):
        ServeSettings(tmp_path, 3, round_timeout=float("nan"))
    with pytest.raises(ConfigError, match="--repeats must be an integer from 1 to 1,000"):
        BenchSettings(repeats=HUGE)


@pytest.mark.parametrize("command", ["prepare", "simulate"])
def test_a_non_utf8_config_file_is_one_line(demo_dir, tmp_path, command):
    config = tmp_path / "c.toml"
    config.write_bytes(b'model = "tiny"\n# caf\xe9\n')
    args = [command, "--config", str(config), "--out", str(tmp_path / "out")]
    r = runner.invoke(cloud, [*args, "--public-data", str(demo_dir / "public.jsonl")] if command == "prepare" else args)
    _one_line(r, f"{config}: not UTF-8 text (byte 0xe9 at line 2, column 6)")
    config.write_text("seed = " + "9" * 5000 + "\n")  # tomllib: "Exceeds the limit (4300 digits)", a ValueError
    _one_line(runner.invoke(cloud, args), f"{config}: invalid TOML")


def test_a_non_utf8_device_profile_is_one_line(tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_bytes(b'name = "\xff"\n')
    _one_line(runner.invoke(edge, ["profiles", str(profile)]), f"{profile}: not UTF-8 text")
