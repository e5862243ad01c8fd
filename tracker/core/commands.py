"""The public calls as typed commands: one small frozen value per call, validated once, where it is built.

``Tracker.run(command, scope)`` executes them (``tracker.service``); ``Tracker.observe(...)`` and the
other public methods only build one and run it. The HTTP routes build them from their request bodies
(``ObserveIn.to_command``) and the clients encode them as requests (``tracker.client.calls``), so a
rule on a call's input is written here and nowhere else: the session id's form, "exactly one of
request or measurement", the idempotency key's and the model's text, the per-call threshold's
inputs, a wait's timeout. What needs the session's state (a basis this session measured, a fencing
token, the provider's numbers against the measured ones) is the decision's to check (``tracker.core``).

Pure: no I/O, no clock, no globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, TypeVar

from tracker.core.decide import Result
from tracker.core.ledger import ModelSummary
from tracker.core.model import FULL_SCALE_BP, Basis, Measurement, check_session_id, check_text
from tracker.core.policy import Policy
from tracker.core.reports import Report
from tracker.core.state import Attempt, SessionState
from tracker.core.thresholds import resolve_threshold
from tracker.errors import InvalidInput, InvalidPolicy

R = TypeVar("R")


class Command(Generic[R]):
    """A call on one session (``session_id`` as its caller names it); ``R`` is what running it returns.

    ``NAME``: the name the Tracker's hooks see it by (None: a read, not wrapped by the hooks)."""

    NAME: ClassVar[str | None] = None
    session_id: str

    def hooked(self) -> tuple[str | None, str | None]:
        """``(attempt_id, basis)`` as the caller gave them, for the hooks."""
        attempt_id = getattr(self, "attempt_id", None)
        basis = getattr(self, "basis", None)
        return attempt_id, None if basis is None else str(basis)


def _start_policy(policy: Any) -> None:
    if policy is not None and not isinstance(policy, Policy):
        raise InvalidPolicy("policy", f"must be a Policy, got {type(policy).__name__}")


@dataclass(frozen=True)
class _OnSession(Command[R]):
    """A command on one session, named in the core's form (its scope maps it into the store)."""

    session_id: str

    def __post_init__(self) -> None:
        check_session_id(self.session_id)


@dataclass(frozen=True)
class _Write(_OnSession[R]):
    """A command that records; ``idempotency_key``: the caller's, so that a retry gets the original answer."""

    idempotency_key: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.idempotency_key is not None:
            check_text("idempotency_key", self.idempotency_key)  # before it reaches the database


_PER_CALL = ("compaction_threshold", "scope", "scope_confidence", "overhead_tokens")


@dataclass(frozen=True)
class Observe(_Write[Result]):
    """Count ``request`` (for ``model``, over ``basis``) or record ``measurement``, then decide.

    ``policy``: the one a *new* session starts with (default: the scope's fleet's, else the Tracker's).
    ``measured``: ``measurement`` parsed (its basis at revision 1 when bare: the decision resolves it
    against the state it decides on); None when counting a request."""

    NAME: ClassVar[str | None] = "observe"
    request: Any = None
    measurement: Measurement | dict[str, Any] | None = None
    model: str | None = None
    basis: Basis | str | None = None
    compaction_threshold: float | None = None
    scope: str | None = None
    scope_confidence: float | None = None
    overhead_tokens: int | None = None
    policy: Policy | None = None
    measured: Measurement | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _start_policy(self.policy)
        if (self.request is None) == (self.measurement is None):
            raise InvalidInput("request", "give exactly one of request or measurement")
        if self.model is not None:
            check_text("model", self.model)
        if self.compaction_threshold is not None or self.scope is not None or self.scope_confidence is not None:
            # every input is checked whichever would win, so any base validates them (bad input writes nothing)
            resolve_threshold(FULL_SCALE_BP, 0, self.compaction_threshold, self.scope, self.scope_confidence)
        if self.measurement is not None:
            m = self.measurement
            object.__setattr__(self, "measured", m if isinstance(m, Measurement) else Measurement.from_data(m, 1))
            return
        if self.model is None:
            raise InvalidInput("model", "is required when counting a request")
        if self.basis is None:
            raise InvalidInput("basis", "is required when counting a request")
        Basis.parse(self.basis, 1)

    def per_call(self) -> dict[str, Any]:
        """The per-call inputs of the decision (threshold, scope and its confidence, overhead)."""
        return {name: getattr(self, name) for name in _PER_CALL}

    @property
    def raw_basis(self) -> Any:
        """The basis as given (a bare one is resolved at the revision decided on)."""
        m = self.measurement
        if m is None:
            return self.basis
        return m.basis if isinstance(m, Measurement) else m["basis"]


@dataclass(frozen=True)
class RequestCompaction(_Write[Attempt]):
    """Open a manual attempt (regardless of pressure; at most one manual attempt open).
    ``policy``: the one a *new* session starts with (as for ``Observe``)."""

    NAME: ClassVar[str | None] = "manual"
    basis: Basis | str | None = None
    overhead_tokens: int | None = None
    policy: Policy | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _start_policy(self.policy)
        if self.basis is not None:
            Basis.parse(self.basis, 1)


@dataclass(frozen=True)
class _Settle(_Write[SessionState]):
    """Ends an open attempt its holder (``fencing_token``) holds."""

    attempt_id: str
    fencing_token: int


@dataclass(frozen=True)
class Commit(_Settle):
    """Record the attempt's compaction: the session's history is now ``tokens_after`` tokens."""

    NAME: ClassVar[str | None] = "commit"
    tokens_after: int


@dataclass(frozen=True)
class Reject(_Settle):
    """Record that the attempt's holder gave up (``reject_reason``)."""

    NAME: ClassVar[str | None] = "reject"
    reject_reason: str


@dataclass(frozen=True)
class Wait(_OnSession[str]):
    """Until the attempt ends ('committed' or 'rejected:<reason>'), at most ``timeout`` seconds."""

    NAME: ClassVar[str | None] = "wait"
    attempt_id: str
    timeout: float = 30.0
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise InvalidInput("timeout", f"must be a number >= 0, got {self.timeout!r}")


@dataclass(frozen=True)
class _Report(_Write[Report]):
    """A report of the provider's on the request of ``basis`` (checked against the session by the decision)."""

    basis: Basis | str

    def given(self) -> dict[str, Any]:
        """The report's inputs, as the decision takes them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("session_id", "idempotency_key")}


@dataclass(frozen=True)
class ReportUsage(_Report):
    """What the provider billed for the request of ``basis``."""

    NAME: ClassVar[str | None] = "usage"
    input_tokens: int
    model: str | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None


@dataclass(frozen=True)
class ReportRejection(_Report):
    """The provider refused the request of ``basis`` as too long for the model."""

    NAME: ClassVar[str | None] = "rejection"
    message: str | None = None
    input_tokens: int | None = None
    input_limit: int | None = None
    model: str | None = None


@dataclass(frozen=True)
class State(_OnSession[SessionState]):
    """The session's state (the fold of its log)."""


@dataclass(frozen=True)
class History(_OnSession[Any]):
    """The session's events from ``from_version`` on (an iterator of ``StoredEvent``)."""

    from_version: int = 1


@dataclass(frozen=True)
class Calibration(Command[list[ModelSummary]]):
    """What calibration knows, per (fleet, model, counter): of ``fleet`` (None: every fleet), or of
    the scope's own fleet when run for one."""

    fleet: str | None = None
