"""The provider's own numbers as decisions: a usage report, a context-length rejection.

``decide_usage`` and ``decide_rejection`` check a report against the session (the basis must be
one it measured, the model the one measured, every count a plausible integer) and return the
``Outcome`` recording it: a ``UsageReported`` or a ``ProviderRejected`` event, nothing else. Bad
input raises ``InvalidInput`` naming the field before anything is recorded. Pure.

What the events do afterwards: the calibration ledger (:mod:`tracker.core.ledger`) folds both
into per-model samples and learned limits; ``apply`` marks a rejected basis of the current
revision, which every later measurement of it decides at the hard limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracker.core import events as ev
from tracker.core.model import JSON_SAFE_INT, Basis, ceil_div, check_text, is_int
from tracker.core.outcome import Outcome, outcome
from tracker.core.provider_errors import MAX_MESSAGE_CHARS, parse_context_length_error
from tracker.core.state import RECENT_BASES_KEPT, MeasuredBasis, SessionState
from tracker.errors import InvalidInput

__all__ = [
    "ABSURD_LIMIT_MULTIPLE",
    "Report",
    "LEARNED_LIMIT_FLOOR",
    "MESSAGE_KEPT_CHARS",
    "decide_rejection",
    "decide_usage",
    "learned_limit",
    "same_report",
]

#: a reported count above this multiple of the measurement's input limit is not a count of that request
ABSURD_LIMIT_MULTIPLE = 4
#: a limit learned from a rejection is never below this fraction of the measured limit (a bound on
#: what one report can do: it can make the fleet's sessions compact earlier, not refuse everything)
LEARNED_LIMIT_FLOOR = (1, 4)
#: how much of a rejection's message the event keeps
MESSAGE_KEPT_CHARS = 2000


@dataclass(frozen=True)
class Report:
    """What ``report_usage`` / ``report_rejection`` return: the event recorded, at the session's version."""

    session_id: str
    version: int
    event: ev.UsageReported | ev.ProviderRejected

    @property
    def type(self) -> str:
        return self.event.TYPE

    def to_data(self) -> dict[str, Any]:
        data = {k: v for k, v in self.event.to_data().items() if k != "v"}
        return {"session_id": self.session_id, "version": self.version, "type": self.type, **data}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Report:
        """The inverse of ``to_data`` (an HTTP answer)."""
        kind = {c.TYPE: c for c in (ev.UsageReported, ev.ProviderRejected)}.get(data.get("type", ""))
        if kind is None:
            raise InvalidInput("type", f"must be UsageReported or ProviderRejected, got {data.get('type')!r}")
        body = {k: v for k, v in data.items() if k not in ("session_id", "version", "type")}
        return cls(data["session_id"], data["version"], kind.from_data(body))  # type: ignore[arg-type]


def _count(field: str, value: Any, cap: int | None = None, what: str = "") -> int | None:
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise InvalidInput(field, f"must be an integer token count >= 0, got {str(value)[:40]!r}")
    if value > JSON_SAFE_INT or (cap is not None and value > cap):
        bound = JSON_SAFE_INT if cap is None else cap
        raise InvalidInput(field, f"{value} is absurd{what}: at most {bound}")
    return value


def _measured(state: SessionState, basis: Any, model: Any) -> tuple[Basis, MeasuredBasis]:
    b = Basis.parse(basis, state.revision)
    m = state.measured_basis(str(b))
    if m is None:
        raise InvalidInput(
            "basis",
            f"{b} was not measured in this session (a report names one of its last {RECENT_BASES_KEPT} measured bases)",
        )
    if model is not None:
        check_text("model", model, 301)
        name = model.rpartition("/")[2]
        if name != m.model:
            raise InvalidInput("model", f"{model!r} is not the model {b} was measured for ({m.model!r})")
    return b, m


def _cap(m: MeasuredBasis) -> tuple[int, str]:
    cap = ABSURD_LIMIT_MULTIPLE * m.input_limit
    return cap, f" for a request measured against an input limit of {m.input_limit} ({ABSURD_LIMIT_MULTIPLE} x)"


def decide_usage(
    state: SessionState,
    *,
    basis: Any,
    input_tokens: Any,
    model: Any = None,
    output_tokens: Any = None,
    cache_read_tokens: Any = None,
    cache_write_tokens: Any = None,
    now: float,
) -> Outcome:
    """Record what the provider billed for the request of ``basis`` (input + cache tokens)."""
    b, m = _measured(state, basis, model)
    cap, what = _cap(m)
    if input_tokens is None:
        raise InvalidInput("input_tokens", "is required: the input tokens the provider billed")
    inp = _count("input_tokens", input_tokens, cap, what)
    out = _count("output_tokens", output_tokens, cap, what)
    cr = _count("cache_read_tokens", cache_read_tokens, cap, what)
    cw = _count("cache_write_tokens", cache_write_tokens, cap, what)
    assert inp is not None
    total = inp + (cr or 0) + (cw or 0)
    if total > cap:
        raise InvalidInput("input_tokens", f"input + cache tokens {total} is absurd{what}: at most {cap}")
    event = ev.UsageReported(
        basis=str(b),
        model=m.model,
        quality=m.quality,
        counted_tokens=m.counted_tokens,
        input_tokens=inp,
        output_tokens=out,
        cache_read_tokens=cr,
        cache_write_tokens=cw,
        at=now,
        messages=m.messages,
        chain=m.chain,
        content=m.content,
        anchored=m.anchored,
        decided_tokens=m.decided_tokens,
    )
    return outcome(state, [event])


def learned_limit(measured_limit: int, input_tokens: int | None, input_limit: int | None) -> int | None:
    """The input limit a rejection teaches, when lower than the measured one (else None).

    The provider's limit when it states one; otherwise one less than the count it refused. Never
    below ``LEARNED_LIMIT_FLOOR`` of the measured limit."""
    ceiling = input_limit if input_limit is not None else (input_tokens - 1 if input_tokens else None)
    if ceiling is None or ceiling >= measured_limit:
        return None
    num, den = LEARNED_LIMIT_FLOOR
    return max(ceiling, ceil_div(measured_limit * num, den), 1)


def _clean(message: str) -> str:
    """The message as kept: at most ``MESSAGE_KEPT_CHARS``, control characters as spaces."""
    head = message[:MESSAGE_KEPT_CHARS]
    return "".join(ch if ch.isprintable() or ch == " " else " " for ch in head)


def decide_rejection(
    state: SessionState,
    *,
    basis: Any,
    message: Any = None,
    input_tokens: Any = None,
    input_limit: Any = None,
    model: Any = None,
    now: float,
) -> Outcome:
    """Record that the provider refused the request of ``basis`` as too long.

    The counts are read from ``message`` (Anthropic, OpenAI and Gemini wordings) unless given;
    an unrecognised message is still recorded, with no numbers."""
    b, m = _measured(state, basis, model)
    if message is not None and not isinstance(message, str):
        raise InvalidInput("message", f"must be the provider's error text, got {type(message).__name__}")
    cap, what = _cap(m)
    n = _count("input_tokens", input_tokens, cap, what)
    lim = _count("input_limit", input_limit, cap, what)
    if lim == 0:
        raise InvalidInput("input_limit", "must be > 0: a limit of 0 tokens is not a model's limit")
    parsed = parse_context_length_error(message[:MAX_MESSAGE_CHARS]) if message else None
    if parsed is not None:
        n = n if n is not None else _plausible(parsed.input_tokens, cap)
        lim = lim if lim is not None else _plausible(parsed.input_limit, cap)
    event = ev.ProviderRejected(
        basis=str(b),
        model=m.model,
        quality=m.quality,
        counted_tokens=m.counted_tokens,
        measured_limit=m.input_limit,
        input_tokens=n,
        input_limit=lim,
        learned_limit=learned_limit(m.input_limit, n, lim),
        provider=parsed.provider if parsed else None,
        form=parsed.form if parsed else None,
        message=_clean(message) if message else None,
        at=now,
    )
    return outcome(state, [event])


def same_report(event: ev.UsageReported | ev.ProviderRejected, given: dict[str, Any]) -> None:
    """An idempotency key is bound to the whole report: answered from the record only when the
    call gives the same basis and numbers, else ``InvalidInput`` on ``idempotency_key``."""
    differs = []
    basis = given.get("basis")
    reported = Basis.parse(event.basis)
    # a bare basis names the revision the report was recorded at
    if isinstance(basis, (str, Basis)) and Basis.parse(basis, reported.revision) != reported:
        differs.append("basis")
    for name, value in given.items():
        if name == "basis" or value is None:
            continue
        recorded = getattr(event, name, None)
        if name == "message":
            value = _clean(value) if isinstance(value, str) else value
        elif name == "model":
            value = value.rpartition("/")[2] if isinstance(value, str) else value
        if recorded != value:
            differs.append(name)
    if differs:
        raise InvalidInput(
            "idempotency_key",
            f"was used for a {event.TYPE} with another {', '.join(differs)}: a retry must repeat the call as it was",
        )


def _plausible(value: int | None, cap: int) -> int | None:
    """A number read from a message, unless it is absurd for this request (then it is not used)."""
    return value if value is not None and 0 < value <= cap else None
