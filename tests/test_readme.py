"""The README stays true: its command reference is the CLIs', its Python API runs, the files it names exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands():
    """``tools/readme_commands.py`` as a module (``tools/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tools" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_command_reference_is_generated_from_the_clis():
    tool = readme_commands()
    text = README.read_text(encoding="utf-8")
    assert tool.rewrite(text, tool.render()) == text, "README.md's command reference is stale: run `make readme`"


def test_command_reference_names_every_option():
    """Options the README once left out are in the generated reference."""
    text = README.read_text(encoding="utf-8")
    for command, option in [
        ("ciders-edge join", "--key-file"),
        ("ciders-edge join", "--admit-wait"),
        ("ciders-cloud serve", "--certs"),
        ("ciders-cloud serve", "--connect"),
        ("ciders-cloud certs", "--days"),
        ("ciders-cloud simulate", "--eval-data"),
        ("ciders-cloud prepare", "--client"),
        ("ciders-edge export", "--quantize"),
        ("ciders-edge bench", "--runtimes"),
    ]:
        section = text.split(f"#### `{command}`", 1)[1].split("####", 1)[0]
        assert f"`{option} " in section or f"`{option}`" in section, (command, option)


def test_python_api_block_runs(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- api:start -->", 1)[1].split("<!-- api:end -->", 1)[0]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (Python API)", "exec"), {})
    assert (tmp_path / "run" / "bundles" / "cpu-laptop" / "round-0001" / "manifest.json").is_file()


def test_every_file_the_readme_names_exists():
    text = README.read_text(encoding="utf-8")
    roots = "ciders_edge|ciders_cloud|export|benchmarks|tests|tools|device_profiles"
    paths = set(re.findall(rf"`((?:{roots})/[\w./-]*)`", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README.md names files that do not exist: {missing}"
