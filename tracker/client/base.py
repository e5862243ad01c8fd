"""What both clients share: their settings, which wire carries a call, and how an answer settles.

A call that gets no answer (connection refused or lost, a timeout), a ``503``, and a ``504`` that is
not the tracker's own recorded ``count_timeout`` are retried with exponential backoff (``retries``
times, full jitter); every other error is raised at once as the typed error the embedded
``Tracker`` raises (rebuilt from the error body's ``code``).
"""

from __future__ import annotations

import random
from typing import Any, Generic, TypeVar

import httpx

from tracker.client.calls import Call, call_of
from tracker.client.http11 import Answer, Origin, Unreachable
from tracker.core.commands import Command
from tracker.errors import CountTimeout, InvalidInput, StoreUnavailable, TrackerError, error_from_dict

RETRY_STATUSES = frozenset({502, 503, 504})
R = TypeVar("R")


def _error(response: Answer) -> TrackerError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        return error_from_dict(body)
    return TrackerError(
        f"HTTP {response.status_code} from the tracker: {response.text[:200]}", status=response.status_code
    )


def _retryable(response: Answer) -> bool:
    if response.status_code not in RETRY_STATUSES:
        return False
    if response.status_code == 504:  # the tracker's own count_timeout is a recorded answer, not a glitch
        try:
            return response.json().get("code") != CountTimeout.code
        except ValueError:
            return True
    return True


TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class Base(Generic[TransportT]):
    """A client of one ``tracker serve`` endpoint (``base_url``), with one API key."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 35.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: TransportT | None = None,
    ) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise InvalidInput("retries", f"must be an integer >= 0, got {retries!r}")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": "context-tracker-client"}
        self._origin = Origin(self.base_url, self._headers)
        self._open(transport)

    def _open(self, transport: TransportT | None) -> None:
        raise NotImplementedError

    def _delay(self, attempt: int) -> float:
        return random.uniform(0, self.backoff_s * 2**attempt)  # full jitter

    def _settle(self, call: Call[Any], attempt: int, response: Answer | None, exc: Exception | None) -> Any:
        """The parsed answer, ``RETRY`` to try again after a pause, or the typed error raised."""
        if response is None:
            if attempt == self.retries:
                cause = exc.cause if isinstance(exc, Unreachable) else exc
                raise StoreUnavailable(f"the tracker could not be reached: {type(cause).__name__}: {cause}") from exc
            return RETRY
        if response.status_code in (200, 201):
            return call.parse(response.json())
        if not _retryable(response) or attempt == self.retries:
            raise _error(response)
        return RETRY

    @staticmethod
    def _call(request: Command[R] | Call[R]) -> Call[R]:
        """The HTTP call of a command (``tracker.client.calls``), or the call itself."""
        return call_of(request) if isinstance(request, Command) else request


RETRY = object()
