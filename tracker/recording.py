"""How the service records a decision on a session: load → decide → append, re-decided on a lost race.

The first try decides on the state this process last recorded, without a lock (the store's
version check is the guard), so an uncontended session costs no coordination round trip at all.
A ``ConcurrencyConflict`` means another process appended first: re-decide (the decision is
deterministic in the state, so the retry sees that process's attempt and does not open another).
After a lost race, and for as long as others keep writing the session (``CONTENDED_S``), this
process decides under the coordinator's session lock, on the state read under it: contenders
queue up (handed the lock by a wake-up, not by polling) instead of appending on stale states, and
only one automatic attempt per basis is ever started. A retried call (same idempotency key) gets
its original answer, not a new decision (``tracker.idempotent``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from tracker._lru import LRU
from tracker.coordination import Coordinator
from tracker.core import Outcome, SessionState
from tracker.core.events import CompactionCommitted, CompactionRejected
from tracker.errors import ArchivedSession, ConcurrencyConflict, IntegrityError, TrackerError
from tracker.hooks import Hooks
from tracker.idempotent import answer_from, recorded_answer
from tracker.store.base import AppendResult, EventStore, NewEvent

CONFLICT_RETRY_S = 30.0
STATE_CACHE_SIZE = 10_000  # sessions whose last recorded state this process keeps
CONTENDED_S = 1.0  # after a lost race, decide under the session lock for this long (renewed while contended)
_UNLOCKED = nullcontext(False)  # (reusable: a nullcontext keeps no state between uses)


class SessionWriter:
    """Records decisions on sessions of one store: the state cache, contention, the lock and the retries."""

    def __init__(self, store: EventStore, coordinator: Coordinator, hooks: Hooks) -> None:
        self.store = store
        self.coordinator = coordinator
        self.hooks = hooks
        self._phase = hooks.phase
        self._states: LRU[str, SessionState] = LRU(STATE_CACHE_SIZE)
        #: session -> when this process last saw it contended (see ``record``)
        self._contended: LRU[str, float] = LRU(STATE_CACHE_SIZE)

    def load(self, session_id: str) -> SessionState:
        """The session's recorded state (its projection, checked against the stream's version)."""
        data, version = self.store.load(session_id)
        if data is None:
            return SessionState(session_id=session_id)
        state = SessionState.from_data(data)
        if state.version != version:
            raise IntegrityError(
                f"session {session_id}: projection is at version {state.version} but the stream at {version}; "
                "run `tracker verify`",
                session_id=session_id,
            )
        if state.archived is not None:
            raise archived_error(session_id, state.archived)
        return state

    def known(self, session_id: str) -> SessionState:
        """This process's last recorded state of the session, else the recorded one (never trusted for a decision)."""
        return self._states.get(session_id) or self.load(session_id)

    def record(
        self,
        session_id: str,
        decide: Callable[[SessionState], Outcome],
        idempotency_key: str | None = None,
        op: str = "observe",
        looked_up: bool = False,
    ) -> tuple[Outcome, int]:
        """Load → decide → append; on a version conflict, decide again on the state that won.

        ``looked_up``: the caller has just looked for a call recorded under ``idempotency_key``
        and found none (observe does, before counting): not looked for again here, since an
        append under a key a racing call took in between is answered by the store as a replay.

        The first try decides on the state this process last recorded, without a lock (the
        store's version check guards it). A refusal or a no-op decided on that cached state is
        confirmed on the record; a lost race (or a session still contended) is decided under the
        coordinator's lock on the state read under it, backing off with full jitter while it
        keeps conflicting (coordination degraded, or a lock wait timed out).
        """
        if idempotency_key is not None and not looked_up:
            # A retried call (commit, reject, manual, observe) gets its original answer, not a new decision.
            replay = recorded_answer(self.store, session_id, idempotency_key, op, decide)
            if replay is not None:
                return replay
        deadline = time.monotonic() + CONFLICT_RETRY_S
        locked = self._is_contended(session_id)
        cached = None if locked else self._states.get(session_id)  # never trusted alone (see above)
        tries = 0
        while True:
            lock = self.coordinator.session_lock(session_id) if locked else _UNLOCKED
            with self._phase("coordination"), lock:
                state = cached if cached is not None else self._load_noting_contention(session_id, locked)
                try:
                    with self._phase("decide"):
                        outcome = decide(state)
                except TrackerError:
                    if cached is None:
                        raise
                    cached = None  # refused on a cached state (a revision it has not seen?): ask the record
                    continue
                if not outcome.events:
                    if cached is None:
                        return outcome, state.version
                    cached = None  # nothing to append, so no version check: confirm on the record
                    continue
                result = self._append(session_id, state, outcome, idempotency_key)
            if result is not None:
                if result.replayed:  # the same key, appended by a racing call: its answer
                    return answer_from(self.store, session_id, result, op, decide), result.last_version
                self.hooks.after_record(op, session_id, outcome)
                if any(isinstance(e, (CompactionCommitted, CompactionRejected)) for e in outcome.events):
                    self.coordinator.attempt_ended(session_id)  # wakes long-polls (a hint; they re-read)
                return outcome, result.last_version
            self._contended.put(session_id, time.monotonic())
            if locked:  # conflicting under the lock: back off
                tries += 1
                if time.monotonic() >= deadline:
                    raise ConcurrencyConflict(
                        f"still conflicting after {tries} tries in {CONFLICT_RETRY_S:.0f}s",
                        session_id=session_id,
                    )
                time.sleep(random.uniform(0, min(0.1, 0.002 * 2 ** min(tries, 10))))
            locked, cached = True, None  # (a lost optimistic race is re-decided at once, under the lock)

    def _load_noting_contention(self, session_id: str, locked: bool) -> SessionState:
        """The recorded state; under the lock, the session stays contended while others append
        between this process's own appends (the state read is not the one it last recorded)."""
        if not locked:
            return self.load(session_id)
        mine = self._states.get(session_id)
        state = self.load(session_id)
        if mine is not None and mine.version == state.version:
            self._contended.pop(session_id)
        else:
            self._contended.put(session_id, time.monotonic())
        return state

    def _append(
        self, session_id: str, state: SessionState, outcome: Outcome, idempotency_key: str | None
    ) -> AppendResult | None:
        """Append ``outcome``'s events at ``state``'s version; None on a version conflict. The
        state cache follows: the new state when appended, nothing when in doubt."""
        try:
            with self._phase("append"):
                result = self.store.append(
                    session_id,
                    state.version,
                    [_new_event(e) for e in outcome.events],
                    idempotency_key=idempotency_key,
                    projected=outcome.state.to_data(),
                )
        except ConcurrencyConflict:
            self._states.pop(session_id)
            return None
        except BaseException:
            self._states.pop(session_id)
            raise
        if result.replayed:
            self._states.pop(session_id)
        else:
            self._states.put(session_id, outcome.state)
        return result

    def _is_contended(self, session_id: str) -> bool:
        """Whether this process lost a race on the session within the last ``CONTENDED_S`` seconds
        (renewed while it keeps finding that others appended since its own last append)."""
        since = self._contended.get(session_id)
        if since is None:
            return False
        if time.monotonic() - since < CONTENDED_S:
            return True
        self._contended.pop(session_id)
        return False


def _new_event(e: Any) -> NewEvent:
    return NewEvent(type=e.TYPE, data=e.to_data())


def archived_error(session_id: str, archived: dict[str, Any]) -> ArchivedSession:
    """The typed refusal of a command on an archived session, saying how to bring it back."""
    where = archived.get("archive", "")
    return ArchivedSession(
        f"session {session_id} is archived (versions 1-{archived.get('final_version')} in "
        f"{where}/{archived.get('segment')}); run `tracker restore {where} --session {session_id}` first",
        session_id=session_id,
        archive=where,
        segment=archived.get("segment"),
    )
