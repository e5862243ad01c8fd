"""The event-store tests' toy domain: ``ToyProjector`` (counts events by type, follows the last
``Pressure`` level), ``fold`` (its state from a list of events), ``ev`` (a ``NewEvent``) and
``execute_sql`` (a statement run behind the store's back)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import create_engine, text

from tracker.settings import normalize_database_url
from tracker.store import NewEvent, StoredEvent


class ToyProjector:
    """Counts events by type; 'pressure' follows the last Pressure event's level."""

    def initial(self, session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "count": 0, "by_type": {}, "pressure": "normal", "last_version": 0, "sum": 0}

    def apply(self, state: dict[str, Any], event: StoredEvent) -> dict[str, Any]:
        by_type = dict(state["by_type"])
        by_type[event.type] = by_type.get(event.type, 0) + 1
        pressure = event.data.get("level", state["pressure"]) if event.type == "Pressure" else state["pressure"]
        return {
            **state,
            "count": state["count"] + 1,
            "by_type": by_type,
            "pressure": pressure,
            "last_version": event.version,
            "sum": state["sum"] + int(event.data.get("n", 0)),
        }

    def columns(self, state: dict[str, Any]) -> dict[str, Any]:
        return {
            "pressure": state["pressure"],
            "revision": 1 + state["by_type"].get("Compacted", 0),
            "occupancy_bp": state["sum"] if state["count"] else None,
            "open_attempts": state["by_type"].get("Started", 0) - state["by_type"].get("Compacted", 0),
        }


def fold(projector: ToyProjector, session_id: str, events: list[StoredEvent]) -> dict[str, Any]:
    state = projector.initial(session_id)
    for e in events:
        state = projector.apply(state, e)
    return json.loads(json.dumps(state))


def ev(type_: str = "Tick", **data: Any) -> NewEvent:
    return NewEvent(type_, data)


def execute_sql(url: str, sql: str, **params: Any) -> None:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(sql), params)
    finally:
        engine.dispose()
