"""The provider's numbers in the console, in a real browser (Playwright driving Debian's Chromium).

One ``tracker serve`` on a fresh PostgreSQL database. Fleet alpha's session ``calib-1`` is a coding
agent on ``claude-sonnet-4-5`` (counted by the heuristic, no API key): every request is measured
through the real ``Tracker`` and billed by the simulated provider (tracker/bench/sim_provider.py)
through ``report_usage``, so after 20 reports its counts are calibrated; then the provider rejects
one request as too long (its billed count over a limit just under it; the turns before it are
anchored on the one before, whose usage was reported), the next measurement is
decided against that learned limit and compacts, and the session goes on at r2. ``exact-1`` counts ``gpt-4o``
exactly and is billed 4 % over every count (drift). Fleet beta has reports of its own on another
model. The tests read the session page's chart (billed dots beside the used and raw-count lines,
the rejection's mark), its measurements table and its account, and the overview's calibration
panel (scoped to the viewer's fleet), and save screenshots (to ``$TRACKER_CONSOLE_SHOTS`` as well
when it is set).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.support.api import api_server
from tests.support.bench import CODING_AGENT, SimProvider, session
from tests.support.browser import CONSOLE_MARKS, shoot, shot_folders, sign_in

pytestmark = [*CONSOLE_MARKS, pytest.mark.feed]  # the server's calibration reads the feed: on a private cluster

ESTIMATED = "claude-sonnet-4-5"  # the shipped registry counts it with the heuristic without an API key
EXACT = "gpt-4o"
TURNS = 30


def seed_sessions(url: str, fleets: list[dict[str, Any]]) -> dict[str, Any]:
    from tracker.core import SessionProjector
    from tracker.counting.backends import InProcessCounting
    from tracker.counting.registry import ModelRegistry
    from tracker.service import Tracker
    from tracker.store import open_store

    fa, fb = fleets[0]["fleet_id"], fleets[1]["fleet_id"]
    sim = SimProvider()
    seen: dict[str, Any] = {"billed": {}, "decided": {}, "counted": {}}
    with Tracker(open_store(url, projector=SessionProjector()), counting=InProcessCounting(ModelRegistry.load())) as t:
        sid = f"{fa}:calib-1"
        requests = session(random.Random(1), CODING_AGENT, TURNS + 1)
        for i, request in enumerate(requests[:TURNS]):
            d = t.observe(sid, request=request, model=ESTIMATED, basis=f"m{i}").decision
            billed = sim.billed(request)
            t.report_usage(sid, basis=f"m{i}", input_tokens=billed)
            seen["billed"][f"r1:m{i}"] = billed
            seen["decided"][f"r1:m{i}"] = d.input_tokens
            seen["counted"][f"r1:m{i}"] = d.counted_tokens
        last = f"m{TURNS - 1}"
        # the provider's own count of the request, over a limit just under it
        stated = seen["billed"][f"r1:{last}"]
        limit = stated // 1000 * 1000
        seen["rejection"] = (stated, limit)
        t.report_rejection(sid, basis=last, message=f"prompt is too long: {stated} tokens > {limit} maximum")
        r = t.observe(sid, request=requests[TURNS], model=ESTIMATED, basis=f"m{TURNS}")
        assert r.action == "compact" and r.decision.input_limit == limit, r.decision
        seen["rejected_basis"] = f"r1:{last}"
        t.commit(sid, r.attempt.attempt_id, r.attempt.fencing_token, tokens_after=20_000)
        for j, request in enumerate(session(random.Random(12), CODING_AGENT, 3)):
            t.observe(sid, request=request, model=ESTIMATED, basis=f"n{j}")
            t.report_usage(sid, basis=f"n{j}", input_tokens=sim.billed(request))

        for i, request in enumerate(session(random.Random(13), CODING_AGENT, 6)):
            d = t.observe(f"{fa}:exact-1", request=request, model=EXACT, basis=f"e{i}").decision
            t.report_usage(f"{fa}:exact-1", basis=f"e{i}", input_tokens=d.counted_tokens * 104 // 100)
        for i, request in enumerate(session(random.Random(14), CODING_AGENT, 3)):
            d = t.observe(f"{fb}:beta-1", request=request, model="gpt-4.1", basis=f"b{i}").decision
            t.report_usage(f"{fb}:beta-1", basis=f"b{i}", input_tokens=d.counted_tokens)
    return seen


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_pg):
    d = tmp_path_factory.mktemp("console-calibration")
    seen: dict[str, Any] = {}

    def seed(url: str, fleets: list[dict[str, Any]]) -> None:
        seen.update(seed_sessions(url, fleets))

    with api_server(
        fleets=("alpha", "beta"),
        redis=False,
        clean=True,
        operator_key=True,
        seed=seed,
        prefix="console_cal",
        admin_url=private_pg.admin_url,
    ) as api:
        assert api.operator is not None
        shots = shot_folders(d)
        yield {
            "base": api.url,
            "shots": shots,
            "seen": seen,
            "keys": {"alpha": api.token_a, "beta": api.token_b, "operator": api.operator[1]},
        }


def tokens_at(page: Any) -> Any:
    """The chart's y (pixels) → tokens, read off its own axis ticks."""
    ticks = page.eval_on_selector_all(
        "svg#timeline .y-axis text.tick",
        "ts => ts.map(t => [+t.textContent.replace(/,/g, ''), +t.getAttribute('y') - 4])",
    )
    (t0, y0), (t1, y1) = ticks[0], ticks[-1]
    return lambda y: t0 + (y - y0) * (t1 - t0) / (y1 - y0)


def test_the_session_page_draws_billed_beside_counted_and_marks_the_rejection(page, server):
    seen = server["seen"]
    sign_in(page, server, "alpha")
    page.goto(server["base"] + "/console/sessions/calib-1")
    shoot(page, server, "console-calibration-session.png", full_page=False)
    shoot(page, server, "console-calibration-session-full.png", full_page=True)

    # every usage report is a dot at the billed count, with its numbers in its tooltip
    dots = page.eval_on_selector_all(
        "svg#timeline g.billed circle", "cs => cs.map(c => [+c.getAttribute('cy'), c.textContent])"
    )
    assert len(dots) == TURNS + 3
    to_tokens = tokens_at(page)
    first_basis, first_billed = "r1:m0", seen["billed"]["r1:m0"]
    y, title = dots[0]
    assert title.startswith(f"{first_basis}: billed {first_billed:,}, counted {seen['counted'][first_basis]:,}")
    assert abs(to_tokens(y) - first_billed) < 1_000, (to_tokens(y), first_billed)
    # calibrated decisions: the used line is the count decided on, the raw count is its own dashed line
    assert page.locator("svg#timeline path.counted").count() == 1
    assert page.locator("svg#timeline path.used").count() == 1
    # the rejection's mark, with the provider's numbers and the limit it taught
    (label,) = page.eval_on_selector_all(
        "svg#timeline g.marker.provider_rejected title", "ts => ts.map(t => t.textContent)"
    )
    stated, limit = seen["rejection"]
    assert f"{stated:,} > {limit:,}" in label and f"learned limit {limit:,}" in label, label
    legend = page.eval_on_selector_all("#legend [data-legend]", "ls => ls.map(l => l.dataset.legend)")
    assert {"counted", "billed", "provider_rejected"} <= set(legend)

    # the measurements table: counted, decided on (× factor), billed, billed ÷ counted, the rejection
    rows = page.eval_on_selector_all(
        "#measurements tbody tr",
        "rs => rs.map(r => ({basis: r.dataset.basis, cls: r.className, counted: r.querySelector('.counted').innerText,"
        " decided: r.querySelector('.decided').innerText, billed: r.querySelector('.billed').innerText,"
        " ratio: r.querySelector('.ratio').innerText, provider: r.querySelector('.provider').innerText}))",
    )
    by_basis = {r["basis"]: r for r in rows}
    calibrated = by_basis[f"r1:m{TURNS - 2}"]
    basis = f"r1:m{TURNS - 2}"
    assert calibrated["counted"] == f"{seen['counted'][basis]:,}"
    assert calibrated["decided"] == f"{seen['decided'][basis]:,}"
    assert seen["decided"][basis] < seen["counted"][basis]  # the heuristic over-counts; calibration corrects
    assert calibrated["billed"] == f"{seen['billed'][basis]:,}"
    assert float(calibrated["ratio"]) == pytest.approx(seen["billed"][basis] / seen["counted"][basis], abs=0.001)
    # every turn after the first is anchored on the one before (its usage was reported): decided
    # against billed per turn, and what the decision rested on
    anchored = page.inner_text(f"#measurements tr[data-basis='{basis}'] td.anchor")
    prev = f"r1:m{TURNS - 3}"
    assert anchored.startswith(f"{prev}: {seen['billed'][prev]:,} billed + "), anchored
    drift = page.inner_text(f"#measurements tr[data-basis='{basis}'] td.decided-billed")
    assert float(drift) == pytest.approx(seen["decided"][basis] / seen["billed"][basis], abs=0.001)
    assert 0.99 <= float(drift) <= 1.05
    assert page.inner_text("#measurements tr[data-basis='r1:m0'] td.anchor") == ""  # the first: nothing billed yet
    rejected = by_basis[seen["rejected_basis"]]
    assert rejected["cls"] == "provider-rejected"
    assert rejected["provider"] == f"rejected as too long: {stated:,} > {limit:,}; learned limit {limit:,}"
    after = by_basis[f"r1:m{TURNS}"]  # decided against the learned limit: compact
    assert (
        after["billed"] == ""
        and page.inner_text(f"#measurements tr[data-basis='r1:m{TURNS}'] td:nth-child(10)") == f"{limit:,}"
    )

    account = page.inner_text("#account")
    assert f"The provider billed {TURNS + 3} requests of this session" in account, account
    assert "decisions were anchored on the session's own billed count" in account, account
    assert (
        f"the provider rejected the request of {seen['rejected_basis']} as too long: {stated:,} > {limit:,}" in account
        and f"the tracker learned a limit of {limit:,} tokens for claude-sonnet-4-5" in account
    ), account
    # the event table tells the reports too
    page.goto(server["base"] + "/console/sessions/calib-1?type=ProviderRejected#events-h")
    (summary,) = page.eval_on_selector_all("#events tbody tr td:nth-child(4)", "ts => ts.map(t => t.innerText)")
    assert f"provider rejected {seen['rejected_basis']}: {stated:,} > {limit:,}" in summary, summary
    assert f"learned limit {limit:,}" in summary, summary


def test_the_overview_shows_each_models_calibration_of_the_viewers_fleet(page, server):
    sign_in(page, server, "alpha")
    rows = page.eval_on_selector_all(
        "#calibration tbody tr",
        "rs => rs.map(r => [r.dataset.model, r.dataset.counter, r.className, [...r.cells].map(c => c.innerText)])",
    )
    assert {(m, c) for m, c, _, _ in rows} == {(ESTIMATED, "estimate"), (EXACT, "exact")}  # not beta's model
    assert page.inner_text("#sessions tr[data-session='calib-1'] td.pressure") == "normal"
    table = page.locator("#calibration")
    table.scroll_into_view_if_needed()
    shoot(page, server, "console-calibration-overview.png", full_page=True)
    est = next(r for r in rows if r[0] == ESTIMATED)
    model, counter, reports, rejections, samples, median, p90, factor, drift, learned, _last = est[3]
    assert (model, counter, reports, rejections) == (ESTIMATED, "estimate", str(TURNS + 3), "1")
    assert 0.6 < float(median) < 0.85 and float(median) <= float(p90)
    assert 0.6 < float(factor) < 0.85  # the factor the decisions use
    assert learned == f"{server['seen']['rejection'][1]:,}" and drift == "" and est[2] == ""
    exact = next(r for r in rows if r[0] == EXACT)
    assert exact[2] == "drifted"
    assert exact[3][8] == "+4.0 % drifted" and exact[3][7] == "exact: none", exact

    page.context.clear_cookies()
    sign_in(page, server, "operator")
    rows = page.eval_on_selector_all(
        "#calibration tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText).slice(0, 3))"
    )
    assert sorted(rows) == [
        ["alpha", ESTIMATED, "estimate"],
        ["alpha", EXACT, "exact"],
        ["beta", "gpt-4.1", "exact"],
    ]
