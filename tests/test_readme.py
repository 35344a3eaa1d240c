"""The README and docs/ stay true: the command reference is the CLIs', the Python API runs, every file
they name exists, every link and anchor resolves, and no path points outside the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = ROOT / "docs" / "commands.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def readme_commands():
    """``tools/readme_commands.py`` as a module (``tools/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tools" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_command_reference_is_generated_from_the_clis():
    tool = readme_commands()
    text = COMMANDS.read_text(encoding="utf-8")
    assert tool.rewrite(text, tool.render()) == text, "docs/commands.md is stale: run `make readme`"


def test_command_reference_names_every_option():
    """Options the README once left out are in the generated reference."""
    text = COMMANDS.read_text(encoding="utf-8")
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
        section = text.split(f"### `{command}`", 1)[1].split("###", 1)[0]
        assert f"`{option} " in section or f"`{option}`" in section, (command, option)


def test_python_api_block_runs(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- api:start -->", 1)[1].split("<!-- api:end -->", 1)[0]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (Python API)", "exec"), {})
    assert (tmp_path / "run" / "bundles" / "cpu-laptop" / "round-0001" / "manifest.json").is_file()


def test_every_file_the_pages_name_exists():
    roots = "ciders_edge|ciders_cloud|export|benchmarks|tests|tools|device_profiles|docs"
    missing = {}
    for page in PAGES:
        paths = set(re.findall(rf"`((?:{roots})/[\w./-]*)`", page.read_text(encoding="utf-8")))
        if gone := sorted(p for p in paths if not (ROOT / p).exists()):
            missing[page.name] = gone
    assert not missing, f"pages name files that do not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_slug_is_githubs():
    assert slug("Bundle storage (`bundle_size.py`)") == "bundle-storage-bundle_sizepy"
    assert slug("5. Files that travel") == "5-files-that-travel"


def test_every_link_and_anchor_resolves_inside_the_repository():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{page.name}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_no_page_names_a_path_outside_the_repository():
    outside = {p.name: re.findall(r"`(\.\./[^`]*)`", p.read_text(encoding="utf-8")) for p in PAGES}
    assert not {k: v for k, v in outside.items() if v}, outside
