"""Calibration for live decisions: the log's provider reports, folded and kept up to date.

``CalibrationBook`` holds a :class:`~tracker.core.ledger.CalibrationLedger` folded from the store's
``UsageReported`` and ``ProviderRejected`` events (``read_all(types=PROVIDER_REPORTS)``, served
by a partial index of just those events) and catches up with the log at most every
``refresh_s`` seconds, and at once after this process recorded a report itself. So every process
of a fleet, on any machine, converges on the same ledger: the fold of the same log.

A decision uses what the book knows at that moment and records it (the factor and its samples,
the limit) in its ``ContextMeasured``: a process that is a few seconds behind decides with a
slightly older calibration, and replay still reproduces its decision exactly from the record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from tracker._lru import LRU
from tracker.core.calibration import Calibration
from tracker.core.events import PROVIDER_REPORTS, DomainEvent
from tracker.core.ledger import CalibrationLedger, ModelSummary
from tracker.core.model import SessionScope
from tracker.store.base import EventStore, StoredEvent
from tracker.store.decoding import event_of

__all__ = ["CalibrationBook", "ledger_of", "provider_reports"]

BATCH = 1000
#: how many recently folded reports a book remembers (a report it recorded itself is folded at once;
#: the catch-up must not fold it again when the log's safe horizon reaches it)
FOLDED_KEPT = 100_000


def ledger_of(store: EventStore, *, scope: SessionScope = SessionScope()) -> CalibrationLedger:
    """The ledger folded from the whole log (``tracker calibration``) of the scope's sessions (by
    default every fleet's)."""
    ledger = CalibrationLedger()
    _catch_up(store, ledger, 0, scope.stored_prefix())
    return ledger


def provider_reports(store: EventStore, *, scope: SessionScope = SessionScope()) -> Iterator[StoredEvent]:
    """The provider reports of the scope's sessions in global order, read in batches (the what-if's
    ``reports``)."""
    position = 0
    prefix = scope.stored_prefix()
    while True:
        batch = store.read_all(position, BATCH, session_prefix=prefix, types=PROVIDER_REPORTS)
        yield from batch
        if len(batch) < BATCH:
            return
        position = batch[-1].position


def _catch_up(
    store: EventStore,
    ledger: CalibrationLedger,
    position: int,
    prefix: str | None = None,
    folded: LRU[tuple[str, int], bool] | None = None,
) -> int:
    while True:
        batch = store.read_all(position, BATCH, session_prefix=prefix, types=PROVIDER_REPORTS)
        for e in batch:
            if folded is not None:
                key = (e.session_id, e.version)
                if folded.get(key):  # folded already, when this process recorded it
                    continue
                folded.put(key, True)
            ledger.fold(SessionScope.fleet_of(e.session_id), event_of(e), e.session_id)
        if batch:
            position = batch[-1].position
        if len(batch) < BATCH:
            return position


class CalibrationBook:
    """The ledger one process decides with (thread-safe). ``enabled=False``: no correction factors
    (learned limits from rejections still apply: they are facts about the provider, not estimates)."""

    def __init__(
        self,
        store: EventStore,
        *,
        enabled: bool = True,
        refresh_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ledger = CalibrationLedger()
        self._position = 0
        self._read_at: float | None = None
        #: the reports folded lately, by (session, version): each is folded once, whichever way came first
        self._folded: LRU[tuple[str, int], bool] = LRU(FOLDED_KEPT)

    def stale(self) -> None:
        """Read the log again before the next decision."""
        self._read_at = None

    def note(self, session_id: str, version: int, event: DomainEvent) -> None:
        """This process recorded a report (the event at ``version`` of ``session_id``): fold it now.

        The log's commit-safe reads (``read_all``) show an event only once every transaction open
        when it committed has ended, anywhere in the database; a process's own report need not wait
        for that. The catch-up skips it when it gets there. (An idempotent retry answered from the
        record is noted again: it is skipped if already folded.)"""
        key = (session_id, version)
        with self._lock:
            if self._folded.get(key):
                return
            self._folded.put(key, True)
            self._ledger.fold(SessionScope.fleet_of(session_id), event, session_id)

    def refresh(self, *, force: bool = False) -> None:
        now = self._clock()
        if not force and self._read_at is not None and now - self._read_at < self.refresh_s:
            return
        with self._lock:
            if not force and self._read_at is not None and now - self._read_at < self.refresh_s:
                return
            self._position = _catch_up(self.store, self._ledger, self._position, folded=self._folded)
            self._read_at = now

    def for_decision(
        self, session_id: str, model: str, quality: str, content: str | None = None
    ) -> tuple[Calibration | None, int | None]:
        """(calibration, learned limit) for a measurement of ``model`` with ``quality`` (of the kind of
        content ``content``, when known) in ``session_id``'s fleet."""
        self.refresh()
        fleet = SessionScope.fleet_of(session_id)
        with self._lock:
            calibration = self._ledger.calibration(fleet, model, quality, content) if self.enabled else None
            return calibration, self._ledger.learned_limit(fleet, model)

    def summaries(self, fleet: str | None = None) -> list[ModelSummary]:
        self.refresh(force=True)
        with self._lock:
            return self._ledger.summaries(fleet)
