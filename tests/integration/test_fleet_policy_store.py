"""The fleets' policies in the store (``FleetStore``), on both backends: versions, history, refusals, the cache,
concurrent changes; and a fleet's policy reaching a new session through the HTTP caller's scope (``Caller``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from tracker.core import Policy
from tracker.errors import InvalidInput, InvalidPolicy, UnknownFleet
from tracker.store import make_engine
from tracker.store.fleets import FleetStore
from tracker.store.migrate import upgrade
from tracker.store.schema import fleet_policy_events, fleets


@pytest.fixture
def store(db_url: str) -> Iterator[FleetStore]:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        yield FleetStore(engine, cache_s=0)
    finally:
        engine.dispose()


def rows(store: FleetStore) -> tuple[int, int]:
    with store.engine.connect() as conn:
        return (
            conn.execute(select(func.count()).select_from(fleet_policy_events)).scalar_one(),
            conn.execute(select(func.count()).select_from(fleets)).scalar_one(),
        )


def test_versions_and_history(store: FleetStore) -> None:
    plain = store.create_fleet("plain")
    assert plain["policy"] is None
    assert store.current_policy("plain")["version"] == 0 and store.policy_of(plain["fleet_id"]) is None
    assert store.policy_history("plain") == []
    own = store.create_fleet("own", Policy(compact_at_bp=7000), actor="alice")
    assert own["policy"]["compact_at_bp"] == 7000
    assert store.policy_of(own["fleet_id"]) == Policy(compact_at_bp=7000)
    second = store.set_policy("own", {**Policy().to_data(), "compact_at_bp": 9000}, actor="bob")
    assert second["version"] == 2 and second["actor"] == "bob"
    reset = store.set_policy(own["fleet_id"], None, actor="carol")
    assert reset["version"] == 3 and reset["policy"] is None
    assert store.policy_of(own["fleet_id"]) is None
    history = store.policy_history("own")
    assert [(r["version"], r["actor"]) for r in history] == [(1, "alice"), (2, "bob"), (3, "carol")]
    assert [r["policy"] and r["policy"]["compact_at_bp"] for r in history] == [7000, 9000, None]
    assert store.current_policy("own") == history[-1]


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"compact_at_bp": 10000}, "compact_at_bp"),
        ({"compact_at_bp": 7000, "rearm_below_bp": 7000}, "rearm_below_bp"),
        ({"compact_at_bp": -1}, "compact_at_bp"),
        ({"turn_delta": 0}, "turn_delta"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"compact_at_bp": "7000"}, "compact_at_bp"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field_and_writes_nothing(store: FleetStore, policy, field) -> None:
    store.create_fleet("f", Policy(compact_at_bp=7000), actor="alice")
    before = rows(store)
    with pytest.raises(InvalidPolicy) as refused:
        store.set_policy("f", policy, actor="bob")
    assert refused.value.field == field
    with pytest.raises(InvalidPolicy) as refused:
        store.create_fleet("g", policy, actor="bob")
    assert refused.value.field == field
    with pytest.raises(InvalidInput) as no_actor:
        store.set_policy("f", Policy(), actor="")
    assert no_actor.value.field == "actor"
    with pytest.raises(InvalidInput) as bad_actor:
        store.set_policy("f", Policy(), actor="a\x1bb")
    assert bad_actor.value.field == "actor"
    with pytest.raises(UnknownFleet):
        store.set_policy("nope", Policy(), actor="bob")
    assert rows(store) == before
    assert store.current_policy("f")["policy"]["compact_at_bp"] == 7000


def test_policy_of_is_cached_for_cache_s(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        writer, server = FleetStore(engine, cache_s=0), FleetStore(engine, cache_s=0.5)
        fid = writer.create_fleet("c", Policy(compact_at_bp=7000), actor="a")["fleet_id"]
        assert server.policy_of(fid) == Policy(compact_at_bp=7000)
        writer.set_policy(fid, Policy(compact_at_bp=9000), actor="a")
        assert server.policy_of(fid) == Policy(compact_at_bp=7000)  # cached
        time.sleep(0.6)
        assert server.policy_of(fid) == Policy(compact_at_bp=9000)
        server.set_policy(fid, Policy(compact_at_bp=6500), actor="a")  # its own change: at once
        assert server.policy_of(fid) == Policy(compact_at_bp=6500)
    finally:
        engine.dispose()


def test_concurrent_changes_each_get_their_own_version(store: FleetStore) -> None:
    fid = store.create_fleet("race")["fleet_id"]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def change(i: int) -> None:
        try:
            start.wait(30)
            for j in range(5):
                store.set_policy(fid, Policy(compact_at_bp=7000 + i * 10 + j), actor=f"t{i}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=change, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    history = store.policy_history(fid)
    assert [r["version"] for r in history] == list(range(1, 21))
    assert sorted(r["policy"]["compact_at_bp"] for r in history) == sorted(
        7000 + i * 10 + j for i in range(4) for j in range(5)
    )


def test_the_http_commands_start_a_fleets_new_session_with_its_policy(db_url: str) -> None:
    from tracker.bootstrap import build_fleets
    from tracker.core import SessionProjector
    from tracker.core.commands import Observe, RequestCompaction
    from tracker.core.model import SessionScope
    from tracker.http.runtime import Caller
    from tracker.service import Tracker
    from tracker.store import open_store

    upgrade(db_url)
    with Tracker(open_store(db_url, projector=SessionProjector())) as tracker:
        fleets_ = build_fleets(tracker.store, cache_s=0)
        own = fleets_.create_fleet("own", Policy(compact_at_bp=7000, rearm_below_bp=5000), actor="a")["fleet_id"]
        plain = fleets_.create_fleet("plain")["fleet_id"]
        a, p = Caller(own, fleets_.policy_of), Caller(plain, fleets_.policy_of)

        def m(basis: str, tokens: int) -> dict[str, Any]:
            return {"basis": basis, "input_tokens": tokens, "input_limit": 100_000}

        def observe(scope: SessionScope, sid: str, basis: str, tokens: int) -> Any:
            return tracker.run(Observe(sid, measurement=m(basis, tokens)), scope).decision

        assert observe(a, "s", "m1", 70_000).action == "compact"
        assert observe(p, "s", "m1", 70_000).action == "proceed"
        assert observe(SessionScope(), "bare", "m1", 70_000).action == "proceed"
        attempt = tracker.run(RequestCompaction("manual"), a)  # a manual attempt may start a session too
        assert attempt.trigger == "manual"
        assert tracker.state(f"{own}:manual").policy == Policy(compact_at_bp=7000, rearm_below_bp=5000)
        # a change reaches new sessions only
        fleets_.set_policy(own, Policy(compact_at_bp=9000), actor="b")
        kept = observe(a, "s", "m2", 75_000)
        assert kept.pressure == "compact" and kept.threshold_bp == 7000
        assert observe(a, "t", "m1", 75_000).action == "proceed"
        assert tracker.state(f"{own}:s").policy.compact_at_bp == 7000
        assert tracker.state(f"{own}:t").policy.compact_at_bp == 9000
        # the per-call policy is for new sessions: the library's default stays the Tracker's
        assert tracker.state(f"{plain}:s").policy == tracker.policy
        # a per-call policy that is not a Policy is refused, nothing written
        with pytest.raises(InvalidPolicy) as refused:
            tracker.observe("typed", measurement=m("m1", 1), policy={"compact_at_bp": 7000})  # type: ignore[arg-type]
        assert refused.value.field == "policy"
        with pytest.raises(InvalidPolicy):
            tracker.request_compaction("typed", policy="7000")  # type: ignore[arg-type]
        assert list(tracker.history("typed")) == []
