"""What every ``tracker`` command shares: settings, consoles, errors, the store, output helpers."""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tracker.errors import InvalidInput, SchemaOutOfDate, TrackerError
from tracker.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core import Policy
    from tracker.store.sql import SqlEventStore

console = Console(width=None if sys.stdout.isatty() else 150)
err_console = Console(stderr=True)

# beyond this many rows a table is printed line by line as the rows come (constant memory)
TABLE_MAX_ROWS = 2000


def fail(exc: TrackerError, as_json: bool = False) -> NoReturn:
    """Print a typed error (JSON on stdout with ``--json``, else one line on stderr) and exit 2."""
    if as_json:
        print(json.dumps(exc.to_dict()))
    else:
        # soft_wrap: a hint such as `tracker db upgrade` must not be broken across lines;
        # escape: the message may quote user input, which is not Rich markup
        err_console.print(f"[bold red]error[/] ({exc.code}): {escape(str(exc.message or exc))}", soft_wrap=True)
    raise typer.Exit(2)


def invalid(field: str, problem: str) -> InvalidInput:
    return InvalidInput(field, problem)


@functools.cache
def settings() -> Settings:
    """This process's settings: ``TRACKER_*`` read once; an invalid variable stops the command (exit 2)."""
    try:
        return Settings.load()
    except TrackerError as exc:
        fail(exc, as_json="--json" in sys.argv[1:])


# -- the store ---------------------------------------------------------------------------------


def sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for other databases and in-memory SQLite)."""
    if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(url[len("sqlite:///") :].split("?", 1)[0])


def require_database_file(url: str) -> None:
    """Refuse a SQLite file that does not exist: opening it would create an empty one (or fail on a
    missing directory with a bare OperationalError)."""
    path = sqlite_file(url)
    if path is not None and not path.exists():
        raise SchemaOutOfDate(f"no database at {path}; run `tracker db upgrade`", database=str(path))


def open_store(as_json: bool = False) -> SqlEventStore:
    """The event store of this process's settings, its schema checked (else a clear error and exit 2)."""
    from tracker.bootstrap import build_store
    from tracker.core import SessionProjector

    s = settings()
    try:
        require_database_file(s.store.database_url)
        return build_store(s.store, projector=SessionProjector())
    except TrackerError as exc:
        fail(exc, as_json)


@contextmanager
def store_open(as_json: bool = False) -> Iterator[SqlEventStore]:
    """``with store_open(as_json) as store:`` – closed at the end; a typed error is printed and exits 2."""
    store = open_store(as_json)
    try:
        yield store
    except TrackerError as exc:
        fail(exc, as_json)
    finally:
        store.close()


def redact(url: str) -> str:
    """A database URL with its password hidden."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL SQLAlchemy can parse: nothing to hide in it
        return url


# -- output ------------------------------------------------------------------------------------


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """``data`` as one JSON document with ``--json``, else ``human(data)`` (a table or a sentence)."""
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human(data)


def print_table(title: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> None:
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*row)
    console.print(t)


def print_rows(title: str, columns: tuple[str, ...], rows: Iterable[Iterable[str]], stream: bool) -> None:
    """A Rich table for small outputs; for long ones, one line per row as it comes (constant memory)."""
    if stream:
        console.print(f"[bold]{title}[/]  " + " | ".join(columns))
        for row in rows:
            console.print(" | ".join(row), highlight=False)
        return
    print_table(title, columns, rows)


def print_json_lines(items: Iterable[Any]) -> None:
    for item in items:
        print(json.dumps(item))


# -- options -----------------------------------------------------------------------------------

COMPACT_AT = typer.Option(None, "--compact-at", help="compact_at_bp (basis points, default 8000)")
REARM_BELOW = typer.Option(None, "--rearm-below", help="rearm_below_bp (basis points, default 6000)")
TURN_DELTA = typer.Option(None, "--turn-delta", help="growth trigger in (0, 1]; off by default")
OBSERVE_ONLY = typer.Option(False, "--observe-only", help="never compact automatically (automatic=false)")
MAX_AUTO = typer.Option(None, "--max-automatic-per-episode", help="loop breaker (default 3)")


def policy_from_flags(
    compact_at: int | None,
    rearm_below: int | None,
    turn_delta: float | None,
    observe_only: bool,
    max_automatic_per_episode: int | None,
    base: Policy | None = None,
) -> Policy:
    """``base`` (default: the default policy) with the policy flags that were given applied."""
    from tracker.core import Policy

    policy = base or Policy()
    changes: dict[str, Any] = {}
    if compact_at is not None:
        changes["compact_at_bp"] = compact_at
    if rearm_below is not None:
        changes["rearm_below_bp"] = rearm_below
    if turn_delta is not None:
        changes["turn_delta"] = turn_delta
    if observe_only:
        changes["automatic"] = False
    if max_automatic_per_episode is not None:
        changes["max_automatic_per_episode"] = max_automatic_per_episode
    return policy.replace(**changes) if changes else policy


def parse_since(text: str, as_json: bool) -> dt.datetime:
    """An ISO time, or a duration back from now like ``15m``, ``2h``, ``1d`` (UTC)."""
    m = re.fullmatch(r"(\d+)([smhd])", text.strip())
    now = dt.datetime.now(dt.UTC)
    if m:
        n, unit = int(m.group(1)), m.group(2)
        return now - dt.timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: n})
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        fail(invalid("since", f"must be an ISO time or a duration like 15m, got {text!r}"), as_json)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
