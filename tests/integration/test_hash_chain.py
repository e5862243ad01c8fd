"""The tamper-evident log (tracker.store.chain) on every backend: in memory, real SQLite, real PostgreSQL.

An append chains each event to the previous event of its session; ``verify_chains`` recomputes
every chain and names the first broken event of each: an edit, a delete and a reorder done
behind the store's back (raw SQL on a database; the store's own lists in memory) are each caught
and named. On PostgreSQL the hash is computed by ``ct_append`` server side: the same bytes as
Python's (checked here on awkward data).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sqlalchemy import create_engine

from tests.support.toy_store import ToyProjector, ev, execute_sql
from tracker.errors import InvalidInput
from tracker.settings import normalize_database_url
from tracker.store import MemoryEventStore, NewEvent, chain, migrate, open_store, upgrade
from tracker.store.verify import verify_chains

# data whose canonical bytes are easy to get wrong: key order, unicode, escapes, floats JSONB rewrites
AWKWARD = [
    ev("Started", z=1, a='ünï "q" \\ \n \t \u2028 😀', nested={"b": [1.5, None, True], "a": {}}),
    ev("Tick", big=2**70, f=1e20, g=-0.0, h=1e-7, i=0.1, j=-1.25e16, s="e+ -0.0"),
    ev("Tick", n=3),
    ev("Tick", n=4),
]


def _expected_chain(sid: str, events: list[NewEvent], start: int = 1) -> list[bytes]:
    prev, out = chain.GENESIS, []
    for i, e in enumerate(events):
        prev = chain.link(prev, chain.canonical(sid, start + i, e.type, json.loads(json.dumps(e.data))))
        out.append(prev)
    return out


def _fill(store: Any) -> None:
    store.append("t", 0, AWKWARD[:2])  # one append of two, then one of one, one of one
    store.append("t", 2, AWKWARD[2:3])
    store.append("t", 3, AWKWARD[3:])
    store.append("u", 0, [ev("Tick", n=1)])


# -- the memory store's tampering: its own lists, as raw SQL edits a table ------------------------------


def _mem_replace(store: MemoryEventStore, sid: str, version: int, **changes: Any) -> None:
    stream = store._streams[sid]
    old = stream[version - 1]
    new = dataclasses.replace(old, **changes)
    stream[version - 1] = new
    store._log[store._log.index(old)] = new


def edit(store: Any, url: str | None, sid: str, version: int) -> None:
    if url is None:
        _mem_replace(store, sid, version, data_json='{"n":99}')
    else:
        cast = "CAST(:d AS jsonb)" if url.startswith("postgresql") else ":d"
        execute_sql(
            url,
            f"UPDATE events SET data = {cast} WHERE session_id = :s AND version = :v",
            d='{"n": 99}',
            s=sid,
            v=version,
        )


def delete(store: Any, url: str | None, sid: str, version: int) -> None:
    if url is None:
        gone = store._streams[sid].pop(version - 1)
        store._log.remove(gone)
    else:
        execute_sql(url, "DELETE FROM events WHERE session_id = :s AND version = :v", s=sid, v=version)


def swap(store: Any, url: str | None, sid: str, a: int, b: int) -> None:
    """Events ``a`` and ``b`` of the stream trade places (their versions), hashes and all."""
    if url is None:
        stream = store._streams[sid]
        ea, eb = stream[a - 1], stream[b - 1]
        _mem_replace(
            store,
            sid,
            a,
            **{f.name: getattr(eb, f.name) for f in dataclasses.fields(eb) if f.name not in ("version", "position")},
        )
        _mem_replace(
            store,
            sid,
            b,
            **{f.name: getattr(ea, f.name) for f in dataclasses.fields(ea) if f.name not in ("version", "position")},
        )
    else:
        for frm, to in ((a, 1_000_000), (b, a), (1_000_000, b)):
            execute_sql(
                url, "UPDATE events SET version = :to WHERE session_id = :s AND version = :frm", to=to, s=sid, frm=frm
            )


def unchain(store: Any, url: str | None, sid: str, version: int) -> None:
    if url is None:
        _mem_replace(store, sid, version, hash=None)
    else:
        execute_sql(url, "UPDATE events SET hash = NULL WHERE session_id = :s AND version = :v", s=sid, v=version)


# -- the chain an append writes ---------------------------------------------------------------------


def test_an_append_chains_each_event_to_the_previous_one_of_its_session(store):
    _fill(store)
    links = list(store.chain_links("t"))
    assert [h for *_, h in links] == _expected_chain("t", AWKWARD)
    assert [h for *_, h in store.chain_links("u")] == _expected_chain("u", [ev("Tick", n=1)])
    # what a reader gets back hashes to what was stored (JSONB's rewritten floats included)
    for (version, type_, data, stored), read in zip(links, store.read_stream("t"), strict=True):
        assert (version, type_, data) == (read.version, read.type, read.data)
        assert len(stored) == chain.HASH_BYTES
    assert verify_chains(store) == {"chains": 2, "events": 5, "broken": []}


def test_bad_input_gets_a_typed_error_and_leaves_the_chain_as_it_was(store):
    _fill(store)
    with pytest.raises(InvalidInput):
        store.append("t", 4, [ev("Tick", x=float("nan"))])
    with pytest.raises(InvalidInput):
        store.append("t", 4, [ev("Tick", n=5), NewEvent("", {})])
    assert store.stream_version("t") == 4
    store.append("t", 4, [ev("Tick", n=5)])
    assert [h for *_, h in store.chain_links("t")] == _expected_chain("t", [*AWKWARD, ev("Tick", n=5)])
    assert verify_chains(store)["broken"] == []


# -- tampering, caught and named ----------------------------------------------------------------------


def _first_broken(store: Any) -> list[tuple[str, int, str]]:
    return [(b["session_id"], b["version"], b["what"]) for b in verify_chains(store)["broken"]]


def test_an_edited_event_is_caught_and_named(store, backend):
    _fill(store)
    edit(store, backend, "t", 2)
    assert _first_broken(store) == [("t", 2, "edited")]


def test_a_deleted_event_is_caught_and_named(store, backend):
    _fill(store)
    delete(store, backend, "t", 2)
    assert _first_broken(store) == [("t", 2, "deleted (gap)")]


def test_a_deleted_last_event_is_caught_by_the_projection_ahead_of_the_log(store, backend):
    _fill(store)
    delete(store, backend, "t", 4)
    found = verify_chains(store)["broken"]
    assert [(b["session_id"], b["version"], b["what"]) for b in found] == [("t", 4, "deleted (gap)")]
    assert "projection is at 4" in found[0]["detail"]


def test_reordered_events_are_caught_and_named(store, backend):
    _fill(store)
    swap(store, backend, "t", 2, 3)
    found = verify_chains(store)["broken"]
    assert [(b["session_id"], b["version"], b["what"]) for b in found] == [("t", 2, "reordered")]
    assert "stored at version 3" in found[0]["detail"]


def test_an_event_without_a_hash_is_unchained(store, backend):
    _fill(store)
    unchain(store, backend, "t", 3)
    assert _first_broken(store) == [("t", 3, "unchained")]


def test_every_broken_chain_is_named_once_and_the_others_pass(store, backend):
    _fill(store)
    store.append("v", 0, [ev("Tick", n=1), ev("Tick", n=2)])
    edit(store, backend, "v", 1)
    delete(store, backend, "t", 1)
    assert _first_broken(store) == [("t", 1, "deleted (gap)"), ("v", 1, "edited")]
    report = verify_chains(store)
    assert report["chains"] == 3


@pytest.mark.postgres
def test_postgres_refuses_a_canonical_text_that_is_not_this_appends(pg_url):
    """``ct_append`` stores what it hashes, and only for the session and versions it appends."""
    import psycopg

    upgrade(pg_url)
    call = "SELECT out_status FROM ct_append(%s, %s, %s, NULL, NULL, NULL, NULL, NULL, NULL)"
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        for bad in ('["x",1,"T",{}]', '["s",2,"T",{}]', '["s",1,"T",[]]', '["s",1,"T",{}]\n["s",3,"T",{}]'):
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                conn.execute(call, ("s", 0, bad))
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (0,)
        assert conn.execute(call, ("s", 0, '["s",1,"T",{"b":1,"a":2}]')).fetchone() == ("ok",)
        (stored,) = conn.execute("SELECT hash FROM events").fetchone()
    assert bytes(stored) == chain.link(chain.GENESIS, b'["s",1,"T",{"b":1,"a":2}]')


# -- migration 0010: a database from before it gets a valid chain ----------------------------------------

BEFORE_CHAIN = "0009_provider_reports"
OLD_ROWS = [("a", AWKWARD), ("b", [ev("Tick", n=1), ev("Tick", n=2)]), ("f000000001:c", [ev("Tick", n=7)])]


def _old_rows(url: str) -> None:
    """Events and projection rows as the 0009 schema held them (written with raw SQL: today's store
    refuses that schema)."""
    pg = url.startswith("postgresql")
    data = "CAST(:d AS jsonb)" if pg else ":d"
    for sid, events in OLD_ROWS:
        for i, e in enumerate(events):
            execute_sql(
                url,
                "INSERT INTO events (session_id, version, type, data, recorded_at, batch_size, fleet) "
                f"VALUES (:s, :v, :t, {data}, :at, 1, :f)",
                s=sid,
                v=i + 1,
                t=e.type,
                d=json.dumps(e.data),
                at="2026-01-01 00:00:00",
                f=sid.split(":")[0] if ":" in sid else "",
            )
        execute_sql(
            url,
            "INSERT INTO sessions (session_id, version, state, open_attempts, created_at, updated_at) "
            "VALUES (:s, :v, NULL, 0, :at, :at)",
            s=sid,
            v=len(events),
            at="2026-01-01 00:00:00",
        )


def test_a_database_from_before_the_chain_gets_a_valid_one(db_url):
    migrate.upgrade(db_url, BEFORE_CHAIN)
    _old_rows(db_url)
    migrate.upgrade(db_url)
    store = open_store(db_url, projector=ToyProjector())
    try:
        for sid, events in OLD_ROWS:
            assert [h for *_, h in store.chain_links(sid)] == _expected_chain(sid, events)
        assert verify_chains(store) == {"chains": 3, "events": 7, "broken": []}
        store.append("a", 4, [ev("Tick", n=5)])  # the chain goes on from the backfilled head
        assert verify_chains(store)["broken"] == []
    finally:
        store.close()
    # every step back and forth keeps it valid (the downgrade drops the column, the upgrade rebuilds it)
    migrate.downgrade(db_url, BEFORE_CHAIN)
    migrate.upgrade(db_url)
    store = open_store(db_url)
    try:
        assert verify_chains(store) == {"chains": 3, "events": 8, "broken": []}
    finally:
        store.close()


def test_the_backfill_carries_a_chain_across_its_batches(db_url):
    """Batches of 2 split sessions anywhere: each chain still comes out whole."""
    module = migrate.migration_module("0010_hash_chain.py")
    migrate.upgrade(db_url, BEFORE_CHAIN)
    _old_rows(db_url)
    migrate.upgrade(db_url)
    execute_sql(db_url, "UPDATE events SET hash = NULL")
    engine = create_engine(normalize_database_url(db_url))
    try:
        with engine.begin() as conn:
            assert module.backfill(conn, batch=2) == 7
    finally:
        engine.dispose()
    store = open_store(db_url)
    try:
        assert verify_chains(store) == {"chains": 3, "events": 7, "broken": []}
    finally:
        store.close()
