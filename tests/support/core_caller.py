"""A caller of the pure decision core, for tests that drive it without a store: it keeps the state and
the events each decision returns, as the service would record them, and hands them back as stored rows.

Tests subclass it with the calls they make (``decide_measure``, ``decide_usage``, ...).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tracker.core import Policy, SessionState
from tracker.core.events import DomainEvent
from tracker.store import StoredEvent

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class CoreCaller:
    def __init__(self, policy: Policy | None = None, sid: str = "s") -> None:
        self.policy, self.sid = policy or Policy(), sid
        self.state = SessionState(session_id=sid)
        self.events: list[DomainEvent] = []
        self.now = 1000.0
        self.n = 0  # calls that may open an attempt (its id: a1, a2, ...)

    def record(self, out: Any) -> Any:
        """Keep what a decision returned (its events appended, its state the session's); return it."""
        self.events.extend(out.events)
        self.state = out.state
        return out

    def stored(self) -> list[StoredEvent]:
        """The events as the store hands them back (version i at ``T0`` + i seconds)."""
        return [
            StoredEvent(i, self.sid, i, e.TYPE, e.to_data(), T0 + timedelta(seconds=i), None)
            for i, e in enumerate(self.events, start=1)
        ]
