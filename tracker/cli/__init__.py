"""The ``tracker`` command line (Typer + Rich): one package, one module per command group.

* :mod:`tracker.cli.sessions`  observe, sessions, history, replay, export, verify
* :mod:`tracker.cli.reports`   usage, rejection, calibration (the provider's numbers)
* :mod:`tracker.cli.ops`       db upgrade, worker, serve, demo, whatif, bench
* :mod:`tracker.cli.fleets`    fleet and key commands
* :mod:`tracker.cli._common`   settings, errors, the store, output helpers

Every command runs with the settings read once at start (``TRACKER_*``); an invalid variable
stops any command with a one-line error naming it (exit 2). The console script is
``tracker = tracker.cli:app``; ``python -m tracker.cli`` is the same.

One error boundary (:class:`Guarded`) turns what escapes a command into one line on stderr (JSON on
stdout with ``--json``) and exit 2: a typed ``TrackerError``, a usage error (naming the option), an
``OSError`` (a file that cannot be read or written), input nested too deeply. No traceback.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

import typer
from typer._click.exceptions import UsageError  # typer's bundled click: the base of its usage errors
from typer.core import TyperGroup

from tracker.cli import fleets, ops, reports, retention, sessions
from tracker.cli._common import fail, invalid, settings
from tracker.errors import TrackerError


class Guarded(TyperGroup):
    """The root command: every subcommand runs inside this error boundary."""

    def invoke(self, ctx: Any) -> Any:
        as_json = "--json" in sys.argv[1:]
        try:
            return super().invoke(ctx)
        except TrackerError as exc:
            fail(exc, as_json)
        except typer.BadParameter as exc:  # typer's own checks (e.g. not an integer), a missing option
            param = exc.param
            if param is None or not param.name:
                fail(invalid("usage", exc.format_message()), as_json)
            opts = [o for o in param.opts if o.startswith("--")]
            if not opts:  # an argument
                fail(invalid(param.name, exc.message), as_json)
            problem = exc.message or "is required"  # a missing option has no message of its own
            fail(invalid(max(opts, key=len).lstrip("-"), f"{problem} ({max(opts, key=len)})"), as_json)
        except UsageError as exc:  # no such option, an extra argument, an unknown command
            fail(invalid("usage", exc.format_message()), as_json)
        except RecursionError:
            fail(invalid("input", "nests too deeply to read"), as_json)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # `tracker export | head`: typer's own quiet exit
                raise
            # a file named on the command line that cannot be read or written (the door checks the
            # rest: a missing folder, a folder given as a file)
            where = "" if exc.filename is None else f": {exc.filename}"
            fail(invalid("file", f"{exc.strerror or type(exc).__name__}{where}"), as_json)


app = typer.Typer(
    cls=Guarded,
    name="tracker",
    help="Context Tracker: decide when LLM agents must compact their context, and keep the record.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        print(f"context-tracker {ops.package_version()}")
        raise typer.Exit()


@app.callback()
def _load_settings(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_show_version, is_eager=True
    ),
) -> None:
    """Read the settings before any command runs (help needs none)."""
    if "--help" not in sys.argv[1:]:
        settings()


def _flags_take_no_value() -> None:
    """Typer's rich help shows a type beside every option, ``--json <bool>`` included; a flag takes no
    value, so its type column is left empty (the plain-text help already does this)."""
    from typer.core import TyperOption

    show_type = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and not self.count else show_type(self, ctx)

    setattr(TyperOption, "display_type_rich", display_type_rich)  # noqa: B010 - a method replaced on purpose


_flags_take_no_value()


app.add_typer(ops.app)
app.add_typer(ops.db_app, name="db")
app.add_typer(sessions.app)
app.add_typer(retention.app)
app.add_typer(reports.app)
app.add_typer(fleets.fleet_app, name="fleet")
app.add_typer(fleets.key_app, name="key")


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "main"]
