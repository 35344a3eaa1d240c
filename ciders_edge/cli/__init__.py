"""``ciders-edge``: the on-device runtime's commands.

One module per group: :mod:`~ciders_edge.cli.device` (profiles, verify), :mod:`~ciders_edge.cli.rounds`
(train, validate, keygen, join) and :mod:`~ciders_edge.cli.inference` (infer, evaluate). Other packages add
commands through the ``ciders_edge.commands`` entry-point group (``export`` adds export and bench).
"""

from __future__ import annotations

import os

# libraries' own tqdm bars (transformers' GGUF loader, the GenAI builder) are noise beside ours; tqdm reads
# this when first imported, and torch imports it, so it is set before anything else loads
os.environ.setdefault("TQDM_DISABLE", "1")

from importlib.metadata import entry_points

import typer

from ciders_edge.cli import device, inference, rounds
from ciders_edge.progress import console

__all__ = ["app", "main"]

app = typer.Typer(
    help="CIDERS edge runtime: train the messenger, infer, export, benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

COMMANDS = (  # in the order `--help` lists them
    device.profiles,
    device.verify,
    rounds.train,
    rounds.validate,
    inference.infer,
    inference.evaluate,
    rounds.keygen,
    rounds.join,
)
for _command in COMMANDS:
    app.command()(_command)


def _add_plugin_commands() -> None:
    """Commands other packages contribute, so this light runtime never imports them itself."""
    for ep in entry_points(group="ciders_edge.commands"):
        try:
            app.command(ep.name)(ep.load())
        except ImportError as err:  # a broken plugin must not take `train` down with it
            console.print(f"[yellow]notice:[/] command {ep.name!r} unavailable ({err})", soft_wrap=True)


_add_plugin_commands()


def main() -> None:
    app()
