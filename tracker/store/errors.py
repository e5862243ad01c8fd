"""The one place where database driver errors become the tracker's typed errors.

    with map_db_errors("append"):
        ...  # SQLAlchemy, sqlite3 or psycopg calls

Inside the block, a driver or SQLAlchemy exception is re-raised as
``StoreUnavailable`` when the database cannot be reached (connection lost or
refused, server stopped, ``database is locked`` beyond the busy timeout, no pooled
connection free in time), else as ``StoreError``; the original stays as
``__cause__``. The tracker's own errors pass through unchanged. (The shape is
httpx's ``map_httpcore_exceptions``.) The event store, its PostgreSQL fast path, the
read side's views, the fleet store and the migrations all use it, so "unavailable" means
the same everywhere. ``run_core`` runs one read on a Core connection through it.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import exc as sa_exc

from tracker.errors import StoreError, StoreUnavailable, TrackerError

__all__ = ["db_errors", "is_unavailable", "map_db_errors", "run_core", "to_store_error"]

#: Errors meaning "the database cannot be reached now". ``sa_exc.TimeoutError``: no pooled
#: connection free within pool_timeout (every connection busy, e.g. many request threads of
#: ``tracker serve`` at once) -- the database is unavailable to us now. (And psycopg's
#: ``OperationalError`` / ``InterfaceError``: ``_psycopg_errors``.)
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    sqlite3.OperationalError,
)


def _psycopg_errors(*names: str) -> tuple[type[BaseException], ...]:
    """psycopg's error classes ``names``, if this process has loaded psycopg. It is not imported
    here: a process on SQLite never loads it (a CLI command starts faster), and a psycopg error
    can only come from a process that has (every PostgreSQL engine and fast path imports it)."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return ()
    return tuple(getattr(psycopg, name) for name in names)


def db_errors() -> tuple[type[BaseException], ...]:
    """Every exception a database call can raise that ``map_db_errors`` translates."""
    return (sa_exc.SQLAlchemyError, sqlite3.Error, *_psycopg_errors("Error"))


def is_unavailable(exc: BaseException) -> bool:
    """True if the driver/SQLAlchemy error ``exc`` means the database cannot be reached
    (rather than that it refused a statement)."""
    if isinstance(exc, _UNAVAILABLE + _psycopg_errors("OperationalError", "InterfaceError")):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def to_store_error(exc: BaseException, what: str) -> TrackerError:
    """The typed error for a driver/SQLAlchemy exception raised during ``what``."""
    if isinstance(exc, TrackerError):
        return exc
    text = str(exc).strip()
    detail = text.splitlines()[0][:300] if text else exc.__class__.__name__
    if is_unavailable(exc):
        return StoreUnavailable(f"the database is unavailable ({what}): {detail}", operation=what)
    return StoreError(f"database error ({what}): {detail}", operation=what)


@contextmanager
def map_db_errors(what: str) -> Iterator[None]:
    """Re-raise database errors of the block as ``StoreUnavailable`` / ``StoreError`` (see the module doc)."""
    try:
        yield
    except TrackerError:
        raise
    except db_errors() as exc:
        raise to_store_error(exc, what) from exc


def run_core(engine: Any, what: str, fn: Callable[[Any], Any]) -> Any:
    """``fn(conn)`` on a Core connection of ``engine``, with typed errors; run once more on a
    fresh connection if the pooled one turned out dead (``connection_invalidated``). Only for
    reads (and look-ups that write nothing): running them twice changes nothing."""
    with map_db_errors(what):
        try:
            with engine.connect() as conn:
                return fn(conn)
        except sa_exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        with engine.connect() as conn:
            return fn(conn)
