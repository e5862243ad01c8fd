"""The drivers: run the guard's steps against a tracker, its counter, the share and a summariser.

:func:`drive_sync` runs a generator of steps (``guard.steps``, ``ModelCall.settle`` ...) to its
return value with a sync tracker (``Tracker``, ``TrackerClient``); :func:`drive_async` does the same
from an event loop with any tracker: an ``AsyncTrackerClient``'s calls and an async summariser are
awaited on the loop, anything blocking (a sync tracker or client, the Redis or file share, the
counter, a sync summariser) runs in a worker thread (:func:`call_async`, this package's one thread hop).
What a step returns is sent into the generator; what it raises is thrown in at the ``yield``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tracker.core.events import CompactionCommitted
from tracker.errors import InvalidInput
from tracker.integrations.compaction import guard as g
from tracker.integrations.compaction.view import Outcome, Spans, View
from tracker.queries import decode

T = TypeVar("T")
M = TypeVar("M")
#: ``summarize(view, start, end, budget) -> text`` (or an awaitable of it): what a ``Summarize`` step runs
SummarizeFn = Callable[[View, int, int, int], str | Awaitable[str]]
Effect = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _is_async(fn: Any) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or (callable(fn) and inspect.iscoroutinefunction(type(fn).__call__))


def _commit_to(stored: Any, revision: int) -> CompactionCommitted | None:
    event = decode(stored).event
    return event if isinstance(event, CompactionCommitted) and event.new_revision == revision else None


def find_commit(tracker: Any, session_id: str, revision: int, from_version: int) -> CompactionCommitted | None:
    """The session's commit to ``revision`` (typed, through the read side's decoder), reading its
    history from ``from_version`` on and no further than that commit."""
    for stored in tracker.history(session_id, from_version=from_version):
        if (found := _commit_to(stored, revision)) is not None:
            return found
    return None


async def afind_commit(tracker: Any, session_id: str, revision: int, from_version: int) -> CompactionCommitted | None:
    """:func:`find_commit` for an async tracker (its ``history`` is an async iterator)."""
    async with contextlib.aclosing(tracker.history(session_id, from_version=from_version)) as events:
        async for stored in events:
            if (found := _commit_to(stored, revision)) is not None:
                return found
    return None


@dataclass
class Effects:
    """What one call's steps run against: the guard's tracker, counter and share, on ``session_id``,
    and the call's ``summarize``."""

    guard: g.Guard
    session_id: str
    summarize: SummarizeFn | None = None

    def of(self, step: g.Step) -> Effect:
        """The callable a step runs, with its arguments (called by a driver, sync or async)."""
        t, s = self.guard.tracker, self.session_id
        match step:
            case g.Observe(request=request, model=model, basis=basis):
                return t.observe, (s,), {"request": request, "model": model, "basis": basis}
            case g.Wait(attempt_id=attempt_id, timeout=timeout):
                return t.wait, (s, attempt_id), {"timeout": timeout}
            case g.Commit(attempt_id=a, fencing_token=f, tokens_after=n):
                return t.commit, (s, a, f, n), {}
            case g.Reject(attempt_id=a, fencing_token=f, reason=reason):
                return t.reject, (s, a, f, reason), {}
            case g.Report(method=method, options=options):
                report = getattr(t, method, None)
                if not callable(report):
                    raise g.Unsupported(f"this tracker takes no {method.replace('_', ' ')}s")
                return report, (s,), options
            case g.FindCommit(revision=revision, from_version=from_version):
                finder = afind_commit if inspect.isasyncgenfunction(getattr(t, "history", None)) else find_commit
                return finder, (t, s, revision, from_version), {}
            case g.Count(request=request):
                return self.guard.count, (request,), {}
            case g.Summarize(view=view, start=start, end=end, budget=budget):
                if self.summarize is None:
                    raise InvalidInput("summarize", "this call was given no summariser")
                return self.summarize, (view, start, end, budget), {}
            case g.Publish(attempt_id=a, payload=payload):
                return self.guard.share.put, (s, a, payload), {}
            case g.Fetch(attempt_id=a):
                return self.guard.share.get, (s, a), {}
        raise TypeError(f"not a step: {step!r}")  # pragma: no cover


class _Run(Generic[T]):
    """A generator of steps being driven: ``next()`` sends it the last reply (or throws the last error)."""

    value: T

    def __init__(self, steps: Generator[g.Step, Any, T]) -> None:
        self._steps = steps
        self.reply: Any = None
        self.error: Exception | None = None

    def next(self) -> g.Step | None:
        """The next step, or None when the generator returned (its value is ``value``)."""
        reply, error, self.reply, self.error = self.reply, self.error, None, None
        try:
            return self._steps.send(reply) if error is None else self._steps.throw(error)
        except StopIteration as stop:
            self.value = stop.value
            return None


def drive_sync(effects: Effects, steps: Generator[g.Step, Any, T]) -> T:
    """Run ``steps`` to their return value, each step in this thread (a sync tracker)."""
    run = _Run(steps)
    while (step := run.next()) is not None:
        try:
            fn, args, kwargs = effects.of(step)
            run.reply = fn(*args, **kwargs)
            if inspect.isawaitable(run.reply):
                if not isinstance(step, g.Summarize):
                    _close(run.reply)
                    raise InvalidInput("tracker", "an async tracker needs the framework's async path (ainvoke, arun)")
                run.reply = asyncio.run(_awaited(run.reply))  # an async summariser, from sync code
        except Exception as exc:  # noqa: BLE001 - thrown into the steps, which decide
            run.error = exc
    return run.value


async def drive_async(effects: Effects, steps: Generator[g.Step, Any, T]) -> T:
    """Run ``steps`` to their return value from an event loop, with a sync or an async tracker."""
    run = _Run(steps)
    while (step := run.next()) is not None:
        try:
            fn, args, kwargs = effects.of(step)
            run.reply = await call_async(fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - thrown into the steps, which decide
            run.error = exc
    return run.value


class ContextGuard(g.Guard):
    """The guard (:class:`~.guard.Guard`: its ``steps``) with the sync driver, for code that is not an adapter
    (the adapters drive the steps themselves, sync or async: ``drive_async(call.effects, call.settle())``)."""

    def before_call(self, session_id: str, view: View, summarize: Callable[[int, int, int], str]) -> Outcome:
        """Settle ``view`` with a sync tracker; ``summarize(start, end, budget)`` indexes the view being
        compacted (the one given, unless a compaction was adopted first)."""
        effects = Effects(self, session_id, lambda _view, start, end, budget: summarize(start, end, budget))
        return drive_sync(effects, self.steps(session_id, view))


async def call_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` from the loop: awaited when it is async, else in a worker thread (it may
    block: a sync tracker waits on the network, a sync summariser on a model); an awaitable it returns
    is awaited on the loop."""
    if _is_async(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def _awaited(value: Awaitable[T]) -> T:
    return await value


def _close(awaitable: Any) -> None:
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()  # a coroutine never awaited: no "was never awaited" warning


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def summarize_with(summarizer: Callable[[list[M], int], Any], spans: Spans[M]) -> SummarizeFn:
    """The ``Summarize`` step of one call: ``summarizer(messages, budget_tokens) -> text``, sync or async
    (or a sync callable returning an awaitable), given the framework messages of the span (``spans``).

    An adapter turns its framework's own summariser (a chat model, an ``Agent``, an SDK ``Model``) into
    such a callable first; the drivers await an async one on the agent's loop."""
    if _is_async(summarizer):

        async def summarize_async(view: View, start: int, end: int, budget: int) -> str:
            return _text(await summarizer(spans(view, start, end), budget))

        return summarize_async

    def summarize(view: View, start: int, end: int, budget: int) -> str | Awaitable[str]:
        result = summarizer(spans(view, start, end), budget)
        return _texted(result) if inspect.isawaitable(result) else _text(result)

    return summarize


async def _texted(value: Awaitable[Any]) -> str:
    return _text(await value)


__all__: Sequence[str] = (
    "ContextGuard",
    "Effects",
    "SummarizeFn",
    "afind_commit",
    "call_async",
    "drive_async",
    "drive_sync",
    "find_commit",
    "summarize_with",
)
