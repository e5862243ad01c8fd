"""How events read: the one-line summary (tables, the HTML report) and the JSON form.

``event_to_dict`` is defined on the read side (:mod:`tracker.queries`, which the HTTP
API and the CLI both page through) and re-exported here with the other formatting.
"""

from __future__ import annotations

import json

from tracker.core import events as ev
from tracker.queries import Recorded, Unrecognised, decode, event_to_dict
from tracker.store import StoredEvent

PRESSURE_STYLE = {"normal": "green", "compact": "yellow", "hard_limit": "bold red"}


def event_summary(e: StoredEvent | Recorded) -> str:
    """What happened, in one line (the ``what happened`` column of ``tracker history`` and the report)."""
    return summary((e if isinstance(e, Recorded) else decode(e)).event)


def summary(event: ev.DomainEvent | Unrecognised) -> str:
    """The one-line summary of a decoded event."""
    match event:
        case ev.ContextMeasured(measurement=m):
            return (
                f"{m.basis} {_measured(event)} ({event.occupancy_bp} bp) "
                f"{event.pressure_before}→{event.pressure} → {event.action}"
                + (f" [{event.trigger}]" if event.trigger else "")
                + (" (provider rejected this basis)" if event.rejected else "")
            )
        case ev.UsageReported():
            decided = event.decided_tokens
            return (
                f"usage {event.basis} billed {event.billed_tokens:,} (counted {event.counted_tokens:,}"
                + (
                    f", decided {decided:,} = {decided / event.billed_tokens:.3f} × billed"
                    if decided is not None and event.billed_tokens
                    else ""
                )
                + (", anchored" if event.anchored else "")
                + ")"
                + (f", {event.output_tokens:,} out" if event.output_tokens is not None else "")
            )
        case ev.ProviderRejected():
            if event.input_tokens is not None and event.input_limit is not None:
                numbers = f": {event.input_tokens:,} > {event.input_limit:,}"
            elif event.input_tokens is not None:
                numbers = f": {event.input_tokens:,} tokens"
            else:
                numbers = f" (counted {event.counted_tokens:,})"
            form = f" ({event.form})" if event.form else (" (message not recognised)" if event.message else "")
            learned = f", learned limit {event.learned_limit:,}" if event.learned_limit is not None else ""
            return f"provider rejected {event.basis}{numbers}{form}{learned}"
        case ev.CompactionStarted():
            budget = event.history_budget
            trigger = f" ({event.trigger})" if event.trigger else ""
            return f"{event.reason} attempt {event.attempt_id[:12]} on {event.basis}{trigger}" + (
                "" if budget is None else f", budget {budget}"
            )
        case ev.CompactionCommitted():
            return (
                f"attempt {event.attempt_id[:12]} committed {event.tokens_before}→{event.tokens_after}, "
                f"now r{event.new_revision}"
            )
        case ev.CompactionRejected():
            return f"attempt {event.attempt_id[:12]} rejected: {event.reject_reason}"
        case ev.CountFailed():
            return f"{event.kind} for {event.model}: {event.detail}"
        case ev.ContextLimitReached():
            return f"{event.input_tokens} tokens ≥ limit {event.input_limit} on {event.basis}"
        case ev.UsageReported():
            ratio = f" (×{event.billed_tokens / event.counted_tokens:.3f})" if event.counted_tokens else ""
            cache = (
                f", cache read {event.cache_read_tokens} / write {event.cache_write_tokens}"
                if event.cache_read_tokens or event.cache_write_tokens
                else ""
            )
            return f"{event.basis}: billed {event.billed_tokens}, counted {event.counted_tokens}{ratio}{cache}"
        case ev.ProviderRejected():
            got = "?" if event.input_tokens is None else event.input_tokens
            limit = "?" if event.input_limit is None else event.input_limit
            learned = "" if event.learned_limit is None else f", learned limit {event.learned_limit}"
            return f"{event.basis}: provider rejected as too long: {got} > {limit} (counted {event.counted_tokens}){learned}"
        case ev.MeasurementRefused():
            return f"{event.kind}: {event.basis} (session at r{event.current_revision})"
        case ev.SessionStarted(policy=p):
            return f"policy compact at {p.compact_at_bp} bp, rearm below {p.rearm_below_bp} bp, automatic={p.automatic}"
        case ev.SessionArchived():
            return (
                f"versions 1-{event.final_version} archived to {event.archive}/{event.segment}; "
                f"`tracker restore {event.archive} --session ID` brings them back"
            )
        case Unrecognised(data=data):
            return json.dumps(data)[:100]
    return json.dumps(event.to_data())[:100]


def _measured(event: ev.ContextMeasured) -> str:
    """``tokens/limit`` as decided; the counter's raw count (and the measured limit) beside them when
    calibration or a learned limit changed them."""
    raw, limit = event.measurement.input_tokens, event.measurement.input_limit
    tokens, decided_limit = event.decided_tokens, event.decided_limit
    text = f"{tokens}/{decided_limit}"
    notes = []
    if tokens != raw:
        notes.append(f"counted {raw}")
    if decided_limit != limit:
        notes.append(f"learned limit, measured {limit}")
    a = event.anchor
    if a is not None:
        notes.append(f"anchored on {a.basis}: billed {a.billed} + {a.estimated_delta} new")
    return text + (f" ({', '.join(notes)})" if notes else "")


def pressure_markup(pressure: str) -> str:
    """A pressure in Rich markup, coloured by severity."""
    style = PRESSURE_STYLE.get(pressure)
    return f"[{style}]{pressure}[/]" if style else pressure


__all__ = ["event_summary", "event_to_dict", "pressure_markup", "summary"]
