"""The one decoder: stored rows as the core's typed events (``tracker.core.events``).

Every reader outside the core -- the read side (``tracker.queries`` re-exports these), the audit
pages, replay, the calibration ledger, the idempotent answers, ``verify`` -- turns a stored row
into its event here, so a row decodes one way everywhere: as the core's class, upcast from the
schema version it was written in (``DomainEvent.from_data``), its value types built
(``Measurement``, ``Policy``, ``Calibration``). The only list of event types is the core's
``EVENT_TYPES``.

A row the core cannot hold (another writer's type, or data its class refuses) decodes as
:class:`Unrecognised` (the read side shows it as it is and folds nothing from it); what a fold
needs, :func:`event_of` / :func:`events_of`, raises the core's ``InvalidInput`` naming the field
instead::

    match decode(stored).event:
        case CompactionRejected(reject_reason=why): ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from tracker.core.events import EVENT_TYPES, DomainEvent
from tracker.errors import InvalidInput
from tracker.store.base import StoredEvent

__all__ = ["Recorded", "Unrecognised", "decode", "decode_all", "event_of", "events_of", "type_names"]


@dataclass(frozen=True)
class Unrecognised:
    """A stored event that is none of the core's events (another writer's type, or data its class
    cannot be built from): the read side shows it as it is and folds nothing from it."""

    type: str
    data: dict[str, Any]
    problem: str


class Recorded(NamedTuple):
    """One stored event, decoded: the core's typed event (``event``) and where the log keeps it.

    Readers match on the event's class and read its attributes::

        match decode(stored).event:
            case CompactionCommitted(tokens_after=after): ...
    """

    event: DomainEvent | Unrecognised
    version: int
    recorded_at: datetime
    position: int
    session_id: str
    idempotency_key: str | None

    @property
    def type(self) -> str:
        """The name the log stores (the class's ``TYPE``)."""
        e = self.event
        return e.type if isinstance(e, Unrecognised) else e.TYPE


def event_of(stored: StoredEvent) -> DomainEvent:
    """A stored row as the core's event class; ``InvalidInput`` naming the field for a row of another
    type or one its class refuses."""
    cls = EVENT_TYPES.get(stored.type)
    if cls is None:
        raise InvalidInput("type", f"unknown event type {stored.type!r}")
    try:
        return cls.from_data(stored.data)
    except TypeError as exc:
        raise InvalidInput(stored.type, str(exc)) from None


def decode(stored: StoredEvent) -> Recorded:
    """A stored row as the core's event class (:func:`event_of`); a row of any other type, or one
    its class refuses, as ``Unrecognised``."""
    event: DomainEvent | Unrecognised
    try:
        event = event_of(stored)
    except InvalidInput as exc:
        event = Unrecognised(stored.type, stored.data, str(exc))
    return Recorded(
        event,
        stored.version,
        stored.recorded_at,
        stored.position,
        stored.session_id,
        stored.idempotency_key,
    )


def decode_all(stored: Iterable[StoredEvent]) -> Iterator[Recorded]:
    """:func:`decode` over a stream (lazily: constant memory on very long sessions)."""
    return map(decode, stored)


def events_of(stored: Iterable[StoredEvent]) -> Iterator[DomainEvent]:
    """The stream's events, strictly decoded (what a fold takes): ``InvalidInput`` at a row the core
    cannot hold."""
    return map(event_of, stored)


def type_names(*classes: type[DomainEvent]) -> tuple[str, ...]:
    """The stored type names of event classes (for the store's by-type reads)."""
    return tuple(cls.TYPE for cls in classes)
