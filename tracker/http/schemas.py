"""The wire format: request models, response models and the limits of the HTTP API.

Requests are pydantic models of their own (they are the API's contract, strict and
``extra="forbid"``). Responses are **views** of the core's dataclasses: ``AttemptOut`` has
exactly the fields of :class:`~tracker.core.Attempt`, ``DecisionOut`` those of
:class:`~tracker.core.Decision`, ``SessionStateOut`` those of
:class:`~tracker.core.SessionState`, ``EventOut`` those of
:class:`~tracker.store.StoredEvent`. Only the fields whose JSON form differs from their
Python type (a frozenset sent as a list, a datetime as ISO text) are spelled here, so a
field added to the core shows up in the API and its OpenAPI document by itself.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from tracker.core import Attempt, Decision, Policy, SessionState, check_text
from tracker.core.commands import Commit, Observe, Reject, ReportRejection, ReportUsage, RequestCompaction
from tracker.core.events import DomainEvent, ProviderRejected, UsageReported
from tracker.core.model import FLEET_ID_LEN, JSON_SAFE_INT, MAX_SESSION_ID_LEN, Quality, SessionScope
from tracker.core.provider_errors import MAX_MESSAGE_CHARS
from tracker.core.state import LastMeasurement
from tracker.errors import InvalidInput
from tracker.store import StoredEvent

API_PREFIX = "/v1"
WAIT_MAX_S = 30.0
MAX_INTERNAL_SESSION_ID = MAX_SESSION_ID_LEN
#: 189: the longest id a fleet's caller may name ("<fleet_id>:" is added on the way in)
MAX_SESSION_ID = SessionScope("f" * FLEET_ID_LEN).max_len
SESSION_ID_PATTERN = rf"^[A-Za-z0-9._:-]{{1,{MAX_SESSION_ID}}}$"
MAX_POSITION = 2**63 - 1
MAX_VERSION = 2**31 - 1


# -- requests -----------------------------------------------------------------------------------


def _safe_text(value: str) -> str:
    """No control characters (they would reach an operator's terminal) and no lone surrogates."""
    try:
        return check_text("text", value, max_len=len(value) or 1)
    except InvalidInput as exc:
        raise ValueError(exc.problem) from None


SafeText = Annotated[str, AfterValidator(_safe_text)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRefIn(_In):
    # text checked by the service (tracker.core.check_text): in a union, pydantic's error path would name the branch
    provider: str = Field("unknown", min_length=1, max_length=100)
    name: str = Field(..., min_length=1, max_length=200)


class MeasurementIn(_In):
    """A count you made yourself (behaviour.md "Words")."""

    basis: SafeText = Field(
        ...,
        min_length=1,
        max_length=220,
        description="`r<revision>:<through>`, or a bare `through` at the current revision",
    )
    input_tokens: int = Field(..., strict=True, ge=0, le=JSON_SAFE_INT)
    input_limit: int = Field(..., strict=True, gt=0, le=JSON_SAFE_INT)
    model: ModelRefIn | str | None = Field(None, description="{provider, name} or a name")
    fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 hex of the counted request")
    quality: Quality = "exact_local"


class ObserveIn(_In):
    """Exactly one of ``measurement``, or ``request`` + ``model`` + ``basis`` (counted by the tracker)."""

    measurement: MeasurementIn | None = None
    request: dict[str, Any] | None = Field(
        None, description="the complete LLM request (system, messages, tools) to count"
    )
    model: SafeText | None = Field(
        None, min_length=1, max_length=200, description="model name from the registry (with request)"
    )
    basis: SafeText | None = Field(
        None, min_length=1, max_length=220, description="what the request covers (with request)"
    )
    # strict: a string or a boolean is not a number (an integer is)
    compaction_threshold: float | None = Field(
        None, strict=True, allow_inf_nan=False, description="per-request threshold; may only lower it"
    )
    scope: SafeText | None = Field(None, max_length=100)
    scope_confidence: float | None = Field(None, strict=True, allow_inf_nan=False)
    overhead_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str) -> Observe:
        """The ``Observe`` command of this body (the one rule of the wire's own: a given measurement
        carries its model and basis inside it)."""
        measurement = None
        if self.measurement is not None:
            if self.request is None and (self.model is not None or self.basis is not None):
                raise InvalidInput("measurement", "model and basis belong inside the measurement when one is given")
            measurement = self.measurement.model_dump(exclude_none=True)
        return Observe(session_id, **{**dict(self), "measurement": measurement})  # (dict(): the fields, shallow)


class ManualIn(_In):
    basis: SafeText | None = Field(None, min_length=1, max_length=220)
    overhead_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str) -> RequestCompaction:
        return RequestCompaction(session_id, **dict(self))


class CommitIn(_In):
    fencing_token: int = Field(..., strict=True, ge=-JSON_SAFE_INT, le=JSON_SAFE_INT)
    tokens_after: int = Field(..., strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str, attempt_id: str) -> Commit:
        return Commit(session_id, attempt_id, **dict(self))


class RejectIn(_In):
    fencing_token: int = Field(..., strict=True, ge=-JSON_SAFE_INT, le=JSON_SAFE_INT)
    reject_reason: SafeText = Field(..., min_length=1, max_length=200)
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str, attempt_id: str) -> Reject:
        return Reject(session_id, attempt_id, **dict(self))


class UsageIn(_In):
    """What the provider billed for the request of ``basis`` (its response's ``usage``)."""

    basis: SafeText = Field(
        ...,
        min_length=1,
        max_length=220,
        description="the measured basis the request covered (`r<revision>:<through>`)",
    )
    input_tokens: int = Field(
        ..., strict=True, ge=0, le=JSON_SAFE_INT, description="input tokens billed (uncached; cache tokens apart)"
    )
    model: SafeText | None = Field(
        None, min_length=1, max_length=301, description="the model billed (`provider/name` or a name): the measured one"
    )
    output_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    cache_read_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    cache_write_tokens: int | None = Field(None, strict=True, ge=0, le=JSON_SAFE_INT)
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str) -> ReportUsage:
        return ReportUsage(session_id, **dict(self))


class RejectionIn(_In):
    """The provider refused the request of ``basis`` as too long for the model's context."""

    basis: SafeText = Field(
        ...,
        min_length=1,
        max_length=220,
        description="the measured basis the request covered (`r<revision>:<through>`)",
    )
    # the provider's text as it came (newlines included): the tracker keeps it with control characters as spaces
    message: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_MESSAGE_CHARS,
        description="the provider's error message; its count and limit are read from it unless given",
    )
    input_tokens: int | None = Field(
        None, strict=True, ge=0, le=JSON_SAFE_INT, description="the provider's count of the refused request"
    )
    input_limit: int | None = Field(None, strict=True, gt=0, le=JSON_SAFE_INT, description="the provider's limit")
    model: SafeText | None = Field(None, min_length=1, max_length=301, description="the measured model")
    idempotency_key: SafeText | None = Field(None, min_length=1, max_length=200)

    def to_command(self, session_id: str) -> ReportRejection:
        return ReportRejection(session_id, **dict(self))


# -- responses: views of the core's dataclasses -------------------------------------------------


def view(name: str, source: type, doc: str, /, **wire: Any) -> type[BaseModel]:
    """A response model with the fields of the dataclass ``source``, every one required.

    ``wire`` gives a field's JSON type where it differs from the Python one (a type, or a
    ``(type, Field(...))`` pair); names that are not fields of ``source`` are added before them.
    """
    hints = typing.get_type_hints(source)
    names = [f.name for f in dataclasses.fields(source)]
    fields: dict[str, Any] = {}
    for field in [n for n in wire if n not in names] + names:
        spec = wire.get(field, hints.get(field))
        fields[field] = spec if isinstance(spec, tuple) else (spec, ...)
    return create_model(name, __doc__=doc, **fields)


AttemptOut = view("AttemptOut", Attempt, "A compaction attempt (open, or as it was opened).")

DecisionOut = view(
    "DecisionOut",
    Decision,
    "The decision on one measurement (``Result.to_data()``).",
    session_id=str,
    version=int,
    attempt=(AttemptOut | None, Field(None, description="the attempt opened for this caller (action compact)")),
    waiting_on=(AttemptOut | None, Field(None, description="the open automatic attempt (action wait)")),
)

LastMeasurementOut = view("LastMeasurementOut", LastMeasurement, "The session's last recorded measurement.")

SessionStateOut = view(
    "SessionStateOut",
    SessionState,
    "The session's state: the fold of its log (``SessionState.to_data()``).",
    policy=dict[str, Any] | None,
    exhausted=list[str],
    open_attempts=list[AttemptOut],  # type: ignore[valid-type]  # a model built at import time by view()
    last=LastMeasurementOut | None,
    recent_outcomes=list[list[str]],
    archived=(
        dict[str, Any] | None,
        Field(None, description="where an archived session's events went (absent while it is live)"),
    ),
    anchor=(
        dict[str, Any] | None,
        Field(None, description="the session's last billed request its decisions are anchored on (absent: none)"),
    ),
)

EventOut = view("EventOut", StoredEvent, "One recorded event (``tracker.queries.event_to_dict``).", recorded_at=str)


class HistoryOut(BaseModel):
    session_id: str
    events: list[EventOut]  # type: ignore[valid-type]
    next_from_version: int = Field(..., description="from_version for the next page")
    has_more: bool


class SessionRowOut(BaseModel):
    """One session of the fleet's listing (``tracker.queries.sessions_page``)."""

    session_id: str = Field(..., description="the session id as the agent knows it")
    version: int = Field(..., description="number of events in its log")
    pressure: str | None
    occupancy_bp: int | None = Field(..., description="last measured occupancy, in basis points of the input limit")
    revision: int | None
    open_attempts: int
    created_at: str
    updated_at: str = Field(..., description="last activity: the time of its last event (ISO 8601)")


class SessionsOut(BaseModel):
    sessions: list[SessionRowOut]
    next_cursor: str | None = Field(..., description="`cursor` for the next page; null on the last page")


class FeedOut(BaseModel):
    events: list[EventOut]  # type: ignore[valid-type]
    next_after: int = Field(..., description="`after` for the next page: the last position returned (resumable)")
    has_more: bool


class WaitOut(BaseModel):
    attempt_id: str
    outcome: str = Field(..., description="`committed` or `rejected:<reason>`")
    status: Literal["committed", "rejected"]
    reject_reason: str | None


PolicyFieldsOut = view("PolicyFieldsOut", Policy, 'Every field of a compaction policy (behaviour.md "Policy").')


class PolicyOut(BaseModel):
    """The policy this fleet's new sessions start with (``GET /v1/policy``)."""

    source: Literal["fleet", "server"] = Field(
        ..., description="`fleet`: the fleet's own (`tracker fleet policy`); `server`: the server's (it has none)"
    )
    version: int = Field(..., description="the fleet policy's version (0: the fleet never had one)")
    changed_at: str | None = Field(..., description="when that version was recorded (ISO 8601); null for version 0")
    policy: PolicyFieldsOut  # type: ignore[valid-type]


def _report_view(name: str, event: type[DomainEvent], doc: str) -> type[BaseModel]:
    kind: Any = Literal[event.TYPE]  # the literal of the event class's name
    return view(
        name,
        event,
        doc,
        session_id=str,
        version=(int, Field(..., description="the session's version after the report")),
        type=kind,
    )


UsageReportOut = _report_view(
    "UsageReportOut",
    UsageReported,
    "A recorded usage report (``Report.to_data()``): the measured count beside the billed one.",
)
RejectionReportOut = _report_view(
    "RejectionReportOut",
    ProviderRejected,
    "A recorded provider rejection (``Report.to_data()``): the provider's numbers and the limit learned, if any.",
)


class ModelCalibrationOut(BaseModel):
    """What calibration knows of one model and counter kind in the caller's fleet (``ModelSummary.to_data()``)."""

    model: str
    counter: Literal["estimate", "exact"] = Field(
        ..., description="`estimate`: counts calibration corrects; `exact`: counts it only watches for drift"
    )
    usage_reports: int
    rejections: int
    samples: int = Field(..., description="usable samples in the window")
    ignored: int = Field(..., description="reports the estimator ignored (absurd ratio, tiny request)")
    median_ratio: float | None = Field(..., description="median billed / counted")
    p90_ratio: float | None
    factor: float | None = Field(..., description="the correction factor decisions use (estimates only)")
    calibration: dict[str, Any] | None
    drift: float | None = Field(..., description="exact counters: median billed / counted")
    drifted: bool
    learned_limit: int | None = Field(..., description="the lowest input limit learned from rejections")
    last_at: float


class CalibrationOut(BaseModel):
    """``GET /v1/calibration``: one row per model and counter kind, for the caller's fleet."""

    models: list[ModelCalibrationOut]


class ErrorBody(BaseModel):
    """Every error: a stable ``code``, the error class, a message, and details (``field`` names bad input)."""

    model_config = ConfigDict(extra="allow")
    code: str
    error: str
    message: str
    field: str | None = None


class HealthOut(BaseModel):
    status: str
