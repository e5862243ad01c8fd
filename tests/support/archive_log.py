"""What the retention tests compare before and after an archive and a restore: every stored event
with every column the archive must keep, and every session's folded state."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from tracker import Tracker
from tracker.store.schema import events as events_t
from tracker.store.sql import SqlEventStore

from .service_suite import m


def log_rows(store: SqlEventStore) -> list[tuple[Any, ...]]:
    """Every stored event in position order: position, session, version, type, data (sorted JSON),
    recorded_at, idempotency key, batch size, hash, fleet."""
    e = events_t.c
    cols = (e.position, e.session_id, e.version, e.type, e.data, e.recorded_at, e.idempotency_key, e.batch_size)
    rows = store._rows("test", select(*cols, e.hash, e.fleet).order_by(e.position))
    return [(*r[:4], json.dumps(r[4], sort_keys=True), *r[5:8], bytes(r[8]), r[9]) for r in rows]


def by_session(rows: list[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in rows:
        out.setdefault(r[1], []).append(r)
    return out


def states(store: SqlEventStore, sids: list[str]) -> dict[str, Any]:
    return {sid: store.fold_stream(sid)[0] for sid in sids}


def fill(t: Tracker, sessions: int = 4, steps: int = 6, prefix: str = "s") -> list[str]:
    """``sessions`` sessions of ``steps`` measurements each, compacting (and committing) when told."""
    sids = [f"{prefix}{k}" for k in range(sessions)]
    for sid in sids:
        for i in range(steps):
            r = t.observe(sid, measurement=m(f"b{i}", 500 + 90 * (i % 6)))
            if r.action == "compact":
                t.commit(sid, r.attempt.attempt_id, r.attempt.fencing_token, tokens_after=100)
    return sids
