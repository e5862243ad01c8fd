"""What the integration tests share about the provider's side of a call: its errors, the reports they expect.

* ``openai_context_error(count, limit)`` — the ``openai.BadRequestError`` the OpenAI SDK raises for a
  request over the context window (built as the SDK's ``_make_status_error`` builds it: the message
  ``Error code: 400 - {body}``, ``body`` the inner error object with ``code=context_length_exceeded``);
* ``anthropic_context_body(count, limit)`` — Anthropic's error body for a prompt over the limit;
* ``reports(tracker, session)`` — every ``UsageReported`` / ``ProviderRejected`` with the basis of the
  ``ContextMeasured`` just before it (the request the call sent);
* ``FailingReports(tracker)`` — the tracker, with ``report_usage`` raising.
"""

from __future__ import annotations

from typing import Any

OPENAI_URL = "https://api.openai.com/v1/chat/completions"


def openai_context_message(count: int, limit: int) -> str:
    return (
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in {count} "
        "tokens. Please reduce the length of the messages."
    )


def openai_context_error(count: int, limit: int) -> Exception:
    import openai

    try:
        import httpx2 as httpx  # the openai SDK's own HTTP client, where it ships one
    except ImportError:  # pragma: no cover - older openai SDKs use httpx
        import httpx  # type: ignore[no-redef]

    body = {
        "message": openai_context_message(count, limit),
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    response = httpx.Response(400, request=httpx.Request("POST", OPENAI_URL))
    return openai.BadRequestError(f"Error code: 400 - {{'error': {body}}}", response=response, body=body)


def anthropic_context_body(count: int, limit: int) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"prompt is too long: {count} tokens > {limit} maximum"},
    }


def reports(tracker: Any, session: str) -> list[tuple[str, dict[str, Any], str | None]]:
    """(type, data, basis measured just before) of every provider report on the session, oldest first."""
    out, measured = [], None
    for e in tracker.history(session):
        if e.type == "ContextMeasured":
            measured = e.data["measurement"]["basis"]
        elif e.type in ("UsageReported", "ProviderRejected"):
            out.append((e.type, e.data, measured))
    return out


class FailingReports:
    """The tracker, except that ``report_usage`` raises (a report that fails must not break the call)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def report_usage(self, session_id: str, **kwargs: Any) -> Any:
        self.failed += 1
        raise RuntimeError("the tracker is unreachable")
