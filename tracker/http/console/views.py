"""The console's view models: what each page shows, read from the store, as plain values for the templates.

Every function here is blocking (FastAPI runs the routes that call them in its thread pool) and
reads through two ports: the event store (``EventStore``: a session's version and projection, its
log for the events table, the JSON downloads and the what-if replay) and the read side's narrow
reads (:class:`tracker.store.base.SessionViews`: listings, counts by type, events of some types, a
sample, events at versions, an attempt's events). Events are read as the core's classes
(:func:`tracker.queries.decode`); the event types are the core's (:data:`tracker.core.EVENT_TYPES`).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from tracker import queries
from tracker._lru import LRU
from tracker.audit.builder import build_story
from tracker.audit.format import summary
from tracker.audit.model import Attempt, Story
from tracker.audit.pages import session_context
from tracker.audit.replay import whatif_rows
from tracker.audit.story import read_story
from tracker.calibrations import ledger_of
from tracker.core import EVENT_TYPES as CORE_EVENT_TYPES
from tracker.core import PRESSURES, Policy, check_session_id
from tracker.core.events import (
    CompactionCommitted,
    CompactionRejected,
    CompactionStarted,
    ContextLimitReached,
    CountFailed,
    SessionStarted,
)
from tracker.errors import InvalidInput, TrackerError, UnknownAttempt
from tracker.http.console.auth import PREFIX, Viewer
from tracker.queries import Recorded, decode, decode_all, type_names
from tracker.store import EventStore
from tracker.store.base import SessionViews

EVENT_TYPES: tuple[str, ...] = tuple(CORE_EVENT_TYPES)  # the event table's filter: the core's list
SINCE = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7), "30d": timedelta(days=30)}
RECENT_SESSIONS = 40  # the overview's attempts and failures come from the newest events of these sessions
RECENT_EVENTS = 400
RECENT_TYPES = type_names(CompactionStarted, CompactionCommitted, CompactionRejected, CountFailed, ContextLimitReached)
ATTEMPT_EVENTS = type_names(CompactionStarted, CompactionCommitted, CompactionRejected)
WHATIF_FIELDS = ("compact_at_bp", "rearm_below_bp", "turn_delta", "max_automatic_per_episode", "attempt_lease_s")
FAILURE_KINDS = ("count_failed", "context_limit")  # the overview chart's two kinds of bar
OVERVIEW_ROWS = 200
OVERVIEW_ALL = 1000

Row = tuple[int, str, str, str]  # an event table's row: version, recorded at, type, what happened

#: sessions' stories by (store, stored id, version): the log is append-only, so a (session, version)
#: is read once and kept (the newest few) until the session moves on
STORIES: LRU[tuple[int, str, int], Story] = LRU(8)


def shown_url(shown: str) -> str:
    """The console's page of a session, by the id its viewer knows it by."""
    return f"{PREFIX}/sessions/{urllib.parse.quote(shown, safe=':')}"


def session_url(viewer: Viewer, stored_id: str) -> str:
    return shown_url(viewer.external(stored_id))


def parse_int(value: str, name: str, default: int, low: int, high: int) -> int:
    """A query parameter as an integer in ``[low, high]`` (``default`` when empty); else ``InvalidInput``."""
    if value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise InvalidInput(name, f"must be an integer, got {value!r}") from None
    if not low <= n <= high:
        raise InvalidInput(name, f"must be between {low} and {high}, got {n}")
    return n


def _row(r: Recorded) -> Row:
    return (r.version, r.recorded_at.isoformat()[:23], r.type, summary(r.event))


# -- the overview --------------------------------------------------------------------------------


def overview(
    store: EventStore,
    views: SessionViews,
    viewer: Viewer,
    fleet_names: dict[str, str],
    q: str,
    pressure: str,
    since: str,
) -> dict[str, Any]:
    """The fleet overview: sessions (filtered), counts by pressure, the nearest to their limit, recent
    activity, and the calibration of each model (what the provider billed against what was counted)."""
    if pressure and pressure not in PRESSURES:
        raise InvalidInput("pressure", f"must be one of {', '.join(PRESSURES)}, got {pressure!r}")
    if since and since not in SINCE:
        raise InvalidInput("since", f"must be one of {', '.join(SINCE)}, got {since!r}")
    if q:
        check_session_id(q)
    now = datetime.now(UTC)
    active_since = now - SINCE[since] if since else None
    scope = viewer.scope  # the rows' ids are the viewer's
    rows = queries.list_sessions(
        views, pressure=pressure or None, since=active_since, match=q, limit=OVERVIEW_ROWS, scope=scope
    )
    everyone = queries.list_sessions(views, since=active_since, limit=OVERVIEW_ALL, scope=scope)
    by_pressure = {p: 0 for p in PRESSURES}
    for r in everyone:
        if r.get("pressure") in by_pressure:
            by_pressure[r["pressure"]] += 1
    nearest = sorted(everyone, key=lambda r: -(r.get("occupancy_bp") or 0))[:8]
    recent = _recent(views, everyone[:RECENT_SESSIONS], viewer, now, active_since)
    show_fleet = viewer.kind != "fleet"

    def row(r: dict[str, Any]) -> dict[str, Any]:
        shown = r["session_id"]
        fleet = scope.fleet_of(scope.internal(shown))
        return {
            **r,
            "shown": shown,
            "url": shown_url(shown),
            "fleet": fleet_names.get(fleet, fleet) if show_fleet else "",
        }

    return {
        "rows": [row(r) for r in rows],
        "nearest": [row(r) for r in nearest],
        "by_pressure": by_pressure,
        "total": len(everyone),
        "capped": len(everyone) >= OVERVIEW_ALL,
        "recent": recent,
        "filters": {"q": q, "pressure": pressure, "since": since},
        "pressures": PRESSURES,
        "since_choices": list(SINCE),
        "show_fleet": show_fleet,
        "calibration": calibration_rows(store, viewer, fleet_names),
        "feed_held": feed_held(views, viewer, now),
    }


def feed_held(views: SessionViews, viewer: Viewer, now: datetime) -> dict[str, Any] | None:
    """What the event feed holds back (``SessionViews.feed_held``), for the banner above the
    calibration table (which is folded from the feed): None when it shows every committed event.
    ``events`` (of every fleet) is shown to operators only."""
    held, waited = queries.feed_held(views, now.timestamp())
    if not held:
        return None
    return {
        "for": f"{waited:.0f} s" if waited < 120 else f"{waited / 60:.0f} min",
        "events": held if viewer.kind != "fleet" else None,
    }


def calibration_rows(store: EventStore, viewer: Viewer, fleet_names: dict[str, str]) -> list[dict[str, Any]]:
    """Per (fleet, model, counter kind): the ledger folded from the provider reports of the viewer's
    fleet (``tracker.calibrations.ledger_of``; an operator's: every fleet's), as ``ModelSummary.to_data``
    plus the fleet's name."""
    rows = []
    for model in ledger_of(store, scope=viewer.scope).summaries():
        row = model.to_data()
        row["fleet_name"] = fleet_names.get(model.fleet, model.fleet) if viewer.kind != "fleet" else ""
        rows.append(row)
    return rows


def _recent(
    views: SessionViews, rows: list[dict[str, Any]], viewer: Viewer, now: datetime, active_since: datetime | None
) -> dict[str, Any]:
    """Recent attempts (with outcomes) and count failures / context-limit errors over time, read from
    the newest ``RECENT_EVENTS`` events of the ``RECENT_SESSIONS`` most recently active sessions
    (only their lifecycle events are read)."""
    attempts: dict[tuple[str, str], dict[str, Any]] = {}
    failures: list[tuple[datetime, str]] = []
    for r in rows:
        shown, version = r["session_id"], r["version"]
        sid = viewer.internal(shown)
        for rec in decode_all(views.read_types(sid, RECENT_TYPES, max(1, version - RECENT_EVENTS + 1))):
            match rec.event:
                case CompactionStarted() as e:
                    attempts[(sid, e.attempt_id)] = {
                        "session": shown,
                        "url": f"{shown_url(shown)}/attempts/{urllib.parse.quote(e.attempt_id)}",
                        "session_url": shown_url(shown),
                        "attempt_id": e.attempt_id,
                        "reason": e.reason,
                        "basis": e.basis,
                        "opened_at": rec.recorded_at,
                        "outcome": "open",
                        "detail": "",
                    }
                case CompactionCommitted() as e:
                    if (a := attempts.get((sid, e.attempt_id))) is not None:
                        a["outcome"], a["detail"] = "committed", f"{e.tokens_before} → {e.tokens_after}"
                case CompactionRejected() as e:
                    if (a := attempts.get((sid, e.attempt_id))) is not None:
                        a["outcome"], a["detail"] = "rejected", e.reject_reason
                case CountFailed():
                    failures.append((rec.recorded_at, "count_failed"))
                case ContextLimitReached():
                    failures.append((rec.recorded_at, "context_limit"))
    recent = sorted(attempts.values(), key=lambda a: a["opened_at"], reverse=True)[:25]
    return {"attempts": recent, "chart": failure_chart(failures, now, active_since)}


def failure_chart(failures: list[tuple[datetime, str]], now: datetime, since: datetime | None) -> dict[str, Any]:
    """Count failures and context-limit errors (``FAILURE_KINDS``) in 24 buckets of time, as bars for an inline SVG."""
    if not failures and since is None:
        return {"bars": [], "max": 0, "start": None, "end": now, "total": dict.fromkeys(FAILURE_KINDS, 0)}
    start = since or min(t for t, _ in failures)
    end = now
    if (end - start).total_seconds() <= 0:
        start = end - timedelta(minutes=1)
    width = (end - start) / 24
    bars: list[dict[str, Any]] = [{"from": start + width * i, **dict.fromkeys(FAILURE_KINDS, 0)} for i in range(24)]
    total = dict.fromkeys(FAILURE_KINDS, 0)
    for t, kind in failures:
        if t < start:
            continue
        i = min(23, int((t - start) / width))
        bars[i][kind] += 1
        total[kind] += 1
    top = max([sum(b[k] for k in FAILURE_KINDS) for b in bars] + [1])
    return {"bars": bars, "max": top, "start": start, "end": end, "total": total}


# -- one session -----------------------------------------------------------------------------------


def session_page(
    store: EventStore, views: SessionViews, viewer: Viewer, session_id: str, qp: Mapping[str, str]
) -> dict[str, Any]:
    """The session page's context: the story (``session_context``) and ``page`` (links, events, what-if)."""
    sid = viewer.internal(session_id)
    version = queries.require_session(store, session_id, scope=viewer.scope)
    kind = qp.get("type", "")
    if kind and kind not in EVENT_TYPES:
        raise InvalidInput("type", f"must be one of {', '.join(EVENT_TYPES)}, got {kind!r}")
    limit = parse_int(qp.get("limit", ""), "limit", 100, 1, 500)
    start = parse_int(qp.get("from", ""), "from", 1, 1, 10**9)
    story = cached_story(store, views, sid, session_id, version)
    events, last, more = events_page(store, views, sid, start, limit, kind)
    url = session_url(viewer, sid)

    def link(**changes: Any) -> str:
        params = {"type": kind, "from": str(start), "limit": str(limit), **{k: str(v) for k, v in changes.items()}}
        return f"{url}?{urllib.parse.urlencode({k: v for k, v in params.items() if v})}#events-h"

    whatif = whatif_run(store, views, sid, qp) if qp.get("wi") else whatif_form(views, sid)
    page = {
        "session_url": url,
        "attempt_base": f"{url}/attempts/",
        "links": {
            "history": f"{url}/history.json",
            "export": f"{url}/export.jsonl",
            "report": f"{url}/report.html",
            "whatif": True,
        },
        "event_types": EVENT_TYPES,
        "filter": {"type": kind, "from": start, "limit": limit},
        "events": events,
        "events_from": events[0][0] if events else start,
        "events_to": events[-1][0] if events else start,
        "prev_url": link(**{"from": max(1, start - limit)}) if start > 1 and not kind else None,
        "next_url": link(**{"from": last + 1}) if more else None,
        "whatif": whatif,
        "version": version,
    }
    return {"page": page, **session_context(story)}


def cached_story(store: EventStore, views: SessionViews, sid: str, shown: str, version: int) -> Story:
    """The session's story at ``version`` (:data:`STORIES` keeps the newest few)."""
    key = (id(store), sid, version)
    hit = STORIES.get(key)
    if hit is None:
        hit = read_story(store, sid, shown=shown, views=views)
        STORIES.put(key, hit)
    return hit


def events_page(
    store: EventStore, views: SessionViews, sid: str, start: int, limit: int, kind: str
) -> tuple[list[Row], int, bool]:
    """At most ``limit`` events from version ``start`` (of type ``kind`` if given): (rows, last version read, more?)."""
    # limit + 1 events: the extra one only says whether there are more
    stored = (
        views.read_types(sid, [kind], start, limit=limit + 1) if kind else store.read_stream(sid, start, start + limit)
    )
    got = list(decode_all(stored))
    rows = [_row(r) for r in got[:limit]]
    if len(got) > limit:
        return rows, rows[-1][0], True
    return rows, got[-1].version if got else start - 1, False


def recorded_policy(views: SessionViews, sid: str) -> Policy:
    """The policy the session started with (its first event), or the default policy."""
    first = views.read_versions(sid, [1])
    event = decode(first[0]).event if first else None
    return event.policy if isinstance(event, SessionStarted) else Policy()


def whatif_form(views: SessionViews, sid: str) -> dict[str, Any]:
    p = recorded_policy(views, sid)
    values: dict[str, Any] = {f: getattr(p, f) for f in WHATIF_FIELDS}
    values["turn_delta"] = "" if p.turn_delta is None else p.turn_delta
    return {"values": values, "automatic": p.automatic, "recorded": dict(values), "result": None, "error": None}


def whatif_run(store: EventStore, views: SessionViews, sid: str, qp: Mapping[str, str]) -> dict[str, Any]:
    """Replay the recorded measurements under the policy of the form, beside the recorded decisions."""
    form = whatif_form(views, sid)
    base = recorded_policy(views, sid)
    changes: dict[str, Any] = {}
    values = dict(form["values"])
    try:
        for f in WHATIF_FIELDS:
            raw = (qp.get(f) or "").strip()
            values[f] = raw
            if raw == "":
                if f == "turn_delta":
                    changes[f] = None
                continue
            if f in ("turn_delta", "attempt_lease_s"):
                try:
                    changes[f] = float(raw)
                except ValueError:
                    raise InvalidInput(f, f"must be a number, got {raw!r}") from None
            else:
                changes[f] = parse_int(raw, f, 0, -(10**9), 10**9)
        automatic = qp.get("automatic") == "on"
        changes["automatic"] = automatic
        policy = base.replace(**changes)
    except TrackerError as exc:
        return {**form, "values": values, "error": f"{exc.code}: {exc.message}"}
    recorded = {"compact": 0, "context_limit": 0, "proceed": 0, "wait": 0}
    replayed = {"compact": 0, "context_limit": 0, "proceed": 0, "wait": 0}
    changed: list[dict[str, Any]] = []
    n_changed = 0
    measures = 0
    for row in whatif_rows(queries.read_history(store, sid), policy, sid):
        if row["op"] != "measure":
            continue
        measures += 1
        rec = row.get("recorded_action", "")
        got = row["whatif"].get("action") or ("refused: " + row["whatif"].get("code", "error"))
        recorded[rec] = recorded.get(rec, 0) + 1
        replayed[got] = replayed.get(got, 0) + 1
        if rec != got:
            n_changed += 1
            if len(changed) < 200:
                w = row["whatif"]
                changed.append(
                    {
                        "version": row["version"],
                        "recorded": rec,
                        "whatif": got,
                        "occupancy_bp": w.get("occupancy_bp"),
                        "pressure": w.get("pressure"),
                        "threshold_bp": w.get("threshold_bp"),
                    }
                )
    keys = sorted(set(recorded) | set(replayed), key=lambda k: (k not in ("compact", "context_limit"), k))
    return {
        "values": values,
        "automatic": automatic,
        "recorded": form["recorded"],
        "error": None,
        "result": {
            "measures": measures,
            "changed": n_changed,
            "rows": changed,
            "totals": [(k, recorded.get(k, 0), replayed.get(k, 0)) for k in keys],
        },
    }


# -- one attempt -----------------------------------------------------------------------------------


def attempt_page(
    store: EventStore, views: SessionViews, viewer: Viewer, session_id: str, attempt_id: str
) -> dict[str, Any]:
    """The attempt page's context: the attempt and the events around it; ``UnknownAttempt`` if there is none."""
    sid = viewer.internal(session_id)
    queries.require_session(store, session_id, scope=viewer.scope)
    found = find_attempt(store, views, sid, attempt_id)
    if found is None:
        raise UnknownAttempt(f"no attempt {attempt_id} in session {session_id}", attempt_id=attempt_id)
    attempt, events = found
    return {"session_id": session_id, "session_url": session_url(viewer, sid), "a": attempt, "events": events}


def find_attempt(store: EventStore, views: SessionViews, sid: str, attempt_id: str) -> tuple[Attempt, list[Row]] | None:
    opened: int | None = None
    ended: int | None = None
    # only the attempt lifecycle events are looked at (through the index on session, type, version)
    for r in decode_all(views.find_by_data(sid, ATTEMPT_EVENTS, "attempt_id", attempt_id)):
        if isinstance(r.event, CompactionStarted):
            opened = r.version
        elif opened is not None:
            ended = r.version
            break
    if opened is None:
        return None
    window = list(store.read_stream(sid, max(1, opened - 2), (ended or opened) + 2))
    story = build_story(sid, window, table_rows=0)
    attempt = next((a for a in story.attempts if a.attempt_id == attempt_id), None)
    if attempt is None:  # pragma: no cover - the window holds its start
        return None
    return attempt, [_row(r) for r in decode_all(window)]
