"""``ciders-cloud``: prepare a run and move it on, simulate and report studies, serve a fleet.

One module per command group: :mod:`.run` (prepare, distill, aggregate), :mod:`.study` (simulate,
report, demo-data), :mod:`.fleet` (serve, certs). Each command parses its flags, calls one library
function and prints; ``--json`` prints the same summary as JSON.
"""

from __future__ import annotations

import typer

from ciders_cloud.cli import fleet, run, study

__all__ = ["app", "main"]

app = typer.Typer(
    help="CIDERS cloud: prepare models, distill, ship AdapEmu bundles.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for command in (run.prepare, run.distill, run.aggregate, study.simulate, study.report, fleet.serve, fleet.certs):
    app.command()(command)
app.command("demo-data")(study.demo_data)


def main() -> None:
    app()
