"""Every error Context Tracker raises, in one tree.

    TrackerError
    ├── InvalidInput (also a ValueError)      bad caller input; names the field; nothing is written
    │   ├── InvalidPolicy                     a policy field out of range
    │   ├── InvalidSetting                    a TRACKER_* variable is invalid; names the variable
    │   ├── InvalidSessionId
    │   └── PayloadTooLarge                   an event's data (or an HTTP body) exceeds the limit
    ├── CountError                            a count could not be trusted; recorded as CountFailed
    │   ├── CountTimeout                      no valid count within count_timeout_s
    │   ├── InvalidCountModel                 the counter cannot count this model / reported another
    │   ├── QualityMismatch                   quality not the counter's, or not allowed by policy
    │   ├── MalformedMeasurement              negative/non-integer tokens, missing fields, bad fingerprint
    │   └── ContextLimitUnknown               no input limit for the model (checked before counting)
    ├── RankFileError                         a shipped encoding file is missing or not what tiktoken expects
    ├── ContextLimitError                     hard limit and no automatic attempt eligible
    ├── StaleBasis                            the measurement's revision is older than the session's
    ├── AttemptError                          commit / reject / wait refused
    │   ├── UnknownAttempt                    no such attempt in this session
    │   ├── AttemptNotOpen                    the attempt already ended
    │   ├── NotAttemptHolder                  wrong fencing token
    │   ├── ManualAttemptOpen                 a manual attempt is already open
    │   └── SummaryTooLarge                   tokens_after >= input_limit (recorded as a rejection)
    ├── WaitTimeout                           wait() gave up before the attempt ended
    ├── StoreError
    │   ├── StoreUnavailable                  the database cannot be reached; nothing was written
    │   ├── ConcurrencyConflict               another writer appended first (expected version moved)
    │   ├── SchemaOutOfDate                   the database schema is missing or older than the code
    │   ├── IntegrityError                    stored data contradicts itself (run `tracker verify`)
    │   └── UnknownSession
    ├── FleetError                            fleets and their API keys
    │   ├── UnknownFleet
    │   ├── UnknownKey
    │   └── FleetExists
    └── HttpError                             refusals only the HTTP API makes
        ├── Unauthorized                      missing, malformed, unknown or revoked key
        ├── NotFound                          no such route
        ├── MethodNotAllowed
        ├── TooManyWaits                      the fleet's cap on concurrent long-polls is reached
        └── BodyTimeout                       the request body did not arrive in time

Every error has a stable ``code`` (used by the CLI's ``--json`` output and the
HTTP API) and ``to_dict()`` so it can travel as data between processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class TrackerError(Exception):
    code = "tracker_error"

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "error": type(self).__name__, "message": self.message, **self.details}


# -- bad input -------------------------------------------------------------------------------


class InvalidInput(TrackerError, ValueError):
    """Bad caller input. ``field`` names what is wrong."""

    code = "invalid_input"

    def __init__(self, field: str, problem: str, **details: Any) -> None:
        super().__init__(f"{field}: {problem}", field=field, **details)
        self.field = field
        self.problem = problem


def an_object(field: str, value: Any) -> Mapping[str, Any]:
    """``value`` if it is an object (a mapping, as JSON objects decode), else ``InvalidInput`` naming ``field``."""
    if not isinstance(value, Mapping):
        raise InvalidInput(field, f"must be an object, got {type(value).__name__}")
    return value


class InvalidPolicy(InvalidInput):
    code = "invalid_policy"


class InvalidSetting(InvalidInput):
    """A ``TRACKER_*`` environment variable is invalid; ``field`` is the variable's name."""

    code = "invalid_setting"


class InvalidSessionId(InvalidInput):
    code = "invalid_session_id"

    def __init__(self, problem: str, **details: Any) -> None:
        super().__init__("session_id", problem, **details)


class PayloadTooLarge(InvalidInput):
    code = "payload_too_large"


# -- counting --------------------------------------------------------------------------------


class CountError(TrackerError):
    """A count that could not be trusted. ``kind`` is the class name, recorded in CountFailed."""

    code = "count_failed"

    @property
    def kind(self) -> str:
        return type(self).__name__


class CountTimeout(CountError):
    code = "count_timeout"


class InvalidCountModel(CountError):
    code = "invalid_count_model"


class QualityMismatch(CountError):
    code = "quality_mismatch"


class MalformedMeasurement(CountError, ValueError):
    code = "malformed_measurement"

    def __init__(self, message: str = "", field: str | None = None, **details: Any) -> None:
        if field is not None:
            details["field"] = field
            if not message.startswith(field):
                message = f"{field}: {message}"
        super().__init__(message, **details)
        self.field = field


class ContextLimitUnknown(CountError):
    code = "context_limit_unknown"


COUNT_ERRORS: dict[str, type[CountError]] = {
    cls.__name__: cls
    for cls in (CountTimeout, InvalidCountModel, QualityMismatch, MalformedMeasurement, ContextLimitUnknown)
}


def count_error_from_dict(data: dict[str, Any]) -> CountError:
    """Rebuild a typed count failure that travelled as data (e.g. from a Celery worker)."""
    cls = COUNT_ERRORS.get(str(data.get("kind") or data.get("error")), CountError)
    details = {k: v for k, v in data.items() if k not in {"kind", "error", "code", "message"}}
    return cls(str(data.get("message", "")), **details)


class RankFileError(TrackerError):
    """A shipped encoding (rank) file is missing or not the file tiktoken expects."""

    code = "rank_file_error"


# -- decisions -------------------------------------------------------------------------------


class ContextLimitError(TrackerError):
    """The request is at the hard limit and no automatic compaction is eligible."""

    code = "context_limit"


class StaleBasis(TrackerError):
    code = "stale_basis"


class AttemptError(TrackerError):
    code = "attempt_error"


class UnknownAttempt(AttemptError):
    code = "unknown_attempt"


class AttemptNotOpen(AttemptError):
    code = "attempt_not_open"


class NotAttemptHolder(AttemptError):
    code = "not_attempt_holder"


class ManualAttemptOpen(AttemptError):
    code = "manual_attempt_open"


class SummaryTooLarge(AttemptError):
    code = "summary_too_large"


class WaitTimeout(TrackerError):
    code = "wait_timeout"


# -- storage ---------------------------------------------------------------------------------


class StoreError(TrackerError):
    code = "store_error"


class StoreUnavailable(StoreError):
    code = "store_unavailable"


class ConcurrencyConflict(StoreError):
    """Another writer appended first: the stream is at ``actual``, not the ``expected`` version.

    ``expected``/``actual`` are None when the service gave up after repeated conflicts.
    """

    code = "concurrency_conflict"
    #: The stream's projection state at ``actual`` when the store read it while refusing the
    #: append (so the caller can re-decide without reading it again); None when unknown.
    #: Not part of ``details``: it never leaves the process.
    current_state: dict[str, Any] | None = None

    def __init__(
        self,
        message: str = "",
        *,
        session_id: str | None = None,
        expected: int | None = None,
        actual: int | None = None,
        **details: Any,
    ) -> None:
        known = {"session_id": session_id, "expected": expected, "actual": actual}
        super().__init__(message, **{k: v for k, v in known.items() if v is not None}, **details)

    # Read from ``details``, so an error rebuilt from ``to_dict()`` data has them too.
    @property
    def session_id(self) -> str | None:
        return self.details.get("session_id")

    @property
    def expected(self) -> int | None:
        return self.details.get("expected")

    @property
    def actual(self) -> int | None:
        return self.details.get("actual")


class SchemaOutOfDate(StoreError):
    code = "schema_out_of_date"


class IntegrityError(StoreError):
    """Stored data contradicts itself (e.g. a projection row disagrees with its stream)."""

    code = "integrity_error"


class UnknownSession(StoreError):
    code = "unknown_session"


class ArchivedSession(StoreError):
    """The session's events were moved to an archive (``tracker archive``): nothing is decided or
    recorded for it until ``tracker restore ARCHIVE --session ID`` brings them back."""

    code = "session_archived"


# -- fleets and keys -------------------------------------------------------------------------


class FleetError(TrackerError):
    code = "fleet_error"


class UnknownFleet(FleetError):
    code = "unknown_fleet"


class UnknownKey(FleetError):
    code = "unknown_key"


class FleetExists(FleetError):
    code = "fleet_exists"


# -- HTTP-only refusals ----------------------------------------------------------------------


class HttpError(TrackerError):
    code = "http_error"


class Unauthorized(HttpError):
    code = "unauthorized"


class NotFound(HttpError):
    code = "not_found"


class MethodNotAllowed(HttpError):
    code = "method_not_allowed"


class TooManyWaits(HttpError):
    """The fleet already holds its cap of concurrent ``wait`` long-polls; ``retry_after_s`` says when to retry."""

    code = "too_many_waits"


class BodyTimeout(HttpError):
    """The request body did not arrive within ``TRACKER_BODY_TIMEOUT_S``."""

    code = "body_timeout"


# -- errors carried as data ------------------------------------------------------------------


def _all_subclasses(cls: type[TrackerError]) -> list[type[TrackerError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_class(code: str) -> type[TrackerError]:
    """The error class with this stable ``code`` (``TrackerError`` when none has it)."""
    return next((c for c in _all_subclasses(TrackerError) if c.code == code), TrackerError)


def error_from_dict(data: dict[str, Any]) -> TrackerError:
    """Rebuild a typed error that travelled as data (``to_dict()``: an HTTP body, a Celery result).

    The class is chosen by ``code`` (else by the class name in ``error``); message and details
    are kept as they were, ``field`` included, without running the class's own constructor.
    """
    cls = error_class(str(data.get("code", "")))
    if cls is TrackerError and data.get("error"):
        cls = next((c for c in _all_subclasses(TrackerError) if c.__name__ == data["error"]), TrackerError)
    details = {k: v for k, v in data.items() if k not in {"code", "error", "message"}}
    exc = cls.__new__(cls)
    TrackerError.__init__(exc, str(data.get("message", "")), **details)
    if "field" in details:
        exc.field = details["field"]  # type: ignore[attr-defined]
        message = str(data.get("message", ""))
        prefix = f"{details['field']}: "
        exc.problem = message[len(prefix) :] if message.startswith(prefix) else message  # type: ignore[attr-defined]
    return exc
