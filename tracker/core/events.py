"""The domain events of behaviour.md "Events" as typed, versioned records.

Each event class has a ``TYPE`` (the name stored in the log) and a ``SCHEMA``
version. ``to_data()`` gives the JSON object stored in the event's ``data``
column (with ``"v": SCHEMA``); ``event_from_data(type, data)`` turns a stored
event back into its class, upcasting older schema versions when there are any.
Unknown fields from newer writers are ignored, so old readers keep working.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from tracker.core.model import Action, Pressure, Trigger, built
from tracker.errors import InvalidInput


@dataclass(frozen=True)
class DomainEvent:
    TYPE: ClassVar[str] = ""
    SCHEMA: ClassVar[int] = 1

    def to_data(self) -> dict[str, Any]:
        # The fields are JSON-native values (no nested dataclasses), so a shallow copy is the
        # whole conversion (``dataclasses.asdict`` deep-copies: several times slower).
        data = dict(self.__dict__)
        data["v"] = self.SCHEMA
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> DomainEvent:
        shape = _SHAPES.get(cls) or _shape(cls)
        for name in shape.required:
            if name not in data:
                raise InvalidInput(f"{cls.TYPE}.{name}", "missing from event data")
        # every field is then given or defaulted, and the fields validate nothing: fill the instance's
        # dict in one update instead of a frozen ``__init__``'s ``object.__setattr__`` per field
        # (every read of the log, and every fold, decodes each event through here)
        values = dict(shape.defaults)
        names = shape.names
        values.update({k: v for k, v in data.items() if k in names})
        return built(cls, values)


@dataclass(frozen=True)
class _Shape:
    """An event class's fields: their names, the ones without a default, and the defaults."""

    names: frozenset[str]
    required: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]


def _shape(cls: type[DomainEvent]) -> _Shape:
    fs = fields(cls)
    if any(f.default_factory is not MISSING for f in fs):
        raise TypeError(f"{cls.__name__}: event fields take plain defaults (from_data fills them as given)")
    return _Shape(
        names=frozenset(f.name for f in fs),
        required=tuple(f.name for f in fs if f.default is MISSING),
        defaults=tuple((f.name, f.default) for f in fs if f.default is not MISSING),
    )


@dataclass(frozen=True)
class SessionStarted(DomainEvent):
    TYPE: ClassVar[str] = "SessionStarted"
    policy: dict[str, Any]
    at: float = 0.0


@dataclass(frozen=True)
class ContextMeasured(DomainEvent):
    TYPE: ClassVar[str] = "ContextMeasured"
    SCHEMA: ClassVar[int] = 2  # 2: input_tokens, input_limit, calibration, rejected (version 1 folds as uncalibrated)
    measurement: dict[str, Any]
    occupancy_bp: int
    pressure_before: Pressure
    pressure: Pressure
    threshold_bp: int
    threshold_source: str
    compact_level: int
    rearm_level: int
    hard_level: int
    growth_fired: bool
    action: Action
    trigger: Trigger | None = None
    at: float = 0.0
    # the per-request inputs as given (compaction_threshold, scope, scope_confidence, overhead_tokens),
    # kept so replay and what-if can re-decide exactly
    inputs: dict[str, Any] | None = None
    # what the decision used beside the measurement (schema 2; None in events written before):
    # the count decided on (the counter's ``measurement.input_tokens`` corrected by ``calibration``),
    # the input limit (the measurement's, or a lower one learned from a provider rejection), the
    # calibration applied (``Calibration.to_data()``) and whether the basis was rejected by the provider
    input_tokens: int | None = None
    input_limit: int | None = None
    calibration: dict[str, Any] | None = None
    rejected: bool = False

    @property
    def decided_tokens(self) -> int:
        """The count this measurement was decided on (the raw count in events without calibration)."""
        return self.measurement["input_tokens"] if self.input_tokens is None else self.input_tokens

    @property
    def decided_limit(self) -> int:
        """The input limit this measurement was decided against."""
        return self.measurement["input_limit"] if self.input_limit is None else self.input_limit


@dataclass(frozen=True)
class CountFailed(DomainEvent):
    TYPE: ClassVar[str] = "CountFailed"
    kind: str
    model: str
    detail: str
    duration_ms: int
    basis: str | None = None
    at: float = 0.0


@dataclass(frozen=True)
class MeasurementRefused(DomainEvent):
    """A measurement refused before deciding (today: a stale basis)."""

    TYPE: ClassVar[str] = "MeasurementRefused"
    kind: str
    basis: str
    current_revision: int
    at: float = 0.0


@dataclass(frozen=True)
class AttemptTerms:
    """What a compaction attempt is opened on: ``CompactionStarted`` records these fields, and the
    session state's ``Attempt`` (:mod:`tracker.core.state`) holds them while the attempt is open."""

    attempt_id: str
    reason: str  # automatic | manual
    trigger: str  # threshold | hard_limit | growth | manual
    basis: str
    fencing_token: int
    opened_at: float
    lease_expires_at: float
    tokens_before: int | None
    input_limit: int | None
    history_budget: int | None


@dataclass(frozen=True)
class CompactionStarted(DomainEvent, AttemptTerms):
    TYPE: ClassVar[str] = "CompactionStarted"


@dataclass(frozen=True)
class CompactionCommitted(DomainEvent):
    TYPE: ClassVar[str] = "CompactionCommitted"
    attempt_id: str
    reason: str
    basis: str
    new_revision: int
    tokens_before: int | None
    tokens_after: int
    duration_ms: int
    at: float = 0.0


@dataclass(frozen=True)
class CompactionRejected(DomainEvent):
    TYPE: ClassVar[str] = "CompactionRejected"
    attempt_id: str
    reason: str
    basis: str
    reject_reason: str
    duration_ms: int
    at: float = 0.0


@dataclass(frozen=True)
class ContextLimitReached(DomainEvent):
    TYPE: ClassVar[str] = "ContextLimitReached"
    basis: str
    input_tokens: int
    input_limit: int
    at: float = 0.0


@dataclass(frozen=True)
class UsageReported(DomainEvent):
    """What the provider billed for the request of ``basis`` (its response's usage).

    ``model``, ``quality`` and ``counted_tokens`` are the measurement's (the last one of that basis:
    the request that was sent), so the pair (counted, billed) is a calibration sample on its own."""

    TYPE: ClassVar[str] = "UsageReported"
    basis: str
    model: str
    quality: str
    counted_tokens: int
    input_tokens: int
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    at: float = 0.0

    @property
    def billed_tokens(self) -> int:
        """Input tokens billed in all: uncached + cache read + cache write."""
        return self.input_tokens + (self.cache_read_tokens or 0) + (self.cache_write_tokens or 0)


@dataclass(frozen=True)
class ProviderRejected(DomainEvent):
    """The provider refused the request of ``basis`` as too long for the model's context.

    ``input_tokens`` / ``input_limit``: the provider's numbers (from its message, or given), None
    where unknown; ``learned_limit``: the input limit learned from them when lower than the
    measurement's (None: nothing learned); ``form``/``provider``: the wording recognised in
    ``message`` (None: not recognised, or no message)."""

    TYPE: ClassVar[str] = "ProviderRejected"
    basis: str
    model: str
    quality: str
    counted_tokens: int
    measured_limit: int
    input_tokens: int | None = None
    input_limit: int | None = None
    learned_limit: int | None = None
    provider: str | None = None
    form: str | None = None
    message: str | None = None
    at: float = 0.0


EVENT_TYPES: dict[str, type[DomainEvent]] = {
    cls.TYPE: cls
    for cls in (
        SessionStarted,
        ContextMeasured,
        CountFailed,
        MeasurementRefused,
        CompactionStarted,
        CompactionCommitted,
        CompactionRejected,
        ContextLimitReached,
        UsageReported,
        ProviderRejected,
    )
}

#: the events a provider's own numbers arrive in: calibration (``tracker.core.calibration``) folds these
PROVIDER_REPORTS: tuple[str, ...] = (ProviderRejected.TYPE, UsageReported.TYPE)


#: the shape of each event class, worked out once (a constant of the module, like ``EVENT_TYPES``)
_SHAPES: dict[type[DomainEvent], _Shape] = {cls: _shape(cls) for cls in EVENT_TYPES.values()}


def event_from_data(type_: str, data: dict[str, Any]) -> DomainEvent:
    cls = EVENT_TYPES.get(type_)
    if cls is None:
        raise InvalidInput("type", f"unknown event type {type_!r}")
    return cls.from_data(data)
