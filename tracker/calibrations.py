"""Calibration for live decisions: the log's provider reports, folded and kept up to date.

``CalibrationBook`` holds a :class:`~tracker.core.ledger.CalibrationLedger` folded from the store's
``UsageReported`` and ``ProviderRejected`` events (``read_all(types=PROVIDER_REPORTS)``, served
by a partial index of just those events). A decision never reads the log: the book is loaded once
(:meth:`CalibrationBook.start`, on the first decision of a process unless started before), then a
background thread catches up with the log every ``refresh_s`` seconds, and a report this process
records itself is folded at once (:meth:`CalibrationBook.note`). So every process of a fleet, on
any machine, converges on the same ledger: the fold of the same log.

A decision uses what the book knows at that moment and records it (the factor and its samples,
the limit) in its ``ContextMeasured``: a process that is a few seconds behind decides with a
slightly older calibration, and replay still reproduces its decision exactly from the record.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

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
#: the background refresh reads the log at most this often, whatever ``refresh_s`` says
MIN_REFRESH_S = 0.05

log = logging.getLogger("tracker.calibrations")


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


class _Unlocked:
    """The store as the book's catch-up reads it: the book's lock is held while the catch-up folds
    a batch and released while it reads the next one (a decision never waits on a log read)."""

    def __init__(self, store: EventStore, lock: Any) -> None:
        self._store = store
        self._lock = lock

    def read_all(self, *args: Any, **kwargs: Any) -> list[StoredEvent]:
        self._lock.release()
        try:
            return self._store.read_all(*args, **kwargs)
        finally:
            self._lock.acquire()


def _refresher(ref: weakref.ReferenceType[CalibrationBook], wake: threading.Event, stop: threading.Event) -> None:
    """The background refresh: a catch-up every ``refresh_s`` (or when woken), until the book is
    closed or gone (the thread holds no reference to it between catch-ups)."""
    failing = False
    while not stop.is_set():
        book = ref()
        if book is None:
            return
        interval = max(book.refresh_s, MIN_REFRESH_S)
        del book
        wake.wait(interval)
        wake.clear()
        book = ref()
        if book is None or stop.is_set():
            return
        try:
            book.refresh(force=True)
            failing = False
        except Exception:  # noqa: BLE001 - a failed refresh is retried next time; decisions go on
            if stop.is_set():
                return
            if not failing:  # once per run of failures
                log.warning("calibration refresh failed; decisions use the last calibration read", exc_info=True)
            failing = True
        del book


class CalibrationBook:
    """The ledger one process decides with (thread-safe). ``enabled=False``: no correction factors
    (learned limits from rejections still apply: they are facts about the provider, not estimates).

    ``start()`` loads it (one catch-up with the log, on the caller's thread) and starts the
    background refresh (a daemon thread, every ``refresh_s`` seconds); the first decision starts it
    if nothing did. ``close()`` stops the thread (``Tracker.close`` does, before the store closes);
    a book dropped without ``close()`` stops it too. A forked child restarts it on its first decision."""

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
        self._reading = threading.Lock()  # one catch-up at a time (the ledger's lock is released while it reads)
        self._loaded = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        _LIVE.add(self)

    def start(self) -> None:
        """Load the book (the first time: a catch-up with the log, on the caller's thread) and start
        the background refresh, if not running in this process yet. A closed book stays closed."""
        if self._thread is not None or self._stop.is_set():
            return
        with self._reading:
            if self._thread is not None or self._stop.is_set():
                return
            if not self._loaded:
                self._catch_up(time.monotonic())
            thread = threading.Thread(
                target=_refresher,
                args=(weakref.ref(self), self._wake, self._stop),
                name="tracker-calibration-refresh",
                daemon=True,
            )
            thread.start()
            self._thread = thread

    def close(self) -> None:
        """Stop the background refresh (the book still answers, with what it has read)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def stale(self) -> None:
        """Read the log again soon: wakes the background refresh."""
        self._read_at = None
        self._wake.set()

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
        """Catch up with the log now (``force``), or if the last catch-up is ``refresh_s`` old. On the
        caller's thread: the background refresh, ``summaries``, a test; never a decision."""
        now = self._clock()
        if not force and self._read_at is not None and now - self._read_at < self.refresh_s:
            return
        with self._reading:
            if not force and self._read_at is not None and now - self._read_at < self.refresh_s:
                return
            self._catch_up(now)

    def _catch_up(self, now: float) -> None:
        """One catch-up (``self._reading`` held): each batch folded under the ledger's lock, which
        is released while the next batch is read."""
        with self._lock:
            reader: Any = _Unlocked(self.store, self._lock)
            self._position = _catch_up(reader, self._ledger, self._position, folded=self._folded)
        self._read_at = now
        self._loaded = True

    def for_decision(
        self, session_id: str, model: str, quality: str, content: str | None = None
    ) -> tuple[Calibration | None, int | None]:
        """(calibration, learned limit) for a measurement of ``model`` with ``quality`` (of the kind of
        content ``content``, when known) in ``session_id``'s fleet. Never reads the log (but to load the
        book, on a process's first decision if nothing started it)."""
        if self._thread is None:
            self.start()
        fleet = SessionScope.fleet_of(session_id)
        with self._lock:
            calibration = self._ledger.calibration(fleet, model, quality, content) if self.enabled else None
            return calibration, self._ledger.learned_limit(fleet, model)

    def summaries(self, fleet: str | None = None) -> list[ModelSummary]:
        self.refresh(force=True)
        with self._lock:
            return self._ledger.summaries(fleet)


_LIVE: weakref.WeakSet[CalibrationBook] = weakref.WeakSet()


def _restart_in_child() -> None:
    """A forked child has none of its parent's threads: its books' locks are new, and each restarts
    its background refresh on its next decision (with the ledger read so far, not read again)."""
    for book in list(_LIVE):
        book._lock = threading.Lock()
        book._reading = threading.Lock()
        book._wake = threading.Event()
        stopped, book._stop = book._stop.is_set(), threading.Event()
        if stopped:
            book._stop.set()
        book._thread = None


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_restart_in_child)
