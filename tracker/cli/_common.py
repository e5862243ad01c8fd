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
from rich.text import Text

from tracker.core.model import JSON_SAFE_INT
from tracker.errors import InvalidInput, TrackerError

if TYPE_CHECKING:  # pragma: no cover
    from tracker.bootstrap import Storage
    from tracker.core import Policy
    from tracker.settings import Settings
    from tracker.store.sql import SqlEventStore

# emoji=False: an ``:emoji_name:`` in recorded data is shown as typed, never replaced
console = Console(width=None if sys.stdout.isatty() else 150, emoji=False)
err_console = Console(stderr=True, emoji=False)

# the largest integer every JSON reader holds exactly (the HTTP API's bound too)

# beyond this many rows a table is printed line by line as the rows come (constant memory)
TABLE_MAX_ROWS = 2000


def fail(exc: TrackerError, as_json: bool = False) -> NoReturn:
    """Print a typed error (JSON on stdout with ``--json``, else one line on stderr) and exit 2."""
    if as_json:
        print(json.dumps(exc.to_dict()))
    else:
        # soft_wrap: a hint such as `tracker db upgrade` must not be broken across lines;
        # escape: the message may quote user input, which is not Rich markup
        err_console.print(f"[bold red]error[/] ({exc.code}): {plain(str(exc.message or exc))}", soft_wrap=True)
    raise typer.Exit(2)


def invalid(field: str, problem: str) -> InvalidInput:
    return InvalidInput(field, problem)


@functools.cache
def settings() -> Settings:
    """This process's settings: ``TRACKER_*`` read once; an invalid variable stops the command (exit 2)."""
    from tracker.settings import Settings  # pydantic-settings: loaded by a command, not by --help

    try:
        return Settings.load()
    except TrackerError as exc:
        fail(exc, as_json="--json" in sys.argv[1:])


# -- the store ---------------------------------------------------------------------------------


def open_storage(as_json: bool = False, *, read: bool = False) -> Storage:
    """The event store of this process's settings with its views and fleets (one engine), from the
    composition root (``bootstrap.build_reader``): the schema checked, a missing embedded database
    refused (else a clear error and exit 2). ``read``: the read side's (the replica of
    ``TRACKER_READ_DATABASE_URL`` when set)."""
    from tracker.bootstrap import build_reader

    try:
        return build_reader(settings(), read=read)
    except TrackerError as exc:
        fail(exc, as_json)


@contextmanager
def storage_open(as_json: bool = False, *, read: bool = False) -> Iterator[Storage]:
    """``with storage_open(as_json) as db:`` -- ``db.store``, ``db.views``, ``db.fleets``; closed at
    the end; a typed error is printed and exits 2. ``read``: on the read side (``open_storage``)."""
    db = open_storage(as_json, read=read)
    try:
        yield db
    except TrackerError as exc:
        fail(exc, as_json)
    finally:
        db.close()


@contextmanager
def store_open(as_json: bool = False) -> Iterator[SqlEventStore]:
    """``with store_open(as_json) as store:`` -- the event store alone (``storage_open``)."""
    with storage_open(as_json) as db:
        yield db.store


def redact(url: str) -> str:
    """A database URL with its password hidden."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL SQLAlchemy can parse: nothing to hide in it
        return url


# -- output ------------------------------------------------------------------------------------
#
# Recorded strings (reject reasons, model names, paths, trace ops) were written by API clients, old
# versions or other writers: they reach the terminal only through ``visible`` (control characters and
# lone surrogates shown as ``\x1b``, ``\ud800``) and never as Rich markup. Table cells and titles are
# data (``print_table``/``print_rows`` do both); a styled cell is a ``Text`` (``styled``); a sentence
# with markup interpolates data through ``plain``.

# C0/C1 controls (ESC, NUL, CR, BEL ...), lone surrogates (not text), bidirectional overrides
_UNSAFE_OUTPUT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def visible(value: Any) -> str:
    """``value`` as text safe for a terminal: each control character or lone surrogate as its escape."""
    return _UNSAFE_OUTPUT.sub(lambda m: ascii(m.group())[1:-1], str(value))


def plain(value: Any) -> str:
    """``value`` for a Rich markup string: visible, and its brackets not read as markup."""
    return escape(visible(value))


def styled(value: Any, style: str = "") -> Text:
    """A table cell or sentence part in ``style``, its text shown as it is (visible, no markup)."""
    return Text(visible(value), style=style)


def pressure_cell(pressure: Any) -> Text:
    """A pressure coloured by severity (an unknown value from an old writer: as it is, no colour)."""
    from tracker.audit.format import PRESSURE_STYLE

    return styled(pressure, PRESSURE_STYLE.get(pressure, ""))


def _cell(value: str | Text) -> Text:
    return value if isinstance(value, Text) else Text(visible(value))


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """``data`` as one JSON document with ``--json``, else ``human(data)`` (a table or a sentence)."""
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human(data)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 key``, ``2 keys``, ``0 sessions`` (``many``: an irregular plural)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


Cell = str | Text


def print_table(title: str, columns: Iterable[str], rows: Iterable[Iterable[Cell]]) -> None:
    """A Rich table. The title and ``str`` cells are data, shown as they are (see ``visible``); a
    ``Text`` cell keeps its style."""
    t = Table(title=_cell(title))
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*map(_cell, row))
    console.print(t)


def print_rows(title: str, columns: tuple[str, ...], rows: Iterable[Iterable[Cell]], stream: bool) -> None:
    """A Rich table for small outputs; for long ones, one line per row as it comes (constant memory)."""
    if stream:
        console.print(Text.assemble(styled(title, "bold"), "  " + " | ".join(columns)))
        for row in rows:
            console.print(Text(" | ").join(map(_cell, row)), highlight=False)
        return
    print_table(title, columns, rows)


def print_json_lines(items: Iterable[Any]) -> None:
    for item in items:
        print(json.dumps(item))


# -- options -----------------------------------------------------------------------------------
#
# Checked at the door, before any database is opened: a bad value is a typed ``InvalidInput`` naming
# the option (one line, exit 2; JSON with ``--json``), printed by the error boundary of
# ``tracker.cli`` (``Guarded``).


def option_field(param: typer.CallbackParam) -> str:
    """What the user typed for ``param``: ``limit`` for ``--limit``, ``session_id`` for an argument."""
    opts = [o for o in param.opts if o.startswith("--")]
    return max(opts, key=len).lstrip("-") if opts else (param.name or "value")


def shown_int(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}… ({len(text)} digits)"


def int_between(lo: int, hi: int = JSON_SAFE_INT) -> Callable[[typer.CallbackParam, int | None], int | None]:
    """An option callback: the integer is in ``[lo, hi]`` (by default at most 2**53-1, JSON-safe)."""

    def check(param: typer.CallbackParam, value: int | None) -> int | None:
        if value is not None and not lo <= value <= hi:
            raise invalid(option_field(param), f"must be an integer from {lo} to {hi}, got {shown_int(value)}")
        return value

    return check


def identifier(param: typer.CallbackParam, value: str | None) -> str | None:
    """An option callback for names and ids: no control characters or lone surrogates (they would
    reach a terminal), at most 1000 characters; the service checks the rest."""
    from tracker.core.model import check_text

    return None if value is None else check_text(option_field(param), value, max_len=1000)


def new_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An option callback for a file to write: not a folder, in a folder that exists."""
    if value is None:
        return None
    field = option_field(param)
    if not str(value).strip() or value.is_dir():
        raise invalid(field, f"{str(value)!r} is a folder, not a file name")
    folder = value.parent
    if not folder.is_dir():
        raise invalid(field, f"cannot write {value}: the folder {folder} does not exist")
    return value


def existing_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An option callback for a file to read: it exists and is not a folder."""
    if value is not None and not value.is_file():
        what = "is a folder, not a file" if value.is_dir() else "does not exist"
        raise invalid(option_field(param), f"{value} {what}")
    return value


# any JSON-safe integer: the policy says what is in range
POLICY_INT = int_between(-JSON_SAFE_INT)
COMPACT_AT = typer.Option(None, "--compact-at", help="compact_at_bp (basis points, default 8000)", callback=POLICY_INT)
REARM_BELOW = typer.Option(
    None, "--rearm-below", help="rearm_below_bp (basis points, default 6000)", callback=POLICY_INT
)
TURN_DELTA = typer.Option(None, "--turn-delta", help="growth trigger in (0, 1]; off by default")
OBSERVE_ONLY = typer.Option(False, "--observe-only", help="never compact automatically (automatic=false)")
MAX_AUTO = typer.Option(None, "--max-automatic-per-episode", help="loop breaker (default 3)", callback=POLICY_INT)


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
        try:
            return now - dt.timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: n})
        except (OverflowError, ValueError):  # before the year 1, or beyond what a duration holds
            fail(invalid("since", f"{shown_int(n)}{unit} reaches back before the year 1"), as_json)
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        fail(invalid("since", f"must be an ISO time or a duration like 15m, got {text!r}"), as_json)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
