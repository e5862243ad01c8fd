"""Retention on both real backends (``tracker.store.archive``): idle sessions archived to verified
Parquet segments, the live log left with one ``SessionArchived`` record each, restored unchanged.

Round trip: archive → the live log holds only the records → ``verify_archive`` passes (and
``tracker verify``'s chains and projections too) → restore → the same events (versions,
positions, ``recorded_at``, data, hashes) and the same folded states → a second restore changes
nothing → the session takes new observes at the next version.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.archive_log import fill, log_rows, states
from tests.support.service_suite import Clock, m
from tracker import Policy, Tracker
from tracker.core import SessionProjector
from tracker.errors import ArchivedSession, InvalidInput
from tracker.store import NewEvent, open_store, verify_projections
from tracker.store.archive import archive_sessions, digest_of
from tracker.store.migrate import upgrade
from tracker.store.restore import archived_marker, restore_sessions, verify_archive
from tracker.store.verify import verify_chains

LATER = datetime.now(UTC) + timedelta(days=1)


@pytest.fixture
def tracker(db_url):
    upgrade(db_url)
    t = Tracker(open_store(db_url, projector=SessionProjector()), policy=Policy(attempt_lease_s=30), clock=Clock())
    yield t
    t.close()


def test_round_trip_archive_verify_restore(tracker, tmp_path: Path):
    t = tracker
    fill(t)
    sids = [f"s{k}" for k in range(4)]
    before_rows, before_states = log_rows(t.store), states(t.store, sids)
    before_rows_proj = {sid: t.store.projection_row(sid) for sid in sids}
    out = tmp_path / "archive"

    dry = archive_sessions(t.store, out, before=LATER, dry_run=True)
    assert (dry["sessions"], dry["events"]) == (4, len(before_rows))
    assert log_rows(t.store) == before_rows and not out.exists()

    report = archive_sessions(t.store, out, before=LATER, batch_events=10)  # several segments
    assert (report["sessions"], report["events"], report["skipped"]) == (4, len(before_rows), [])
    assert len(report["segments"]) > 1
    live = log_rows(t.store)
    assert [(r[1], r[3]) for r in live] == [(sid, "SessionArchived") for sid in sids]
    for sid in sids:
        final = before_rows_proj[sid]["version"]
        marker = archived_marker(t.store, sid)
        assert marker is not None and marker["final_version"] == final
        assert marker["digest"] == digest_of(before_states[sid])
        with pytest.raises(ArchivedSession, match=f"tracker restore .* --session {sid}"):
            t.observe(sid, measurement=m("later", 100))
    # the live log stays verifiable: the records chain on to the archived heads
    assert verify_chains(t.store)["broken"] == []
    assert verify_projections(t.store, SessionProjector()) == []

    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["sessions"]) == sids
    table = pq.read_table(out / report["segments"][0])
    assert table.schema.field("version").type == "int32" and table.schema.field("hash").type == "binary"
    assert pq.ParquetFile(out / report["segments"][0]).metadata.row_group(0).column(0).compression == "ZSTD"
    checked = verify_archive(out, SessionProjector())
    assert checked["ok"] and checked["events"] == len(before_rows)

    # nothing more to archive: an archived session is not idle, it is gone
    assert archive_sessions(t.store, out, before=LATER)["sessions"] == 0

    first = restore_sessions(t.store, out, session_id="s1")
    assert (first["restored"], first["live"]) == (1, 0)
    done = restore_sessions(t.store, out)
    assert (done["restored"], done["live"]) == (3, 1)
    assert log_rows(t.store) == before_rows
    assert states(t.store, sids) == before_states
    for sid in sids:
        row = t.store.projection_row(sid)
        assert (row["version"], row["state"]) == (before_rows_proj[sid]["version"], before_rows_proj[sid]["state"])
    assert verify_chains(t.store)["broken"] == [] and verify_projections(t.store, SessionProjector()) == []

    again = restore_sessions(t.store, out)
    assert (again["restored"], again["live"]) == (0, 4) and log_rows(t.store) == before_rows

    version = t.store.stream_version("s0")
    t.observe("s0", measurement=m("after-restore", 200))
    assert t.store.stream_version("s0") == version + 1
    assert verify_chains(t.store)["broken"] == []


def test_only_sessions_idle_long_enough_and_of_the_prefix_move(tracker, tmp_path: Path):
    t = tracker
    fill(t, sessions=2, steps=2)
    t.observe("f1:a", measurement=m("x", 100))
    assert archive_sessions(t.store, tmp_path / "a", before=datetime.now(UTC) - timedelta(days=1))["sessions"] == 0
    report = archive_sessions(t.store, tmp_path / "a", before=LATER, session_prefix="f1:")
    assert report["sessions"] == 1 and archived_marker(t.store, "f1:a") is not None
    assert archived_marker(t.store, "s0") is None and t.store.stream_version("s0") > 1


def test_a_session_written_to_after_it_was_read_stays_live(tracker, tmp_path: Path, monkeypatch):
    """The archiving transaction compare-and-sets each session's version: a session that moved on
    between the read and the transaction is skipped, whole, and keeps every event."""
    import tracker.store.archive as archive

    t = tracker
    fill(t, sessions=2, steps=2)
    real = archive._archive_tx

    def racing(conn, **kw):
        t.observe("s1", measurement=m("late", 300))
        return real(conn, **kw)

    monkeypatch.setattr(archive, "_archive_tx", racing)
    report = archive_sessions(t.store, tmp_path / "a", before=LATER)
    assert report["sessions"] == 1
    assert report["skipped"] == [{"session_id": "s1", "reason": "written to since it was read"}]
    assert archived_marker(t.store, "s1") is None
    assert [e.version for e in t.store.read_stream("s1")] == list(range(1, t.store.stream_version("s1") + 1))
    assert verify_chains(t.store)["broken"] == []


def test_a_tampered_segment_is_refused_by_verify_and_restore(tracker, tmp_path: Path):
    t = tracker
    fill(t, sessions=1, steps=3)
    out = tmp_path / "a"
    report = archive_sessions(t.store, out, before=LATER)
    seg = out / report["segments"][0]
    table = pq.read_table(seg)
    data = table.column("data").to_pylist()
    data[0] = data[0].replace('"v":', '"x":1,"v":', 1)
    import pyarrow as pa

    pq.write_table(table.set_column(4, "data", pa.array(data, pa.string())), seg, compression="zstd")
    checked = verify_archive(out, SessionProjector())
    assert not checked["ok"] and "sha256" in checked["problems"][0]["problem"]
    with pytest.raises(InvalidInput, match="sha256"):
        restore_sessions(t.store, out)
    assert archived_marker(t.store, "s0") is not None  # still archived: nothing half-restored


def test_a_long_archived_session_reads_folds_and_verifies_from_its_record(tracker, tmp_path: Path):
    """An archived stream starts at its record's version, far past 1: reading it from version 1
    finds the record even when it lies beyond the first page of a stream read (2,000 versions)."""
    t = tracker
    fill(t, sessions=1, steps=2)
    measured = [e for e in t.store.read_stream("s0") if e.type == "ContextMeasured"][-1]
    for _ in range(5):
        version = t.store.stream_version("s0")
        t.store.append("s0", version, [NewEvent(measured.type, measured.data)] * 500)
    final = t.store.stream_version("s0")
    assert final > 2500
    folded = t.store.fold_stream("s0")[0]
    archive_sessions(t.store, tmp_path / "a", before=LATER)
    assert [(e.version, e.type) for e in t.store.read_stream("s0")] == [(final + 1, "SessionArchived")]
    assert t.store.fold_stream("s0")[1] == final + 1
    assert verify_projections(t.store, SessionProjector()) == [] and verify_chains(t.store)["broken"] == []
    restore_sessions(t.store, tmp_path / "a")
    assert t.store.fold_stream("s0") == (folded, final)
