"""The web console in a real browser: Playwright driving Debian's Chromium against ``tracker serve``.

One real server (``tracker serve`` in a subprocess, uvicorn) on a fresh PostgreSQL database holds
two fleets and a session of no fleet. Fleet A's session ``story-1`` is built through the real
``Tracker``: a committed compaction, a count failure, three attempts rejected with
``summarizer_error`` and then ``ContextLimitError``. The tests sign in with a fleet key and an
operator key, navigate overview → session → attempt, use the filters and the what-if form, and
save screenshots (to a temporary folder, and to ``$TRACKER_CONSOLE_SHOTS`` when it is set: that
is how ``docs/console/`` was made) whose chart is checked element by element: time and token
axes, the three levels, the drop of the committed compaction, the markers and the legend, the
attempts table. The last test runs ``tracker demo`` and reads the console's account of its
context-limit session.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import pytest

from tests.support.api import api_server
from tests.support.browser import CONSOLE_MARKS, shoot, shot_folders, sign_in
from tests.support.cli import run_tracker
from tests.support.db import create_pg_database, drop_pg_database, transaction_open_elsewhere
from tests.support.db import sqlalchemy_url as _sqlalchemy_url
from tests.support.measurements import measurement

TRACKER = shutil.which("tracker")
pytestmark = [*CONSOLE_MARKS, pytest.mark.feed]  # holds the feed back: its server is on a private cluster

LIMIT = 100_000


def _m(basis: str, tokens: int) -> dict[str, Any]:
    return measurement(basis, tokens, LIMIT)


def build_story_session(t: Any, sid: str) -> None:
    from tracker.errors import ContextLimitError, ContextLimitUnknown

    assert t.observe(sid, measurement=_m("m1", 50_000)).action == "proceed"
    r = t.observe(sid, measurement=_m("m2", 85_000))
    t.commit(sid, r.attempt.attempt_id, r.attempt.fencing_token, tokens_after=30_000)
    for i in range(3, 60):  # enough events for a second page of the event table
        t.observe(sid, measurement=_m(f"m{i}", 30_000 + i * 100))
    with pytest.raises(ContextLimitUnknown):
        t.observe(sid, request={"messages": [{"role": "user", "content": "hi"}]}, model="no-such-model", basis="x1")
    for basis, tokens in (("m70", 88_000), ("m71", 92_000), ("m72", 95_000)):
        time.sleep(0.02)
        r = t.observe(sid, measurement=_m(basis, tokens))
        assert r.action == "compact"
        t.reject(sid, r.attempt.attempt_id, r.attempt.fencing_token, "summarizer_error")
    with pytest.raises(ContextLimitError):
        t.observe(sid, measurement=_m("m73", 101_000))


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_pg):
    from tracker import Tracker
    from tracker.settings import Settings

    d = tmp_path_factory.mktemp("console")

    def seed(url: str, fleets: list[dict[str, Any]]) -> None:
        fa, fb = fleets[0]["fleet_id"], fleets[1]["fleet_id"]
        with Tracker.from_settings(Settings.of(database_url=url)) as t:
            build_story_session(t, f"{fa}:story-1")
            t.observe(f"{fa}:calm-1", measurement=_m("c1", 20_000))
            t.observe(f"{fb}:other-1", measurement=_m("o1", 40_000))
            t.observe("loose-1", measurement=_m("l1", 10_000))

    # the server's environment: no TRACKER_* but the database (no Redis), its log in the folder
    with api_server(
        fleets=("alpha", "beta"),
        redis=False,
        clean=True,
        operator_key=True,
        seed=seed,
        log=d / "server.log",
        prefix="console",
        admin_url=private_pg.admin_url,
    ) as api:
        assert api.operator is not None
        op_record, key_op = api.operator
        shots = shot_folders(d)
        yield {
            "base": api.url,
            "url": api.db_url,
            "env": api.env,
            "dir": d,
            "shots": shots,
            "log": d / "server.log",
            "keys": {"alpha": api.token_a, "beta": api.token_b, "operator": key_op, "operator_id": op_record["key_id"]},
            "fleets": {"alpha": api.fleet_a["fleet_id"], "beta": api.fleet_b["fleet_id"]},
        }


def sessions_listed(page: Any) -> set[str]:
    return set(page.eval_on_selector_all("#sessions tr[data-session]", "rows => rows.map(r => r.dataset.session)"))


# -- sign-in, sign-out, and who sees what ------------------------------------------------------------


def test_sign_in_and_out_with_a_fleet_key(page, server):
    base = server["base"]
    page.goto(base + "/console/")
    assert page.url.endswith("/console/signin")
    page.fill("#key", "ctk_000000000000_not-a-real-key-at-all-000000")
    page.click("#signin")
    assert "malformed, unknown or revoked" in page.inner_text("#signin-error")

    sign_in(page, server, "alpha")
    assert page.inner_text("#who") == "signed in as fleet alpha"
    cookies = page.context.cookies()
    assert [c["name"] for c in cookies] == ["tracker_console"]
    c = cookies[0]
    assert c["httpOnly"] is True and c["sameSite"] == "Strict" and c["path"] == "/console"
    secret_part = server["keys"]["alpha"].split("_", 2)[2]
    assert secret_part not in c["value"] and server["keys"]["alpha"] not in page.url
    assert page.evaluate("document.cookie") == "", "the cookie must not be readable by scripts"

    page.click("#signout")
    page.wait_for_url(base + "/console/signin")
    assert page.context.cookies() == []
    page.goto(base + "/console/")
    assert page.url.endswith("/console/signin"), "signed out, the overview needs a key again"
    # the key never reached the server's log (it was only ever in a POST body)
    assert server["keys"]["alpha"] not in server["log"].read_text()


def test_a_fleet_key_sees_only_its_fleet(page, server):
    sign_in(page, server, "alpha")
    assert sessions_listed(page) == {"story-1", "calm-1"}
    page.goto(server["base"] + "/console/sessions/other-1")  # fleet beta's session, by its id
    assert page.inner_text("h1") == "unknown_session"
    for stored in (f"{server['fleets']['beta']}:other-1", "loose-1"):
        response = page.goto(server["base"] + f"/console/sessions/{stored}")
        assert response.status in (404, 422), (stored, response.status)
    response = page.goto(server["base"] + "/console/sessions/other-1/history.json")
    assert response.status == 404

    page.context.clear_cookies()
    sign_in(page, server, "beta")
    assert sessions_listed(page) == {"other-1"}


def test_an_operator_key_sees_every_fleet(page, server):
    sign_in(page, server, "operator")
    assert page.inner_text("#who") == "signed in as operator (every fleet)"
    fa, fb = server["fleets"]["alpha"], server["fleets"]["beta"]
    assert sessions_listed(page) == {f"{fa}:story-1", f"{fa}:calm-1", f"{fb}:other-1", "loose-1"}
    fleets = page.eval_on_selector_all("#sessions tr[data-session] td:first-child", "tds => tds.map(t => t.innerText)")
    assert set(fleets) == {"alpha", "beta", ""}


def test_a_revoked_key_ends_its_sign_in(page, server):
    from tracker.bootstrap import build_fleets
    from tracker.store import open_store

    store = open_store(server["url"])
    try:
        fleets = build_fleets(store)
        _, token = fleets.create_key("alpha")
        page.goto(server["base"] + "/console/signin")
        page.fill("#key", token)
        page.click("#signin")
        page.wait_for_url(server["base"] + "/console/")
        fleets.revoke_key(token.split("_")[1])
    finally:
        store.close()
    page.goto(server["base"] + "/console/")
    assert page.url.endswith("/console/signin")


# -- navigation, filters, what-if ---------------------------------------------------------------------


def test_overview_to_session_to_attempt(page, server):
    sign_in(page, server, "alpha")
    assert page.inner_text("#by-pressure .card.hard_limit b") == "1"
    assert page.locator("#nearest tr").first.get_attribute("data-session") == "story-1"
    assert page.locator("#recent-attempts tr[data-outcome=rejected]").count() == 3
    assert page.locator("#failures-chart rect.count_failed").count() >= 1
    assert page.locator("#failures-chart rect.context_limit").count() >= 1
    shoot(page, server, "overview.png", full_page=True)

    page.click("#sessions a:text('story-1')")
    page.wait_for_url("**/console/sessions/story-1")
    account = page.inner_text("#account")
    assert "reached its hard limit" in account and "ContextLimitError" in account
    assert "Three automatic attempts on r2 were rejected (summarizer_error" in account, account
    # the JSON links work with the cookie
    links = page.eval_on_selector_all("#links a", "as => as.map(a => a.getAttribute('href'))")
    assert links[:2] == ["/console/sessions/story-1/history.json", "/console/sessions/story-1/export.jsonl"]
    history = page.evaluate("fetch('/console/sessions/story-1/history.json?limit=3').then(r => r.json())")
    assert [e["version"] for e in history["events"]] == [1, 2, 3] and history["events"][0]["session_id"] == "story-1"

    rows = page.locator("#attempts tbody tr")
    assert rows.count() == 4
    rows.nth(2).locator("a").click()
    page.wait_for_url("**/console/sessions/story-1/attempts/*")
    assert page.inner_text("#attempt-outcome") == "rejected: summarizer_error"
    assert page.locator("#events tr.CompactionRejected").count() >= 1
    page.click("#to-session")
    page.wait_for_url("**/console/sessions/story-1")


def test_filters(page, server):
    sign_in(page, server, "alpha")
    page.select_option("#pressure", "hard_limit")  # submits by itself (console.js)
    page.wait_for_url("**/console/?**pressure=hard_limit**")
    assert sessions_listed(page) == {"story-1"}
    page.fill("#q", "calm")
    page.select_option("#pressure", "")
    page.wait_for_url("**q=calm**")
    assert sessions_listed(page) == {"calm-1"}
    page.fill("#q", "nothing-like-this")
    page.click("#filters button")
    page.wait_for_load_state()
    assert sessions_listed(page) == set() and page.locator("#no-sessions").count() == 1

    page.goto(server["base"] + "/console/sessions/story-1")
    page.select_option("#event-filters select[name=type]", "CompactionRejected")
    page.click("#event-filters button")
    page.wait_for_url("**type=CompactionRejected**")
    classes = page.eval_on_selector_all("#events tbody tr", "rows => rows.map(r => r.className)")
    assert classes == ["CompactionRejected"] * 3
    # paging: 50 rows, then the next page starts where the first ended
    page.goto(server["base"] + "/console/sessions/story-1?limit=50")
    first = page.eval_on_selector_all("#events tbody tr td:first-child", "tds => tds.map(t => +t.innerText)")
    assert first == list(range(1, 51))
    page.click("#events-next")
    page.wait_for_load_state()
    second = page.eval_on_selector_all("#events tbody tr td:first-child", "tds => tds.map(t => +t.innerText)")
    assert second[0] == 51 and len(second) <= 50


def test_whatif_form(page, server):
    sign_in(page, server, "alpha")
    page.goto(server["base"] + "/console/sessions/story-1")
    assert page.input_value("#whatif-form input[name=compact_at_bp]") == "8000"
    page.fill("#whatif-form input[name=max_automatic_per_episode]", "5")
    page.fill("#whatif-form input[name=compact_at_bp]", "9000")
    page.click("#whatif-run")
    page.wait_for_url("**wi=1**")
    totals = {
        r[0]: (int(r[1]), int(r[2]))
        for r in page.eval_on_selector_all(
            "#whatif-totals tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.innerText))"
        )
    }
    assert totals["compact"][0] == 4, totals  # recorded: 4 compact decisions
    assert totals["compact"][1] != totals["compact"][0], totals  # at 9000 bp some of them are not compactions
    assert int(page.inner_text("#whatif-changed")) > 0
    assert page.locator("#whatif-rows tr.changed").count() == int(page.inner_text("#whatif-changed"))
    assert page.input_value("#whatif-form input[name=compact_at_bp]") == "9000"
    shoot(page, server, "whatif.png", full_page=False)
    page.locator("#whatif").scroll_into_view_if_needed()
    # a policy the core refuses is reported, nothing replayed
    page.fill("#whatif-form input[name=rearm_below_bp]", "9500")
    page.click("#whatif-run")
    page.wait_for_load_state()
    assert "invalid_policy" in page.inner_text("#whatif-error")
    assert page.locator("#whatif-result").count() == 0


# -- the chart and the attempts table, on screen ----------------------------------------------------


def test_session_page_chart_and_attempts_table(page, server):
    sign_in(page, server, "alpha")
    page.goto(server["base"] + "/console/sessions/story-1")
    shot = shoot(page, server, "session.png", full_page=False)
    shoot(page, server, "session-full.png", full_page=True)
    assert shot.stat().st_size > 50_000

    svg = page.locator("svg#timeline")
    box = svg.bounding_box()
    assert box is not None and box["y"] + box["height"] < 1000, "the chart is on the first screen"
    x_ticks = page.eval_on_selector_all("svg#timeline .x-axis text.tick", "ts => ts.map(t => t.textContent)")
    assert len(x_ticks) >= 3 and all(t.count(":") >= 2 for t in x_ticks), x_ticks  # wall-clock times
    y_ticks = page.eval_on_selector_all("svg#timeline .y-axis text.tick", "ts => ts.map(t => t.textContent)")
    assert y_ticks[0] == "0" and "100,000" in y_ticks, y_ticks
    titles = page.eval_on_selector_all("svg#timeline text.axis-title", "ts => ts.map(t => t.textContent)")
    assert titles[0] == "tokens (input)" and titles[1].startswith("time (UTC")
    levels = page.eval_on_selector_all(
        "svg#timeline path.level", "ps => ps.map(p => [p.getAttribute('class'), p.getAttribute('stroke')])"
    )
    assert {c for c, _ in levels} == {"level hard", "level compact", "level rearm"}
    assert len({s for _, s in levels}) == 3, "each level has its own colour"
    assert page.text_content("svg#timeline text.level-label.hard") == "hard 100,000"

    # the committed compaction is an instant drop: one vertical line from 85,000 down to 30,000 tokens
    drop = page.eval_on_selector(
        "svg#timeline g.marker.committed line",
        "l => [l.x1.baseVal.value, l.x2.baseVal.value, l.y1.baseVal.value, l.y2.baseVal.value]",
    )
    x1, x2, y1, y2 = drop
    assert x1 == x2 and y2 > y1, drop
    y_of = page.evaluate(
        """() => { const t = [...document.querySelectorAll('svg#timeline .y-axis text.tick')];
        const a = t.find(e => e.textContent === '0'), b = t.find(e => e.textContent === '100,000');
        return [+a.getAttribute('y') - 4, +b.getAttribute('y') - 4]; }"""
    )
    per_token = (y_of[0] - y_of[1]) / 100_000
    assert abs((y2 - y1) / per_token - 55_000) < 1_500, "the drop goes from tokens before to tokens after"
    assert f"L{x1:.1f},{y1:.1f} L{x1:.1f},{y2:.1f}" in svg.locator("path.used").get_attribute("d")

    markers = page.eval_on_selector_all(
        "svg#timeline g.marker", "gs => gs.map(g => g.getAttribute('class').split(' ')[1])"
    )
    assert sorted(markers) == ["committed", "context_limit", "count_failed", "rejected", "rejected", "rejected"]
    # the legend names every mark, in the colour the chart uses
    legend = dict(
        page.eval_on_selector_all(
            "#legend [data-legend]",
            "ls => ls.map(l => [l.dataset.legend, getComputedStyle(l.querySelector('i')).backgroundColor + '|' +"
            " getComputedStyle(l.querySelector('i')).color + '|' + getComputedStyle(l.querySelector('i')).borderTopColor])",
        )
    )
    assert set(legend) >= {"used", "compact", "rearm", "hard", "committed", "rejected", "count_failed", "context_limit"}
    for kind in ("rejected", "count_failed", "context_limit", "committed"):
        fill = page.eval_on_selector(
            f"svg#timeline g.marker.{kind} :is(rect, polygon, line)",
            "e => getComputedStyle(e).fill !== 'none' && e.getAttribute('fill') || e.getAttribute('stroke')",
        )
        rgb = "rgb({}, {}, {})".format(*(int(fill[i : i + 2], 16) for i in (1, 3, 5)))
        assert rgb in legend[kind], (kind, fill, legend[kind])
    assert page.is_visible("#legend")

    # the attempts table: reason, basis, opened → ended, duration, tokens, outcome, reject reason, fencing token
    heads = page.eval_on_selector_all("#attempts thead th", "ths => ths.map(t => t.innerText.toLowerCase())")
    for h in ("reason", "basis", "opened → ended", "duration", "tokens before → after", "outcome", "reject reason"):
        assert h in heads, (h, heads)
    assert "fencing token" in heads
    cells = page.eval_on_selector_all(
        "#attempts tbody tr", "rows => rows.map(r => [r.dataset.outcome, r.cells[8].innerText, r.cells[9].innerText])"
    )
    assert cells == [["committed", "committed", ""]] + [["rejected", "rejected", "summarizer_error"]] * 3
    tokens = page.inner_text("#attempts tbody tr:first-child td:nth-child(8)")
    assert tokens == "85,000 → 30,000"
    assert page.locator("#failures tbody tr[data-kind=ContextLimitUnknown]").count() == 1


def test_the_overview_says_when_the_event_feed_is_held_back(page, browser, server):
    """A transaction left open in another database of the same server holds the event feed back
    (and the calibration table, folded from it): the overview says so above that table, with the
    count of held events for an operator only, and says nothing once it has ended."""
    from tracker import Tracker
    from tracker.settings import Settings

    with transaction_open_elsewhere(server["url"]) as end:
        with Tracker.from_settings(Settings.of(database_url=server["url"])) as t:
            t.observe("loose-1", measurement=_m("l1", 10_000))
        time.sleep(1.1)
        sign_in(page, server, "operator")
        banner = page.inner_text("#feed-held")
        assert banner.startswith("The event feed has been held back for "), banner
        assert "(1 committed event, every fleet's): a transaction that started before" in banner
        assert "Decisions are not affected." in banner
        page.locator("#feed-held").scroll_into_view_if_needed()
        shoot(page, server, "feed-held.png")
        fleet = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
        try:
            sign_in(fleet, server, "alpha")
            seen = fleet.inner_text("#feed-held")
            assert seen.startswith("The event feed has been held back for ") and "committed event" not in seen
        finally:
            fleet.context.close()
        end()
        deadline = time.monotonic() + 30
        while page.locator("#feed-held").count() and time.monotonic() < deadline:
            time.sleep(0.2)
            page.reload()
        assert page.locator("#feed-held").count() == 0


# -- after `tracker demo` -----------------------------------------------------------------------------


@pytest.mark.slow
def test_after_the_demo_the_account_names_the_rejected_attempts(page, server, tmp_path):
    from tracker.store import upgrade

    name, libpq = create_pg_database("console_demo")
    url = _sqlalchemy_url(libpq)
    proc = None
    try:
        upgrade(url)
        env = {**server["env"], "TRACKER_DATABASE_URL": url}
        demo = run_tracker(
            [TRACKER, "demo", "--workers", "2", "--sessions", "2", "--steps", "40", "--json"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert demo.returncode == 0, demo.stderr[-2000:]
        # `tracker console`: loopback, a one-time link, no key
        proc = subprocess.Popen(
            [TRACKER, "console", "--port", "0"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdout is not None
        link = ""
        deadline = time.monotonic() + 60
        while not link.startswith("http://127.0.0.1:") and time.monotonic() < deadline:
            link = proc.stdout.readline().decode().strip()
        assert "/console/signin/ticket?t=" in link, link
        page.goto(link)
        assert page.inner_text("#who") == "signed in as local operator (every fleet)"
        page.select_option("#pressure", "hard_limit")
        page.wait_for_url("**pressure=hard_limit**")
        limited = sessions_listed(page)
        assert len(limited) == 1, limited
        page.click("#sessions tbody a")
        page.wait_for_load_state()
        account = page.inner_text("#account")
        rejected = page.eval_on_selector_all(
            "#attempts tbody tr[data-outcome=rejected]", "rows => rows.map(r => r.cells[9].innerText)"
        )
        assert rejected and set(rejected) == {"summarizer_error"}
        assert "reached its hard limit" in account
        assert f"{len(rejected)} automatic attempts" in account.replace("Three", "3").replace("Two", "2")
        assert "were rejected (summarizer_error" in account, account
        shoot(page, server, "demo-context-limit.png", full_page=False)
        # the one-time link is spent
        other = page.context.browser.new_context()
        try:
            p2 = other.new_page()
            assert p2.goto(link).status == 401
        finally:
            other.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)
        drop_pg_database(name)
