"""What the CLIs share: one-line errors, quiet libraries, the ``--json`` last line, tables that never cut a key."""

from __future__ import annotations

import errno
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.cells import cell_len
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ciders_edge.errors import CidersError, ConfigError
from ciders_edge.progress import console

__all__ = [
    "run_command",
    "file_error",
    "FILE_ERRNOS",
    "quiet_libraries",
    "key_table",
    "print_table",
    "JsonOpt",
    "BackboneOpt",
    "BaseModelOpt",
    "MessengerOpt",
    "GlobalOpt",
    "messenger_choice",
]

FILE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "ENOENT", "EEXIST", "ENOTDIR", "EISDIR", "EACCES", "EPERM")
    + ("ENAMETOOLONG", "ENOTEMPTY", "ETXTBSY", "EMLINK")
    if hasattr(errno, name)
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary as the last line.")]
BackboneOpt = Annotated[
    str | None,
    typer.Option(help="full (AdapFu: the messenger on the full backbone) or emu (the AdapEmu); default: the bundle's."),
]
FrozenOpt = Annotated[
    str | None,
    typer.Option(
        help="int8/int4 frozen weights in memory: quantized (as the bundle ships them, dequantized per matmul) "
        "or dequantized (float from load); default: the profile's.",
        show_default=False,
    ),
]
BaseModelOpt = Annotated[
    str | None,
    typer.Option(help="With --backbone full: a local copy of the base model (checked against the bundle's hash)."),
]

MessengerOpt = Annotated[
    str | None,
    typer.Option(
        help="best (what the state's validation chose; the default), latest (its last personalized one) or global "
        "(the bundle's).",
        show_default=False,
    ),
]
GlobalOpt = Annotated[bool, typer.Option("--global", help="The bundle's global messenger: --messenger global.")]


def messenger_choice(messenger: str | None, use_global: bool) -> str:
    """``--messenger`` (default ``best``), with ``--global`` its shorthand for ``global``."""
    if use_global and messenger not in (None, "global"):
        raise ConfigError(f"--global and --messenger {messenger} disagree; pass one")
    choice = "global" if use_global else messenger or "best"
    if choice not in ("best", "latest", "global"):
        raise ConfigError(f"--messenger must be one of best, latest, global; got {choice!r}")
    return choice


def quiet_libraries() -> None:
    """Silence library chatter that is noise to a CLI user (progress is ours)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(peft|transformers|torch)\..*")


def run_command(fn: Callable[[], dict[str, Any]], as_json: bool, render: Callable[[dict], None] | None = None) -> None:
    """Run a command body; a :class:`CidersError` becomes one line on stderr and exit code 1, and so
    does an OSError of the file system the user chose (a full disk, a read-only mount, a missing
    folder, a file where a folder should be: :data:`FILE_ERRNOS`), named by :func:`file_error`.

    With ``as_json`` the summary is printed as the last line of stdout, else ``render`` shows it.
    """
    quiet_libraries()
    try:
        summary = fn()
    except CidersError as err:
        console.print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except OSError as err:
        if err.errno not in FILE_ERRNOS:
            raise
        console.print(f"[red]error:[/] {escape(file_error(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]; saved state is unchanged")
        raise typer.Exit(130) from None
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    elif render is not None:
        render(summary)


def file_error(err: OSError) -> str:
    """An OSError as one line naming the path(s), the errno's meaning and its name:
    ``/mnt/ro/out: Read-only file system (EROFS)``."""
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    name = errno.errorcode.get(err.errno, err.errno)
    if err.errno in (errno.EEXIST, errno.ENOTDIR) and (file := _file_in_the_way(err.filename)):
        return f"{file}: is a file, not a folder ({name})"
    what = f"{err.strerror or os.strerror(err.errno)} ({name})"
    return f"{where}: {what}" if where else what


def _file_in_the_way(name: object) -> Path | None:
    """The path itself or the nearest parent that exists and is not a folder (``--out FILE/x``)."""
    if not isinstance(name, str | os.PathLike):
        return None
    path = Path(name)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def key_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    keys: int = 1,
    whole_headers: bool = False,
    show_header: bool = True,
    title: str | None = None,
) -> Table:
    """A frameless table whose first ``keys`` columns (names, ids, the row label) are never wrapped or cut.

    Piped output is 80 columns and a terminal may be narrower: the key columns are ``no_wrap`` and as
    wide as their longest value, the others fold. ``whole_headers`` keeps every header whole too (where
    the headers are keys, e.g. evaluate's file names). Print it with :func:`print_table`.
    """
    table = Table(box=None, collapse_padding=True, pad_edge=False, show_header=show_header, title=title)
    for i, name in enumerate(header):
        width = max([cell_len(name), *(cell_len(r[i]) for r in rows)] if i < keys else [cell_len(name)])
        if i < keys:
            table.add_column(name, no_wrap=True, min_width=width)
        elif whole_headers:
            table.add_column(Text(name, no_wrap=True), overflow="fold", min_width=width)
        else:
            table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_table(table: Table) -> None:
    """Print a :func:`key_table`; where its keys are wider than the terminal the lines run long, never cut."""
    console.print(table, crop=False)
