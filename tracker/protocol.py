"""What agent code may rely on, whether the tracker is embedded or remote.

``Tracker`` (embedded) and ``TrackerClient`` (HTTP) satisfy :class:`TrackerProtocol`;
``AsyncTrackerClient`` satisfies :class:`AsyncTrackerProtocol`, the same methods awaited.
Integrations (LangChain, pydantic-ai) are written against these, never against a class.
The keyword arguments of ``observe`` and ``request_compaction`` are declared once, as
:class:`ObserveOptions` and :class:`CompactionOptions`; the clients take them as ``**options``.

The calls whose signature is all positional (``commit``, ``reject``, ``state``) are written here
once, with their bodies: each builds its command (``tracker.core.commands``) and hands it to the
implementation's ``run`` -- the ``Tracker`` executes it, a client sends it -- so ``Tracker`` and
the clients inherit them (they subclass these protocols) instead of writing them out again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Protocol, Required, TypedDict, Unpack, runtime_checkable

from tracker.core.commands import Command, Commit, Reject, State
from tracker.core.decide import Result
from tracker.core.model import Basis, Measurement
from tracker.core.reports import Report
from tracker.core.state import Attempt, SessionState
from tracker.store.base import StoredEvent

#: an idempotency key, or None (one is generated where needed)
Key = str | None


class ObserveOptions(TypedDict, total=False):
    """The keyword arguments of ``observe`` (each optional): ``request=`` (with ``model=`` and
    ``basis=``) or ``measurement=``, then the per-call threshold, scope and overhead, and the
    ``idempotency_key`` a retry reuses. (``**options: Unpack[ObserveOptions]``: type checkers and
    editors see these as named keyword parameters.)"""

    request: Any
    measurement: Measurement | dict[str, Any] | None
    model: str | None
    basis: Basis | str | None
    compaction_threshold: float | None
    scope: str | None
    scope_confidence: float | None
    overhead_tokens: int | None
    idempotency_key: str | None


class CompactionOptions(TypedDict, total=False):
    """The keyword arguments of ``request_compaction`` (each optional)."""

    basis: Basis | str | None
    overhead_tokens: int | None
    idempotency_key: str | None


class UsageOptions(TypedDict, total=False):
    """The keyword arguments of ``report_usage``: ``basis`` and ``input_tokens`` required, the rest optional."""

    basis: Required[Basis | str]
    input_tokens: Required[int]
    model: str | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None
    idempotency_key: str | None


class RejectionOptions(TypedDict, total=False):
    """The keyword arguments of ``report_rejection``: ``basis`` is required, the rest optional."""

    basis: Required[Basis | str]
    message: str | None
    input_tokens: int | None
    input_limit: int | None
    model: str | None
    idempotency_key: str | None


def unexpected(method: str, given: Mapping[str, Any], options: type) -> None:
    """The ``TypeError`` Python raises for a keyword ``options`` (a TypedDict) does not name."""
    for name in given:
        if name not in options.__annotations__:
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}")


def _run(tracker: Any, command: Command[Any]) -> Any:
    """``tracker.run(command)``: the implementation's own (a Tracker executes it, a client sends it;
    an async client's answer is awaited by the caller)."""
    return tracker.run(command)


@runtime_checkable
class TrackerProtocol(Protocol):
    def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result: ...

    def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt: ...

    def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState:
        """Record the attempt's compaction: the session's history is now ``tokens_after`` tokens."""
        return _run(self, Commit(session_id, attempt_id, fencing_token, tokens_after, idempotency_key=idempotency_key))

    def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState:
        """Record that the attempt's holder gave up (``reject_reason``): the session's pressure is
        unchanged and a later observe decides again."""
        return _run(self, Reject(session_id, attempt_id, fencing_token, reject_reason, idempotency_key=idempotency_key))

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str: ...

    def state(self, session_id: str) -> SessionState:
        """The session's state (the fold of its log)."""
        return _run(self, State(session_id))

    def history(self, session_id: str, from_version: int = 1) -> Iterator[StoredEvent]: ...

    def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report: ...

    def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report: ...


@runtime_checkable
class AsyncTrackerProtocol(Protocol):
    async def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result: ...

    async def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt: ...

    async def commit(
        self, session_id: str, attempt_id: str, fencing_token: int, tokens_after: int, idempotency_key: Key = None
    ) -> SessionState:
        return await _run(
            self, Commit(session_id, attempt_id, fencing_token, tokens_after, idempotency_key=idempotency_key)
        )

    async def reject(
        self, session_id: str, attempt_id: str, fencing_token: int, reject_reason: str, idempotency_key: Key = None
    ) -> SessionState:
        return await _run(
            self, Reject(session_id, attempt_id, fencing_token, reject_reason, idempotency_key=idempotency_key)
        )

    async def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str: ...

    async def state(self, session_id: str) -> SessionState:
        return await _run(self, State(session_id))

    def history(self, session_id: str, from_version: int = 1) -> AsyncIterator[StoredEvent]: ...

    async def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report: ...

    async def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report: ...
