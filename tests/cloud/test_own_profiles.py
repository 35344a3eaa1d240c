"""A profile given as a TOML file, and public data by a relative path: the run keeps its own copy of the profile and
the data's absolute path, so a later command works from any folder (it once looked for ``bundles/mine.toml``)."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from ciders_cloud.cli import app as cloud
from ciders_cloud.run.config import load_run
from ciders_edge.training.train import RoundOptions, train

runner = CliRunner()
TINY = ["--model", "tiny", "--messenger-depth", "2", "--drop-ratio", "0.5", "--layer-steps", "2", "--align-steps", "1"]
MINE = 'name = "mine"\ndescription = "my board"\ntarget = "cpu"\nstorage = "fp32"\nmemory_budget_gb = 3.0\n'


@pytest.fixture
def here(tmp_path, demo_dir, monkeypatch):
    """A working folder with the demo's public data and ``mine.toml``, both given by relative paths."""
    shutil.copy(demo_dir / "public.jsonl", tmp_path / "public.jsonl")
    (tmp_path / "mine.toml").write_text(MINE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_run_keeps_its_own_profile_and_aggregates_from_another_folder(here, demo_dir, monkeypatch):
    args = ["prepare", *TINY, "--public-data", "public.jsonl", "--profile", "./mine.toml"]
    r = runner.invoke(cloud, [*args, "--out", "run"])
    assert r.exit_code == 0, r.output
    run = load_run(here / "run")
    assert run.profiles == ["mine"] and list(run.own_profiles) == ["mine"]
    assert run.own_profiles["mine"]["memory_budget_gb"] == 3.0 and run.own_profiles["mine"]["storage"] == "fp32"
    assert run.public_data == str(here / "public.jsonl")
    train(here / "run/bundles/mine/round-0000", demo_dir / "dates/train.jsonl", here / "edge", here / "a.pkt",
          RoundOptions("a"))  # fmt: skip
    (here / "mine.toml").unlink()  # the run reads its own copy
    (here / "elsewhere").mkdir()
    monkeypatch.chdir(here / "elsewhere")
    r = runner.invoke(cloud, ["aggregate", "--run", "../run", "--packets", "../a.pkt", "--json"])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)["bundles"]) == {"mine"}
    assert (here / "run/bundles/mine/round-0001/manifest.json").is_file()


@pytest.mark.parametrize(
    ("toml", "flags", "message"),
    [
        (MINE.replace('"mine"', '"cpu-laptop"'), ["--profile", "mine.toml"],
         "mine.toml: names itself 'cpu-laptop', a shipped profile's name; give it a `name` of its own"),
        (MINE, ["--profile", "mine.toml", "--profile", "./mine.toml"],
         "two of the run's profiles are named 'mine'; give each a `name` of its own"),
    ],
)  # fmt: skip
def test_a_profile_file_that_would_share_a_bundle_folder_is_refused(here, toml, flags, message):
    (here / "mine.toml").write_text(toml)
    r = runner.invoke(cloud, ["prepare", *TINY, "--public-data", "public.jsonl", *flags, "--out", "run"])
    assert r.exit_code == 1 and r.stderr.strip() == f"error: {message}" and "Traceback" not in r.output
    assert not (here / "run").exists()


def test_simulate_runs_clients_on_a_profile_file(here, demo_dir):
    data = [x for f in ("dates", "code") for x in ("--data", str(demo_dir / f / "train.jsonl"))]
    r = runner.invoke(
        cloud, ["simulate", *TINY, "--profile", "mine.toml", *data, "--clients", "2", "--rounds", "1",
                "--local-steps", "1", "--out", "sim", "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert load_run(here / "sim/run").profiles == ["mine"]
    assert (here / "sim/run/bundles/mine/round-0001").is_dir() and (here / "sim/clients/client-00").is_dir()


def test_a_shipped_profile_goes_by_name_and_a_file_by_its_own(here):
    from ciders_cloud.run.splits import run_profiles

    profiles, kept = run_profiles(["rpi5-8gb", "mine.toml"])
    assert [p.name for p in profiles] == kept["profiles"] == ["rpi5-8gb", "mine"]
    assert list(kept["own_profiles"]) == ["mine"] and kept["own_profiles"]["mine"]["description"] == "my board"
    again, _ = run_profiles(kept["profiles"], kept["own_profiles"])  # a run's copy, the file gone
    (here / "mine.toml").unlink()
    assert again == profiles == run_profiles(kept["profiles"], kept["own_profiles"])[0]
