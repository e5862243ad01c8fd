"""``AsyncTrackerClient``: the Tracker over HTTP for asyncio code, the same methods as ``TrackerClient``, awaited.

On asyncio's loop it talks over its own wire (``tracker.client.http11``); on another event loop (trio),
with a ``transport=``, or behind a proxy, through httpx.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from datetime import datetime
from typing import Any, TypeVar, Unpack

import httpx

from tracker.client.base import RETRY, Base
from tracker.client.calls import POLICY, Call, FleetPolicy, Waiting, call_of, given, history_pages, sessions_pages
from tracker.client.http11 import Answer, AsyncWire, Unreachable, encode, httpx_answer, on_asyncio
from tracker.core import commands as cmd
from tracker.core.decide import Result
from tracker.core.reports import Report
from tracker.core.state import Attempt
from tracker.errors import WaitTimeout
from tracker.protocol import AsyncTrackerProtocol, CompactionOptions, ObserveOptions, RejectionOptions, UsageOptions
from tracker.store.base import StoredEvent

R = TypeVar("R")


class AsyncTrackerClient(Base[httpx.AsyncBaseTransport], AsyncTrackerProtocol):
    """A ``Tracker`` over HTTP for asyncio code: the same methods, awaited."""

    def _open(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._transport = transport
        self._wire: AsyncWire | None = None
        self._http: httpx.AsyncClient | None = None
        if transport is None and not self._origin.proxied():
            self._wire = AsyncWire(self._origin, self.timeout)

    def _httpx(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=self._transport
            )
        return self._http

    async def aclose(self) -> None:
        if self._wire is not None:
            await self._wire.aclose()
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncTrackerClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def _send(self, call: Call[Any]) -> Awaitable[Answer]:
        if self._wire is not None and on_asyncio():
            target, body = encode(call)
            return self._wire.send(call.method, target, body)
        return self._send_httpx(call)

    async def _send_httpx(self, call: Call[Any]) -> Answer:
        try:
            response = await self._httpx().request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise Unreachable(exc) from exc
        return httpx_answer(response)

    async def run(self, request: cmd.Command[R] | Call[R]) -> R:
        """A command, or a call, sent (see ``TrackerClient.run``); its answer."""
        call, attempt = self._call(request), 0
        while (answer := self._settle(call, attempt, *(await self._sent(call)))) is RETRY:
            await asyncio.sleep(self._delay(attempt))
            attempt += 1
        return answer

    async def _sent(self, call: Call[Any]) -> tuple[Answer | None, Exception | None]:
        try:
            return await self._send(call), None
        except Unreachable as exc:
            return None, exc

    # -- the Tracker's methods, awaited: each its command, run ---------------------------------
    async def observe(self, session_id: str, **options: Unpack[ObserveOptions]) -> Result:
        return await self.run(given(cmd.Observe, session_id, options))

    async def request_compaction(self, session_id: str, **options: Unpack[CompactionOptions]) -> Attempt:
        return await self.run(given(cmd.RequestCompaction, session_id, options))

    async def report_usage(self, session_id: str, **options: Unpack[UsageOptions]) -> Report:
        return await self.run(given(cmd.ReportUsage, session_id, options))

    async def report_rejection(self, session_id: str, **options: Unpack[RejectionOptions]) -> Report:
        return await self.run(given(cmd.ReportRejection, session_id, options))

    async def calibration(self) -> list[dict[str, Any]]:
        """What this key's fleet's provider reports taught (see ``TrackerClient.calibration``)."""
        return await self.run(call_of(cmd.Calibration()))

    async def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str:
        waiting = Waiting(cmd.Wait(session_id, attempt_id, timeout))
        while True:
            try:
                return await self.run(waiting.poll())
            except WaitTimeout:
                waiting.polled_out()

    async def history(self, session_id: str, from_version: int = 1) -> AsyncIterator[StoredEvent]:
        pages = history_pages(session_id, from_version)
        while (call := pages.next_call()) is not None:
            for event in pages.rows(await self.run(call)):
                yield event

    async def sessions(
        self, *, pressure: str | None = None, since: datetime | float | None = None, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        """The fleet's sessions, most recently active first (see ``TrackerClient.sessions``)."""
        pages = sessions_pages(pressure, since, page_size)
        while (call := pages.next_call()) is not None:
            for row in pages.rows(await self.run(call)):
                yield row

    async def policy(self) -> FleetPolicy:
        """The policy this key's fleet's new sessions start with (see ``TrackerClient.policy``).

        Client-only: not part of ``TrackerProtocol``, since an embedded ``Tracker`` has no fleet.
        """
        return await self.run(POLICY)
