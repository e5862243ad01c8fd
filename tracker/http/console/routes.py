"""The console's routes: sign-in (:mod:`.auth`), pages (view models from :mod:`.views`), downloads.

Errors are answered with the status of :func:`tracker.http.errors.status_for` (the one table the
API answers with too): as an HTML page on the pages, as JSON on the downloads.
"""

from __future__ import annotations

import io
import json
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tracker import queries
from tracker.audit.pages import environment
from tracker.audit.report import render_store_html
from tracker.errors import TrackerError, UnknownSession
from tracker.http.console import views as vm
from tracker.http.console.auth import (
    PREFIX,
    LocalSignIn,
    Viewer,
    clear_cookie,
    cookie_value,
    local_sign_in,
    set_cookie,
    sign_in_with_key,
    viewer_of,
)
from tracker.http.errors import status_for
from tracker.store import EventStore
from tracker.store.base import SessionViews

HERE = Path(__file__).resolve().parent
STATIC = ("console.js",)

router = APIRouter(prefix=PREFIX, include_in_schema=False)
_env = environment(HERE / "templates")


def _runtime(request: Request) -> Any:
    return request.app.state.runtime


def _store(request: Request) -> EventStore:
    return _runtime(request).store()


def _views(request: Request) -> SessionViews:
    """The read side's narrow reads of the console's pages: the one place they are obtained."""
    return _runtime(request).views()


def _page(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    html = _env.get_template(template).render(request_path=request.url.path, prefix=PREFIX, **ctx)
    return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})


def _to_signin() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/signin", status_code=303)


def _error_page(request: Request, viewer: Viewer | None, exc: TrackerError) -> HTMLResponse:
    # the read side names sessions by the viewer's ids (queries take the viewer's scope)
    return _page(request, "error.html.j2", status=status_for(exc), viewer=viewer, code=exc.code, message=exc.message)


def _json_error(exc: TrackerError, message: str | None = None) -> JSONResponse:
    return JSONResponse({"code": exc.code, "message": message or exc.message}, status_code=status_for(exc))


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
        got = await run_in_threadpool(lambda: sign_in_with_key(runtime.fleets(), token))
    except TrackerError as exc:
        return _error_page(request, None, exc)
    if got.cookie is None:
        return _page(request, "signin.html.j2", status=401, viewer=None, error=got.error)
    response = RedirectResponse(f"{PREFIX}/", status_code=303)
    set_cookie(request, response, got.cookie)
    return response


@router.get("/signin/ticket")
def signin_ticket(request: Request, t: str = "") -> Response:
    local = local_sign_in(request)
    if local is None or not t or len(t) > 100 or not local.redeem(t):
        return _page(
            request,
            "signin.html.j2",
            status=401,
            viewer=None,
            error="That sign-in link was already used or is not from this console. Sign in with a key.",
        )
    response = RedirectResponse(f"{PREFIX}/", status_code=303)
    set_cookie(request, response, cookie_value("local", "local", local.secret))
    return response


@router.post("/signout")
def signout(request: Request) -> Response:
    response = _to_signin()
    clear_cookie(response)
    return response


@router.get("/static/{name}")
def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404)
    return FileResponse(HERE / "static" / name, media_type="text/javascript", headers={"Cache-Control": "max-age=300"})


# -- pages ---------------------------------------------------------------------------------------


@router.get("", include_in_schema=False)
def root_redirect() -> Response:
    return RedirectResponse(f"{PREFIX}/", status_code=307)


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, q: str = "", pressure: str = "", since: str = "") -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return _to_signin()
    try:
        fleet_names: dict[str, str] = {}
        if viewer.kind != "fleet":
            fleet_names = {f["fleet_id"]: f["name"] for f in _runtime(request).fleets().list_fleets()}
        ctx = vm.overview(_store(request), _views(request), viewer, fleet_names, q.strip(), pressure, since)
        return _page(request, "overview.html.j2", viewer=viewer, **ctx)
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


@router.get("/sessions/{session_id}", response_class=HTMLResponse)
def session_page(request: Request, session_id: str) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return _to_signin()
    try:
        ctx = vm.session_page(_store(request), _views(request), viewer, session_id, request.query_params)
        return _page(request, "session.html.j2", viewer=viewer, **ctx)
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


@router.get("/sessions/{session_id}/attempts/{attempt_id}", response_class=HTMLResponse)
def attempt_page(request: Request, session_id: str, attempt_id: str) -> Response:
    viewer = viewer_of(request)
    if viewer is None:
        return _to_signin()
    try:
        ctx = vm.attempt_page(_store(request), _views(request), viewer, session_id, attempt_id)
        return _page(request, "attempt.html.j2", viewer=viewer, **ctx)
    except TrackerError as exc:
        return _error_page(request, viewer, exc)


# -- JSON and the file -------------------------------------------------------------------------------


def _session_for_download(request: Request, session_id: str) -> tuple[Viewer, EventStore, str] | Response:
    viewer = viewer_of(request)
    if viewer is None:
        return JSONResponse({"code": "unauthorized", "message": "sign in to the console first"}, status_code=401)
    store = _store(request)
    try:
        sid = viewer.internal(session_id)
        queries.require_session(store, session_id, scope=viewer.scope)
    except TrackerError as exc:
        return _json_error(exc)
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
        page = queries.history_page(store, session_id, from_version, limit, scope=viewer.scope)
    except UnknownSession as exc:
        return _json_error(exc)
    return JSONResponse(
        {"session_id": session_id, "events": page.events, "next_from_version": page.next},
        headers={"Cache-Control": "no-store"},
    )


#: a session file's body: (request, the session id as shown, the viewer, the store, the internal id)
SessionFile = Callable[[Request, str, Viewer, EventStore, str], Response]


def _session_file(path: str) -> Callable[[SessionFile], SessionFile]:
    """``GET path`` serves what ``fn`` makes of a session the viewer may see (else the refusal, as JSON)."""

    def register(fn: SessionFile) -> SessionFile:
        def endpoint(request: Request, session_id: str) -> Response:
            got = _session_for_download(request, session_id)
            return got if isinstance(got, Response) else fn(request, session_id, *got)

        endpoint.__name__ = endpoint.__qualname__ = fn.__name__
        router.get(path)(endpoint)
        return fn

    return register


@_session_file("/sessions/{session_id}/export.jsonl")
def export_jsonl(request: Request, session_id: str, viewer: Viewer, store: EventStore, sid: str) -> Response:
    def lines() -> Iterator[bytes]:
        for e in queries.read_history(store, session_id, scope=viewer.scope):
            yield (json.dumps(queries.event_to_dict(e, scope=viewer.scope)) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers={"Cache-Control": "no-store"})


@_session_file("/sessions/{session_id}/report.html")
def report_file(request: Request, session_id: str, viewer: Viewer, store: EventStore, sid: str) -> Response:
    buf = io.StringIO()
    render_store_html(store, sid, buf, shown=session_id, views=_views(request))
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in session_id)
    return HTMLResponse(
        buf.getvalue(), headers={"Content-Disposition": f'inline; filename="{name}.html"', "Cache-Control": "no-store"}
    )


# -- `tracker console` -------------------------------------------------------------------------------


def run_local(app: Any, *, host: str = "127.0.0.1", port: int = 8090, announce: Any = print) -> None:
    """Serve ``app`` (``tracker.http.app.create_app()``: the API and the console) on ``host:port``
    (port 0: any free one) with a one-time sign-in link, passed to ``announce`` once the socket
    listens; runs until interrupted."""
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
