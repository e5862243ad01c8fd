"""What agent code may rely on, whether the tracker is embedded or remote.

``Tracker`` (embedded) and ``TrackerClient`` (HTTP) satisfy :class:`TrackerProtocol`;
``AsyncTrackerClient`` satisfies :class:`AsyncTrackerProtocol`, the same methods awaited.
Integrations (LangChain, pydantic-ai) are written against these, never against a class.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol, runtime_checkable

from tracker.core.decide import Result
from tracker.core.model import Basis, Measurement
from tracker.core.state import Attempt, SessionState
from tracker.store.base import StoredEvent


@runtime_checkable
class TrackerProtocol(Protocol):
    def observe(
        self,
        session_id: str,
        *,
        request: Any = None,
        measurement: Measurement | dict[str, Any] | None = None,
        model: str | None = None,
        basis: Basis | str | None = None,
        compaction_threshold: float | None = None,
        scope: str | None = None,
        scope_confidence: float | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Result: ...

    def request_compaction(
        self,
        session_id: str,
        *,
        basis: Basis | str | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Attempt: ...

    def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState: ...

    def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState: ...

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str: ...

    def state(self, session_id: str) -> SessionState: ...

    def history(self, session_id: str, from_version: int = 1) -> Iterator[StoredEvent]: ...


@runtime_checkable
class AsyncTrackerProtocol(Protocol):
    async def observe(
        self,
        session_id: str,
        *,
        request: Any = None,
        measurement: Measurement | dict[str, Any] | None = None,
        model: str | None = None,
        basis: Basis | str | None = None,
        compaction_threshold: float | None = None,
        scope: str | None = None,
        scope_confidence: float | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Result: ...

    async def request_compaction(
        self,
        session_id: str,
        *,
        basis: Basis | str | None = None,
        overhead_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> Attempt: ...

    async def commit(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        tokens_after: int,
        idempotency_key: str | None = None,
    ) -> SessionState: ...

    async def reject(
        self,
        session_id: str,
        attempt_id: str,
        fencing_token: int,
        reject_reason: str,
        idempotency_key: str | None = None,
    ) -> SessionState: ...

    async def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str: ...

    async def state(self, session_id: str) -> SessionState: ...

    def history(self, session_id: str, from_version: int = 1) -> AsyncIterator[StoredEvent]: ...
