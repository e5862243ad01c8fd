"""The one table from the Tracker's commands to HTTP calls: method, path, body, and how the answer is read.

Both clients run these (``tracker.client.sync``, ``tracker.client.aio``): a public method builds
its command (``tracker.core.commands``: validated there, once, as for the embedded ``Tracker``),
and :func:`call_of` turns it into the request it is on the wire. Every write carries an
``idempotency_key`` (the caller's, or one generated for the call), and a retry of the call sends
the same request again, so a retried call gets the original answer and never records twice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

from tracker.core import commands as cmd
from tracker.core.decide import Result
from tracker.core.model import Measurement
from tracker.core.outcome import Decision
from tracker.core.policy import Policy
from tracker.core.reports import Report
from tracker.core.state import Attempt, SessionState
from tracker.errors import InvalidInput, WaitTimeout
from tracker.protocol import CompactionOptions, ObserveOptions, RejectionOptions, UsageOptions, unexpected
from tracker.store.base import StoredEvent

API_PREFIX = "/v1"
MAX_WAIT_PER_REQUEST_S = 30.0
HISTORY_PAGE = 500
R = TypeVar("R")
C = TypeVar("C", bound=cmd.Command[Any])


@dataclass(frozen=True)
class Call(Generic[R]):
    """One request as data, and how its answer (the JSON of a 200 or 201) becomes the ``Tracker``'s type."""

    method: str
    path: str
    parse: Callable[[Any], R]
    json: Any = None
    params: dict[str, Any] | None = None


def _path(*parts: str) -> str:
    return API_PREFIX + "".join("/" + quote(p, safe="") for p in parts)


def _key(idempotency_key: str | None) -> str:
    return idempotency_key if idempotency_key is not None else uuid.uuid4().hex


# -- the commands ---------------------------------------------------------------------------------

#: the keyword arguments each command's public method takes (a misspelt one is a ``TypeError`` naming the method)
_KEYWORDS: dict[type, tuple[str, type]] = {
    cmd.Observe: ("observe", ObserveOptions),
    cmd.RequestCompaction: ("request_compaction", CompactionOptions),
    cmd.ReportUsage: ("report_usage", UsageOptions),
    cmd.ReportRejection: ("report_rejection", RejectionOptions),
}


def given(command: Callable[..., C], session_id: str, options: Mapping[str, Any]) -> C:
    """The command of a call made with the keyword ``options`` of its public method."""
    method, kind = _KEYWORDS[command]  # type: ignore[index]
    unexpected(method, options, kind)
    return command(session_id, **options)


def _measurement_body(measurement: Measurement | dict[str, Any]) -> dict[str, Any]:
    if isinstance(measurement, Measurement):
        data = measurement.to_data()
        data["basis"] = str(measurement.basis)
        return {k: v for k, v in data.items() if v is not None}
    return dict(measurement)


def _observe(c: cmd.Observe) -> Call[Result]:
    body: dict[str, Any] = {"idempotency_key": _key(c.idempotency_key)}
    if c.measurement is not None:
        body["measurement"] = _measurement_body(c.measurement)
    else:
        body.update(request=c.request, model=c.model, basis=str(c.basis) if c.basis is not None else None)
    body.update((name, value) for name, value in c.per_call().items() if value is not None)
    return Call("POST", _path("sessions", c.session_id, "observe"), _result, json=body)


def _result(data: dict[str, Any]) -> Result:
    return Result(session_id=data["session_id"], version=data["version"], decision=Decision.from_data(data))


def _manual(c: cmd.RequestCompaction) -> Call[Attempt]:
    body = {
        "idempotency_key": _key(c.idempotency_key),
        "basis": str(c.basis) if c.basis is not None else None,
        "overhead_tokens": c.overhead_tokens,
    }
    return Call("POST", _path("sessions", c.session_id, "compactions"), lambda d: Attempt(**d), json=body)


def _end(c: cmd.Commit | cmd.Reject) -> Call[SessionState]:
    """A commit or a reject of the attempt."""
    body: dict[str, Any]
    if isinstance(c, cmd.Commit):
        verb, body = "commit", {"fencing_token": c.fencing_token, "tokens_after": c.tokens_after}
    else:
        verb, body = "reject", {"fencing_token": c.fencing_token, "reject_reason": c.reject_reason}
    path = _path("sessions", c.session_id, "compactions", c.attempt_id, verb)
    return Call("POST", path, SessionState.from_data, json={**body, "idempotency_key": _key(c.idempotency_key)})


def _report(c: cmd.ReportUsage | cmd.ReportRejection) -> Call[Report]:
    body = {k: v for k, v in c.given().items() if v is not None}
    body["basis"] = str(body["basis"])
    body["idempotency_key"] = _key(c.idempotency_key)
    verb = "usage" if isinstance(c, cmd.ReportUsage) else "rejection"
    return Call("POST", _path("sessions", c.session_id, verb), Report.from_data, json=body)


#: THE table: what each command is on the wire (``wait`` and ``history`` are series of these: see below)
_CALLS: dict[type, Callable[[Any], Call[Any]]] = {
    cmd.Observe: _observe,
    cmd.RequestCompaction: _manual,
    cmd.Commit: _end,
    cmd.Reject: _end,
    cmd.ReportUsage: _report,
    cmd.ReportRejection: _report,
    cmd.State: lambda c: Call("GET", _path("sessions", c.session_id), SessionState.from_data),
    cmd.Calibration: lambda c: Call("GET", _path("calibration"), lambda d: list(d["models"])),
}


def call_of(command: cmd.Command[R]) -> Call[Any]:
    """The HTTP call of ``command``."""
    return _CALLS[type(command)](command)


# -- reads of many requests: a wait's long-polls, a listing's pages -------------------------------


class Waiting:
    """One ``wait``: its long-polls (each at most ``MAX_WAIT_PER_REQUEST_S``) until ``timeout``."""

    def __init__(self, command: cmd.Wait) -> None:
        self.command = command
        self.deadline = time.monotonic() + command.timeout

    def poll(self) -> Call[str]:
        c, left = self.command, max(0.0, self.deadline - time.monotonic())
        path = _path("sessions", c.session_id, "compactions", c.attempt_id, "wait")
        return Call("GET", path, lambda d: str(d["outcome"]), params={"timeout": min(left, MAX_WAIT_PER_REQUEST_S)})

    def polled_out(self) -> None:
        """A poll timed out: poll again, or (past the deadline) raise ``WaitTimeout``."""
        if time.monotonic() >= self.deadline:
            c = self.command
            raise WaitTimeout(
                f"attempt {c.attempt_id} still open after {c.timeout}s", attempt_id=c.attempt_id
            ) from None


_LAST = object()


class Pages:
    """A listing fetched page by page: the request for the next page (None after the last) and each page's rows."""

    def __init__(
        self, call: Callable[[Any], Call[Any]], at: Any, rows: Callable[[Any], list[Any]], after: Callable[[Any], Any]
    ) -> None:
        self._call, self._at, self._rows, self._after = call, at, rows, after

    def next_call(self) -> Call[Any] | None:
        return None if self._at is _LAST else self._call(self._at)

    def rows(self, page: Any) -> list[Any]:
        self._at = self._after(page)
        return self._rows(page)


def _event(data: dict[str, Any]) -> StoredEvent:
    return StoredEvent(
        position=data["position"],
        session_id=data["session_id"],
        version=data["version"],
        type=data["type"],
        data=data["data"],
        recorded_at=datetime.fromisoformat(data["recorded_at"]),
        idempotency_key=data.get("idempotency_key"),
    )


def history_pages(session_id: str, from_version: int) -> Pages:
    path = _path("sessions", session_id, "history")
    return Pages(
        lambda version: Call("GET", path, lambda d: d, params={"from_version": version, "limit": HISTORY_PAGE}),
        from_version,
        lambda page: [_event(e) for e in page["events"]],
        lambda page: page["next_from_version"] if page["has_more"] else _LAST,
    )


def _sessions_params(
    pressure: str | None, since: datetime | float | None, page_size: int, cursor: str | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": page_size}
    if pressure is not None:
        params["pressure"] = pressure
    if since is not None:
        if isinstance(since, datetime):
            when = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        elif isinstance(since, (int, float)) and not isinstance(since, bool):
            when = datetime.fromtimestamp(since, UTC)
        else:
            raise InvalidInput("since", f"must be a datetime or seconds since the epoch, got {since!r}")
        params["since"] = when.isoformat()
    if cursor is not None:
        params["cursor"] = cursor
    return params


def sessions_pages(pressure: str | None, since: datetime | float | None, page_size: int) -> Pages:
    return Pages(
        lambda cursor: Call(
            "GET", _path("sessions"), lambda d: d, params=_sessions_params(pressure, since, page_size, cursor)
        ),
        None,
        lambda page: page["sessions"],
        lambda page: page.get("next_cursor") or _LAST,
    )


# -- the fleet's policy (client-only: an embedded Tracker has no fleet) ---------------------------


@dataclass(frozen=True)
class FleetPolicy:
    """The policy the caller's fleet's new sessions start with (``GET /v1/policy``).

    ``source``: ``"fleet"`` (the fleet's own, set with ``tracker fleet policy``) or ``"server"``
    (the fleet has none: the server's); ``version``: the fleet policy's version (``0``: the fleet
    never had one); ``changed_at``: when that version was recorded (``None`` for version 0);
    ``policy``: the policy itself, as the core's ``Policy``.
    """

    source: Literal["fleet", "server"]
    version: int
    changed_at: datetime | None
    policy: Policy

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> FleetPolicy:
        changed_at = data.get("changed_at")
        return cls(
            source=data["source"],
            version=data["version"],
            changed_at=datetime.fromisoformat(changed_at) if changed_at is not None else None,
            policy=Policy.from_data(data["policy"]),
        )


POLICY = Call("GET", _path("policy"), FleetPolicy.from_data)
