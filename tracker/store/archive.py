"""Retention: idle sessions moved to verified Parquet segments, and back (``tracker archive`` / ``restore``).

``archive_sessions`` picks the sessions idle since a time (their projection row's ``updated_at``,
the time of their last append), in batches of about ``batch_events`` events, and for each batch:

1. reads the sessions' events (one statement);
2. writes them as one segment (``tracker.store.segments``: temp name, fsync, rename);
3. reads the segment back: every column must equal what was read from the live log; then every
   session is folded from the read-back rows (the store's projector) -- its **digest** is the
   sha256 of the canonical JSON of that state, the same as the live events' fold since the rows
   are equal -- and its hash chain recomputed from the rows up to the head the live log has;
4. records the segment and its sessions in ``manifest.json`` (durably, under the directory's lock);
5. then, in **one transaction**, for each session still at the version it was read at (its
   projection row is compare-and-set, so a session written to meanwhile is skipped and stays
   live): deletes its events and appends one ``SessionArchived`` record (``tracker.core.events``)
   at the next version, chained to the archived head.

A kill -9 anywhere loses nothing: until step 5 commits every session is fully live (a segment or
manifest entry written before is a harmless copy, superseded by the next run's); after it, its
events are in a segment that was verified before they left the live log.

``tracker.store.restore`` brings sessions back and verifies an archive directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, exists, func, insert, select, text, update
from sqlalchemy.engine import Connection

from tracker.core.events import SessionArchived
from tracker.core.model import SessionScope
from tracker.errors import InvalidInput
from tracker.store.base import Projector, StoredEvent, fold_events, row_columns
from tracker.store.chain import GENESIS, canonical, canonical_data, canonical_event, canonical_json, link
from tracker.store.errors import map_db_errors
from tracker.store.schema import APPEND_LOCK_KEY
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t
from tracker.store.segments import (
    MANIFEST,
    Segment,
    directory_lock,
    file_sha256,
    read_manifest,
    read_segment,
    write_manifest,
    write_segment,
)
from tracker.store.sql import SqlEventStore

__all__ = [
    "DEFAULT_BATCH_EVENTS",
    "SessionRows",
    "archive_sessions",
    "check_rows",
    "digest_of",
    "projector_of",
    "row_index",
    "segment_columns",
    "write_tx",
]

#: about this many events per segment and per archiving transaction
DEFAULT_BATCH_EVENTS = 100_000
#: at most this many sessions per batch
MAX_BATCH_SESSIONS = 1000
#: rows per INSERT statement (PostgreSQL) or executemany (SQLite) while restoring
INSERT_CHUNK = 5000

#: ``progress(done, total)`` in events
Progress = Callable[[int, int], None]

_E = events_t.c
_S = sessions_t.c
_ROW = (
    _E.session_id,
    _E.version,
    _E.position,
    _E.type,
    _E.data,
    _E.recorded_at,
    _E.idempotency_key,
    _E.batch_size,
    _E.hash,
)


def digest_of(state: dict[str, Any]) -> str:
    """The digest of a folded state: sha256 of its canonical JSON, hex."""
    return hashlib.sha256(canonical_json(state).encode("utf-8")).hexdigest()


def projector_of(store: SqlEventStore) -> Projector:
    if store.projector is None:
        raise InvalidInput("projector", "archiving folds every session: the store needs a projector")
    return store.projector


def _fold(proj: Projector, sid: str, seg: Segment, lo: int, hi: int, datas: list[dict[str, Any]]) -> dict[str, Any]:
    stored = [
        StoredEvent(
            seg.position[i], sid, seg.version[i], seg.type[i], datas[i - lo], seg.recorded_at[i], seg.idempotency_key[i]
        )
        for i in range(lo, hi)
    ]
    return fold_events(proj, proj.initial(sid), stored)


@dataclass
class SessionRows:
    """One session of a batch: where its rows are in the segment, and what was checked of it."""

    sid: str
    version: int  # its final version (the projection row's when it was picked)
    lo: int = 0
    hi: int = 0
    digest: str = ""
    head: str = ""
    #: set by ``check_rows``: the rows' data, parsed, and the state they fold to
    datas: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Run:
    directory: Path
    proj: Projector
    report: dict[str, Any] = field(default_factory=dict)


# -- picking and reading -----------------------------------------------------------------------------


def _idle(store: SqlEventStore, before: datetime, prefix: str | None) -> Iterator[tuple[str, int]]:
    """(session_id, version) of each live session last written before ``before``, in id order."""
    marker = exists().where(_E.session_id == _S.session_id, _E.version == _S.version, _E.type == SessionArchived.TYPE)
    stmt = select(_S.session_id, _S.version).where(_S.updated_at < before, _S.version > 0, ~marker)
    if prefix is not None:
        stmt = stmt.where(func.substr(_S.session_id, 1, len(prefix)) == prefix)
    after: str | None = None
    while True:
        page = stmt.order_by(_S.session_id).limit(MAX_BATCH_SESSIONS)
        if after is not None:
            page = page.where(_S.session_id > after)
        rows = store._rows("archive", page)
        yield from ((str(r[0]), int(r[1])) for r in rows)
        if len(rows) < MAX_BATCH_SESSIONS:
            return
        after = rows[-1][0]


def _batches(picked: Iterator[tuple[str, int]], batch_events: int) -> Iterator[list[tuple[str, int]]]:
    batch: list[tuple[str, int]] = []
    n = 0
    for sid, version in picked:
        batch.append((sid, version))
        n += version
        if n >= batch_events or len(batch) >= MAX_BATCH_SESSIONS:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _read(store: SqlEventStore, batch: list[tuple[str, int]], run: _Run) -> tuple[Segment, list[SessionRows]]:
    """The batch's events as a segment's columns, and each session folded (a session that moved on
    since it was picked, or whose log has a gap, is dropped from the batch)."""
    wanted = dict(batch)
    stmt = select(*_ROW).where(_E.session_id.in_(list(wanted))).order_by(_E.session_id, _E.version)
    rows = store._rows("archive", stmt)
    seg = Segment.empty()
    sessions: list[SessionRows] = []
    i = 0
    while i < len(rows):
        sid = rows[i][0]
        j = i
        while j < len(rows) and rows[j][0] == sid:
            j += 1
        group = rows[i:j]
        i = j
        final = wanted[sid]
        versions = [r[1] for r in group]
        if versions != list(range(1, final + 1)):
            why = (
                "written to since it was picked" if versions[-1] > final else "its log has a gap: run `tracker verify`"
            )
            run.report["skipped"].append({"session_id": sid, "reason": why})
            continue
        s = SessionRows(sid, final, len(seg), len(seg) + len(group))
        seg.session_id.extend([sid] * len(group))
        seg.version.extend(versions)
        seg.position.extend(r[2] for r in group)
        seg.type.extend(r[3] for r in group)
        seg.data.extend(canonical_json(r[4]) for r in group)
        seg.recorded_at.extend(r[5] for r in group)
        seg.idempotency_key.extend(r[6] for r in group)
        seg.batch_size.extend(r[7] for r in group)
        seg.hash.extend(None if r[8] is None else bytes(r[8]) for r in group)
        last = seg.hash[s.hi - 1]
        if last is None:
            run.report["skipped"].append({"session_id": sid, "reason": "unchained rows: run `tracker verify`"})
            for col in seg.__dict__.values():
                del col[s.lo :]
            continue
        s.head = last.hex()
        sessions.append(s)
    return seg, sessions


# -- checking a segment ------------------------------------------------------------------------------


def segment_columns(table: Any) -> Segment:
    return Segment(*(table.column(n).to_pylist() for n in table.schema.names))


def check_rows(proj: Projector, seg: Segment, s: SessionRows) -> str | None:
    """Why the session's rows in ``seg`` are not what it was archived as (None: they are): its
    versions, its re-fold to ``s.digest`` and its hash chain, recomputed from the rows' canonical
    texts, up to ``s.head``. An empty ``s.digest`` is set to the rows' (the archive's first fold:
    of the read-back segment, once every column of it equals what was read from the live log)."""
    versions = seg.version[s.lo : s.hi]
    if versions != list(range(1, s.version + 1)):
        return f"holds versions {versions[:1]}..{versions[-1:]}, not 1..{s.version}"
    texts = seg.data[s.lo : s.hi]
    s.datas = [json.loads(d) for d in texts]
    s.state = _fold(proj, s.sid, seg, s.lo, s.hi, s.datas)
    digest = digest_of(s.state)
    if not s.digest:
        s.digest = digest
    if digest != s.digest:
        return "its events fold to another state (digest differs)"
    prev = GENESIS
    for version, type_, body, stored in zip(versions, seg.type[s.lo : s.hi], texts, seg.hash[s.lo : s.hi], strict=True):
        prev = link(prev, canonical_event(s.sid, version, type_, canonical_data(body)).encode("utf-8"))
        if stored != prev:
            return f"its hash chain is broken at version {version}"
    if prev.hex() != s.head:
        return "its chain ends at another head"
    return None


def row_index(seg: Segment) -> dict[str, tuple[int, int]]:
    """session id -> (lo, hi) of its rows in a segment (rows are in session order)."""
    out: dict[str, tuple[int, int]] = {}
    ids = seg.session_id
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        out[ids[i]] = (i, j)
        i = j
    return out


# -- archive -----------------------------------------------------------------------------------------


def archive_sessions(
    store: SqlEventStore,
    directory: Path,
    *,
    before: datetime,
    session_prefix: str | None = None,
    dry_run: bool = False,
    batch_events: int = DEFAULT_BATCH_EVENTS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Archive every live session last written before ``before`` (and whose id starts with
    ``session_prefix``) to ``directory`` (module doc). Returns ``{"sessions", "events", "segments",
    "skipped", "dry_run", "seconds", "archive"}``; with ``dry_run``, what would be archived, and
    nothing is written."""
    if batch_events < 1:
        raise InvalidInput("batch_events", "must be at least 1")
    started = time.perf_counter()
    directory = Path(directory).resolve()
    run = _Run(directory, projector_of(store))
    run.report = {
        "archive": str(directory),
        "sessions": 0,
        "events": 0,
        "segments": [],
        "skipped": [],
        "dry_run": dry_run,
    }
    picked = list(_idle(store, before, session_prefix))
    total = sum(v for _, v in picked)
    if dry_run:
        run.report.update(sessions=len(picked), events=total, seconds=round(time.perf_counter() - started, 3))
        return run.report
    directory.mkdir(parents=True, exist_ok=True)
    with directory_lock(directory):  # an archive directory from the first run on, even an empty one
        if not (directory / MANIFEST).exists():
            write_manifest(directory, read_manifest(directory))
    done = 0
    for batch in _batches(iter(picked), batch_events):
        seg, sessions = _read(store, batch, run)
        if sessions:
            _archive_batch(store, run, seg, sessions)
        done += sum(v for _, v in batch)
        if progress is not None:
            progress(done, total)
    run.report["seconds"] = round(time.perf_counter() - started, 3)
    return run.report


def _archive_batch(store: SqlEventStore, run: _Run, seg: Segment, sessions: list[SessionRows]) -> None:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"segment-{stamp}-{uuid.uuid4().hex[:8]}.parquet"
    path = write_segment(run.directory, name, seg)
    back = segment_columns(read_segment(path))
    for col in Segment.__dataclass_fields__:
        if getattr(back, col) != getattr(seg, col):
            raise InvalidInput("segment", f"{name}: column {col} read back differs from what was written")
    checked = []
    for s in sessions:
        # the rows equal the live log's, so a problem here is the live log's own (a broken chain)
        problem = check_rows(run.proj, back, s)
        if problem is None:
            checked.append(s)
        else:
            run.report["skipped"].append({"session_id": s.sid, "reason": f"{problem}: run `tracker verify`"})
    sessions = checked
    if not sessions:
        return
    entry = {
        "sha256": file_sha256(path),
        "events": len(seg),
        "sessions": len(sessions),
        "first_position": min(seg.position),
        "last_position": max(seg.position),
    }
    with directory_lock(run.directory):
        manifest = read_manifest(run.directory)
        manifest["segments"][name] = entry
        for s in sessions:
            positions = seg.position[s.lo : s.hi]
            manifest["sessions"][s.sid] = {
                "segment": name,
                "final_version": s.version,
                "events": s.hi - s.lo,
                "first_position": min(positions),
                "last_position": max(positions),
                "digest": s.digest,
                "chain_head": s.head,
            }
        write_manifest(run.directory, manifest)
    archived = write_tx(
        store, "archive", functools.partial(_archive_tx, store=store, run=run, name=name, sessions=sessions)
    )
    run.report["segments"].append(name)
    run.report["sessions"] += len(archived)
    run.report["events"] += sum(s.version for s in sessions if s.sid in archived)
    for s in sessions:
        if s.sid not in archived:
            run.report["skipped"].append({"session_id": s.sid, "reason": "written to since it was read"})


def write_tx(store: SqlEventStore, what: str, fn: Callable[[Connection], Any]) -> Any:
    """``fn(conn)``, a write transaction, with typed errors; never run twice (``run_core`` is for reads)."""
    with map_db_errors(what), store.engine.connect() as conn:
        return fn(conn)


def _marker(run: _Run, name: str, s: SessionRows) -> SessionArchived:
    return SessionArchived(
        final_version=s.version,
        digest=s.digest,
        chain_head=s.head,
        segment=name,
        archive=str(run.directory),
        events=s.hi - s.lo,
    )


def _archive_tx(conn: Connection, store: SqlEventStore, run: _Run, name: str, sessions: list[SessionRows]) -> set[str]:
    """One transaction: each session still at its version loses its events and gains its marker."""
    pg = store.backend == "postgresql"
    conn = conn.execution_options(ct_write=True)  # SQLite: BEGIN IMMEDIATE (the write lock first)
    archived: set[str] = set()
    with conn.begin():
        positions: list[int] = []
        txid = None
        if pg:  # as ct_append does: the transaction id, then the positions, under the append lock
            conn.execute(text(f"SELECT pg_advisory_lock({APPEND_LOCK_KEY})"))
            try:
                txid = int(conn.execute(text("SELECT pg_current_xact_id()::text::bigint")).scalar_one())
                positions = list(
                    conn.execute(
                        text("SELECT nextval('events_position_seq') FROM generate_series(1, :n)"), {"n": len(sessions)}
                    ).scalars()
                )
            finally:
                conn.execute(text(f"SELECT pg_advisory_unlock({APPEND_LOCK_KEY})"))
        now = datetime.now(UTC)
        for k, s in enumerate(sessions):
            head = conn.execute(
                select(_E.hash).where(_E.session_id == s.sid, _E.version == s.version)
            ).scalar_one_or_none()
            if head is None or bytes(head).hex() != s.head:
                continue
            marker = _marker(run, name, s)
            data = marker.to_data()
            version = s.version + 1
            stored = StoredEvent(positions[k] if pg else 0, s.sid, version, marker.TYPE, data, now, None)
            state = fold_events(run.proj, run.proj.initial(s.sid), [stored])
            pressure, revision, occupancy, open_attempts = row_columns(run.proj, state)
            moved = conn.execute(
                update(sessions_t)
                .where(_S.session_id == s.sid, _S.version == s.version)
                .values(
                    version=version,
                    state=state,
                    pressure=pressure,
                    revision=revision,
                    occupancy_bp=occupancy,
                    open_attempts=open_attempts,
                )
            ).rowcount
            if moved != 1:
                continue
            if conn.execute(select(func.max(_E.version)).where(_E.session_id == s.sid)).scalar_one() != s.version:
                raise InvalidInput("archive", f"session {s.sid}: its log moved on past its projection row")
            row: dict[str, Any] = {
                "session_id": s.sid,
                "version": version,
                "type": marker.TYPE,
                "data": data,
                "recorded_at": now,
                "idempotency_key": None,
                "batch_size": 1,
                "fleet": SessionScope.fleet_of(s.sid),
                "hash": link(bytes.fromhex(s.head), canonical(s.sid, version, marker.TYPE, data)),
            }
            if pg:
                row.update(position=positions[k], txid=txid)
            conn.execute(insert(events_t).values(**row))
            conn.execute(delete(events_t).where(_E.session_id == s.sid, _E.version <= s.version))
            archived.add(s.sid)
    for sid in archived:
        store._states.discard(sid)
    return archived
