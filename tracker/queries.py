"""The read side: what the CLI and the HTTP API show of the record (cosmicpython's ``views.py``).

Commands go through :class:`tracker.service.Tracker`; reads come here and go straight to the
store's public methods. Both entry points use these functions, so an event has one JSON
form (:func:`event_to_dict`) and a page of history or of the global feed is cut one way.

    events, next_from = history_page(store, "s1", from_version=1, limit=100)
    events, next_after = feed_page(store, after=0, limit=100)

Pages unpack as pairs; ``page.has_more`` says whether more events follow and
``page.resume`` is where the next page starts (never ``None``).

``external`` (on the functions that show session ids) maps a stored session id to the one
the reader knows: the HTTP API keeps each fleet's sessions under a prefix it hides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from tracker.core import PRESSURES, SessionProjector, SessionState, check_session_id
from tracker.errors import InvalidInput, UnknownSession
from tracker.store import StoredEvent, verify_projections

External = Callable[[str], str]

EXPORT_BATCH = 1000


def event_to_dict(event: StoredEvent, *, external: External | None = None) -> dict[str, Any]:
    """One stored event as JSON data: the form of ``tracker history/export --json`` and of the HTTP API."""
    return {
        "position": event.position,
        "session_id": external(event.session_id) if external else event.session_id,
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


def session_exists(store: Any, session_id: str) -> bool:
    """Whether the session has any event (a malformed id raises ``InvalidInput``)."""
    check_session_id(session_id)
    return store.stream_version(session_id) > 0


def require_session(store: Any, session_id: str, *, name: str | None = None) -> int:
    """The session's current version; ``UnknownSession`` (naming ``name`` or the id) if it has no events."""
    check_session_id(session_id)
    version = store.stream_version(session_id)
    if version == 0:
        shown = name if name is not None else session_id
        raise UnknownSession(f"no session {shown}", session_id=shown)
    return version


def session_state(store: Any, session_id: str) -> SessionState:
    """The session's projected state (version 0 for an unknown session)."""
    check_session_id(session_id)
    data, _ = store.load(session_id)
    return SessionState.from_data(data) if data is not None else SessionState(session_id=session_id)


def read_history(
    store: Any, session_id: str, from_version: int = 1, to_version: int | None = None
) -> Iterator[StoredEvent]:
    """The session's events, streamed in batches (constant memory on very long sessions)."""
    return store.read_stream(session_id, from_version, to_version)


def history_page(
    store: Any, session_id: str, from_version: int = 1, limit: int = 100, *, external: External | None = None
) -> Page:
    """At most ``limit`` events of a session from ``from_version``: ``(events, next_from_version | None)``.

    Raises ``UnknownSession`` (naming the external id) for a session with no events.
    """
    events = list(store.read_stream(session_id, from_version, from_version + limit))  # one extra: has_more
    if not events and store.stream_version(session_id) == 0:
        shown = external(session_id) if external else session_id
        raise UnknownSession(f"no session {shown}", session_id=shown)
    page = events[:limit]
    has_more = len(events) > limit
    resume = page[-1].version + 1 if page else from_version
    return Page(
        [event_to_dict(e, external=external) for e in page],
        resume if has_more else None,
        has_more=has_more,
        resume=resume,
    )


def feed_page(
    store: Any, after: int = 0, limit: int = 100, prefix: str | None = None, *, external: External | None = None
) -> Page:
    """At most ``limit`` events in global commit order after position ``after``: ``(events, next_after)``.

    ``prefix``: only sessions whose id starts with it. A reader resuming at ``next_after`` never
    misses an event that commits later with a lower position.
    """
    events = store.read_all(after, limit + 1, session_prefix=prefix)
    page = events[:limit]
    next_after = page[-1].position if page else after
    return Page(
        [event_to_dict(e, external=external) for e in page], next_after, has_more=len(events) > limit, resume=next_after
    )


def export_events(store: Any, since: int = 0, limit: int = 0) -> Iterator[dict[str, Any]]:
    """Every event after position ``since`` in global commit order, as dicts (``limit`` 0: all)."""
    written = 0
    position = since
    while True:
        batch = store.read_all(after_position=position, limit=EXPORT_BATCH)
        if not batch:
            return
        for e in batch:
            yield event_to_dict(e)
            position = e.position
            written += 1
            if limit and written >= limit:
                return


def check_pressure(pressure: str | None) -> None:
    """``InvalidInput`` unless ``pressure`` is None or one of ``normal``, ``compact``, ``hard_limit``."""
    if pressure is not None and pressure not in PRESSURES:
        raise InvalidInput("pressure", f"must be one of {', '.join(PRESSURES)}, got {pressure!r}")


def list_sessions(
    store: Any,
    *,
    pressure: str | None = None,
    since: datetime | None = None,
    prefix: str | None = None,
    limit: int | None = None,
    external: External | None = None,
) -> list[dict[str, Any]]:
    """Projection rows, most recently active first: pressure, occupancy, revision, open attempts, ...

    ``since``: active at or after this time; ``prefix``: only sessions whose id starts with it;
    ``limit``: at most this many rows (default 1000).
    """
    check_pressure(pressure)
    want = 1000 if limit is None else limit
    if prefix is None:
        rows = store.list_sessions(pressure=pressure, active_since=since, limit=want)
    else:  # the store filters no prefix here: ask for more rows until enough of them match
        ask = want
        while True:
            fetched = store.list_sessions(pressure=pressure, active_since=since, limit=ask)
            rows = [r for r in fetched if r["session_id"].startswith(prefix)][:want]
            if len(rows) >= want or len(fetched) < ask:
                break
            ask *= 4
    if external is not None:
        rows = [{**r, "session_id": external(r["session_id"])} for r in rows]
    return rows


def verify(store: Any) -> dict[str, Any]:
    """Re-fold every session from the log and compare with the stored projection.

    ``{"ok": bool, "sessions": n, "differences": [...]}``; ``ok`` is true when every projection
    equals the fold of its log.
    """
    diffs = verify_projections(store, SessionProjector())
    n = sum(1 for _ in store.session_ids())
    return {"ok": not diffs, "sessions": n, "differences": diffs}


__all__ = [
    "Page",
    "check_pressure",
    "event_to_dict",
    "export_events",
    "feed_page",
    "history_page",
    "list_sessions",
    "read_history",
    "require_session",
    "session_exists",
    "session_state",
    "verify",
]
