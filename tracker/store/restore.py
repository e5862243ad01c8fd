"""Archived sessions back into the live log (``tracker restore``), and an archive re-checked (``tracker verify --archive``).

``restore_sessions`` brings sessions back, **one transaction per session**: its ``SessionArchived``
record must be the one the manifest names (same digest); the segment's file checksum, the
session's re-fold and its chain are checked first; then its events are inserted with their
versions, positions, ``recorded_at``, data and hashes unchanged, the record is deleted and the
projection row is put back at the final version. A session that is live already is left alone,
so a second run changes nothing. Restored events keep their original **positions** (below every
position drawn since): a feed reader that read past them before the archive does not see them
again, and one that reads from 0 afterwards finds them in their original order.

On PostgreSQL each chunk of a session's events (``INSERT_CHUNK``) is one INSERT statement, so the
partitioned log's uniqueness triggers (migrations 0011, 0012) run once per chunk, not once per
event; and each session's transaction plans its statements afresh (``plan_cache_mode =
force_custom_plan``): a plan its connection cached while the partitions looked empty -- after a
``VACUUM`` of the log an archive emptied -- reads them whole at every session (docs/performance.md
"Retention").

``verify_archive`` re-checks a directory against its manifest (checksums, re-folds, chains).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.engine import Connection

from tracker.core.events import SessionArchived
from tracker.core.model import SessionScope
from tracker.errors import InvalidInput
from tracker.store.archive import (
    INSERT_CHUNK,
    Progress,
    SessionRows,
    check_rows,
    projector_of,
    row_index,
    segment_columns,
    write_tx,
)
from tracker.store.base import Projector, row_columns
from tracker.store.schema import events as events_t
from tracker.store.schema import sessions as sessions_t
from tracker.store.segments import MANIFEST, Segment, file_sha256, read_manifest, read_segment
from tracker.store.sql import SqlEventStore

__all__ = ["archived_marker", "restore_sessions", "verify_archive"]

_E = events_t.c
_S = sessions_t.c


# -- restore -----------------------------------------------------------------------------------------


def archived_marker(store: SqlEventStore, session_id: str) -> dict[str, Any] | None:
    """The data of the session's ``SessionArchived`` record when it is archived (its last event), else None."""
    stmt = (
        select(_E.data)
        .join(sessions_t, _S.session_id == _E.session_id)
        .where(_E.session_id == session_id, _E.version == _S.version, _E.type == SessionArchived.TYPE)
    )
    return store._run("archive", lambda conn: conn.execute(stmt).scalar_one_or_none())


def restore_sessions(
    store: SqlEventStore, directory: Path, *, session_id: str | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Bring archived sessions back from ``directory`` (module doc): all its manifest's sessions, or
    one. Returns ``{"restored", "events", "live", "seconds"}``; ``live``: sessions left alone because
    the live log does not hold this archive's record of them (restored already, or never archived)."""
    started = time.perf_counter()
    directory = Path(directory).resolve()
    proj = projector_of(store)
    if not (directory / MANIFEST).exists():
        raise InvalidInput("archive", f"{directory} holds no {MANIFEST}: not an archive directory")
    manifest = read_manifest(directory)
    sessions: dict[str, Any] = manifest["sessions"]
    if session_id is not None:
        if session_id not in sessions:
            raise InvalidInput("session", f"{session_id} is not in the archive {directory}")
        sessions = {session_id: sessions[session_id]}
    report: dict[str, Any] = {"archive": str(directory), "restored": 0, "events": 0, "live": 0}
    by_segment: dict[str, list[str]] = {}
    for sid, entry in sorted(sessions.items()):
        by_segment.setdefault(entry["segment"], []).append(sid)
    total = sum(int(e["events"]) for e in sessions.values())
    done = 0
    for name, sids in sorted(by_segment.items()):
        pending = [sid for sid in sids if _still_archived(store, sid, sessions[sid])]
        report["live"] += len(sids) - len(pending)
        if pending:
            seg, index = _open_segment(directory, manifest, name)
            for sid in pending:
                entry = sessions[sid]
                lo, hi = index.get(sid, (0, 0))
                s = SessionRows(sid, int(entry["final_version"]), lo, hi, entry["digest"], entry["chain_head"])
                problem = check_rows(proj, seg, s)
                if problem is not None:
                    raise InvalidInput("archive", f"{name}: session {sid} {problem}")
                if write_tx(store, "restore", functools.partial(_restore_tx, store=store, proj=proj, seg=seg, s=s)):
                    report["restored"] += 1
                    report["events"] += hi - lo
                else:
                    report["live"] += 1
        done += sum(int(sessions[sid]["events"]) for sid in sids)
        if progress is not None:
            progress(done, total)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def _still_archived(store: SqlEventStore, sid: str, entry: dict[str, Any]) -> bool:
    marker = archived_marker(store, sid)
    return (
        marker is not None
        and marker.get("digest") == entry["digest"]
        and marker.get("final_version") == entry["final_version"]
    )


def _open_segment(directory: Path, manifest: dict[str, Any], name: str) -> tuple[Segment, dict[str, tuple[int, int]]]:
    path = directory / name
    entry = manifest["segments"].get(name)
    if entry is None or not path.exists():
        raise InvalidInput("archive", f"segment {name} is missing from {directory}")
    if file_sha256(path) != entry["sha256"]:
        raise InvalidInput("archive", f"segment {name}: its sha256 is not the manifest's")
    seg = segment_columns(read_segment(path))
    return seg, row_index(seg)


def _restore_tx(conn: Connection, store: SqlEventStore, proj: Projector, seg: Segment, s: SessionRows) -> bool:
    """One transaction: the session's events back, its marker gone, its projection row at its final
    version. False (nothing written) when the session is no longer archived by this record."""
    pg = store.backend == "postgresql"
    conn = conn.execution_options(ct_write=True)
    marker_version = s.version + 1
    with conn.begin():
        if pg:  # this session's statements planned for the partitions as they are now (module doc)
            conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_custom_plan")
        lock = select(_S.version).where(_S.session_id == s.sid)
        current = conn.execute(lock.with_for_update() if pg else lock).scalar_one_or_none()
        marker = conn.execute(
            select(_E.type, _E.data).where(_E.session_id == s.sid, _E.version == marker_version)
        ).first()
        if (
            current != marker_version
            or marker is None
            or marker[0] != SessionArchived.TYPE
            or marker[1].get("digest") != s.digest
        ):
            return False
        txid = int(conn.execute(text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()) if pg else None
        fleet = SessionScope.fleet_of(s.sid)
        conn.execute(delete(events_t).where(_E.session_id == s.sid, _E.version <= s.version))
        for k in range(s.lo, s.hi, INSERT_CHUNK):
            _insert_rows(conn, pg, seg, s, k, min(k + INSERT_CHUNK, s.hi), fleet, txid)
        conn.execute(delete(events_t).where(_E.session_id == s.sid, _E.version == marker_version))
        state = s.state  # (check_rows folded these very rows)
        pressure, revision, occupancy, open_attempts = row_columns(proj, state)
        conn.execute(
            update(sessions_t)
            .where(_S.session_id == s.sid)
            .values(
                version=s.version,
                state=state,
                pressure=pressure,
                revision=revision,
                occupancy_bp=occupancy,
                open_attempts=open_attempts,
                updated_at=seg.recorded_at[s.hi - 1],
            )
        )
    store._states.discard(s.sid)
    return True


#: one statement for a chunk of a session's rows on PostgreSQL (its uniqueness triggers, migration
#: 0011, run once per statement): the columns as arrays (``%b``: sent in binary, no text-array
#: quoting of the JSON), unnested; ``data`` from the segment's JSON texts
_PG_INSERT = (
    "INSERT INTO events (position, session_id, version, type, data, recorded_at, idempotency_key, batch_size, "
    "txid, fleet, hash) SELECT p, %s, v, t, d::jsonb, r, k, b, %s, %s, h FROM unnest(%b::bigint[], "
    "%b::integer[], %b::text[], %b::text[], %b::timestamptz[], %b::text[], %b::integer[], %b::bytea[]) "
    "AS u(p, v, t, d, r, k, b, h)"
)


def _insert_rows(
    conn: Connection, pg: bool, seg: Segment, s: SessionRows, lo: int, hi: int, fleet: str, txid: int | None
) -> None:
    """Rows ``lo:hi`` of ``seg`` (of session ``s``) into ``events``, as they were: one INSERT
    statement on PostgreSQL, an executemany on SQLite (no trigger there; one prepared statement)."""
    if pg:
        columns = (seg.position, seg.version, seg.type, seg.data, seg.recorded_at, seg.idempotency_key, seg.batch_size)
        arrays = [c[lo:hi] for c in (*columns, seg.hash)]
        conn.exec_driver_sql(_PG_INSERT, (s.sid, txid, fleet, *arrays))
        return
    rows = [
        {
            "position": seg.position[i],
            "session_id": s.sid,
            "version": seg.version[i],
            "type": seg.type[i],
            "data": s.datas[i - s.lo],
            "recorded_at": seg.recorded_at[i],
            "idempotency_key": seg.idempotency_key[i],
            "batch_size": seg.batch_size[i],
            "fleet": fleet,
            "hash": seg.hash[i],
            "txid": txid,
        }
        for i in range(lo, hi)
    ]
    conn.execute(insert(events_t), rows)


# -- verify ------------------------------------------------------------------------------------------


def verify_archive(directory: Path, projector: Projector) -> dict[str, Any]:
    """Re-check an archive directory against its manifest: each segment's sha256, event count and
    position range; each session's versions, re-fold (digest) and hash chain (up to its head).
    ``{"ok", "segments", "sessions", "events", "problems"}``, problems ``{"segment", "session_id", "problem"}``."""
    directory = Path(directory).resolve()
    if not (directory / MANIFEST).exists():
        raise InvalidInput("archive", f"{directory} holds no {MANIFEST}: not an archive directory")
    manifest = read_manifest(directory)
    problems: list[dict[str, Any]] = []
    by_segment: dict[str, list[str]] = {}
    for sid, entry in manifest["sessions"].items():
        by_segment.setdefault(entry["segment"], []).append(sid)
    events = 0
    for name, entry in sorted(manifest["segments"].items()):
        path = directory / name
        if not path.exists():
            problems.append({"segment": name, "session_id": None, "problem": "missing"})
            continue
        if file_sha256(path) != entry["sha256"]:
            problems.append({"segment": name, "session_id": None, "problem": "sha256 differs from the manifest's"})
            continue
        seg = segment_columns(read_segment(path))
        if len(seg) != entry["events"] or (
            seg.position and (min(seg.position), max(seg.position)) != (entry["first_position"], entry["last_position"])
        ):
            problems.append(
                {"segment": name, "session_id": None, "problem": "event count or positions differ from the manifest's"}
            )
        index = row_index(seg)
        for sid in sorted(by_segment.get(name, [])):
            e = manifest["sessions"][sid]
            lo, hi = index.get(sid, (0, 0))
            s = SessionRows(sid, int(e["final_version"]), lo, hi, e["digest"], e["chain_head"])
            problem = check_rows(projector, seg, s) if hi > lo else "has no rows in its segment"
            if problem is not None:
                problems.append({"segment": name, "session_id": sid, "problem": problem})
            events += hi - lo
    for sid, e in manifest["sessions"].items():
        if e["segment"] not in manifest["segments"]:
            problems.append(
                {"segment": e["segment"], "session_id": sid, "problem": "its segment is not in the manifest"}
            )
    return {
        "ok": not problems,
        "archive": str(directory),
        "segments": len(manifest["segments"]),
        "sessions": len(manifest["sessions"]),
        "events": events,
        "problems": problems,
    }
