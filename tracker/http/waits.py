"""Long-polls that hold no request thread, woken when the attempt ends, capped per fleet.

A ``wait`` is a coroutine on the event loop. Each look at the attempt
(:meth:`~tracker.service.Tracker.attempt_status`: one read, and ``lease_expired``
recorded for an attempt past its lease) borrows a request thread for that read only;
between looks the wait sleeps on an :class:`asyncio.Event`. The event is set by a hint
from the coordinator (:meth:`~tracker.coordination.Coordinator.listen`: Redis pub/sub
across processes, in-process calls when embedded) that the Tracker sends after it records
a commit or a rejection. Hints can be lost (Redis down, a writer in another process with
another coordinator), so a wait also looks again every :data:`POLL_S` seconds, and at the
moment the attempt's lease ends.

Each fleet may hold at most ``TRACKER_MAX_WAITS_PER_FLEET`` open waits in one server
process; one more is refused with 429 ``too_many_waits`` and ``Retry-After``, so one
fleet's long-polls cannot take what another fleet's requests need.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from tracker.errors import TooManyWaits, WaitTimeout

POLL_S = 1.0  # the fallback: a wait looks at the record at least this often (with +-20 % jitter)
RETRY_AFTER_S = 1  # what a 429 too_many_waits tells the caller


class Waits:
    """The open waits of one server process (used on its event loop only)."""

    def __init__(self, tracker: Callable[[], Any], cap: int, gauge: Any = None) -> None:
        self._tracker = tracker  # the process's Tracker, once its database has answered (``Runtime.tracker``)
        self._cap = cap
        self._gauge = gauge
        self._per_fleet: dict[str, int] = {}
        self._by_session: dict[str, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: Any = None

    def open_waits(self, fleet_id: str | None = None) -> int:
        if fleet_id is not None:
            return self._per_fleet.get(fleet_id, 0)
        return sum(self._per_fleet.values())

    # -- hints ----------------------------------------------------------------------------------
    def _listen(self, tracker: Any) -> None:
        if self._stop is None:
            self._loop = asyncio.get_running_loop()
            self._stop = tracker.coordinator.listen(self._hint)

    def _hint(self, session_id: str) -> None:
        """From the coordinator's thread: wake the waits on ``session_id`` (on the loop)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake, session_id)

    def _wake(self, session_id: str) -> None:
        for event in self._by_session.get(session_id, ()):
            event.set()

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    # -- one wait -------------------------------------------------------------------------------
    async def wait(self, fleet_id: str, session_id: str, attempt_id: str, timeout: float) -> str:
        """``committed`` or ``rejected:<reason>``; raises ``WaitTimeout``, ``UnknownAttempt``, ``TooManyWaits``."""
        held = self._per_fleet.get(fleet_id, 0)
        if held >= self._cap:
            raise TooManyWaits(
                f"this fleet already has {held} open waits on this server (at most {self._cap}); retry later",
                limit=self._cap,
                retry_after_s=RETRY_AFTER_S,
            )
        self._per_fleet[fleet_id] = held + 1
        event = asyncio.Event()
        self._by_session.setdefault(session_id, set()).add(event)
        if self._gauge is not None:
            self._gauge.inc()
        try:
            tracker = await anyio.to_thread.run_sync(self._tracker)
            self._listen(tracker)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                event.clear()  # a hint that comes during the look below makes the next sleep end at once
                outcome, lease_ends = await anyio.to_thread.run_sync(tracker.attempt_status, session_id, attempt_id)
                if outcome != "open":
                    return str(outcome)
                left = deadline - loop.time()
                if left <= 0:
                    raise WaitTimeout(f"attempt {attempt_id} still open after {timeout:g}s", attempt_id=attempt_id)
                pause = min(left, POLL_S * random.uniform(0.8, 1.2))
                if lease_ends is not None:  # be there when the lease ends, to record lease_expired
                    pause = min(pause, max(0.01, lease_ends - tracker.clock() + 0.01))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), pause)
        finally:
            if self._gauge is not None:
                self._gauge.dec()
            waiting = self._by_session.get(session_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._by_session[session_id]
            left_held = self._per_fleet.get(fleet_id, 1) - 1
            if left_held > 0:
                self._per_fleet[fleet_id] = left_held
            else:
                self._per_fleet.pop(fleet_id, None)
