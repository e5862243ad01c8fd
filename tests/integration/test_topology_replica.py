"""The read side on a streaming replica (``TRACKER_READ_DATABASE_URL``), started for real.

A PostgreSQL primary of its own (``initdb`` in a temporary directory, never the shared server:
that one does not take replication connections) and a hot standby made from it with
``pg_basebackup -R -X stream``, both on free loopback ports, both logging every statement.
Shown here: writes land on the primary and appear on the replica, which refuses writes; the
read side (history, the sessions listing, the event feed, the console, the CLI's read
commands) reads the replica -- its statement log has the reads, the primary's has none, a
paused replica shows the old history while the primary's state is current, a stopped replica
fails the reads while writes go on -- and the decision path never does; the feed tailed on the
standby under concurrent writers skips nothing (its commit-order watermark holds there too);
the lag shows in ``/readyz`` (503 above ``TRACKER_READ_MAX_LAG_S``) and in the gauges.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import shutil
import sys
import threading
import time
import traceback
import uuid

import httpx
import pytest

from tests.support.api import settled_feed
from tests.support.bench import free_port, start_server, stop_server
from tests.support.cli import run_tracker
from tests.support.loopback import wait_for
from tests.support.measurements import measurement
from tests.support.replicas import PgReplication, postgres_bin
from tracker import Tracker
from tracker.bootstrap import build_lag_probe, build_read_store, build_store, read_only_url
from tracker.core import SessionProjector
from tracker.errors import StoreError, StoreUnavailable
from tracker.settings import Settings
from tracker.store import NewEvent, make_engine, open_store, upgrade
from tracker.store.fleets import FleetStore

pytestmark = [pytest.mark.serial, pytest.mark.postgres]

DB = "tracker"
MAX_LAG_S = 1.0


def _skip_reason() -> str | None:
    if postgres_bin() is None:
        return "PostgreSQL server programs (initdb, pg_ctl, pg_basebackup) are not installed"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: initdb cannot run as root"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user for initdb"
    return None


@pytest.fixture(scope="module")
def repl():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with PgReplication() as r:
        r.create_database(DB)
        upgrade(r.url(DB))
        r.wait_caught_up()
        yield r


def _settings(repl: PgReplication, **extra: object) -> Settings:
    return Settings.of(database_url=repl.url(DB), read_database_url=repl.url(DB, replica=True), **extra)


def _app_statements(log: str) -> list[str]:
    """The statements the tracker sent (``application_name`` context-tracker), as logged."""
    return [
        line
        for line in log.splitlines()
        if " context-tracker: " in line and ("statement:" in line or "execute" in line)
    ]


# -- writes and the read store -----------------------------------------------------------------------


def test_writes_land_on_the_primary_appear_on_the_replica_which_refuses_writes(repl):
    s = _settings(repl)
    sid = f"w-{uuid.uuid4().hex[:8]}"
    with Tracker.from_settings(s) as t:
        for i in range(5):
            t.observe(sid, measurement=measurement(f"b{i}", 100 + i))
        primary = [(e.version, e.type, e.position) for e in t.store.read_stream(sid)]
    repl.wait_caught_up()
    read = build_read_store(s.store, projector=SessionProjector())
    try:
        assert [(e.version, e.type, e.position) for e in read.read_stream(sid)] == primary
        assert read.load(sid)[1] == 6  # the projection row too
    finally:
        read.close()
    read = build_read_store(s.store)  # no projector: any event type
    try:
        with pytest.raises(StoreError, match="during recovery|read-only transaction"):  # a standby refuses
            read.append(f"x-{sid}", 0, [NewEvent("Tick", {})])
    finally:
        read.close()
    # the read URL pointed at the primary by mistake cannot write either: every transaction is read-only
    assert "default_transaction_read_only" in read_only_url(repl.url(DB))
    misconfigured = build_read_store(Settings.of(database_url=repl.url(DB), read_database_url=repl.url(DB)).store)
    try:
        with pytest.raises(StoreError, match="read-only transaction"):
            misconfigured.append(f"y-{sid}", 0, [NewEvent("Tick", {})])
    finally:
        misconfigured.close()


# -- the feed on the standby: commit order, gap-free -----------------------------------------------------


def test_the_standby_feed_holds_back_a_later_position_while_an_earlier_one_is_uncommitted(repl):
    """The watermark (``pg_snapshot_xmin(pg_current_snapshot())``) on a hot standby: a transaction
    the primary has not committed yet holds back the feed on the replica, as on the primary."""
    slow, fast = open_store(repl.url(DB)), open_store(repl.url(DB))
    reader = build_read_store(_settings(repl).store)
    naive = make_engine(repl.url(DB, replica=True))
    reached, release, drawn, errors = threading.Event(), threading.Event(), [], []

    def hook(_sid: str, positions: tuple[int, ...]) -> None:
        drawn.append(positions)
        reached.set()
        release.wait(20)

    slow.before_commit = hook
    try:
        start = max([e.position for e in reader.read_all(0, limit=100000)], default=0)
        repl.wait_caught_up()
        start = max([start, *(e.position for e in reader.read_all(start, limit=100000))])

        def run_slow() -> None:
            try:
                slow.append(f"slow-{uuid.uuid4().hex[:6]}", 0, [NewEvent("Tick", {})])
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        thread = threading.Thread(target=run_slow)
        thread.start()
        assert reached.wait(10)
        p_slow = drawn[0][0]
        p_fast = fast.append(f"fast-{uuid.uuid4().hex[:6]}", 0, [NewEvent("Tick", {})]).positions[0]
        assert p_fast > p_slow

        from sqlalchemy import text

        def replica_has_fast() -> bool:
            with naive.connect() as conn:
                return bool(
                    conn.execute(text("SELECT count(*) FROM events WHERE position = :p"), {"p": p_fast}).scalar()
                )

        wait_for(replica_has_fast, 15, "the standby to replay the later commit")
        # the hazard, on the standby: by position alone a tailer would get p_fast now, resume after it, lose p_slow
        with naive.connect() as conn:
            by_position = [
                r[0] for r in conn.execute(text("SELECT position FROM events WHERE position > :a"), {"a": start})
            ]
        assert by_position == [p_fast]
        assert reader.read_all(start) == []  # the standby's watermark holds it back

        release.set()
        thread.join(10)
        assert not errors
        wait_for(lambda: len(reader.read_all(start)) == 2, 15, "both events on the standby's feed")
        assert [e.position for e in reader.read_all(start)] == [p_slow, p_fast]
    finally:
        release.set()
        for s in (slow, fast, reader):
            s.close()
        naive.dispose()


WRITERS = 4
WRITE_S = 3.0


def _writer(url: str, wid: int, go: object, out: object) -> None:
    try:
        rng = random.Random(wid)
        store = open_store(url)
        # widen the window between "positions drawn" and COMMIT so commits reorder
        store.before_commit = lambda sid, pos: time.sleep(rng.random() * 0.003) if rng.random() < 0.3 else None
        written: list[int] = []
        versions: dict[str, int] = {}
        go.wait(60)  # type: ignore[attr-defined]
        until = time.monotonic() + WRITE_S
        while time.monotonic() < until:
            sid = f"feed-{wid}-{rng.randint(0, 3)}"
            batch = [NewEvent("Tick", {"w": wid, "j": j}) for j in range(rng.randint(1, 3))]
            r = store.append(sid, versions.get(sid, 0), batch)
            versions[sid] = r.last_version
            written.extend(r.positions)
        store.close()
        out.put(("ok", wid, written))  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        out.put(("error", wid, traceback.format_exc()))  # type: ignore[attr-defined]


def test_the_feed_tailed_on_the_replica_under_concurrent_writers_never_skips(repl):
    s = _settings(repl)
    primary, reader = build_store(s.store), build_read_store(s.store)
    probe = build_lag_probe(primary, reader)
    naive = make_engine(repl.url(DB, replica=True))
    from sqlalchemy import text

    start = max([e.position for e in primary.read_all(0, limit=1_000_000)], default=0)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(repl.url(DB), w, go, out)) for w in range(WRITERS)]
    seen: list[int] = []
    naive_seen: list[int] = []
    lags: list[tuple[float | None, int]] = []
    stop = threading.Event()

    def tail() -> None:
        after = naive_after = start
        while True:
            finished = stop.is_set()  # before the read: an empty page read after it is the end
            page = reader.read_all(after, limit=200)
            seen.extend(e.position for e in page)
            if page:
                after = page[-1].position
            with naive.connect() as conn:  # the same tailing by position alone, for comparison
                rows = [
                    r[0]
                    for r in conn.execute(
                        text("SELECT position FROM events WHERE position > :a ORDER BY position LIMIT 200"),
                        {"a": naive_after},
                    )
                ]
            naive_seen.extend(rows)
            if rows:
                naive_after = rows[-1]
            if not page and finished:
                return
            time.sleep(0.002)

    def sample_lag() -> None:
        while not stop.is_set():
            lag = probe.measure()
            lags.append((lag.lag_s, lag.lag_bytes))
            time.sleep(0.1)

    tailer, sampler = threading.Thread(target=tail), threading.Thread(target=sample_lag)
    try:
        for p in procs:
            p.start()
        tailer.start()
        sampler.start()
        go.set()
        results = [out.get(timeout=60) for _ in procs]
        assert all(r[0] == "ok" for r in results), [r[2] for r in results if r[0] != "ok"]
        repl.wait_caught_up()
        stop.set()
        tailer.join(30)
        sampler.join(10)
        written = sorted(p for r in results for p in r[2])
        logged = [e.position for e in primary.read_all(start, limit=1_000_000)]
        assert logged == written  # every acknowledged append, nothing else
        assert seen == sorted(seen) and len(seen) == len(set(seen)), "the feed went back or repeated"
        assert seen == written, f"the replica's feed skipped {sorted(set(written) - set(seen))[:10]}"
        naive_missed = len(set(written) - set(naive_seen))
        measured = [lag for lag, _ in lags if lag is not None]
        print(
            f"\nreplica feed: {len(written)} events by {WRITERS} writers in {WRITE_S:g} s, 0 skipped "
            f"(tailing by position alone on the same replica missed {naive_missed}); lag sampled {len(lags)}x: "
            f"max {max(measured, default=0):.3f} s, max {max((b for _, b in lags), default=0)} bytes"
        )
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():  # pragma: no cover - a writer stuck: never leave it behind
                p.kill()
        primary.close()
        reader.close()
        naive.dispose()


# -- the HTTP API and the console ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(repl):
    """``tracker serve`` on the primary with its read side on the replica; one fleet, its key."""
    engine = make_engine(repl.url(DB))
    try:
        fleets = FleetStore(engine)
        fleet = fleets.create_fleet(f"replica-{uuid.uuid4().hex[:6]}")
        _, token = fleets.create_key(fleet["fleet_id"])
    finally:
        engine.dispose()
    repl.wait_caught_up()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env.update(
        TRACKER_DATABASE_URL=repl.url(DB),
        TRACKER_READ_DATABASE_URL=repl.url(DB, replica=True),
        TRACKER_READ_MAX_LAG_S=str(MAX_LAG_S),
        TRACKER_API_KEY_CACHE_S="60",
    )
    proc = start_server(env, port := free_port())
    try:
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "env": env}
    finally:
        stop_server(proc, grace_s=15)


def _client(server: dict) -> httpx.Client:
    return httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {server['token']}"}, timeout=30)


def test_the_read_side_reads_the_replica_and_the_decisions_the_primary(repl, server):
    sid = f"h-{uuid.uuid4().hex[:8]}"
    with _client(server) as c:
        for i in range(3):
            r = c.post(f"/v1/sessions/{sid}/observe", json={"measurement": measurement(f"b{i}", 100 + i)})
            assert r.status_code == 200, r.text
        repl.wait_caught_up()
        primary_mark, replica_mark = len(repl.log("primary")), len(repl.log("replica"))
        assert [e["version"] for e in c.get(f"/v1/sessions/{sid}/history").json()["events"]] == [1, 2, 3, 4]
        assert sid in [row["session_id"] for row in c.get("/v1/sessions").json()["sessions"]]
        feed = settled_feed(c, lambda events: sum(e["session_id"] == sid for e in events) >= 4)
        assert [e["version"] for e in feed if e["session_id"] == sid] == [1, 2, 3, 4]
        console = httpx.Client(base_url=server["url"], timeout=30)
        signin = console.post("/console/signin", data={"key": server["token"]})
        assert signin.status_code == 303, signin.text
        page = console.get(f"/console/sessions/{sid}")
        assert page.status_code == 200 and sid in page.text
        assert sid in console.get("/console/").text
        primary_new = _app_statements(repl.log("primary")[primary_mark:])
        replica_new = _app_statements(repl.log("replica")[replica_mark:])
        # the reads went to the replica: the feed's watermark query, the listing, the history ...
        assert any("pg_snapshot_xmin" in line for line in replica_new)
        assert any(re.search(r"\bFROM sessions\b", line) for line in replica_new)
        assert any(re.search(r"\bFROM events\b", line) for line in replica_new)
        # ... and none of them to the primary (which answered only the API key look-ups, if any)
        assert not [line for line in primary_new if re.search(r"\b(events|sessions)\b", line)], primary_new[:5]

        # replay paused: the replica's history stays behind while the primary's state (and the decisions) move on
        repl.pause_replay()
        try:
            r = c.post(f"/v1/sessions/{sid}/observe", json={"measurement": measurement("b9", 150)})
            assert r.status_code == 200 and r.json()["version"] == 5, r.text
            assert c.get(f"/v1/sessions/{sid}").json()["version"] == 5  # the state: from the primary
            assert len(c.get(f"/v1/sessions/{sid}/history").json()["events"]) == 4  # the history: the replica
        finally:
            repl.resume_replay()
        repl.wait_caught_up()
        wait_for(lambda: len(c.get(f"/v1/sessions/{sid}/history").json()["events"]) == 5, 10, "the replica's history")

        # the replica stopped: the reads fail (typed, 503), the writes and the state do not
        repl.stop_replica()
        try:
            for path in (f"/v1/sessions/{sid}/history", "/v1/sessions", "/v1/events"):
                r = c.get(path)
                assert r.status_code == 503 and r.json()["code"] == "store_unavailable", (path, r.text)
            assert console.get(f"/console/sessions/{sid}").status_code == 503
            r = c.post(f"/v1/sessions/{sid}/observe", json={"measurement": measurement("b10", 160)})
            assert r.status_code == 200 and r.json()["version"] == 6, r.text
            assert c.get(f"/v1/sessions/{sid}").json()["version"] == 6
            ready = c.get("/readyz")
            assert ready.status_code == 503
            body = ready.json()["checks"]
            assert body["database"]["status"] == "ok" and body["read_replica"]["code"] == "store_unavailable"
        finally:
            repl.start_replica()
        repl.wait_caught_up()
        wait_for(lambda: c.get(f"/v1/sessions/{sid}/history").status_code == 200, 15, "reads on the restarted replica")
        assert len(c.get(f"/v1/sessions/{sid}/history").json()["events"]) == 6
        console.close()


def _gauge(page: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", page, re.M)
    return float(m.group(1)) if m else None


def test_lag_shows_in_readyz_and_the_gauge(repl, server):
    sid = f"lag-{uuid.uuid4().hex[:8]}"
    with _client(server) as c:
        repl.wait_caught_up()
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        check = ready.json()["checks"]["read_replica"]
        assert set(check) == {"status", "lag_s", "lag_bytes", "in_recovery", "max_lag_s"}, check
        assert check["status"] == "ok" and check["in_recovery"] is True and check["max_lag_s"] == MAX_LAG_S
        assert 0 <= check["lag_s"] < MAX_LAG_S and check["lag_bytes"] >= 0
        repl.pause_replay()
        try:
            for i in range(3):
                assert (
                    c.post(f"/v1/sessions/{sid}/observe", json={"measurement": measurement(f"b{i}", 10)}).status_code
                    == 200
                )
            time.sleep(MAX_LAG_S + 0.5)
            ready = c.get("/readyz")
            check = ready.json()["checks"]["read_replica"]
            assert ready.status_code == 503 and check["status"] == "lagging", ready.text
            assert check["lag_s"] > MAX_LAG_S and check["lag_bytes"] > 0
            page = c.get("/metrics").text
            lag_s = _gauge(page, "tracker_read_replica_lag_seconds")
            assert lag_s is not None and lag_s > MAX_LAG_S, page[-2000:]
            assert (_gauge(page, "tracker_read_replica_lag_bytes") or 0) > 0
            assert _gauge(page, "tracker_read_replica_up") == 1
            print(
                f"\npaused replay: /readyz lag {check['lag_s']} s, {check['lag_bytes']} bytes -> 503; gauge {lag_s} s"
            )
        finally:
            repl.resume_replay()
        repl.wait_caught_up()
        ready = c.get("/readyz")  # (WAL may still flow, e.g. autovacuum after the other tests' writes: not always 0)
        assert ready.status_code == 200 and ready.json()["checks"]["read_replica"]["lag_s"] < MAX_LAG_S, ready.text
        pages: list[str] = []

        def gauge_at_zero() -> bool:
            pages.append(c.get("/metrics").text)
            lag = _gauge(pages[-1], "tracker_read_replica_lag_seconds")
            return lag is not None and lag < MAX_LAG_S

        try:
            wait_for(gauge_at_zero, 10, "the gauge back under the limit")
        except RuntimeError:
            raise AssertionError([line for line in pages[-1].splitlines() if "replica" in line]) from None


# -- the CLI's read commands ---------------------------------------------------------------------------


def test_the_cli_read_commands_read_the_replica(repl):
    s = _settings(repl)
    sid = f"cli-{uuid.uuid4().hex[:8]}"
    with Tracker.from_settings(s) as t:
        t.observe(sid, measurement=measurement("b0", 100))
        repl.wait_caught_up()
        repl.pause_replay()
        try:
            t.observe(sid, measurement=measurement("b1", 110))  # on the primary only, for now
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
            env.update(TRACKER_DATABASE_URL=repl.url(DB), TRACKER_READ_DATABASE_URL=repl.url(DB, replica=True))

            def cli(*args: str) -> str:
                proc = run_tracker(
                    [sys.executable, "-m", "tracker.cli", *args], env=env, capture_output=True, text=True, timeout=60
                )
                assert proc.returncode == 0, proc.stderr
                return proc.stdout

            history = [json.loads(line) for line in cli("history", sid, "--json").splitlines()]
            exported = [json.loads(line) for line in cli("export", "--json").splitlines()]
            listed = {r["session_id"]: r for r in json.loads(cli("sessions", "--json", "--limit", "1000"))}
            replayed = [json.loads(line) for line in cli("replay", sid, "--json").splitlines()]
            assert t.state(sid).version == 3  # the primary: SessionStarted + two measurements
        finally:
            repl.resume_replay()
    # the replica, paused, still had the first measurement only
    assert [e["version"] for e in history] == [1, 2]
    assert [e["version"] for e in exported if e["session_id"] == sid] == [1, 2]
    assert listed[sid]["version"] == 2
    assert [step["version"] for step in replayed] == [1, 2]


def test_a_stopped_replica_fails_the_read_side_with_a_typed_error(repl):
    """Reads on the replica when it does not answer: ``StoreUnavailable``, never a fallback to the primary."""
    s = _settings(repl)
    reader = build_read_store(s.store, check_schema=False)
    repl.stop_replica()
    try:
        with pytest.raises(StoreUnavailable):
            reader.read_all(0, limit=1)
        with Tracker.from_settings(s) as t:  # the decision path does not need it
            assert t.observe(f"d-{uuid.uuid4().hex[:6]}", measurement=measurement("b0", 10)).version == 2
    finally:
        reader.close()
        repl.start_replica()
