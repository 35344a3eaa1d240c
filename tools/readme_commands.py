"""Rewrite docs/commands.md, the command reference, from the typer apps, so the options it lists are the CLIs' own.

``make readme`` runs it; ``--check`` only says whether the page is current (``tests/test_readme.py``
fails when it is not). The section sits between :data:`START` and :data:`END`.
"""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path

import click
import typer
import typer.main
from typer.models import ParameterInfo

PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
START, END = "<!-- commands:start -->", "<!-- commands:end -->"
JSON_HELP = "Print a machine-readable summary as the last line."  # every command's --json, said once


def apps() -> list[tuple[str, typer.Typer]]:
    """The CLIs by program name; ``ciders-edge`` holds the commands ``export`` registers into it."""
    from ciders_cloud.cli import app as cloud
    from ciders_edge.cli import app as edge

    return [("ciders-cloud", cloud), ("ciders-edge", edge)]


def render() -> str:
    """The generated section, markers excluded."""
    lines = [
        "Generated from the CLIs by `make readme` (`tools/readme_commands.py`). Every command also takes `--json`:",
        f"{JSON_HELP[0].lower()}{JSON_HELP[1:]}",
        "",
    ]
    for prog, app in apps():
        group = typer.main.get_command(app)
        ctx = click.Context(group, info_name=prog)
        lines += [f"## `{prog}`", "", _text(group.help), ""]
        for name in group.list_commands(ctx):
            lines += _command(prog, name, group.get_command(ctx, name))
    return "\n".join(lines).rstrip() + "\n"


def _command(prog: str, name: str, command: click.Command) -> list[str]:
    lines = [f"### `{prog} {name}`", "", _text(command.help), ""]
    rows = [_row(command, p) for p in command.params if getattr(p, "help", None) != JSON_HELP]
    if rows:
        lines += ["| option | meaning | default |", "|---|---|---|", *rows, ""]
    return lines


def _row(command: click.Command, p: click.Parameter) -> str:
    if isinstance(p, click.Argument):
        name = p.name.upper() if p.required else f"[{p.name.upper()}]"
        help_ = _argument_help(command, p.name)
    elif isinstance(p, click.Option) and p.is_flag:
        name, help_ = " / ".join(p.opts + p.secondary_opts), p.help or ""
    else:
        name, help_ = f"{' '.join(p.opts)} {p.type.name.upper()}", p.help or ""
    if p.multiple and "repeatable" not in help_:
        help_ += " Repeatable."
    return f"| `{name}` | {_text(help_)} | {_default(p)} |"


def _argument_help(command: click.Command, name: str) -> str:
    """A positional argument's help, read from its typer annotation (click >= 8.3 drops typer's)."""
    hints = typing.get_type_hints(inspect.unwrap(command.callback), include_extras=True)
    infos = [m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, ParameterInfo)]
    return (infos[0].help or "") if infos else ""


def _default(p: click.Parameter) -> str:
    if p.required:
        return "required"
    if isinstance(p, click.Option) and p.is_flag and p.default is not None:  # None: decided elsewhere (a profile)
        return "on" if p.default else "off"
    if p.default is None or p.default == ():
        return "—"
    return f"`{p.default}`"


def _text(text: str | None) -> str:
    """One line, safe in a markdown table cell."""
    return " ".join((text or "").split()).replace("|", "\\|")


def rewrite(readme: str, section: str) -> str:
    """``readme`` with the text between the markers replaced by ``section``."""
    head, start, rest = readme.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"{PAGE}: no {START} ... {END} section")
    return f"{head}{START}\n{section}{END}{tail}"


def main() -> None:
    text = PAGE.read_text(encoding="utf-8")
    new = rewrite(text, render())
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == text else f"{PAGE}: the command reference is stale; run `make readme`")
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
        print(f"{PAGE}: command reference rewritten")


if __name__ == "__main__":
    main()
