"""The ``tracker`` command line (Typer + Rich): one package, one module per command group.

* :mod:`tracker.cli.sessions`  observe, sessions, history, replay, export, verify
* :mod:`tracker.cli.ops`       db upgrade, worker, serve, demo, whatif, bench
* :mod:`tracker.cli.fleets`    fleet and key commands
* :mod:`tracker.cli._common`   settings, errors, the store, output helpers

Every command runs with the settings read once at start (``TRACKER_*``); an invalid variable
stops any command with a one-line error naming it (exit 2). The console script is
``tracker = tracker.cli:app``; ``python -m tracker.cli`` is the same.
"""

from __future__ import annotations

import sys

import typer

from tracker.cli import fleets, ops, sessions
from tracker.cli._common import settings

app = typer.Typer(
    name="tracker",
    help="Context Tracker: decide when LLM agents must compact their context, and keep the record.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _load_settings() -> None:
    """Read the settings before any command runs (help needs none)."""
    if "--help" not in sys.argv[1:]:
        settings()


app.add_typer(ops.app)
app.add_typer(ops.db_app, name="db")
app.add_typer(sessions.app)
app.add_typer(fleets.fleet_app, name="fleet")
app.add_typer(fleets.key_app, name="key")


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "main"]
