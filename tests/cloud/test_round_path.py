"""How far a cloud round walks: the run folder's way through ``aggregate_files`` and what ``ciders-cloud
aggregate --help`` loads (the measures are tests/call_path.py's). The bounds are what the code reaches
now: a change that lengthens the way, or makes the CLI load more, has to say why by moving them."""

import shutil

from call_path import climbs, modules_loaded, run_folder_way
from conftest import fast_run_config
from tiny_runs import two_clients_round0

from ciders_cloud.round.aggregate import aggregate_files

# measured on a two-client round of a tiny run (issue 60's targets: <= 16 modules and <= 6 climbs)
MAX_WAY_MODULES = 16
MAX_WAY_CLIMBS = 6
MAX_HELP_MODULES = 12  # issue 60 asked for fewer than 30 (53 before the CLI imported its modules in its commands)


def test_the_run_folders_way_through_a_round_stays_short(tmp_path, demo_dir):
    root = two_clients_round0(fast_run_config(demo_dir, client_ids=["a", "b"]), demo_dir, tmp_path)
    packets = [root / "a.pkt", root / "b.pkt"]
    shutil.copytree(root / "run", tmp_path / "warm")
    aggregate_files(tmp_path / "warm", packets)  # the imports a first round does inside functions
    summary, way = run_folder_way(lambda: aggregate_files(root / "run", packets), root / "run")
    assert summary["next_round"] == 1
    modules, up = sorted(set(way)), climbs(way)
    assert len(modules) <= MAX_WAY_MODULES, f"{len(modules)} modules: {modules}"
    assert len(up) <= MAX_WAY_CLIMBS, f"{len(up)} climbs: {up}"


def test_aggregate_help_loads_few_project_modules():
    loaded = modules_loaded("from ciders_cloud.cli import app\napp(['aggregate', '--help'])")
    assert len(loaded) <= MAX_HELP_MODULES, f"{len(loaded)} modules: {loaded}"
