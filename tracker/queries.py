"""The read side: what the CLI and the HTTP API show of the record (cosmicpython's ``views.py``).

Commands go through :class:`tracker.service.Tracker`; reads come here and go straight to the
ports: the log through the ``EventStore`` (history, feed, state, export, verify), listings and
gauges through the read side's ``SessionViews`` (``views``: ``tracker.bootstrap.build_views``). Both entry points use these functions, so an event has one JSON
form (:func:`event_to_dict`) and a page of history or of the global feed is cut one way.

    events, next_from = history_page(store, "s1", from_version=1, limit=100)
    events, next_after = feed_page(store, after=0, limit=100)

Pages unpack as pairs; ``page.has_more`` says whether more events follow and
``page.resume`` is where the next page starts (never ``None``).

``scope`` (a :class:`~tracker.core.model.SessionScope`, on every function that takes or shows
session ids) is whose sessions the reader sees: ids are given and shown as the reader knows them,
and the scope alone turns them into stored ids and back (the HTTP API keeps each fleet's sessions
under a prefix it hides). The default, unscoped, sees every session under its stored id.

:func:`decode` (from ``tracker.store.decoding``, where the calibration ledger, the idempotent
answers and ``verify`` below the read side use it too) is the one decoder: a stored row as the
core's typed event (``tracker.core.events``; the only list of event types is the core's
``EVENT_TYPES``), so readers (the session page, the summaries, replay, the console) match on
event classes and read attributes instead of ``data`` keys::

    match decode(stored).event:
        case CompactionRejected(reject_reason=why): ...
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any, TypedDict, Unpack, cast

from tracker.core import PRESSURES, SessionProjector, SessionState
from tracker.core.model import SessionScope
from tracker.errors import InvalidInput, UnknownSession
from tracker.store import StoredEvent, verify_decisions, verify_projections
from tracker.store.base import EventStore, SessionViews
from tracker.store.decoding import Recorded, Unrecognised, decode, decode_all, event_of, events_of, type_names
from tracker.store.verify import ChainLog, verify_chains

UNSCOPED = SessionScope()  # every session, under its stored id (the library, a local operator)

EXPORT_BATCH = 1000


def event_to_dict(event: StoredEvent, *, scope: SessionScope = UNSCOPED) -> dict[str, Any]:
    """One stored event as JSON data: the form of ``tracker history/export --json`` and of the HTTP API."""
    return {
        "position": event.position,
        "session_id": scope.external(event.session_id),
        "version": event.version,
        "type": event.type,
        "recorded_at": event.recorded_at.isoformat(),
        "data": event.data,
        "idempotency_key": event.idempotency_key,
    }


class Page(tuple):
    """``(events, next)``: a page of event dicts and where to go on.

    ``next`` is ``None`` on the last page of a session's history (there is nothing after it); on the
    global feed it is always the position to resume after. ``has_more`` tells whether more events
    were there when the page was read; ``resume`` is where the next read starts in either case.
    """

    events: list[dict[str, Any]]
    next: int | None
    has_more: bool
    resume: int

    def __new__(cls, events: list[dict[str, Any]], next: int | None, *, has_more: bool, resume: int) -> Page:
        page = super().__new__(cls, (events, next))
        page.events, page.next, page.has_more, page.resume = events, next, has_more, resume
        return page


def session_exists(store: EventStore, session_id: str, *, scope: SessionScope = UNSCOPED) -> bool:
    """Whether the scope's session ``session_id`` has any event (a malformed id raises ``InvalidInput``)."""
    return store.stream_version(scope.internal(session_id)) > 0


def require_session(store: EventStore, session_id: str, *, scope: SessionScope = UNSCOPED) -> int:
    """The current version of the scope's session ``session_id``; ``UnknownSession`` (naming the id
    as given) if it has no events."""
    version = store.stream_version(scope.internal(session_id))
    if version == 0:
        raise UnknownSession(f"no session {session_id}", session_id=session_id)
    return version


def session_state(store: EventStore, session_id: str, *, scope: SessionScope = UNSCOPED) -> SessionState:
    """The projected state of the scope's session ``session_id`` (version 0 for an unknown session;
    its ``session_id`` is the stored one)."""
    sid = scope.internal(session_id)
    data, _ = store.load(sid)
    return SessionState.from_data(data) if data is not None else SessionState(session_id=sid)


def read_history(
    store: EventStore,
    session_id: str,
    from_version: int = 1,
    to_version: int | None = None,
    *,
    scope: SessionScope = UNSCOPED,
) -> Iterator[StoredEvent]:
    """The events of the scope's session ``session_id``, streamed in batches (constant memory on very
    long sessions)."""
    return store.read_stream(scope.internal(session_id), from_version, to_version)


def history_page(
    store: EventStore, session_id: str, from_version: int = 1, limit: int = 100, *, scope: SessionScope = UNSCOPED
) -> Page:
    """At most ``limit`` events of the scope's session ``session_id`` from ``from_version``:
    ``(events, next_from_version | None)``.

    Raises ``UnknownSession`` (naming the id as given) for a session with no events.
    """
    sid = scope.internal(session_id)
    events = list(store.read_stream(sid, from_version, from_version + limit))  # one extra: has_more
    if not events and store.stream_version(sid) == 0:
        raise UnknownSession(f"no session {session_id}", session_id=session_id)
    page = events[:limit]
    has_more = len(events) > limit
    resume = page[-1].version + 1 if page else from_version
    return Page(
        [event_to_dict(e, scope=scope) for e in page],
        resume if has_more else None,
        has_more=has_more,
        resume=resume,
    )


def feed_page(store: EventStore, after: int = 0, limit: int = 100, *, scope: SessionScope = UNSCOPED) -> Page:
    """At most ``limit`` events of the scope's sessions in global commit order after position
    ``after``: ``(events, next_after)``. A reader resuming at ``next_after`` never misses an event
    that commits later with a lower position.
    """
    events = store.read_all(after, limit + 1, session_prefix=scope.stored_prefix())
    page = events[:limit]
    next_after = page[-1].position if page else after
    return Page(
        [event_to_dict(e, scope=scope) for e in page], next_after, has_more=len(events) > limit, resume=next_after
    )


def export_events(
    store: EventStore, since: int = 0, limit: int = 0, *, scope: SessionScope = UNSCOPED
) -> Iterator[dict[str, Any]]:
    """Every event of the scope's sessions after position ``since`` in global commit order, as dicts
    (``limit`` 0: all)."""
    written = 0
    position = since
    prefix = scope.stored_prefix()
    while True:
        batch = store.read_all(after_position=position, limit=EXPORT_BATCH, session_prefix=prefix)
        if not batch:
            return
        for e in batch:
            yield event_to_dict(e, scope=scope)
            position = e.position
            written += 1
            if limit and written >= limit:
                return


def check_pressure(pressure: str | None) -> None:
    """``InvalidInput`` unless ``pressure`` is None or one of ``normal``, ``compact``, ``hard_limit``."""
    if pressure is not None and pressure not in PRESSURES:
        raise InvalidInput("pressure", f"must be one of {', '.join(PRESSURES)}, got {pressure!r}")


class SessionFilters(TypedDict, total=False):
    """What :func:`list_sessions` and :func:`iter_sessions` take (``Unpack[SessionFilters]``)."""

    pressure: str | None  # one of PRESSURES
    since: datetime | None  # active at or after this time
    match: str  # only sessions whose id (as the scope shows it) starts with it
    limit: int | None  # at most this many rows
    scope: SessionScope  # whose sessions, under the ids they show (default: every session, as stored)


def _check_filters(filters: SessionFilters) -> None:
    unknown = sorted(set(filters) - set(SessionFilters.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    check_pressure(filters.get("pressure"))


def _listed(
    views: SessionViews, filters: SessionFilters, want: int, after: tuple[datetime, str] | None = None
) -> list[dict[str, Any]]:
    """One page of the listing (the rows as stored: the scope's ids are for the caller)."""
    scope = filters.get("scope", UNSCOPED)
    return views.list_sessions(
        pressure=filters.get("pressure"),
        active_since=filters.get("since"),
        limit=want,
        session_prefix=scope.stored_prefix(filters.get("match", "")),
        after=after,
    )


def _shown(row: dict[str, Any], scope: SessionScope) -> dict[str, Any]:
    return {**row, "session_id": scope.external(row["session_id"])} if scope.fleet_id else row


def list_sessions(views: SessionViews, **filters: Unpack[SessionFilters]) -> list[dict[str, Any]]:
    """Projection rows of the scope's sessions, most recently active first: pressure, occupancy,
    revision, open attempts, ...

    ``since``: active at or after this time; ``match``: only sessions whose id starts with it;
    ``limit``: at most this many rows (default 1000).
    """
    _check_filters(filters)
    limit = filters.get("limit")
    scope = filters.get("scope", UNSCOPED)
    return [_shown(r, scope) for r in _listed(views, filters, 1000 if limit is None else limit)]


def iter_sessions(
    views: SessionViews, *, batch: int = 1000, **filters: Unpack[SessionFilters]
) -> Iterator[dict[str, Any]]:
    """The rows of :func:`list_sessions` (``limit`` None: all of them), fetched in keyset-paged
    batches, so a whole-list reader holds one batch at a time."""
    _check_filters(filters)
    scope = filters.get("scope", UNSCOPED)
    after: tuple[datetime, str] | None = None
    left = filters.get("limit")
    while left is None or left > 0:
        want = batch if left is None else min(batch, left)
        rows = _listed(views, filters, want, after)
        for r in rows:
            yield _shown(r, scope)
        if len(rows) < want:
            return
        if left is not None:
            left -= len(rows)
        after = (rows[-1]["updated_at"], rows[-1]["session_id"])


SESSION_FIELDS = ("session_id", "version", "pressure", "occupancy_bp", "revision", "open_attempts")


class SessionsPage(tuple):
    """``(sessions, next_cursor)``: listing rows and the opaque cursor of the next page (None: last page)."""

    sessions: list[dict[str, Any]]
    next_cursor: str | None

    def __new__(cls, sessions: list[dict[str, Any]], next_cursor: str | None) -> SessionsPage:
        page = super().__new__(cls, (sessions, next_cursor))
        page.sessions, page.next_cursor = sessions, next_cursor
        return page


def encode_cursor(updated_at: datetime, session_id: str) -> str:
    """The opaque keyset cursor after a row: its last activity and its (external) session id."""
    raw = json.dumps([updated_at.isoformat(), session_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, scope: SessionScope = UNSCOPED) -> tuple[datetime, str]:
    """``(updated_at, stored session id)`` of a cursor from :func:`encode_cursor` for ``scope``;
    ``InvalidInput("cursor")`` if not one."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, sid = json.loads(raw)
        when = datetime.fromisoformat(at)
        if not isinstance(sid, str) or when.tzinfo is None:
            raise ValueError("not a cursor")
        sid = scope.internal(sid)
    except (ValueError, TypeError, binascii.Error, InvalidInput):
        raise InvalidInput("cursor", "not a cursor from this listing (pass next_cursor back unchanged)") from None
    return when, sid


def sessions_page(
    views: SessionViews,
    *,
    pressure: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
    cursor: str | None = None,
    scope: SessionScope = UNSCOPED,
) -> SessionsPage:
    """One page of the sessions listing, most recently active first (then by id), keyset-paged.

    Rows: ``session_id`` (external), ``version``, ``pressure``, ``occupancy_bp``, ``revision``,
    ``open_attempts``, ``created_at``, ``updated_at`` (last activity; ISO text), of the scope's
    sessions; the cursor holds the id as the scope shows it, so it means nothing to another fleet. A session active while a reader pages moves to the front
    (it is not repeated on later pages; the next listing shows it).
    """
    check_pressure(pressure)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
        raise InvalidInput("limit", f"must be an integer from 1 to 1000, got {limit!r}")
    after = None
    if cursor is not None:
        at, sid = decode_cursor(cursor, scope)
        after = (at, sid)
    rows = views.list_sessions(
        pressure=pressure, active_since=since, limit=limit + 1, session_prefix=scope.stored_prefix(), after=after
    )
    page = rows[:limit]
    out = [
        {
            **{k: r[k] for k in SESSION_FIELDS},
            "session_id": scope.external(r["session_id"]),
            "created_at": r["created_at"].isoformat(),
            "updated_at": r["updated_at"].isoformat(),
        }
        for r in page
    ]
    if len(rows) <= limit:
        return SessionsPage(out, None)
    last = page[-1]
    return SessionsPage(out, encode_cursor(last["updated_at"], scope.external(last["session_id"])))


def verify(store: EventStore) -> dict[str, Any]:
    """Re-fold every session from the log and compare with the stored projection.

    ``{"ok": bool, "sessions": n, "differences": [...]}``; ``ok`` is true when every projection
    equals the fold of its log and every recorded decision agrees with its own record (the count
    decided on = its raw count under the calibration it records; its limit <= the measurement's),
    and every session's hash chain is intact: ``chains``, ``events`` (checked) and ``broken`` (the
    first broken event of each broken chain: ``tracker.store.verify.verify_chains``).
    """
    diffs = verify_projections(store, SessionProjector()) + verify_decisions(store)
    n = sum(1 for _ in store.log_versions())
    chains = verify_chains(cast(ChainLog, store))
    return {"ok": not diffs and not chains["broken"], "sessions": n, "differences": diffs, **chains}


NO_FLEET = "none"  # the fleet label of sessions outside any fleet (the Python API on the same database)


def fleet_gauges(views: SessionViews, fleets: dict[str, str], now: float) -> dict[str, Any]:
    """Where each fleet stands, for gauges: every label value from a closed set.

    ``fleets`` maps fleet ids to the names the labels show; sessions outside them count under
    ``none``. Every known fleet gets every pressure (zeros included), so a series never vanishes.
    Returns ``{"sessions": [(fleet, pressure, n)], "open_attempts": [(fleet, n)],
    "oldest_open_attempt_age": [(fleet, seconds)], "feed_held": (events, seconds)}`` (an age is 0
    with nothing open or held; ``feed_held``: the committed events the global feed does not show
    yet, and how long the oldest of them has waited -- ``SessionViews.feed_held``).
    """
    summary = views.session_summary()  # by SessionScope.fleet_of, the fleet calibration files them under
    names = [*fleets.values(), NO_FLEET]
    sessions = {(f, p): 0 for f in names for p in PRESSURES}
    open_attempts = dict.fromkeys(names, 0)
    oldest = dict.fromkeys(names, 0.0)
    for ns, pressure, n, opened in summary["pressure"]:
        fleet = fleets.get(ns, NO_FLEET)
        if pressure in PRESSURES:
            sessions[(fleet, pressure)] += n
        open_attempts[fleet] += opened
    for ns, opened_at in summary["oldest_open"]:
        fleet = fleets.get(ns, NO_FLEET)
        oldest[fleet] = max(oldest[fleet], max(0.0, now - opened_at))
    return {
        "sessions": [(f, p, n) for (f, p), n in sessions.items()],
        "open_attempts": list(open_attempts.items()),
        "oldest_open_attempt_age": list(oldest.items()),
        "feed_held": feed_held(views, now),
    }


def feed_held(views: SessionViews, now: float) -> tuple[int, float]:
    """``(events, seconds)``: the committed events the event feed does not show yet (a transaction
    that started before them is still open somewhere on the PostgreSQL server), and how long the
    oldest of them has waited at ``now`` (epoch seconds); ``(0, 0.0)`` when it shows every one."""
    held, since = views.feed_held()
    return held, 0.0 if since is None or not held else max(0.0, now - since.timestamp())


__all__ = [
    "NO_FLEET",
    "UNSCOPED",
    "Page",
    "Recorded",
    "Unrecognised",
    "SessionsPage",
    "check_pressure",
    "decode",
    "decode_all",
    "event_of",
    "events_of",
    "decode_cursor",
    "encode_cursor",
    "event_to_dict",
    "export_events",
    "feed_page",
    "feed_held",
    "fleet_gauges",
    "history_page",
    "list_sessions",
    "read_history",
    "require_session",
    "session_exists",
    "session_state",
    "sessions_page",
    "type_names",
    "verify",
]
