"""Retention bench: ``tracker archive`` and ``tracker restore`` at 1M events, and what an archive costs ``observe``.

``run_retention_bench(pg_url, quick)`` measures, on each backend in turn -- a SQLite file in a
temporary directory, then a scratch database on the PostgreSQL server of ``pg_url``
(``ct_bench_retention_*``, dropped afterwards; nothing in the given database is touched):

1. **the log**: ``EVENTS`` idle events (1,000,000; ``--quick`` 20,000) in sessions of
   ``SESSION_EVENTS``: copies of one template session that the decision core wrote through the
   store (``tracker.bench.console.build_session``: growth, compactions, rejects, count failures),
   each with its own id, recorded 30-90 days ago, its hash chain recomputed for its id
   (``tracker.store.chain``) and its projection row the template's fold with its id (checked
   against a real fold of the first copy). Written in chunks straight into ``events`` and
   ``sessions`` (one COPY per chunk on PostgreSQL, through the uniqueness triggers), positions
   after the template's and the position sequence moved past them; on PostgreSQL the past
   months' partitions are made first, as the store would have made them then. So the archive's
   read-back, re-fold and chain checks pass as on a real log;
2. **observe beside the archive**: one observer process (``observe`` with a measurement given,
   on ``SESSIONS_PER_PROCESS`` live sessions of its own: the service section's ``observer``)
   calls at a steady ``OBSERVE_RATE`` per second (a call that overruns its slot is followed at
   once, missed slots are skipped), first for ``baseline_s`` with nothing else running
   (``without_archive``), then for as long as the archive runs (``with_archive``). Each is
   ``ms_p50`` / ``ms_p99`` / ``ms_max`` of the calls' own latency (``tracker.bench.stats``),
   ``calls`` and ``errors``; ``p99_ratio`` is with / without;
3. **archive**: ``archive_sessions`` (what ``tracker archive --before`` runs, default batch size)
   of every loaded session (the live ones are newer than its cut-off): ``archive_events_per_s``.
   It must move every loaded event and skip none, else the section fails;
4. **restore**: ``restore_sessions`` of the whole archive directory: ``restore_events_per_s``;
   then the live log must hold every loaded event again and no ``SessionArchived`` record
   (``events_after_restore``, ``counts_match``), else the section fails;
5. **vacuum**: the same sessions archived again (untimed), then ``VACUUM FULL events`` on
   PostgreSQL (a plain VACUUM only marks the space reusable) or ``VACUUM`` on SQLite (the whole
   file); ``vacuum`` says which. The restore runs before the vacuum (before migration 0012 a
   restore into partitions a VACUUM had emptied was quadratic on PostgreSQL: docs/performance.md "Retention");
6. **the live table's size** (``table_bytes``): ``events`` with its indexes and TOAST, every
   partition on PostgreSQL; on SQLite the pages of ``events`` and its indexes (``dbstat``) --
   before the archive, after it (step 3) and after the vacuum (step 5). SQLite's ``file_bytes``
   beside it: a delete frees pages inside the file, VACUUM gives them back.

Throughputs are events over the wall-clock seconds of the call (``tracker.bench.stats.throughput``);
``elapsed_s`` has each phase's seconds. The archive and restore run in this process, as
``tracker archive`` would in its own; the observer is another process, so they share the
machine's cores and the database as they would in a deployment. No Redis: an uncontended
observe makes no lock round trip there anyway.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tracker.bench.procs import create_scratch_db, drop_scratch_db
from tracker.bench.stats import latency_ms, ms, ratio, throughput
from tracker.errors import IntegrityError, TrackerError
from tracker.settings import normalize_database_url

EVENTS = 1_000_000
QUICK_EVENTS = 20_000
#: events per loaded session (a multiple of it is loaded)
SESSION_EVENTS = 250
#: observe calls per second of the observer process
OBSERVE_RATE = 100.0
BASELINE_S = 15.0
QUICK_BASELINE_S = 2.0
#: sessions per insert transaction (one COPY on PostgreSQL) while loading
LOAD_CHUNK_SESSIONS = 200
TEMPLATE = "bench-template"
IDLE_PREFIX = "idle-"
#: the loaded sessions were written this long ago (spread over the following 60 days)
OLDEST = timedelta(days=90)
#: the archive's cut-off: sessions idle for longer than this
IDLE_FOR = timedelta(days=1)


# -- the log -----------------------------------------------------------------------------------------


_Template = list[tuple[str, dict[str, Any], str, str, str | None, int | None]]


def _template(store: Any, engine: Any, n: int) -> _Template:
    """A session of ``n`` core-decided events appended through ``store``: per version (type, data,
    canonical data text, the data's text as the store writes it on SQLite, idempotency key, batch size)."""
    import json

    from sqlalchemy import select

    from tracker.bench.console import build_session
    from tracker.store.chain import canonical_data, canonical_json
    from tracker.store.schema import events as events_t

    build_session(store, TEMPLATE, n)
    e = events_t.c
    stmt = (
        select(e.type, e.data, e.idempotency_key, e.batch_size)
        .where(e.session_id == TEMPLATE)
        .order_by(e.version)
        .limit(n)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [(r[0], r[1], canonical_data(canonical_json(r[1])), json.dumps(r[1]), r[2], r[3]) for r in rows]


_EVENT_COLUMNS = (
    "position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, txid, fleet, hash"
)
_SESSION_COLUMNS = "session_id, version, state, pressure, revision, occupancy_bp, open_attempts, created_at, updated_at"


def _sqlite_writer(engine: Any) -> Any:
    """``write(events, sessions)``: one transaction of rows (``_load``'s tuples) into a SQLite store,
    in the forms the store writes (JSON text, naive UTC timestamps)."""

    def stamp(at: datetime) -> str:
        return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")

    def write(event_rows: list[tuple[Any, ...]], session_rows: list[tuple[Any, ...]]) -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO events ({_EVENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, '', ?)",
                [(p, s, v, t, stored, stamp(at), k, b, h) for p, s, v, t, _, stored, at, k, b, h in event_rows],
            )
            conn.exec_driver_sql(
                f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(*r[:7], stamp(r[7]), stamp(r[8])) for r in session_rows],
            )

    return write


def _pg_writer(url: str) -> Any:
    """``write(events, sessions)``: one transaction of rows (``_load``'s tuples) into PostgreSQL, by
    COPY, on a connection of its own each time (so the uniqueness triggers of ``events`` plan their
    checks for the table as it is, not as it was at the first chunk)."""
    import psycopg

    def write(event_rows: list[tuple[Any, ...]], session_rows: list[tuple[Any, ...]]) -> None:
        with psycopg.connect(url) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY events ({_EVENT_COLUMNS}) FROM STDIN") as copy:
                for p, s, v, t, canon, _, at, k, b, h in event_rows:
                    # txid 1: committed long ago, below every feed watermark
                    copy.write_row((p, s, v, t, canon, at, k, b, 1, "", h))
            with cur.copy(f"COPY sessions ({_SESSION_COLUMNS}) FROM STDIN") as copy:
                for row in session_rows:
                    copy.write_row(row)

    return write


def _load(store: Any, engine: Any, n_events: int, pg_url: str | None) -> dict[str, Any]:
    """``n_events`` idle events in sessions of ``SESSION_EVENTS`` (module doc, 1); their shape.
    ``pg_url``: the libpq URL of the store's database when it is PostgreSQL."""
    import json

    from sqlalchemy import func, select, text

    from tracker.core import SessionProjector
    from tracker.store.base import StoredEvent, fold_events, row_columns
    from tracker.store.chain import GENESIS, canonical_event, link
    from tracker.store.schema import events as events_t

    t0 = time.perf_counter()
    template = _template(store, engine, SESSION_EVENTS)
    if len(template) != SESSION_EVENTS:
        raise IntegrityError(f"the template session has {len(template)} events, not {SESSION_EVENTS}")
    n_sessions = n_events // SESSION_EVENTS
    proj = SessionProjector()
    now = datetime.now(UTC)
    oldest = now - OLDEST
    span = OLDEST - timedelta(days=30)  # the sessions' starts, spread from OLDEST to 30 days ago
    with engine.connect() as conn:
        position = int(conn.execute(select(func.max(events_t.c.position))).scalar_one() or 0)
        if pg_url is not None:  # the months the events fall in have their partitions, as the store makes them
            conn.execute(text("SELECT ct_events_ensure_partitions(:a, :b)"), {"a": oldest, "b": now})
            conn.commit()
    write = _sqlite_writer(engine) if pg_url is None else _pg_writer(pg_url)
    chunk = LOAD_CHUNK_SESSIONS
    folded: dict[str, Any] | None = None  # the template's fold: a copy's differs only in its id
    for first in range(0, n_sessions, chunk):
        event_rows: list[tuple[Any, ...]] = []
        session_rows: list[tuple[Any, ...]] = []
        for j in range(first, min(first + chunk, n_sessions)):
            sid = f"{IDLE_PREFIX}{j:07d}"
            start = oldest + span * (j / n_sessions)
            prev = GENESIS
            for k, (etype, _, canon, stored, key, batch) in enumerate(template):
                position += 1
                prev = link(prev, canonical_event(sid, k + 1, etype, canon).encode("utf-8"))
                at = start + timedelta(seconds=2 * k)
                event_rows.append((position, sid, k + 1, etype, canon, stored, at, key, batch, prev))
            if folded is None:  # the first copy folded for real: its state, with another id, is every copy's
                rows = event_rows[-SESSION_EVENTS:]
                stored_events = [
                    StoredEvent(r[0], sid, r[2], r[3], d[1], r[6], r[7]) for r, d in zip(rows, template, strict=True)
                ]
                folded = fold_events(proj, proj.initial(sid), stored_events)
                if {**folded, "session_id": TEMPLATE} != fold_events(proj, proj.initial(TEMPLATE), stored_events):
                    raise IntegrityError("a copy of the template session folds to another state than its id's")
            state = {**folded, "session_id": sid}
            pressure, revision, occupancy, open_attempts = row_columns(proj, state)
            session_rows.append(
                (
                    sid,
                    SESSION_EVENTS,
                    json.dumps(state),
                    pressure,
                    revision,
                    occupancy,
                    open_attempts,
                    event_rows[-SESSION_EVENTS][6],
                    event_rows[-1][6],
                )
            )
        write(event_rows, session_rows)
    with engine.begin() as conn:
        if pg_url is not None:
            # the identity's sequence (events_position_seq since migration 0011), past every position
            seq = conn.execute(text("SELECT pg_get_serial_sequence('events', 'position')")).scalar_one()
            conn.execute(text("SELECT setval(:seq, :p)"), {"seq": seq, "p": position})
            conn.execute(text("ANALYZE events"))
            conn.execute(text("ANALYZE sessions"))
        else:
            conn.execute(text("ANALYZE"))
    return {
        "events": n_sessions * SESSION_EVENTS,
        "sessions": n_sessions,
        "load_s": round(time.perf_counter() - t0, 1),
    }


def _idle_counts(engine: Any) -> tuple[int, int]:
    """(events of the loaded sessions, SessionArchived records among them) in the live log."""
    from sqlalchemy import func, select

    from tracker.core.events import SessionArchived
    from tracker.store.schema import events as events_t

    e = events_t.c
    idle = func.substr(e.session_id, 1, len(IDLE_PREFIX)) == IDLE_PREFIX
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).where(idle)).scalar_one()
        markers = conn.execute(select(func.count()).where(idle, e.type == SessionArchived.TYPE)).scalar_one()
    return int(n), int(markers)


# -- sizes -------------------------------------------------------------------------------------------


def _pg_events_bytes(url: str) -> int:
    """``events`` on PostgreSQL: every partition's table, indexes and TOAST."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree('events')"
        ).fetchone()
    return int(row[0]) if row else 0


def _sqlite_bytes(path: str) -> tuple[int, int]:
    """(pages of ``events`` and its indexes, the database's pages) of a SQLite file, in bytes."""
    conn = sqlite3.connect(path)
    try:
        events = conn.execute(
            "SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name IN "
            "(SELECT name FROM sqlite_schema WHERE tbl_name = 'events')"
        ).fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
    return int(events), int(pages) * int(size)


def _vacuum(backend: str, where: str) -> str:
    """The vacuum that returns a deleted table's space; its statement."""
    if backend == "postgresql":
        import psycopg

        with psycopg.connect(where, autocommit=True) as conn:
            conn.execute("VACUUM FULL events")
        return "VACUUM FULL events"
    db = sqlite3.connect(where, isolation_level=None)
    try:
        db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return "VACUUM"


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# -- the observer process ----------------------------------------------------------------------------


def _observer_main(db_url: str, prefix: str, rate: float, pipe: Any) -> None:
    """In its own process: build a ``Tracker``, say "started"; on "warm" create its sessions and say
    "ready"; then observe at ``rate`` per second from each "go" to the next "stop" and send back
    (latencies in s, errors). Anything else ("quit") ends it."""
    from tracker.bench.service import SESSIONS_PER_PROCESS, observer
    from tracker.bootstrap import build_tracker
    from tracker.settings import Settings

    t = build_tracker(Settings.of(database_url=db_url))
    try:
        pipe.send("started")
        if pipe.recv() != "warm":
            return
        one = observer(t, prefix)
        pipe.send("ready")
        i = SESSIONS_PER_PROCESS
        interval = 1.0 / rate
        while pipe.recv() == "go":
            latencies: list[float] = []
            errors: list[str] = []
            next_at = time.perf_counter()
            while not pipe.poll(max(0.0, next_at - time.perf_counter())):
                t0 = time.perf_counter()
                try:
                    one(i)
                except TrackerError as exc:  # counted, and its time with the others
                    errors.append(f"{type(exc).__name__}: {exc}")
                latencies.append(time.perf_counter() - t0)
                i += 1
                next_at = max(next_at + interval, time.perf_counter())
            pipe.recv()  # "stop"
            pipe.send((latencies, errors))
    finally:
        t.close()


class _Observer:
    """The observer process (``_observer_main``), driven window by window. It starts (a new
    interpreter, its imports, its ``Tracker``) while the log is loaded; ``warm()`` once the load
    is done creates its sessions (they draw positions after the loaded ones)."""

    def __init__(self, db_url: str, rate: float) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_observer_main, args=(db_url, f"live-{uuid.uuid4().hex[:6]}", rate, child), daemon=True
        )
        self.proc.start()
        child.close()

    def _expect(self, what: str) -> None:
        if not self.pipe.poll(120) or self.pipe.recv() != what:
            raise RuntimeError(f"the observer process did not say {what!r} within 120 s")

    def warm(self) -> None:
        self._expect("started")
        self.pipe.send("warm")
        self._expect("ready")

    def start(self) -> None:
        self.pipe.send("go")

    def stop(self) -> dict[str, Any]:
        self.pipe.send("stop")
        if not self.pipe.poll(120):
            raise RuntimeError("the observer process did not answer within 120 s")
        latencies, errors = self.pipe.recv()
        return {
            "calls": len(latencies),
            **latency_ms(latencies),
            "ms_max": ms(max(latencies)) if latencies else None,
            "errors": len(errors),
            **({"first_error": errors[0]} if errors else {}),
        }

    def close(self) -> None:
        if self.pipe.closed:
            return
        try:
            self.pipe.send("quit")
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.pipe.close()


# -- one backend -------------------------------------------------------------------------------------


def _one_backend(db_url: str, size_at: str, n_events: int, baseline_s: float, work: Path) -> dict[str, Any]:
    """The module doc's steps 1-6 on the migrated, empty database at ``db_url`` (SQLAlchemy URL);
    ``size_at``: the libpq URL (PostgreSQL) or file path (SQLite) the sizes and the vacuum go to."""
    from tracker.core import SessionProjector
    from tracker.store import make_engine, open_store
    from tracker.store.archive import archive_sessions
    from tracker.store.restore import restore_sessions

    store = open_store(db_url, projector=SessionProjector())
    engine = make_engine(db_url)  # the bench's own raw reads and bulk writes, beside the store
    backend = store.backend
    pg = backend == "postgresql"
    phases: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal t0
        phases[phase] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()

    def sizes() -> dict[str, int]:
        if pg:
            return {"table": _pg_events_bytes(size_at)}
        table, file = _sqlite_bytes(size_at)
        return {"table": table, "file": file}

    def archive(directory: Path) -> dict[str, Any]:
        report = archive_sessions(store, directory, before=datetime.now(UTC) - IDLE_FOR)
        if report["events"] != n or report["skipped"]:
            raise IntegrityError(
                f"{backend}: the archive moved {report['events']} of {n} events, skipped {report['skipped'][:3]}"
            )
        return report

    observer = _Observer(db_url, OBSERVE_RATE)
    try:
        out: dict[str, Any] = _load(store, engine, n_events, size_at if pg else None)
        n = out["events"]
        lap("load")
        try:
            observer.warm()
            observer.start()
            time.sleep(baseline_s)
            without = observer.stop()
            lap("baseline")
            before = sizes()
            directory = work / f"archive-{backend}"
            observer.start()
            started = time.perf_counter()
            try:
                archived = archive(directory)
            finally:
                archive_s = time.perf_counter() - started
                beside = observer.stop()
        finally:
            observer.close()
        lap("archive")
        after = sizes()
        started = time.perf_counter()
        restored = restore_sessions(store, directory)
        restore_s = time.perf_counter() - started
        count, markers = _idle_counts(engine)
        counts_match = count == n and markers == 0 and restored["events"] == n
        if not counts_match:
            raise IntegrityError(
                f"{backend}: after the restore the live log holds {count} of the {n} loaded events and "
                f"{markers} SessionArchived records (restore reported {restored['events']} events)"
            )
        lap("restore")
        archive(work / f"archive-{backend}-again")  # the same sessions out again, for the vacuum
        lap("archive_again")
        vacuum = _vacuum(backend, size_at)
        vacuumed = sizes()
        lap("vacuum")
        out.update(
            archive_events_per_s=throughput(n, archive_s),
            archive_s=round(archive_s, 1),
            segments=len(archived["segments"]),
            archive_bytes=_dir_bytes(directory),
            restore_events_per_s=throughput(restored["events"], restore_s),
            restore_s=round(restore_s, 1),
            events_after_restore=count,
            counts_match=counts_match,
            table_bytes={
                "before_archive": before["table"],
                "after_archive": after["table"],
                "after_vacuum": vacuumed["table"],
            },
            vacuum=vacuum,
            observe={
                "rate_per_s": OBSERVE_RATE,
                "without_archive": without,
                "with_archive": beside,
                "p99_ratio": ratio(beside["ms_p99"], without["ms_p99"]),
            },
        )
        if not pg:
            out["file_bytes"] = {
                "before_archive": before["file"],
                "after_archive": after["file"],
                "after_vacuum": vacuumed["file"],
            }
        out["elapsed_s"] = phases
        return out
    finally:
        observer.close()  # (closed already after the archive, unless that failed)
        store.close()
        engine.dispose()


def _sqlite(n_events: int, baseline_s: float) -> dict[str, Any]:
    from tracker.store import upgrade

    with tempfile.TemporaryDirectory(prefix="ct-bench-retention-") as tmp:
        path = os.path.join(tmp, "tracker.db")
        db_url = f"sqlite:///{path}"
        upgrade(db_url)
        return _one_backend(db_url, path, n_events, baseline_s, Path(tmp))


def _postgres(pg_url: str, n_events: int, baseline_s: float) -> dict[str, Any]:
    from tracker.store import upgrade

    name, url = create_scratch_db(pg_url, "ct_bench_retention")
    try:
        db_url = normalize_database_url(url)
        upgrade(db_url)
        with tempfile.TemporaryDirectory(prefix="ct-bench-retention-") as tmp:
            return _one_backend(db_url, url, n_events, baseline_s, Path(tmp))
    finally:
        drop_scratch_db(pg_url, name)


def run_retention_bench(
    pg_url: str,
    quick: bool = False,
    *,
    events: int | None = None,
    backends: tuple[str, ...] = ("sqlite", "postgres"),
) -> dict[str, Any]:
    """Archive and restore throughput, the live table's size and observe beside an archive, per
    backend (module doc). ``events``: how many to load (default ``EVENTS``, ``QUICK_EVENTS`` with
    ``quick``; rounded down to whole sessions). A backend that fails is reported as
    ``{"error": …}`` in its place and as the section's ``error``; the other still reports."""
    n_events = events if events is not None else (QUICK_EVENTS if quick else EVENTS)
    if n_events < SESSION_EVENTS:
        raise ValueError(f"events must be at least {SESSION_EVENTS}, got {n_events}")
    baseline_s = QUICK_BASELINE_S if quick else BASELINE_S
    t0 = time.perf_counter()
    out: dict[str, Any] = {"events_per_session": SESSION_EVENTS}
    errors = []
    for backend in backends:
        try:
            if backend == "sqlite":
                out[backend] = _sqlite(n_events, baseline_s)
            elif backend == "postgres":
                out[backend] = _postgres(pg_url, n_events, baseline_s)
            else:
                raise ValueError(f"unknown backend {backend!r}")
        except Exception as exc:  # noqa: BLE001 - one backend that cannot run says why, the other still reports
            out[backend] = {"error": f"{type(exc).__name__}: {exc}"}
            errors.append(f"{backend}: {out[backend]['error']}")
    if errors:
        out["error"] = "; ".join(errors)
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out
