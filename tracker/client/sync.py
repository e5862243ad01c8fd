"""``TrackerClient``: the Tracker over HTTP, sync. Each method is its command (or read) run over the table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any, TypeVar, Unpack

import httpx

from tracker.client.base import RETRY, Base
from tracker.client.calls import POLICY, Call, FleetPolicy, Waiting, call_of, given, history_pages, sessions_pages
from tracker.client.http11 import Answer, SyncWire, Unreachable, encode, httpx_answer
from tracker.core import commands as cmd
from tracker.core.decide import Result
from tracker.core.reports import Report
from tracker.core.state import Attempt
from tracker.errors import WaitTimeout
from tracker.protocol import CompactionOptions, ObserveOptions, RejectionOptions, TrackerProtocol, UsageOptions
from tracker.store.base import StoredEvent

R = TypeVar("R")


class TrackerClient(Base[httpx.BaseTransport], TrackerProtocol):
    """A ``Tracker`` over HTTP (sync). Use as a context manager or call ``close()``."""

    def _open(self, transport: httpx.BaseTransport | None) -> None:
        self._wire: SyncWire | None = None
        self._http: httpx.Client | None = None
        if transport is None and not self._origin.proxied():
            self._wire = SyncWire(self._origin, self.timeout)
        else:
            self._http = httpx.Client(
                base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
            )

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> TrackerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, call: Call[Any]) -> Answer:
        if self._wire is not None:
            target, body = encode(call)
            return self._wire.send(call.method, target, body)
        assert self._http is not None
        try:
            return httpx_answer(self._http.request(call.method, call.path, json=call.json, params=call.params))
        except httpx.TransportError as exc:
            raise Unreachable(exc) from exc

    def run(self, request: cmd.Command[R] | Call[R]) -> R:
        """A command (``tracker.core.commands``), or a call, sent (retried as the module says); its answer."""
        call, attempt = self._call(request), 0  # (``_settle`` raises once the retries are spent)
        while (answer := self._settle(call, attempt, *self._sent(call))) is RETRY:
            time.sleep(self._delay(attempt))
            attempt += 1
        return answer

    def _sent(self, call: Call[Any]) -> tuple[Answer | None, Exception | None]:
        try:
            return self._send(call), None
        except Unreachable as exc:
            return None, exc

    # -- the Tracker's methods: each its command, run ------------------------------------------
    def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result:
        return self.run(given(cmd.Observe, session_id, options))

    def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt:
        return self.run(given(cmd.RequestCompaction, session_id, options))

    def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report:
        """What the provider billed for the request of a measured ``basis`` (``Tracker.report_usage``)."""
        return self.run(given(cmd.ReportUsage, session_id, options))

    def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report:
        """The provider refused the request of a measured ``basis`` as too long (``Tracker.report_rejection``)."""
        return self.run(given(cmd.ReportRejection, session_id, options))

    def calibration(self) -> list[dict[str, Any]]:
        """What this key's fleet's provider reports taught, per model and counter kind
        (``GET /v1/calibration``: ``ModelSummary.to_data()`` rows without ``fleet``).

        Client-only, like ``policy()``: the embedded ``Tracker.calibration(fleet)`` returns ``ModelSummary`` rows."""
        return self.run(call_of(cmd.Calibration()))

    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str:
        """Block until the attempt ends: 'committed' or 'rejected:<reason>'. Raises ``WaitTimeout``."""
        waiting = Waiting(cmd.Wait(session_id, attempt_id, timeout))
        while True:
            try:
                return self.run(waiting.poll())
            except WaitTimeout:
                waiting.polled_out()

    def history(self, session_id: str, from_version: int = 1) -> Iterator[StoredEvent]:
        """Every event of the session from ``from_version`` on, fetched page by page."""
        pages = history_pages(session_id, from_version)
        while (call := pages.next_call()) is not None:
            yield from pages.rows(self.run(call))

    def sessions(
        self, *, pressure: str | None = None, since: datetime | float | None = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        """The fleet's sessions (``GET /v1/sessions``), most recently active first, fetched page by page.

        ``pressure``: only sessions at this pressure; ``since``: only those active at or after this
        time (a datetime, or seconds since the epoch). Rows: ``session_id``, ``version``,
        ``pressure``, ``occupancy_bp``, ``revision``, ``open_attempts``, ``created_at``,
        ``updated_at`` (last activity, ISO text).
        """
        pages = sessions_pages(pressure, since, page_size)
        while (call := pages.next_call()) is not None:
            yield from pages.rows(self.run(call))

    def policy(self) -> FleetPolicy:
        """The policy this key's fleet's new sessions start with (``GET /v1/policy``): the fleet's
        own, else the server's. Retried like every read. A session keeps the policy it started with;
        a change reaches new sessions within the server's ``TRACKER_API_KEY_CACHE_S``.

        Client-only: not part of ``TrackerProtocol``, since an embedded ``Tracker`` has no fleet
        (its policy is ``Tracker.policy``).
        """
        return self.run(POLICY)
