"""How events read: the one-line summary (tables, the HTML report) and the JSON form.

``event_to_dict`` is defined on the read side (:mod:`tracker.queries`, which the HTTP
API and the CLI both page through) and re-exported here with the other formatting.
"""

from __future__ import annotations

import json
from typing import Any

from tracker.queries import event_to_dict

PRESSURE_STYLE = {"normal": "green", "compact": "yellow", "hard_limit": "bold red"}


def event_summary(e: Any) -> str:
    """What happened, in one line (the ``what happened`` column of ``tracker history`` and the report)."""
    d = e.data
    if e.type == "ContextMeasured":
        m = d["measurement"]
        return (
            f"{m['basis']} {m['input_tokens']}/{m['input_limit']} ({d['occupancy_bp']} bp) "
            f"{d['pressure_before']}→{d['pressure']} → {d['action']}"
            + (f" [{d['trigger']}]" if d.get("trigger") else "")
        )
    if e.type == "CompactionStarted":
        budget = d.get("history_budget")
        trigger = f" ({d['trigger']})" if d.get("trigger") else ""
        return f"{d['reason']} attempt {d['attempt_id'][:12]} on {d['basis']}{trigger}" + (
            "" if budget is None else f", budget {budget}"
        )
    if e.type == "CompactionCommitted":
        return f"attempt {d['attempt_id'][:12]} committed {d['tokens_before']}→{d['tokens_after']}, now r{d['new_revision']}"
    if e.type == "CompactionRejected":
        return f"attempt {d['attempt_id'][:12]} rejected: {d['reject_reason']}"
    if e.type == "CountFailed":
        return f"{d['kind']} for {d['model']}: {d['detail']}"
    if e.type == "ContextLimitReached":
        return f"{d['input_tokens']} tokens ≥ limit {d['input_limit']} on {d['basis']}"
    if e.type == "MeasurementRefused":
        return f"{d['kind']}: {d['basis']} (session at r{d['current_revision']})"
    if e.type == "SessionStarted":
        p = d["policy"]
        return f"policy compact at {p['compact_at_bp']} bp, rearm below {p['rearm_below_bp']} bp, automatic={p['automatic']}"
    return json.dumps(d)[:100]


def pressure_markup(pressure: str) -> str:
    """A pressure in Rich markup, coloured by severity."""
    style = PRESSURE_STYLE.get(pressure)
    return f"[{style}]{pressure}[/]" if style else pressure


__all__ = ["event_summary", "event_to_dict", "pressure_markup"]
