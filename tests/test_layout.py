"""The architecture the folders promise: the edge runtime stands alone, imports flow one way, modules stay small."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("ciders_edge", "ciders_cloud", "export")
MAX_LINES = 320  # "small files with one job each"; a module past this is split by job


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules of ours that ``path`` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES}
    return found


def test_the_edge_runtime_never_imports_the_cloud_or_the_exporter():
    offenders = {
        mod: sorted(i for i in _imports(path, top_level_only=False) if i.split(".")[0] != "ciders_edge")
        for mod, path in MODULES.items()
        if mod.startswith("ciders_edge")
    }
    assert {m: i for m, i in offenders.items() if i} == {}


# what the cloud may use of the edge's training: the equations it shares (eq. 11), the fleet's evidence it pools
# for the deployed choice, and the public entry on files that `simulate` calls as the CLI does; the rest (local
# steps, objective, round) is the runtime's own
EDGE_TRAINING_PUBLIC = {
    "ciders_edge.training.equations",
    "ciders_edge.training.fleet_evidence",
    "ciders_edge.training.train",
}


def test_the_cloud_uses_only_the_edges_public_parts():
    offenders = []
    for mod, path in MODULES.items():
        if not mod.startswith("ciders_cloud"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ciders_edge")):
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            inner = node.module.startswith("ciders_edge.training") and node.module not in EDGE_TRAINING_PUBLIC
            if private or inner:
                offenders.append(f"{mod}: from {node.module} import {', '.join(a.name for a in node.names)}")
    assert offenders == []


def test_module_imports_have_no_cycle():
    """Imports inside functions count too: a circle that only a deferred import keeps from failing at
    load time is still two modules that cannot be read, tested or moved apart."""
    graph = {mod: _imports(path, top_level_only=False) - {mod} for mod, path in MODULES.items()}
    done, path = set(), []

    def visit(mod: str) -> None:
        if mod in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(mod) :], mod]))
        if mod in done:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            if not MODULES[dep].name == "__init__.py":  # importing a package runs only its __init__
                visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)


def _cloud_floors() -> list[str]:
    """docs/layout.md's floor order of the cloud, bottom first: the line ``Floors, bottom up: `a` → `b` …``."""
    line = next(ln for ln in (ROOT / "docs" / "layout.md").read_text().splitlines() if ln.startswith("Floors,"))
    return re.findall(r"`(\w+)`", line)


def test_the_cloud_imports_only_down_its_floors():
    """Each cloud subpackage imports only those below it in docs/layout.md's order (``run/`` is the ground
    floor: data and their checks), so a job can be read and tested with nothing above it loaded."""
    floors = _cloud_floors()
    # every package of code (presets/ holds TOML files) and the preparation module
    packages = {p.parent.name for p in (ROOT / "ciders_cloud").glob("*/__init__.py")} - {"presets"}
    assert packages | {"preparation"} == set(floors), "docs/layout.md's floors name every cloud subpackage"

    def floor(mod: str) -> int | None:
        parts = mod.split(".")
        return floors.index(parts[1]) if parts[0] == "ciders_cloud" and len(parts) > 1 and parts[1] in floors else None

    upward = [
        f"{mod} -> {dep}"
        for mod, path in MODULES.items()
        if (here := floor(mod)) is not None
        for dep in sorted(_imports(path, top_level_only=False))
        if (there := floor(dep)) is not None and there > here
    ]
    assert upward == []


# FedNest's family is one strategy among others: outside its strategy package, a module speaks of what it does (a
# probe, the svrg direction, a bilevel ask, a strategy's table); these few name it by necessity: the run's `fednest`
# table (run/config.py: the key users write and its older place), the edge's one home for the bilevel view
# (training/bilevel.py), and the hyperparameters that name the table their retired keys moved to
MAX_MODULES_NAMING_FEDNEST = 4


def test_fednest_is_named_only_by_its_strategy_and_a_few_modules():
    """Counts the modules outside ``ciders_cloud/strategies/`` whose source (comments and docstrings too)
    matches /fednest|hypergradient/i: the round loop asks a strategy through its hooks instead."""
    word = re.compile("fednest|hypergradient", re.IGNORECASE)
    strategies = ROOT / "ciders_cloud" / "strategies"
    naming = sorted(
        mod for mod, path in MODULES.items() if not path.is_relative_to(strategies) and word.search(path.read_text())
    )
    assert len(naming) <= MAX_MODULES_NAMING_FEDNEST, f"{len(naming)} modules name FedNest: {naming}"


def test_modules_stay_small():
    sizes = {mod: len(path.read_text().splitlines()) for mod, path in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_the_clis_start_without_the_model_stack():
    """Every `ciders-edge` call (a profiles listing, a bad flag) loads the CLI: transformers and PEFT
    (seconds of imports) load only in the commands that build a model."""
    import subprocess
    import sys

    heavy = "('transformers', 'peft', 'optimum', 'onnxruntime')"
    code = f"import sys, ciders_edge.cli; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


TEST_FOLDERS = {"edge": "ciders_edge", "cloud": "ciders_cloud", "fleet": "the fleet of both", "exporter": "export"}


def test_tests_mirror_the_packages_and_share_helpers_not_each_other():
    """Tests live in a folder per package (what spans them at the top); a test file imports the shared
    helpers at the top of tests/, never another test file, so any file runs alone or on any xdist worker."""
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    assert folders == set(TEST_FOLDERS)
    assert not (tests / "export").exists()  # it would shadow the export package on tests' sys.path
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name"
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("test_"), f"{path.relative_to(ROOT)} imports {node.module}"
