"""The console without a browser: its split modules through FastAPI's test client on a SQLite store.

The signed-in viewer's ids are the core's ``SessionScope`` (the API's length limit included), error
pages answer with ``tracker.http.errors.status_for``, the overview's counts read right (1 error,
2 errors), the event-type filter is the core's list, and the stories cache is the shared LRU.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.support.measurements import measurement
from tracker._lru import LRU
from tracker.core import EVENT_TYPES
from tracker.core.model import SessionScope
from tracker.errors import InvalidSessionId, UnknownSession
from tracker.http.console import _STORIES, LocalSignIn, Viewer
from tracker.http.errors import status_for

LIMIT = 100_000


def _m(basis: str, tokens: int) -> dict[str, Any]:
    return measurement(basis, tokens, LIMIT)


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    from fastapi.testclient import TestClient

    from tracker import Tracker
    from tracker.bootstrap import build_fleets
    from tracker.errors import ContextLimitError, ContextLimitUnknown
    from tracker.http.app import create_app
    from tracker.settings import Settings
    from tracker.store import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('console-views') / 't.db'}"
    upgrade(url)
    with Tracker.from_settings(Settings.of(database_url=url)) as t:
        fa = build_fleets(t.store).create_fleet("alpha")["fleet_id"]
        _, key = build_fleets(t.store).create_key("alpha")
        sid = f"{fa}:one"
        t.observe(sid, measurement=_m("m1", 50_000))
        with pytest.raises(ContextLimitUnknown):
            t.observe(sid, request={"messages": [{"role": "user", "content": "hi"}]}, model="no-such-model", basis="x")
        r = t.observe(f"{fa}:two", measurement=_m("m1", 90_000))
        t.reject(f"{fa}:two", r.attempt.attempt_id, r.attempt.fencing_token, "summarizer_error")
        with pytest.raises(ContextLimitError):  # the same basis again: it had its attempt
            t.observe(f"{fa}:two", measurement=_m("m1", 101_000))
    app = create_app(settings=Settings.of(database_url=url))
    local = LocalSignIn()
    app.state.console_local = local
    with TestClient(app) as client:
        yield {"client": client, "local": local, "key": key, "fleet": fa}


def _sign_in_with_key(client: Any, key: str) -> None:
    client.cookies.clear()
    r = client.post("/console/signin", content=f"key={key}", follow_redirects=False)
    assert r.status_code == 303, r.text


def test_a_fleet_viewer_names_ids_through_the_core_s_scope(console):
    v = Viewer("fleet", "k1", scope=SessionScope("f123456789"))
    assert v.scope.prefix == "f123456789:" and v.fleet_id == "f123456789"
    assert v.internal("abc") == "f123456789:abc" and v.external("f123456789:abc") == "abc"
    longest = "a" * SessionScope("f123456789").max_len
    assert v.internal(longest) == "f123456789:" + longest
    with pytest.raises(InvalidSessionId, match="at most 189 characters in a fleet"):
        v.internal(longest + "a")
    operator = Viewer("operator", "k2")
    assert operator.scope.prefix == "" and operator.internal("f1:x") == "f1:x"

    _sign_in_with_key(console["client"], console["key"])
    r = console["client"].get("/console/sessions/" + "a" * 195)
    assert r.status_code == status_for(InvalidSessionId("x")) == 422
    assert "at most 189 characters in a fleet" in r.text
    r = console["client"].get("/console/sessions/nobody")
    assert r.status_code == status_for(UnknownSession("x", session_id="x")) == 404
    r = console["client"].get("/console/sessions/nobody/history.json")
    assert r.status_code == 404 and r.json()["code"] == "unknown_session"


def test_the_overview_counts_read_right(console):
    client = console["client"]
    _sign_in_with_key(client, console["key"])
    page = client.get("/console/").text
    titles = re.findall(r'<g class="bucket"><title>[^<]*: ([^<]*)</title>', page)
    one_each = ("1 count failure, 1 context-limit error",)  # the two in one bucket, or in two buckets:
    apart = ("1 count failure, 0 context-limit errors", "0 count failures, 1 context-limit error")
    assert set(one_each) <= set(titles) or set(apart) <= set(titles), titles
    assert "0 count failures, 0 context-limit errors" in titles
    assert not any(re.search(r"\b1 [a-z-]+ errors\b|\b1 count failures\b", t) for t in titles)
    assert "count failed (1)" in page and "ContextLimitError (1)" in page


def test_the_session_page_uses_the_core_s_event_types_and_the_rule_s_reason(console):
    client = console["client"]
    _sign_in_with_key(client, console["key"])
    page = client.get("/console/sessions/two").text
    assert "the basis r1:m1 had already had its attempt and nothing else was eligible" in page
    options = re.findall(r'<option value="([A-Za-z]+)"', page.split('id="event-filters"', 1)[1].split("</select>")[0])
    assert tuple(options) == tuple(EVENT_TYPES)
    r = client.get("/console/sessions/two?type=Tick")
    assert r.status_code == 422 and "must be one of" in r.text
    rows = client.get("/console/sessions/one?type=CountFailed").text
    assert rows.count('<tr class="CountFailed">') == 1
    assert isinstance(_STORIES, LRU) and len(_STORIES) >= 1


def test_the_local_ticket_signs_in_once(console):
    client = console["client"]
    client.cookies.clear()
    local = LocalSignIn()
    client.app.state.console_local = local
    r = client.get(f"/console/signin/ticket?t={local.ticket}", follow_redirects=False)
    assert r.status_code == 303
    assert "local operator (every fleet)" in client.get("/console/").text
    client.cookies.clear()
    assert client.get(f"/console/signin/ticket?t={local.ticket}").status_code == 401


def test_the_session_files_serve_a_visible_session_and_refuse_the_rest(console):
    client = console["client"]
    client.cookies.clear()
    for name in ("export.jsonl", "report.html"):
        r = client.get(f"/console/sessions/one/{name}")
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    _sign_in_with_key(client, console["key"])
    r = client.get("/console/sessions/one/export.jsonl")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines and {e["session_id"] for e in lines} == {"one"}  # the fleet's ids, as the viewer names them
    assert [e["version"] for e in lines] == list(range(1, len(lines) + 1))
    r = client.get("/console/sessions/one/report.html")
    assert r.status_code == 200 and r.headers["content-disposition"] == 'inline; filename="one.html"'
    assert "<html" in r.text.lower()
    for name in ("export.jsonl", "report.html"):
        r = client.get(f"/console/sessions/nobody/{name}")
        assert r.status_code == 404 and r.json()["code"] == "unknown_session"
