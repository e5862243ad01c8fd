"""The domain events of behaviour.md "Events" as typed, versioned records.

Each event class has a ``TYPE`` (the name stored in the log) and a ``SCHEMA``
version. Its fields are JSON-native values or the core's own value types
(``Measurement``, ``Policy``, ``Calibration``: named in the class's ``VALUES``).
``to_data()`` gives the JSON object stored in the event's ``data`` column (with
``"v": SCHEMA``); ``from_data(data)`` is its inverse for every stored version: data
of an older schema is first brought up to date by the class's upcasters, one per
version (``UPCASTERS[n]`` turns version ``n`` data into version ``n + 1``: the
``upcast_vN_vN+1`` functions below). Unknown fields from newer writers are
ignored, so old readers keep working.

The read side decodes stored rows in one place (``tracker.store.recorded.decode``,
re-exported by ``tracker.queries``); inside the core, the projector folds them
with :func:`event_from_data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from tracker.core.anchor import Anchor, RequestShape
from tracker.core.calibration import Calibration
from tracker.core.model import Action, Measurement, Pressure, Trigger, built, recorded_measurement
from tracker.core.policy import Policy
from tracker.errors import InvalidInput, TrackerError

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class DomainEvent:
    TYPE: ClassVar[str] = ""
    SCHEMA: ClassVar[int] = 1
    #: the fields holding a value type, and how each is built from its stored data (``None`` stays None)
    VALUES: ClassVar[dict[str, Callable[[Any], Any]]] = {}
    #: ``UPCASTERS[n]``: version ``n`` data as version ``n + 1`` data (one per version before ``SCHEMA``)
    UPCASTERS: ClassVar[dict[int, Upcaster]] = {}

    def to_data(self) -> dict[str, Any]:
        # The other fields are JSON-native values, so a shallow copy and the value types' own
        # ``to_data`` are the whole conversion (``dataclasses.asdict`` deep-copies: several times slower).
        data = dict(self.__dict__)
        for name in self.VALUES:
            value = data[name]
            if value is not None:
                data[name] = value.to_data()
        data["v"] = self.SCHEMA
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> DomainEvent:
        if not isinstance(data, dict):
            raise InvalidInput(cls.TYPE, f"event data must be an object, got {type(data).__name__}")
        version = data.get("v", 1)
        while isinstance(version, int) and version < cls.SCHEMA:
            upcast = cls.UPCASTERS.get(version)
            if upcast is None:
                raise InvalidInput(f"{cls.TYPE}.v", f"no upcaster from schema version {version}")
            data, version = upcast(data), version + 1
        shape = _SHAPES.get(cls) or _shape(cls)
        for name in shape.required:
            if name not in data:
                raise InvalidInput(f"{cls.TYPE}.{name}", "missing from event data")
        # every field is then given or defaulted, and the plain fields validate nothing: fill the
        # instance's dict in one update instead of a frozen ``__init__``'s ``object.__setattr__`` per
        # field (every read of the log, and every fold, decodes each event through here)
        values = dict(shape.defaults)
        names = shape.names
        values.update({k: v for k, v in data.items() if k in names})
        for name, build in cls.VALUES.items():
            raw = values[name]
            if raw is not None:
                try:
                    values[name] = build(raw)
                except TrackerError as exc:
                    raise InvalidInput(f"{cls.TYPE}.{name}", exc.message) from None
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
    VALUES: ClassVar[dict[str, Callable[[Any], Any]]] = {"policy": Policy.from_data}
    policy: Policy
    at: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """What one measurement decided and on what levels: ``ContextMeasured`` records these fields and
    the ``observe`` answer (:class:`tracker.core.outcome.Decision`) carries them (as ``AttemptTerms``
    serves ``CompactionStarted`` and the state's open attempt)."""

    action: Action
    pressure: Pressure
    pressure_before: Pressure
    occupancy_bp: int
    threshold_bp: int
    threshold_source: str
    compact_level: int
    rearm_level: int
    hard_level: int
    growth_fired: bool
    trigger: Trigger | None  # threshold | hard_limit | growth (action compact), else None


def upcast_v1_v2(data: dict[str, Any]) -> dict[str, Any]:
    """A ``ContextMeasured`` recorded before calibration (schema 1) as schema 2: it decided on the
    counter's raw count against the measurement's limit, uncalibrated, with no rejection known."""
    m = data.get("measurement")
    m = m if isinstance(m, dict) else {}
    return {
        "trigger": None,  # written only when set by the first writers
        **data,
        "input_tokens": m.get("input_tokens"),
        "input_limit": m.get("input_limit"),
        "calibration": None,
        "rejected": False,
        "v": 2,
    }


def upcast_v2_v3(data: dict[str, Any]) -> dict[str, Any]:
    """A ``ContextMeasured`` recorded before anchoring (schema 2) as schema 3: no request shape was
    known, so it was not anchored."""
    return {**data, "shape": None, "anchor": None, "v": 3}


@dataclass(frozen=True)
class ContextMeasured(DomainEvent, Verdict):
    TYPE: ClassVar[str] = "ContextMeasured"
    # 2: input_tokens, input_limit, calibration, rejected (upcast_v1_v2); 3: shape, anchor (upcast_v2_v3)
    SCHEMA: ClassVar[int] = 3
    VALUES: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "measurement": recorded_measurement,
        "calibration": Calibration.from_data,
        "shape": RequestShape.from_data,
        "anchor": Anchor.from_data,
    }
    UPCASTERS: ClassVar[dict[int, Upcaster]] = {1: upcast_v1_v2, 2: upcast_v2_v3}
    measurement: Measurement
    at: float = 0.0
    # the per-request inputs as given (compaction_threshold, scope, scope_confidence, overhead_tokens),
    # kept so replay and what-if can re-decide exactly
    inputs: dict[str, Any] | None = None
    # what the decision used beside the measurement (schema 2; a schema 1 event is upcast with the
    # raw count and the measurement's limit): the count decided on (the counter's
    # ``measurement.input_tokens`` corrected by ``calibration``), the input limit (the measurement's,
    # or a lower one learned from a provider rejection), the calibration applied (None: uncorrected)
    # and whether the basis was rejected by the provider
    input_tokens: int | None = None
    input_limit: int | None = None
    calibration: Calibration | None = None
    rejected: bool = False
    # schema 3: the counted request's shape (its messages, their digests: from the counting layer;
    # None when the count came without one) and, when the decision was anchored on the session's
    # billed count of a prefix of this request, what it rested on (then ``calibration`` is None and
    # ``input_tokens`` is ``anchor.billed + anchor.estimated_delta``)
    shape: RequestShape | None = None
    anchor: Anchor | None = None

    @property
    def decided_tokens(self) -> int:
        """The count this measurement was decided on (the raw count when none is recorded)."""
        return self.measurement.input_tokens if self.input_tokens is None else self.input_tokens

    @property
    def decided_limit(self) -> int:
        """The input limit this measurement was decided against."""
        return self.measurement.input_limit if self.input_limit is None else self.input_limit


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


def upcast_usage_v1_v2(data: dict[str, Any]) -> dict[str, Any]:
    """A ``UsageReported`` recorded before anchoring (schema 1) as schema 2: its request's shape was
    not known (it anchors nothing) and its decision was not anchored."""
    return {**data, "messages": None, "chain": None, "content": None, "anchored": False, "decided_tokens": None, "v": 2}


@dataclass(frozen=True)
class UsageReported(DomainEvent):
    """What the provider billed for the request of ``basis`` (its response's usage).

    ``model``, ``quality`` and ``counted_tokens`` are the measurement's (the last one of that basis:
    the request that was sent), so the pair (counted, billed) is a calibration sample on its own.
    ``messages`` / ``chain`` / ``content`` (schema 2): that request's shape, when its count came
    with one (the report then anchors the session's next decisions, and calibrates its kind of
    content as well as its model); ``anchored``: whether that measurement was
    decided anchored; ``decided_tokens``: the count it was decided on (with a shape only), so
    the log shows decided against billed per turn."""

    TYPE: ClassVar[str] = "UsageReported"
    SCHEMA: ClassVar[int] = 2
    UPCASTERS: ClassVar[dict[int, Upcaster]] = {1: upcast_usage_v1_v2}
    basis: str
    model: str
    quality: str
    counted_tokens: int
    input_tokens: int
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    at: float = 0.0
    messages: int | None = None
    chain: str | None = None
    content: str | None = None
    anchored: bool = False
    decided_tokens: int | None = None

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


@dataclass(frozen=True)
class SessionArchived(DomainEvent):
    """The session's events ``1 .. final_version`` were moved to a verified archive segment
    (``tracker archive``, docs/operations.md "Retention"): the live log keeps only this record, at
    version ``final_version + 1``, chained to the archived head. Folding it gives a fresh state at
    that version that names where the events went (``SessionState.archived``); ``tracker restore``
    puts the events back and removes this record.

    ``digest``: sha256 of the canonical JSON of the state folded from the archived events;
    ``chain_head``: the hex hash of the event at ``final_version``; ``segment``: the Parquet file in
    the archive directory ``archive``; ``events``: how many events it holds of this session."""

    TYPE: ClassVar[str] = "SessionArchived"
    final_version: int
    digest: str
    chain_head: str
    segment: str
    archive: str
    events: int


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
        SessionArchived,
    )
}

#: the events a provider's own numbers arrive in: calibration (``tracker.core.calibration``) folds these
PROVIDER_REPORTS: tuple[str, ...] = (ProviderRejected.TYPE, UsageReported.TYPE)


#: the shape of each event class, worked out once (a constant of the module, like ``EVENT_TYPES``)
_SHAPES: dict[type[DomainEvent], _Shape] = {cls: _shape(cls) for cls in EVENT_TYPES.values()}


def event_from_data(type_: str, data: dict[str, Any]) -> DomainEvent:
    """The core's own decoding of a stored event (the projector's fold); the read side's is
    ``tracker.store.recorded.decode``. ``InvalidInput`` naming the field for data it cannot hold."""
    cls = EVENT_TYPES.get(type_)
    if cls is None:
        raise InvalidInput("type", f"unknown event type {type_!r}")
    return cls.from_data(data)
