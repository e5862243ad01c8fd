"""``SqlSessionViews``: the read side's port (``tracker.store.base.SessionViews``) on SQLite and PostgreSQL.

These reads serve people -- the console, ``tracker sessions``, the session page, the fleet
gauges -- and decide nothing: commands and replay read the log through ``EventStore``. They
share the event store's database (``tracker.bootstrap`` builds both on one engine) and read
its two tables through SQLAlchemy Core: the projection (``sessions``: listings, gauges) and
the log (``events``: the narrow reads of one session's page).

The narrow reads each read only the rows they return, through the index on
``(session_id, type, version)`` (migration 0005), so a page built from them costs about the
same on a 100k-event session as on a 10k one. Input is checked by ``tracker.store.validate``.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, or_, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql import Select

from tracker.core.model import FLEET_SEP, SessionScope
from tracker.store import validate
from tracker.store.base import StoredEvent
from tracker.store.errors import run_core
from tracker.store.postgres import FEED_WATERMARK
from tracker.store.schema import EVENT_COLUMNS, stored_event
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t

__all__ = ["READ_BATCH", "SqlSessionViews"]

READ_BATCH = 2000


# The events above the feed's last visible position: committed (this statement's snapshot sees
# them) but held back by the watermark. The feed shows a prefix of the log in position order, so
# they are exactly these; the inner max reads the position index backwards from the end and stops
# at the first event the watermark passes, so it costs about the events held back.
_FEED_HELD = text(
    "SELECT count(*), min(recorded_at) FROM events WHERE position > coalesce(("
    f"SELECT max(position) FROM events WHERE {FEED_WATERMARK}), 0)"
)


def fleet_of(session_id: ColumnElement[str], dialect: str) -> ColumnElement[str]:
    """:meth:`SessionScope.fleet_of` in SQL (the one rule, written for the database to group by):
    the text before the first ``FLEET_SEP`` of a session id, ``''`` without one."""
    at = func.strpos(session_id, FLEET_SEP) if dialect == "postgresql" else func.instr(session_id, FLEET_SEP)
    return case((at > 0, func.substr(session_id, 1, at - 1)), else_="")


def _upto(to_version: int | None) -> list[Any]:
    return [] if to_version is None else [events_t.c.version <= to_version]


class SqlSessionViews:
    """``SessionViews`` on the event store's database (any engine of it). Thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _run(self, what: str, fn: Any) -> Any:
        return run_core(self._engine, what, fn)

    def _rows(self, what: str, stmt: Select[Any]) -> list[Any]:
        return run_core(self._engine, what, lambda conn: conn.execute(stmt).all())

    # -- listings (tracker.queries: the sessions list, the console) ----------------------------------

    def list_sessions(
        self,
        *,
        pressure: str | None = None,
        active_since: datetime | None = None,
        limit: int = 1000,
        session_prefix: str | None = None,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """All columns of ``sessions``; the prefix is compared with ``substr`` (exact on both backends)."""
        validate.check_list_sessions(limit, active_since, session_prefix, after)
        s = sessions_t.c
        stmt = select(sessions_t)
        if pressure is not None:
            stmt = stmt.where(s.pressure == pressure)
        if active_since is not None:
            if active_since.tzinfo is None:
                active_since = active_since.replace(tzinfo=UTC)
            stmt = stmt.where(s.updated_at >= active_since)
        if session_prefix is not None:
            # substr, not LIKE: SQLite's LIKE is case-insensitive and '_' is a wildcard
            stmt = stmt.where(func.substr(s.session_id, 1, len(session_prefix)) == session_prefix)
        if after is not None:
            at, sid = after
            if at.tzinfo is None:
                at = at.replace(tzinfo=UTC)
            stmt = stmt.where(or_(s.updated_at < at, and_(s.updated_at == at, s.session_id > sid)))
        stmt = stmt.order_by(s.updated_at.desc(), s.session_id).limit(limit)
        return [dict(r._mapping) for r in self._rows("list_sessions", stmt)]

    # -- gauges (tracker.queries.fleet_gauges, at scrape time) ------------------------------------

    def session_summary(self) -> dict[str, Any]:
        """Where the sessions stand, in two grouped reads of the projection (no state is parsed
        except of sessions with an attempt open): ``{"pressure": [(fleet, pressure, sessions,
        open_attempts)], "oldest_open": [(fleet, opened_at)]}``. ``fleet`` is the session id's
        ``SessionScope.fleet_of`` (grouped in SQL by :func:`fleet_of`, the same rule), the fleet
        calibration and the per-fleet feed file the session's events under.
        """
        s = sessions_t.c
        ns = fleet_of(s.session_id, self._engine.dialect.name).label("ns")
        grouped = select(ns, s.pressure, func.count(), func.coalesce(func.sum(s.open_attempts), 0)).group_by(
            ns, s.pressure
        )
        opened = select(s.session_id, s.state).where(s.open_attempts > 0)

        def read(conn: Connection) -> dict[str, Any]:
            rows = [(r[0], r[1], int(r[2]), int(r[3])) for r in conn.execute(grouped).all()]
            oldest: dict[str, float] = {}
            for sid, state in conn.execute(opened):
                data = json.loads(state) if isinstance(state, str) else state
                times = [a.get("opened_at") for a in (data or {}).get("open_attempts", ())]
                times = [t for t in times if isinstance(t, int | float)]
                if not times:
                    continue
                key = SessionScope.fleet_of(sid)
                oldest[key] = min(oldest.get(key, min(times)), min(times))
            return {"pressure": rows, "oldest_open": sorted(oldest.items())}

        return self._run("session_summary", read)

    def feed_held(self) -> tuple[int, datetime | None]:
        """``(events, oldest recorded_at)``: the committed events the global feed (``read_all``,
        ``/v1/events``, exports, calibration's catch-up) does not show yet. On PostgreSQL the feed
        shows an event once every transaction that took an id before it has ended -- anywhere on
        the server, another database's too (the commit-order proof in ``tracker.store.postgres``),
        so one long transaction holds every later event back. ``(0, None)`` on SQLite, whose feed
        shows every committed event."""
        if self._engine.dialect.name != "postgresql":
            return 0, None

        def read(conn: Connection) -> tuple[int, datetime | None]:
            count, oldest = conn.execute(_FEED_HELD).one()
            return int(count), None if oldest is None else oldest.astimezone(UTC)

        return self._run("feed_held", read)

    # -- narrow reads of one session (the session page: tracker.audit.story) ----------------------

    def count_by_type(self, session_id: str, to_version: int | None = None) -> dict[str, int]:
        """One grouped read of the index."""
        validate.check_session_id(session_id)
        validate.check_to_version(to_version)
        e = events_t.c
        cond = [e.session_id == session_id, *_upto(to_version)]
        stmt = select(e.type, func.count()).where(*cond).group_by(e.type)
        return {str(r[0]): int(r[1]) for r in self._rows("count_by_type", stmt)}

    def read_types(
        self,
        session_id: str,
        types: Sequence[str],
        from_version: int = 1,
        to_version: int | None = None,
        *,
        limit: int | None = None,
    ) -> Iterator[StoredEvent]:
        """Fetched in batches (``READ_BATCH``)."""
        validate.check_session_id(session_id)
        kinds = validate.check_types(types)
        validate.check_from_version(from_version)
        validate.check_to_version(to_version)
        validate.check_count("limit", limit, 1, optional=True)
        # one ordered walk of the index per type, merged here: with ``type IN (…)`` and a version
        # range the planners walk (session_id, version) instead and read every event of the session
        walks = [self._read_type(session_id, k, from_version, to_version, limit) for k in kinds]
        merged = walks[0] if len(walks) == 1 else heapq.merge(*walks, key=lambda ev: ev.version)
        return merged if limit is None else itertools.islice(merged, limit)

    def _read_type(
        self, session_id: str, kind: str, from_version: int, to_version: int | None, limit: int | None
    ) -> Iterator[StoredEvent]:
        e = events_t.c
        after, left = from_version - 1, limit
        while left is None or left > 0:
            n = READ_BATCH if left is None else min(READ_BATCH, left)
            stmt = (
                select(*EVENT_COLUMNS)
                .where(e.session_id == session_id, e.type == kind, e.version > after, *_upto(to_version))
                .order_by(e.version)
                .limit(n)
            )
            page = [stored_event(r) for r in self._rows("read_types", stmt)]
            yield from page
            if len(page) < n:
                return
            after = page[-1].version
            if left is not None:
                left -= len(page)

    def last_of_types(
        self, session_id: str, types: Sequence[str], count: int = 1, to_version: int | None = None
    ) -> list[StoredEvent]:
        validate.check_session_id(session_id)
        kinds = validate.check_types(types)
        validate.check_to_version(to_version)
        validate.check_count("count", count, 1, 100_000)
        e = events_t.c
        stmt = (
            select(*EVENT_COLUMNS)
            .where(e.session_id == session_id, e.type.in_(kinds), *_upto(to_version))
            .order_by(e.version.desc())
            .limit(count)
        )
        return [stored_event(r) for r in reversed(self._rows("last_of_types", stmt))]

    def sample_of_type(
        self, session_id: str, type_: str, points: int, to_version: int | None = None, *, total: int | None = None
    ) -> list[StoredEvent]:
        """At most ``points`` + 1 events of one type, spread evenly over the session by rank: the
        first event of each of ``points`` equal runs, and the last one; in version order. Only the
        index is scanned to pick them; only the picked rows are read. ``total``: how many events of
        that type there are up to ``to_version``, when the caller knows (else they are counted)."""
        validate.check_session_id(session_id)
        kind = validate.check_types([type_])[0]
        validate.check_to_version(to_version)
        validate.check_count("points", points, 1, 100_000)
        validate.check_count("total", total, 0, optional=True)
        e = events_t.c
        cond = [e.session_id == session_id, e.type == kind, *_upto(to_version)]

        def read(conn: Connection) -> list[StoredEvent]:
            n = total if total is not None else int(conn.execute(select(func.count()).where(*cond)).scalar_one())
            if n == 0:
                return []
            ranked = select(e.version.label("v"), func.row_number().over(order_by=e.version).label("rn"))
            r = ranked.where(*cond).subquery().c
            # rank rn opens a new run when floor((rn-1)·points/n) moves on (integer division on both backends)
            picked = select(r.v).where(
                or_(r.rn == 1, r.rn == n, ((r.rn - 1) * points) // n > ((r.rn - 2) * points) // n)
            )
            versions = list(conn.execute(picked).scalars())  # then the picked rows only, by their versions
            out: list[StoredEvent] = []
            for i in range(0, len(versions), 500):
                stmt = (
                    select(*EVENT_COLUMNS)
                    .where(e.session_id == session_id, e.version.in_(versions[i : i + 500]))
                    .order_by(e.version)
                )
                out.extend(stored_event(row) for row in conn.execute(stmt).all())
            return out

        return self._run("sample_of_type", read)

    def read_versions(
        self, session_id: str, versions: Sequence[int], types: Sequence[str] | None = None
    ) -> list[StoredEvent]:
        validate.check_session_id(session_id)
        kinds = None if types is None else validate.check_types(types)
        wanted = sorted({v for v in versions if validate.is_int(v) and v >= 1})
        e = events_t.c
        out: list[StoredEvent] = []
        for i in range(0, len(wanted), 500):
            cond = [e.session_id == session_id, e.version.in_(wanted[i : i + 500])]
            if kinds is not None:
                cond.append(e.type.in_(kinds))
            stmt = select(*EVENT_COLUMNS).where(*cond).order_by(e.version)
            out.extend(stored_event(r) for r in self._rows("read_versions", stmt))
        return out

    def find_by_data(
        self, session_id: str, types: Sequence[str], key: str, value: str, limit: int = 100
    ) -> list[StoredEvent]:
        """Only events of those types are looked at."""
        validate.check_session_id(session_id)
        kinds = validate.check_types(types)
        validate.check_data_key(key, value)
        validate.check_count("limit", limit, 1, 10_000)
        e = events_t.c
        stmt = (
            select(*EVENT_COLUMNS)
            .where(e.session_id == session_id, e.type.in_(kinds), e.data[key].as_string() == value)
            .order_by(e.version)
            .limit(limit)
        )
        return [stored_event(r) for r in self._rows("find_by_data", stmt)]
