"""The read-only web console, served under ``/console`` (``tracker serve``; ``tracker console``).

Server-rendered from the Jinja templates in ``tracker/http/console/templates`` and the session
page of :mod:`tracker.audit.pages`; a little plain JavaScript (``static/console.js``) and no CDN.

Signing in: a fleet key (``ctk_…``: that fleet's sessions) or an operator key (``cto_…``, made
with ``tracker key create --operator``: every fleet) is POSTed once; the answer is a cookie
``tracker_console`` (HttpOnly, SameSite=Strict, path ``/console``) holding
``KIND.KEY_ID.EXPIRES.SIG`` where SIG is an HMAC keyed by the key's stored SHA-256, so the key
itself is never in a URL, a cookie or a log, every server process can check the cookie, and
revoking the key ends the sign-in. ``tracker console`` adds a one-time ticket (printed as a URL,
like notebook servers do) that signs in as the local operator with a secret of that process.

    GET  /console/                                   fleet overview (?q= &pressure= &since=)
    GET  /console/sessions/{sid}                     session page (?type= &from= &limit= events; ?wi=1&… what-if)
    GET  /console/sessions/{sid}/attempts/{aid}      one attempt and the events around it
    GET  /console/sessions/{sid}/history.json        the JSON history, paged (?from_version= &limit=)
    GET  /console/sessions/{sid}/export.jsonl        every event, JSON lines
    GET  /console/sessions/{sid}/report.html         the session page as one self-contained file
    GET|POST /console/signin, GET /console/signin/ticket?t=, POST /console/signout
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tracker import queries
from tracker.audit.pages import environment, session_context
from tracker.audit.report import render_store_html
from tracker.audit.story import build_story, read_story
from tracker.core import PRESSURES, check_session_id
from tracker.errors import InvalidInput, TrackerError, UnknownAttempt, UnknownSession
from tracker.http.errors import ERROR_STATUS

HERE = Path(__file__).resolve().parent
COOKIE = "tracker_console"
COOKIE_TTL_S = 12 * 3600
PREFIX = "/console"
EVENT_TYPES = (
    "SessionStarted",
    "ContextMeasured",
    "CompactionStarted",
    "CompactionCommitted",
    "CompactionRejected",
    "CountFailed",
    "ContextLimitReached",
    "MeasurementRefused",
)
SINCE = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7), "30d": timedelta(days=30)}
RECENT_SESSIONS = 40  # the overview's attempts and failures come from the newest events of these sessions
RECENT_EVENTS = 400

router = APIRouter(prefix=PREFIX, include_in_schema=False)
_env = environment(HERE / "templates")


# -- who is looking ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Viewer:
    """A signed-in reader: a fleet (sees its sessions, ids without the fleet prefix) or an operator."""

    kind: str  # fleet | operator | local
    key_id: str
    fleet_id: str | None = None
    fleet_name: str | None = None

    @property
    def prefix(self) -> str | None:
        return f"{self.fleet_id}:" if self.fleet_id else None

    def internal(self, session_id: str) -> str:
        check_session_id(session_id)
        return check_session_id(f"{self.prefix}{session_id}") if self.prefix else session_id

    def external(self, stored: str) -> str:
        p = self.prefix
        return stored[len(p) :] if p and stored.startswith(p) else stored

    @property
    def label(self) -> str:
        if self.kind == "fleet":
            return f"fleet {self.fleet_name or self.fleet_id}"
        return "operator (every fleet)" if self.kind == "operator" else "local operator (every fleet)"


@dataclass
class LocalSignIn:
    """``tracker console``'s one-time ticket and the secret its cookies are signed with (this process only)."""

    ticket: str | None = field(default_factory=lambda: secrets.token_urlsafe(24))
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def redeem(self, ticket: str) -> bool:
        with self.lock:
            ok = self.ticket is not None and hmac.compare_digest(self.ticket, ticket)
            if ok:
                self.ticket = None
            return ok


def _sign(secret: bytes, payload: str) -> str:
    return hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()


def _cookie_value(kind: str, key_id: str, secret: bytes) -> str:
    payload = f"{kind}.{key_id}.{int(time.time()) + COOKIE_TTL_S}"
    return f"{payload}.{_sign(secret, payload)}"


def _runtime(request: Request) -> Any:
    return request.app.state.runtime


def _local(request: Request) -> LocalSignIn | None:
    return getattr(request.app.state, "console_local", None)


def _viewer(request: Request) -> Viewer | None:
    """The signed-in viewer from the cookie (checked against the key's current record), else None."""
    raw = request.cookies.get(COOKIE)
    if not raw or len(raw) > 300:
        return None
    parts = raw.split(".")
    if len(parts) != 4 or not parts[2].isdigit() or int(parts[2]) < time.time():
        return None
    kind, key_id, _, sig = parts
    payload = ".".join(parts[:3])
    if kind == "local":
        local = _local(request)
        if local is None or not hmac.compare_digest(_sign(local.secret, payload), sig):
            return None
        return Viewer("local", key_id)
    if kind not in ("fleet", "operator"):
        return None
    fleets = _runtime(request).fleets()
    found = fleets.key_secret(kind, key_id)
    if found is None or not hmac.compare_digest(_sign(found[0].encode(), payload), sig):
        return None
    name = None
    if found[1] is not None:
        try:
            name = fleets.get_fleet(found[1])["name"]
        except TrackerError:
            name = None
    return Viewer(kind, key_id, fleet_id=found[1], fleet_name=name)


def _set_cookie(request: Request, response: Response, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        max_age=COOKIE_TTL_S,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _page(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    html = _env.get_template(template).render(request_path=request.url.path, prefix=PREFIX, **ctx)
    return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})


def _to_signin() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/signin", status_code=303)


def _error_page(request: Request, viewer: Viewer | None, exc: TrackerError) -> HTMLResponse:
    status = ERROR_STATUS.get(type(exc), 500)
    for cls, code in ERROR_STATUS.items():
        if isinstance(exc, cls):
            status = code
            break
    message = exc.message
    if viewer is not None and viewer.prefix:
        message = message.replace(viewer.prefix, "")
    return _page(request, "error.html.j2", status=status, viewer=viewer, code=exc.code, message=message)


def _session_url(viewer: Viewer, stored_id: str) -> str:
    return f"{PREFIX}/sessions/{urllib.parse.quote(viewer.external(stored_id), safe=':')}"


# -- sign-in and sign-out ------------------------------------------------------------------------


@router.get("/signin", response_class=HTMLResponse)
def signin_form(request: Request) -> Response:
    return _page(request, "signin.html.j2", viewer=None, error=None)


@router.post("/signin", response_class=HTMLResponse)
async def signin(request: Request) -> Response:
    body = await request.body()
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=5)
    token = (form.get("key") or [""])[0].strip()
    runtime = _runtime(request)
    try:
        who = await run_in_threadpool(lambda: runtime.fleets().console_identity(token))
    except TrackerError as exc:
        return _error_page(request, None, exc)
    if who is None:
        return _page(
            request, "signin.html.j2", status=401, viewer=None, error="That key is malformed, unknown or revoked."
        )
    kind, _, key_id = who
    found = await run_in_threadpool(lambda: runtime.fleets().key_secret(kind, key_id))
    if found is None:  # revoked in between
        return _page(request, "signin.html.j2", status=401, viewer=None, error="That key was revoked.")
    response = RedirectResponse(f"{PREFIX}/", status_code=303)
    _set_cookie(request, response, _cookie_value(kind, key_id, found[0].encode()))
    return response


@router.get("/signin/ticket")
def signin_ticket(request: Request, t: str = "") -> Response:
    local = _local(request)
    if local is None or not t or len(t) > 100 or not local.redeem(t):
        return _page(
            request,
            "signin.html.j2",
            status=401,
            viewer=None,
            error="That sign-in link was already used or is not from this console. Sign in with a key.",
        )
    response = RedirectResponse(f"{PREFIX}/", status_code=303)
    _set_cookie(request, response, _cookie_value("local", "local", local.secret))
    return response


@router.post("/signout")
def signout(request: Request) -> Response:
    response = _to_signin()
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


@router.get("/static/{name}")
def static(name: str) -> Response:
    if name not in ("console.js",):
        return Response(status_code=404)
    return FileResponse(HERE / "static" / name, media_type="text/javascript", headers={"Cache-Control": "max-age=300"})


# -- the overview --------------------------------------------------------------------------------


@router.get("", include_in_schema=False)
def root_redirect() -> Response:
    return RedirectResponse(f"{PREFIX}/", status_code=307)


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, q: str = "", pressure: str = "", since: str = "") -> Response:
    viewer = _viewer(request)
    if viewer is None:
        return _to_signin()
    try:
        return _overview(request, viewer, q.strip(), pressure, since)
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


def _overview(request: Request, viewer: Viewer, q: str, pressure: str, since: str) -> Response:
    store = _runtime(request).store()
    if pressure and pressure not in PRESSURES:
        raise InvalidInput("pressure", f"must be one of {', '.join(PRESSURES)}, got {pressure!r}")
    if since and since not in SINCE:
        raise InvalidInput("since", f"must be one of {', '.join(SINCE)}, got {since!r}")
    if q:
        check_session_id(q)
    base = viewer.prefix
    now = datetime.now(UTC)
    active_since = now - SINCE[since] if since else None
    prefix = f"{base or ''}{q}" or None
    views = _runtime(request).views()
    rows = queries.list_sessions(views, pressure=pressure or None, since=active_since, prefix=prefix, limit=200)
    everyone = queries.list_sessions(views, since=active_since, prefix=base, limit=1000)
    by_pressure = {p: 0 for p in PRESSURES}
    for r in everyone:
        if r.get("pressure") in by_pressure:
            by_pressure[r["pressure"]] += 1
    nearest = sorted(everyone, key=lambda r: -(r.get("occupancy_bp") or 0))[:8]
    fleet_names: dict[str, str] = {}
    if viewer.kind != "fleet":
        fleet_names = {f["fleet_id"]: f["name"] for f in _runtime(request).fleets().list_fleets()}
    recent = _recent(store, everyone[:RECENT_SESSIONS], viewer, now, active_since)

    def row(r: dict[str, Any]) -> dict[str, Any]:
        sid = r["session_id"]
        head, sep, _ = sid.partition(":")
        return {
            **r,
            "shown": viewer.external(sid),
            "url": _session_url(viewer, sid),
            "fleet": fleet_names.get(head, head) if sep and viewer.kind != "fleet" else "",
        }

    return _page(
        request,
        "overview.html.j2",
        viewer=viewer,
        rows=[row(r) for r in rows],
        nearest=[row(r) for r in nearest],
        by_pressure=by_pressure,
        total=len(everyone),
        capped=len(everyone) >= 1000,
        recent=recent,
        filters={"q": q, "pressure": pressure, "since": since},
        pressures=PRESSURES,
        since_choices=list(SINCE),
        show_fleet=viewer.kind != "fleet",
    )


def _recent(
    store: Any, rows: list[dict[str, Any]], viewer: Viewer, now: datetime, active_since: datetime | None
) -> dict[str, Any]:
    """Recent attempts (with outcomes) and count failures / context-limit errors over time, read from
    the newest ``RECENT_EVENTS`` events of the ``RECENT_SESSIONS`` most recently active sessions."""
    attempts: dict[tuple[str, str], dict[str, Any]] = {}
    failures: list[tuple[datetime, str]] = []
    for r in rows:
        sid, version = r["session_id"], r["version"]
        for e in store.read_stream(sid, max(1, version - RECENT_EVENTS + 1), None):
            d = e.data
            if e.type == "CompactionStarted":
                attempts[(sid, d["attempt_id"])] = {
                    "session": viewer.external(sid),
                    "url": f"{_session_url(viewer, sid)}/attempts/{urllib.parse.quote(d['attempt_id'])}",
                    "session_url": _session_url(viewer, sid),
                    "attempt_id": d["attempt_id"],
                    "reason": d["reason"],
                    "basis": d["basis"],
                    "opened_at": e.recorded_at,
                    "outcome": "open",
                    "detail": "",
                }
            elif e.type in ("CompactionCommitted", "CompactionRejected"):
                a = attempts.get((sid, d["attempt_id"]))
                if a is not None:
                    if e.type == "CompactionCommitted":
                        a["outcome"], a["detail"] = "committed", f"{d['tokens_before']} → {d['tokens_after']}"
                    else:
                        a["outcome"], a["detail"] = "rejected", d["reject_reason"]
            elif e.type in ("CountFailed", "ContextLimitReached"):
                failures.append((e.recorded_at, e.type))
    recent = sorted(attempts.values(), key=lambda a: a["opened_at"], reverse=True)[:25]
    return {"attempts": recent, "chart": _failure_chart(failures, now, active_since)}


def _failure_chart(failures: list[tuple[datetime, str]], now: datetime, since: datetime | None) -> dict[str, Any]:
    """Count failures and context-limit errors in 24 buckets of time, as bars for an inline SVG."""
    if not failures and since is None:
        return {"bars": [], "max": 0, "start": None, "end": now, "total": {"CountFailed": 0, "ContextLimitReached": 0}}
    start = since or min(t for t, _ in failures)
    end = now
    if (end - start).total_seconds() <= 0:
        start = end - timedelta(minutes=1)
    width = (end - start) / 24
    bars: list[dict[str, Any]] = [
        {"from": start + width * i, "CountFailed": 0, "ContextLimitReached": 0} for i in range(24)
    ]
    total = {"CountFailed": 0, "ContextLimitReached": 0}
    for t, kind in failures:
        if t < start:
            continue
        i = min(23, int((t - start) / width))
        bars[i][kind] += 1
        total[kind] += 1
    top = max([b["CountFailed"] + b["ContextLimitReached"] for b in bars] + [1])
    return {"bars": bars, "max": top, "start": start, "end": end, "total": total}


# -- one session -----------------------------------------------------------------------------------


def _int(value: str, name: str, default: int, low: int, high: int) -> int:
    if value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise InvalidInput(name, f"must be an integer, got {value!r}") from None
    if not low <= n <= high:
        raise InvalidInput(name, f"must be between {low} and {high}, got {n}")
    return n


@router.get("/sessions/{session_id}", response_class=HTMLResponse)
def session_page(request: Request, session_id: str) -> Response:
    viewer = _viewer(request)
    if viewer is None:
        return _to_signin()
    try:
        return _session_page(request, viewer, session_id)
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


def _session_page(request: Request, viewer: Viewer, session_id: str) -> Response:
    store = _runtime(request).store()
    sid = viewer.internal(session_id)
    version = queries.require_session(store, sid, name=session_id)
    qp = request.query_params
    kind = qp.get("type", "")
    if kind and kind not in EVENT_TYPES:
        raise InvalidInput("type", f"must be one of {', '.join(EVENT_TYPES)}, got {kind!r}")
    limit = _int(qp.get("limit", ""), "limit", 100, 1, 500)
    start = _int(qp.get("from", ""), "from", 1, 1, 10**9)
    views = _runtime(request).views()
    story = _story(store, sid, session_id, version, views)
    events, last, more = _events_page(store, sid, start, limit, kind, views)
    url = _session_url(viewer, sid)

    def link(**changes: Any) -> str:
        params = {"type": kind, "from": str(start), "limit": str(limit), **{k: str(v) for k, v in changes.items()}}
        return f"{url}?{urllib.parse.urlencode({k: v for k, v in params.items() if v})}#events-h"

    whatif = _whatif(store, sid, qp) if qp.get("wi") else _whatif_form(store, sid)
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
    return _page(request, "session.html.j2", viewer=viewer, page=page, **session_context(story))


_STORIES: OrderedDict[tuple[int, str, int], Any] = OrderedDict()  # (store, session, version) -> Story
_STORIES_MAX = 8
_stories_lock = threading.Lock()


def _story(store: Any, sid: str, shown: str, version: int, views: Any) -> Any:
    """The session's story up to ``version``: the log is append-only, so a (session, version) is read once
    and kept (the newest few) until the session moves on."""
    key = (id(store), sid, version)
    with _stories_lock:
        hit = _STORIES.get(key)
        if hit is not None:
            _STORIES.move_to_end(key)
            return hit
    story = read_story(store, sid, shown=shown, views=views)
    with _stories_lock:
        _STORIES[key] = story
        while len(_STORIES) > _STORIES_MAX:
            _STORIES.popitem(last=False)
    return story


def _events_page(store: Any, sid: str, start: int, limit: int, kind: str, views: Any) -> tuple[list[tuple], int, bool]:
    """At most ``limit`` events from version ``start`` (of type ``kind`` if given): (rows, last version read, more?)."""
    from tracker.audit.format import event_summary

    # limit + 1 events: the extra one only says whether there are more
    got = list(
        views.read_types(sid, [kind], start, limit=limit + 1) if kind else store.read_stream(sid, start, start + limit)
    )
    rows = [(e.version, e.recorded_at.isoformat()[:23], e.type, event_summary(e)) for e in got[:limit]]
    if len(got) > limit:
        return rows, rows[-1][0], True
    return rows, got[-1].version if got else start - 1, False


ATTEMPT_EVENTS = ("CompactionStarted", "CompactionCommitted", "CompactionRejected")
WHATIF_FIELDS = ("compact_at_bp", "rearm_below_bp", "turn_delta", "max_automatic_per_episode", "attempt_lease_s")


def _recorded_policy(store: Any, sid: str) -> Any:
    from tracker.core import Policy

    first = next(iter(queries.read_history(store, sid, 1, 1)), None)
    if first is None or first.type != "SessionStarted":
        return Policy()
    return Policy.from_data(first.data["policy"])


def _whatif_form(store: Any, sid: str) -> dict[str, Any]:
    p = _recorded_policy(store, sid)
    values = {f: getattr(p, f) for f in WHATIF_FIELDS}
    values["turn_delta"] = "" if p.turn_delta is None else p.turn_delta
    return {"values": values, "automatic": p.automatic, "recorded": dict(values), "result": None, "error": None}


def _whatif(store: Any, sid: str, qp: Any) -> dict[str, Any]:
    """Replay the recorded measurements under the policy of the form, beside the recorded decisions."""
    from tracker.audit.replay import whatif_rows

    form = _whatif_form(store, sid)
    base = _recorded_policy(store, sid)
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
                changes[f] = _int(raw, f, 0, -(10**9), 10**9)
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


@router.get("/sessions/{session_id}/attempts/{attempt_id}", response_class=HTMLResponse)
def attempt_page(request: Request, session_id: str, attempt_id: str) -> Response:
    viewer = _viewer(request)
    if viewer is None:
        return _to_signin()
    try:
        store = _runtime(request).store()
        sid = viewer.internal(session_id)
        queries.require_session(store, sid, name=session_id)
        found = _find_attempt(store, sid, attempt_id, _runtime(request).views())
        if found is None:
            raise UnknownAttempt(f"no attempt {attempt_id} in session {session_id}", attempt_id=attempt_id)
        attempt, events = found
        return _page(
            request,
            "attempt.html.j2",
            viewer=viewer,
            session_id=session_id,
            session_url=_session_url(viewer, sid),
            a=attempt,
            events=events,
        )
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


def _find_attempt(store: Any, sid: str, attempt_id: str, views: Any) -> tuple[Any, list[tuple]] | None:
    from tracker.audit.format import event_summary

    opened: int | None = None
    ended: int | None = None
    # only the attempt lifecycle events are looked at (through the index on session, type, version)
    for e in views.find_by_data(sid, ATTEMPT_EVENTS, "attempt_id", attempt_id):
        if e.type == "CompactionStarted":
            opened = e.version
        elif opened is not None:
            ended = e.version
            break
    if opened is None:
        return None
    window = list(store.read_stream(sid, max(1, opened - 2), (ended or opened) + 2))
    story = build_story(sid, window, table_rows=0)
    attempt = next((a for a in story.attempts if a.attempt_id == attempt_id), None)
    if attempt is None:  # pragma: no cover - the window holds its start
        return None
    rows = [(e.version, e.recorded_at.isoformat()[:23], e.type, event_summary(e)) for e in window]
    return attempt, rows


# -- JSON and the file -------------------------------------------------------------------------------


def _session_for_download(request: Request, session_id: str) -> tuple[Viewer, Any, str] | Response:
    viewer = _viewer(request)
    if viewer is None:
        return JSONResponse({"code": "unauthorized", "message": "sign in to the console first"}, status_code=401)
    store = _runtime(request).store()
    try:
        sid = viewer.internal(session_id)
        queries.require_session(store, sid, name=session_id)
    except TrackerError as exc:
        status = next((s for c, s in ERROR_STATUS.items() if isinstance(exc, c)), 500)
        return JSONResponse({"code": exc.code, "message": exc.message}, status_code=status)
    return viewer, store, sid


@router.get("/sessions/{session_id}/history.json")
def history_json(request: Request, session_id: str, from_version: int = 1, limit: int = 100) -> Response:
    got = _session_for_download(request, session_id)
    if isinstance(got, Response):
        return got
    viewer, store, sid = got
    if not 1 <= limit <= 1000 or from_version < 1:
        return JSONResponse({"code": "invalid_input", "message": "limit 1-1000, from_version >= 1"}, status_code=422)
    try:
        page = queries.history_page(store, sid, from_version, limit, external=viewer.external)
    except UnknownSession as exc:
        return JSONResponse({"code": exc.code, "message": f"no session {session_id}"}, status_code=404)
    return JSONResponse(
        {"session_id": session_id, "events": page.events, "next_from_version": page.next},
        headers={"Cache-Control": "no-store"},
    )


@router.get("/sessions/{session_id}/export.jsonl")
def export_jsonl(request: Request, session_id: str) -> Response:
    got = _session_for_download(request, session_id)
    if isinstance(got, Response):
        return got
    viewer, store, sid = got

    def lines() -> Iterator[bytes]:
        for e in queries.read_history(store, sid):
            yield (json.dumps(queries.event_to_dict(e, external=viewer.external)) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers={"Cache-Control": "no-store"})


@router.get("/sessions/{session_id}/report.html")
def report_file(request: Request, session_id: str) -> Response:
    got = _session_for_download(request, session_id)
    if isinstance(got, Response):
        return got
    _, store, sid = got
    import io

    buf = io.StringIO()
    render_store_html(store, sid, buf, shown=session_id, views=_runtime(request).views())
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in session_id)
    return HTMLResponse(
        buf.getvalue(), headers={"Content-Disposition": f'inline; filename="{name}.html"', "Cache-Control": "no-store"}
    )


# -- `tracker console` -------------------------------------------------------------------------------


def run_local(app: Any, *, host: str = "127.0.0.1", port: int = 8090, announce: Any = print) -> None:
    """Serve ``app`` (``tracker.http.app.create_app()``: the API and the console) on ``host:port``
    (port 0: any free one) with a one-time sign-in link, passed to ``announce`` once the socket
    listens; runs until interrupted."""
    import socket

    import uvicorn

    local = LocalSignIn()
    app.state.console_local = local
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # a browser opening the link at once waits in the backlog until the server is up
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    announce(f"http://{shown}:{bound}{PREFIX}/signin/ticket?t={local.ticket}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])


__all__ = ["COOKIE", "LocalSignIn", "Viewer", "router", "run_local"]
