"""What both CLIs share: one-line errors, quiet libraries, the ``--json`` last line."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Annotated, Any

import typer

from ciders_edge.errors import CidersError
from ciders_edge.progress import console

__all__ = ["run_command", "quiet_libraries", "JsonOpt", "BackboneOpt", "BaseModelOpt"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary as the last line.")]
BackboneOpt = Annotated[
    str | None,
    typer.Option(help="full (AdapFu: the messenger on the full backbone) or emu (the AdapEmu); default: the bundle's."),
]
BaseModelOpt = Annotated[
    str | None,
    typer.Option(help="With --backbone full: a local copy of the base model (checked against the bundle's hash)."),
]


def quiet_libraries() -> None:
    """Silence library chatter that is noise to a CLI user (progress is ours)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(peft|transformers|torch)\..*")


def run_command(fn: Callable[[], dict[str, Any]], as_json: bool, render: Callable[[dict], None] | None = None) -> None:
    """Run a command body; a :class:`CidersError` becomes one line on stderr and exit code 1.

    With ``as_json`` the summary is printed as the last line of stdout, else ``render`` shows it.
    """
    quiet_libraries()
    try:
        summary = fn()
    except CidersError as err:
        console.print(f"[red]error:[/] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]; saved state is unchanged")
        raise typer.Exit(130) from None
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    elif render is not None:
        render(summary)
