"""``verify_projections``: does every stored projection equal the fold of its log? (``tracker verify``)

It reads through the ``EventStore`` port only (``log_versions``, ``projection_row``,
``fold_stream``), so any event store can be verified (SQL or in memory).
"""

from __future__ import annotations

import json
from typing import Any

from tracker.store.base import PROJECTION_COLUMNS, EventStore, Projector

__all__ = ["verify_projections"]


def _normal(value: Any) -> Any:
    """``value`` as the store keeps it: through a compact JSON round trip."""
    return json.loads(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False))


def verify_projections(store: EventStore, projector: Projector) -> list[dict[str, Any]]:
    """Re-fold every session from the log and compare with its stored projection.

    Returns the differences (empty list = every projection equals the fold), each
    ``{"session_id", "field", "stored", "expected"}`` where field is ``row`` (a
    projection row without events or events without a projection row),
    ``version``, ``state`` or one of the listing columns.
    """
    diffs: list[dict[str, Any]] = []
    for sid, version in store.log_versions():
        row = store.projection_row(sid)
        if version == 0:  # a projection row without events
            if row is not None:
                diffs.append({"session_id": sid, "field": "row", "stored": "projection row", "expected": "no events"})
            continue
        if row is None:
            diffs.append(
                {"session_id": sid, "field": "row", "stored": None, "expected": f"projection at version {version}"}
            )
            continue
        state, folded_version = store.fold_stream(sid, None, projector)
        if folded_version != version:  # the log moved on while we read it; re-check this one
            version = folded_version
            row = store.projection_row(sid) or row
        expected_state = _normal(state)
        if row["version"] != version:
            diffs.append({"session_id": sid, "field": "version", "stored": row["version"], "expected": version})
            continue  # a newer append raced us, or the row is stale: the rest would only repeat it
        if row["state"] != expected_state:
            diffs.append({"session_id": sid, "field": "state", "stored": row["state"], "expected": expected_state})
        cols = projector.columns(state) or {}
        for name in PROJECTION_COLUMNS:
            want = cols.get(name)
            if name == "open_attempts":
                want = int(want or 0)
            if row[name] != want:
                diffs.append({"session_id": sid, "field": name, "stored": row[name], "expected": want})
    return diffs
