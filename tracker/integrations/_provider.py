"""The provider's side of a model call: its usage, its context-length error, one recovery.

The adapters settle each request with the guard's steps (:meth:`Guard.steps
<tracker.integrations.compaction.guard.Guard.steps>`) and send it; :class:`ModelCall` closes
the loop with the provider's own numbers:

* **usage** — after the call, the usage the provider billed is reported on the basis the request
  was observed with (``tracker.report_usage``), so calibration learns from every call. The tracker's
  ``input_tokens`` is the *uncached* input, beside ``cache_read_tokens`` and ``cache_write_tokens``;
  the frameworks count cached tokens *inside* their input total (LangChain's ``usage_metadata``,
  pydantic-ai's ``RequestUsage``, the Agents SDK's ``Usage``, all normalised to OpenAI's inclusive
  convention), so :meth:`Usage.inclusive` takes the cache counts out. A report that fails is logged,
  never raised into the agent's call;
* **a context-length error** — when the call raises the provider's "too long" error (its text is one
  :func:`~tracker.core.provider_errors.parse_context_length_error` reads, the error carries
  OpenAI's code ``context_length_exceeded``, or it is pydantic-ai's ``ModelContextWindowExceededError``;
  the exception or any exception it wraps), the
  rejection is reported (``tracker.report_rejection``), the request is settled again — the tracker
  now decides that basis at the hard limit, so it compacts (or raises ``ContextLimitError`` when no
  compaction is eligible, which propagates) — and the call is retried **once** with the compacted
  history. A second failure propagates, and so does any other error.

:func:`call_sync` and :func:`call_async` drive one :class:`ModelCall` around a framework's
``send``; a framework whose hooks split the call (pydantic-ai) uses the :class:`ModelCall` steps.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tracker.core.provider_errors import parse_context_length_error
from tracker.integrations.compaction import (
    Effects,
    Guard,
    Outcome,
    Report,
    Step,
    Unsupported,
    View,
    drive_async,
    drive_sync,
)
from tracker.integrations.compaction.drive import SummarizeFn

__all__ = ["ModelCall", "Usage", "call_async", "call_sync", "context_length_error", "report_usage_kwargs"]

log = logging.getLogger("tracker.integrations")
R = TypeVar("R")

#: the error code OpenAI (and OpenAI-compatible servers) put on a context-length rejection
CONTEXT_LENGTH_CODES = frozenset({"context_length_exceeded"})
#: exception classes (by name, so no framework is imported) that are a context-length rejection:
#: pydantic-ai's category of a provider's "too long" error, LiteLLM's
CONTEXT_LENGTH_TYPES = frozenset({"ModelContextWindowExceededError", "ContextWindowExceededError"})


# -- usage ---------------------------------------------------------------------------------------


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class Usage:
    """What the provider billed for one call, in the tracker's terms (``input_tokens``: uncached)."""

    input_tokens: int
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None

    @property
    def billed_tokens(self) -> int:
        return self.input_tokens + (self.cache_read_tokens or 0) + (self.cache_write_tokens or 0)

    @classmethod
    def inclusive(
        cls,
        input_tokens: Any,
        *,
        output_tokens: Any = None,
        cache_read_tokens: Any = None,
        cache_write_tokens: Any = None,
    ) -> Usage | None:
        """From a framework's usage whose input total *includes* the cached tokens.

        ``uncached = input - cache_read - cache_write``. When the cache counts exceed the total they
        cannot be part of it (an adapter that reports them beside the input, as Anthropic's raw usage
        does): the total is taken as the uncached input. None when there is nothing to report (no
        input count, or a call that billed no input at all: a fake model)."""
        total = _int(input_tokens)
        if total is None:
            return None
        read, write = _int(cache_read_tokens) or 0, _int(cache_write_tokens) or 0
        if total + read + write == 0:
            return None
        uncached = total - read - write if read + write <= total else total
        return cls(
            input_tokens=uncached,
            output_tokens=_int(output_tokens),
            cache_read_tokens=read or None,
            cache_write_tokens=write or None,
        )


def report_usage_kwargs(basis: str, usage: Usage) -> dict[str, Any]:
    """The keyword arguments of ``tracker.report_usage(session_id, **kwargs)`` for this usage."""
    kwargs: dict[str, Any] = {"basis": basis, "input_tokens": usage.input_tokens}
    for name in ("output_tokens", "cache_read_tokens", "cache_write_tokens"):
        value = getattr(usage, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


# -- the provider's context-length error ----------------------------------------------------------


def _code(exc: BaseException) -> str | None:
    for attr in ("code", "provider_error_code"):
        code = getattr(exc, attr, None)
        if isinstance(code, str):
            return code
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping):
        error = body.get("error")
        inner = error.get("code") if isinstance(error, Mapping) else body.get("code")
        return inner if isinstance(inner, str) else None
    return None


def context_length_error(exc: BaseException) -> str | None:
    """The provider's message when ``exc`` (or an exception it wraps) is a context-length rejection.

        Recognised by its text (:func:`~tracker.core.provider_errors.parse_context_length_error`: the
        Anthropic, OpenAI and Gemini wordings, also inside an SDK's ``Error code: 400 - {...}`` or a
        framework's wrapper), by OpenAI's error code ``context_length_exceeded``, or by its class
    (:data:`CONTEXT_LENGTH_TYPES`: pydantic-ai's ``ModelContextWindowExceededError``). No SDK is imported."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        try:
            text = str(current)
        except Exception:  # noqa: BLE001 - an exception whose str() fails is not one we can read
            text = ""
        if text and parse_context_length_error(text) is not None:
            return text
        if _code(current) in CONTEXT_LENGTH_CODES or any(
            c.__name__ in CONTEXT_LENGTH_TYPES for c in type(current).__mro__
        ):
            return text or type(current).__name__
        current = current.__cause__ or current.__context__
    return None


# -- one model call ---------------------------------------------------------------------------------


class ModelCall:
    """One model call under ``guard`` on ``session_id``: settle, report the usage, recover once from a
    context-length error. Each is a generator of steps (``guard.steps`` and the two reports), run by
    :func:`call_sync` / :func:`call_async` or, where a framework's hooks split the call (pydantic-ai),
    by the adapter with ``drive_async(call.effects, call.settle())`` and so on.

    ``settle()`` → the :class:`Outcome` to send; after the call ``succeeded(result, usage_of)`` reports
    ``usage_of(result)`` on the sent request's basis (never raises); if the call raised,
    ``recover(exc)`` → the outcome to retry with (its ``replacements`` are all made since ``view``),
    or None: re-raise ``exc``.
    """

    def __init__(self, guard: Guard, session_id: str, view: View, summarize: SummarizeFn) -> None:
        self.guard, self.session_id, self.view = guard, session_id, view
        self.effects = Effects(guard, session_id, summarize)
        self.outcome: Outcome | None = None
        self.recovered = False  # a call is retried at most once

    @property
    def basis(self) -> str | None:
        """The basis of the request sent last (None before ``settle``)."""
        return self.outcome.view.basis() if self.outcome is not None else None

    def settle(self) -> Generator[Step, Any, Outcome]:
        self.outcome = yield from self.guard.steps(self.session_id, self.view)
        return self.outcome

    def recover(self, exc: BaseException) -> Generator[Step, Any, Outcome | None]:
        """The provider refused the sent request: report it, compact, and return what to retry with.

        None (re-raise ``exc``) when ``exc`` is not a context-length error, when this call was
        retried already, or when the rejection cannot be reported (the tracker has no
        ``report_rejection``, or the report failed: logged). A ``ContextLimitError`` from settling
        again (nothing eligible to compact) propagates."""
        sent = self.outcome
        message = context_length_error(exc) if sent is not None and not self.recovered else None
        if sent is None or message is None:
            return None
        self.recovered = True
        basis = sent.view.basis()
        try:
            yield Report("report_rejection", {"basis": basis, "message": message})
        except Exception as err:  # noqa: BLE001 - the provider's error is what the caller gets
            log.warning("session %s: the provider refused the request as too long and the rejection was not "
                        "reported (%s: %s), so it is not retried", self.session_id, type(err).__name__, err)  # fmt: skip
            return None
        log.info(
            "session %s: the provider refused %s as too long; compacting and retrying once", self.session_id, basis
        )
        again = yield from self.guard.steps(self.session_id, sent.view)
        if again.view.basis() == basis:
            return None  # nothing changed: sending the same request again would fail the same way
        self.outcome = Outcome(again.view, [*sent.replacements, *again.replacements])
        return self.outcome

    def succeeded(self, result: Any, usage_of: Callable[[Any], Usage | None]) -> Generator[Step, Any, None]:
        """Report the usage of the call's ``result`` (``usage_of`` maps the framework's); never raises."""
        try:
            usage, basis = usage_of(result), self.basis
            if usage is not None and basis is not None:
                yield Report("report_usage", report_usage_kwargs(basis, usage))
        except Unsupported:
            pass  # a tracker that takes no usage reports is sent none
        except Exception as err:  # noqa: BLE001 - a usage report never breaks the agent's call
            log.warning("session %s: usage report failed: %s: %s", self.session_id, type(err).__name__, err)


def call_sync(
    call: ModelCall, send: Callable[[Outcome], R], usage_of: Callable[[R], Usage | None]
) -> tuple[Outcome, R]:
    """Settle, send, report; on a context-length error recover once. The outcome sent and the result."""
    out = drive_sync(call.effects, call.settle())
    while True:
        try:
            result = send(out)
        except Exception as exc:
            retry = drive_sync(call.effects, call.recover(exc))
            if retry is None:
                raise
            out = retry
            continue
        drive_sync(call.effects, call.succeeded(result, usage_of))
        return out, result


async def call_async(
    call: ModelCall, send: Callable[[Outcome], Awaitable[R]], usage_of: Callable[[R], Usage | None]
) -> tuple[Outcome, R]:
    """:func:`call_sync` for an async ``send``, with a sync or an async tracker."""
    out = await drive_async(call.effects, call.settle())
    while True:
        try:
            result = await send(out)
        except Exception as exc:
            retry = await drive_async(call.effects, call.recover(exc))
            if retry is None:
                raise
            out = retry
            continue
        await drive_async(call.effects, call.succeeded(result, usage_of))
        return out, result
