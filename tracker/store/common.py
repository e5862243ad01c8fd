"""What the two ``EventStore`` implementations share: the entries that check input, and folding from the log.

``tracker.store.sql.SqlEventStore`` and ``tracker.store.memory.MemoryEventStore`` both check an
append's (and a feed read's) input the same way before anything is written or read
(``tracker.store.validate``), and both fold a session's state from their own ``read_stream``;
``LogStore`` does that once, and each store writes a checked append (``CheckedAppend``) and reads
the checked feed its own way (``_append``, ``_read_all``, ``_stream_version``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Self

from tracker.errors import InvalidInput
from tracker.store import validate
from tracker.store.base import AppendResult, NewEvent, Projector, StoredEvent, fold_events, row_columns
from tracker.store.chain import canonical_data, canonical_event

__all__ = ["FOLD_BATCH", "CheckedAppend", "LogStore"]

#: events folded per ``fold_events`` call while a stream is folded
FOLD_BATCH = 2000


@dataclass(frozen=True, slots=True)
class CheckedAppend:
    """An append whose input passed ``validate.check_append``: the events' types, JSON texts and
    (when parsed) data as a reader will get it back, in order."""

    session_id: str
    expected: int
    types: list[str]
    texts: list[str]
    datas: list[dict[str, Any]]
    key: str | None
    projected: dict[str, Any] | None

    def canonical_texts(self) -> list[str]:
        """Each event's canonical text (``tracker.store.chain``), at the versions this append writes
        (from the data texts ``validate.check_append`` wrote with ``chain.canonical_json``)."""
        sid, first = self.session_id, self.expected + 1
        return [
            canonical_event(sid, first + i, t, canonical_data(text))
            for i, (t, text) in enumerate(zip(self.types, self.texts, strict=True))
        ]

    def stored(self, positions: Sequence[int], recorded_at: datetime) -> list[StoredEvent]:
        """The events as a projector sees them once written at ``positions`` (the key on the first)."""
        first, key = self.expected + 1, self.key
        return [
            StoredEvent(
                pos, self.session_id, first + i, self.types[i], self.datas[i], recorded_at, key if i == 0 else None
            )
            for i, pos in enumerate(positions)
        ]

    def projection(
        self, proj: Projector, base: Callable[[], dict[str, Any]], positions: Sequence[int], recorded_at: datetime
    ) -> tuple[dict[str, Any], str, tuple[Any, Any, Any, int]]:
        """The session's projection after this append -- ``projected`` when the caller gave it, else
        ``base()`` (the state at ``expected``) folded with these events -- with its JSON and listing columns."""
        if self.projected is not None:
            state = self.projected
        else:
            state = fold_events(proj, base(), self.stored(positions, recorded_at))
        return state, validate.dumps(state), row_columns(proj, state)


class LogStore(ABC):
    """The shared part of an ``EventStore``: ``append`` (checked, then ``_append``), ``fold_stream``,
    and use as a context manager (``close`` on leaving). The methods' contracts: ``EventStore``."""

    projector: Projector | None
    max_event_bytes: int

    def append(
        self,
        session_id: str,
        expected_version: int,
        events: Sequence[NewEvent],
        *,
        idempotency_key: str | None = None,
        projected: dict[str, Any] | None = None,
    ) -> AppendResult:
        """``EventStore.append``: bad input raises its typed error and writes nothing."""
        types, texts, datas = validate.check_append(
            session_id, expected_version, events, idempotency_key, self.max_event_bytes, self._parses(projected)
        )
        return self._append(
            CheckedAppend(session_id, expected_version, types, texts, datas, idempotency_key, projected)
        )

    def _parses(self, projected: dict[str, Any] | None) -> bool:
        """Whether this append needs the events' data parsed (``check_append``'s ``parse``): yes, unless
        a store says it writes the JSON texts and will fold nothing."""
        return True

    @abstractmethod
    def _append(self, append: CheckedAppend) -> AppendResult: ...

    @abstractmethod
    def read_stream(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[StoredEvent]: ...

    def read_all(
        self,
        after_position: int = 0,
        limit: int = 1000,
        *,
        session_prefix: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        """``EventStore.read_all``: bad input raises its typed error before anything is read."""
        kinds = validate.check_read_all(after_position, limit, session_prefix, types)
        return self._read_all(after_position, limit, session_prefix, kinds)

    @abstractmethod
    def _read_all(
        self, after_position: int, limit: int, session_prefix: str | None, kinds: tuple[str, ...] | None
    ) -> list[StoredEvent]:
        """Checked ``read_all``: ``kinds`` is None (every type) or the checked type names."""

    def stream_version(self, session_id: str) -> int:
        validate.check_session_id(session_id)
        return self._stream_version(session_id)

    @abstractmethod
    def _stream_version(self, session_id: str) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    def fold_stream(
        self, session_id: str, to_version: int | None = None, projector: Projector | None = None
    ) -> tuple[dict[str, Any], int]:
        """``EventStore.fold_stream``, streamed: ``FOLD_BATCH`` events folded at a time."""
        proj = projector or self.projector
        if proj is None:
            raise InvalidInput("projector", "folding needs a projector")
        state = proj.initial(session_id)
        version = 0
        batch: list[StoredEvent] = []
        for ev in self.read_stream(session_id, 1, to_version):
            batch.append(ev)
            version = ev.version
            if len(batch) >= FOLD_BATCH:
                state = fold_events(proj, state, batch)
                batch = []
        if batch:
            state = fold_events(proj, state, batch)
        return state, version

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
