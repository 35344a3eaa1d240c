"""The fleet commands: ``serve`` the rounds on a Flower SuperLink, make its TLS material with ``certs``.

Flower is imported inside the commands, so the other commands start without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ciders_cloud.cli.run import locked
from ciders_edge.cli_utils import JsonOpt, key_table, print_table, run_command
from ciders_edge.progress import console

__all__ = ["serve", "certs"]


def serve(
    run: Annotated[Path, typer.Option(help="Run folder made by `prepare`; edge keys in RUN/nodes/<id>.pub.")],
    rounds: Annotated[int, typer.Option(help="Run until this many rounds are complete (a restart resumes).")],
    min_clients: Annotated[int, typer.Option(help="Edges to wait for before a round (then whoever is there).")] = 1,
    address: Annotated[str, typer.Option(help="HOST:PORT the SuperLink listens on.")] = "0.0.0.0:9092",
    round_timeout: Annotated[float, typer.Option(help="Seconds to wait for edges and their replies.")] = 600.0,
    certs: Annotated[Path | None, typer.Option(help="Folder from `ciders-cloud certs` (default RUN/certs).")] = None,
    connect: Annotated[bool, typer.Option(help="Use the SuperLink running on this host.")] = False,
    secure_aggregation: Annotated[
        bool,
        typer.Option(help="Sum the edges' displacements by Flower's SecAgg+: the cloud sees only their mean."),
    ] = False,
    rechoose: Annotated[
        bool,
        typer.Option(
            help="After each round, every online edge that holds a choice chooses its deployed messenger again on "
            "the new bundle (`ciders-edge validate`, Flower's evaluate messages; edges join with --val-fraction)."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the rounds over the network on a Flower SuperLink; edges join with `ciders-edge join`."""
    from ciders_cloud.fleet.serve import ServeSettings
    from ciders_cloud.fleet.serve import serve as serve_fleet

    def render(s: dict) -> None:
        rows = [
            (str(r["round"]), r["client"], r.get("status", ""), f"{r['bytes_down']:,}", f"{r['bytes_up']:,}")
            for r in s["clients"]
        ]
        header = ("round", "client", "status", "bytes down", "bytes up")
        print_table(key_table(header, rows, keys=2, title=f"fleet {s['run']}"))
        done = "complete" if s["complete"] else "not complete"
        console.print(f"[green]✓[/] run at round {s['round']} of {s['rounds']} ({done})")

    opts = dict(min_clients=min_clients, address=address, round_timeout=round_timeout, certs=certs)
    opts.update(secure_aggregation=secure_aggregation, rechoose=rechoose)
    body = locked(run, "serve", lambda: serve_fleet(ServeSettings(run, rounds, connect=connect, **opts)))
    run_command(body, as_json, render)


def certs(
    out: Annotated[Path, typer.Option(help="Folder for ca.crt and server.pem/server.key.")],
    host: Annotated[
        list[str] | None, typer.Option(help="Name or IP the edges use to reach the cloud (repeatable).")
    ] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
    ca_key: Annotated[
        Path | None,
        typer.Option(help="Where to keep the CA's private key, outside --out (offline media); default: discard it."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a private CA and the SuperLink's TLS certificate (for a deployment or a test)."""
    from ciders_cloud.fleet.certs import make_certs

    def render(s: dict) -> None:
        kept = f"CA key in {s['ca_key']}" if s["ca_key"] else "CA key discarded (--ca-key PATH keeps it)"
        console.print(f"[green]✓[/] CA {s['ca']} and server certificate for {', '.join(s['hosts'])}; {kept}")

    run_command(lambda: make_certs(out, host or [], days, ca_key), as_json, render)
