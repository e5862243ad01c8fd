"""What-if: replay a JSON-lines trace through the decision core, with no database (the README).

Input ops (one JSON object per line):

    {"op": "measure", "basis": "b2", "input_tokens": 80, "input_limit": 100}
        optional: compaction_threshold, scope, scope_confidence, model, quality, overhead_tokens, at,
        calibration ({"factor_bp": 7400, "intercept": 300, "samples": 20}: applied to a count of
        quality heuristic_estimate, as live), counted_tokens (the counter's raw count; the same as
        input_tokens, either may be given), learned_limit (a lower limit learned from a rejection)
        shape ({"messages": 12, "chain": "<sha256>", "at": 10, "at_chain": "<sha256>"}: the counted
        request's history digests; a measure that extends the session's last billed request is
        decided anchored on it, as live)
    {"op": "usage", "basis": "b2", "input_tokens": 61234}   what the provider billed for that
        basis (input + cache tokens): with a shape, it anchors the next decisions
    {"op": "rejection", "basis": "b2"}             the provider refused that basis: it decides at
        the hard limit from then on (optional: input_tokens, input_limit, the provider's numbers)
    {"op": "commit", "tokens_after": 40}          acts on the open attempt, automatic first
    {"op": "reject", "reject_reason": "execution_failed"}
        optional on both: "reason": "automatic" | "manual" picks which open attempt
    {"op": "manual"}

``at`` (seconds) is optional on every op; by default line *n* happens at *n*
seconds, so attempt leases behave as they would live. A bad line yields
``{"error": ...}`` naming the field, and the run goes on with the state
unchanged. The same ``WhatIf`` runner drives the what-if of ``tracker replay`` (:mod:`tracker.audit.replay`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tracker.core import (
    Basis,
    Measurement,
    ModelRef,
    Policy,
    SessionState,
    decide_commit,
    decide_manual,
    decide_measure,
    decide_reject,
)
from tracker.core.anchor import RequestShape
from tracker.core.calibration import Calibration
from tracker.core.events import ContextMeasured
from tracker.core.model import is_int
from tracker.core.outcome import Outcome
from tracker.core.reports import decide_rejection, decide_usage
from tracker.errors import InvalidInput, TrackerError

OPS = ("measure", "commit", "reject", "manual", "rejection", "usage")
MEASURE_KEYS = {
    "op",
    "basis",
    "input_tokens",
    "input_limit",
    "compaction_threshold",
    "scope",
    "scope_confidence",
    "model",
    "quality",
    "overhead_tokens",
    "at",
    "fingerprint",
    "calibration",
    "counted_tokens",
    "learned_limit",
    "shape",
}


@dataclass
class WhatIf:
    policy: Policy = field(default_factory=Policy)
    session_id: str = "whatif"
    state: SessionState = field(init=False)
    line_no: int = 0
    keep_events: bool = True  # the CLI turns this off so long traces run in constant memory
    calibrated: bool = True  # False: ignore the ops' calibration (decide on the raw counts)
    events: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = SessionState(session_id=self.session_id)

    def run(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        for line in lines:
            if not line.strip():
                continue
            yield self.step_line(line)

    def step_line(self, line: str) -> dict[str, Any]:
        self.line_no += 1
        try:
            op = json.loads(line)
        except json.JSONDecodeError as exc:
            return {"error": f"line {self.line_no}: malformed JSON ({exc.msg} at column {exc.colno})"}
        except (RecursionError, ValueError) as exc:  # nested too deep, numbers too long, bad text
            return {"error": f"line {self.line_no}: unreadable JSON ({type(exc).__name__})"}
        return self.step(op)

    def step(self, op: Any) -> dict[str, Any]:
        try:
            outcome, out = self._step(op)
        except TrackerError as exc:
            return _error(exc)
        except (ArithmeticError, RecursionError) as exc:  # a value no decision can use: this line's error only
            return {"error": f"line {self.line_no}: unusable value ({type(exc).__name__})"}
        # only a well-formed op reaches here: its events are the new truth
        self.state = outcome.state
        if self.keep_events:
            self.events.extend(outcome.events)
        if outcome.error is not None and not out:
            return _error(outcome.error)
        return out

    # -- one op --------------------------------------------------------------------------
    def _now(self, op: dict[str, Any]) -> float:
        at = op.get("at", self.line_no)
        if not (is_int(at) or isinstance(at, float)):
            raise InvalidInput("at", f"must be a number of seconds, got {str(at)[:40]!r}")
        try:
            seconds = float(at)
        except OverflowError:  # an integer too large for a float (hundreds of digits)
            seconds = math.inf
        if not math.isfinite(seconds):
            raise InvalidInput("at", f"must be a finite number of seconds, got {str(at)[:40]}")
        return seconds

    def _next_attempt_id(self) -> str:
        # derived from the folded state, so a refused line or a measure that opens nothing never shifts later ids
        return f"a{self.state.attempts_opened + 1}"

    def _step(self, op: Any) -> tuple[Outcome, dict[str, Any]]:
        if not isinstance(op, dict):
            raise InvalidInput("op", f"each line must be a JSON object, got {type(op).__name__}")
        kind = op.get("op")
        if kind not in OPS:
            raise InvalidInput("op", f"must be one of {', '.join(OPS)}, got {kind!r}")
        now = self._now(op)
        if kind == "measure":
            return self._measure(op, now)
        if kind == "rejection":
            if "basis" not in op:
                raise InvalidInput("basis", "is required for rejection")
            outcome = decide_rejection(
                self.state,
                basis=op["basis"],
                input_tokens=op.get("input_tokens"),
                input_limit=op.get("input_limit"),
                now=now,
            )
            return outcome, {"ok": True, "rejected": str(outcome.events[-1].basis)}  # type: ignore[attr-defined]
        if kind == "usage":
            if "basis" not in op:
                raise InvalidInput("basis", "is required for usage")
            outcome = decide_usage(self.state, basis=op["basis"], input_tokens=op.get("input_tokens"), now=now)
            return outcome, {"ok": True, "reported": str(outcome.events[-1].basis)}  # type: ignore[attr-defined]
        if kind == "manual":
            outcome = decide_manual(self.state, self.policy, now=now, new_attempt_id=self._next_attempt_id())
            if outcome.error is not None:
                raise outcome.error
            assert outcome.attempt is not None
            return outcome, {"ok": True, "revision": outcome.state.revision, "attempt_id": outcome.attempt.attempt_id}
        reason = op.get("reason")  # optional: which open attempt to act on (automatic first by default)
        if reason not in (None, "automatic", "manual"):
            raise InvalidInput("reason", f"must be automatic or manual, got {reason!r}")
        if reason == "manual":
            target = self.state.open_manual
        elif reason == "automatic":
            target = self.state.open_automatic
        else:
            target = self.state.open_automatic or self.state.open_manual
        if target is None:
            raise InvalidInput("op", f"{kind}: no {reason + ' ' if reason else ''}attempt is open")
        if kind == "commit":
            if "tokens_after" not in op:
                raise InvalidInput("tokens_after", "is required for commit")
            outcome = decide_commit(
                self.state,
                attempt_id=target.attempt_id,
                fencing_token=target.fencing_token,
                tokens_after=op["tokens_after"],
                now=now,
            )
        else:
            outcome = decide_reject(
                self.state,
                attempt_id=target.attempt_id,
                fencing_token=target.fencing_token,
                reject_reason=op.get("reject_reason", "execution_failed"),
                now=now,
            )
        out: dict[str, Any] = {
            "ok": outcome.error is None,
            "revision": outcome.state.revision,
            "attempt_id": target.attempt_id,
        }
        if outcome.error is not None:
            out["rejected"] = getattr(outcome.error, "code", "error")
            out["detail"] = outcome.error.message
        return outcome, out

    def _measure(self, op: dict[str, Any], now: float) -> tuple[Outcome, dict[str, Any]]:
        unknown = sorted(set(op) - MEASURE_KEYS)
        if unknown:
            raise InvalidInput(unknown[0], "is not a measure field")
        if "input_tokens" not in op and "counted_tokens" in op:
            op = {**op, "input_tokens": op["counted_tokens"]}
        elif "counted_tokens" in op and op["counted_tokens"] != op["input_tokens"]:
            raise InvalidInput("counted_tokens", "differs from input_tokens (both are the counter's raw count)")
        for key in ("basis", "input_tokens", "input_limit"):
            if key not in op:
                raise InvalidInput(key, "is required for measure")
        calibration = Calibration.from_data(op["calibration"]) if op.get("calibration") is not None else None
        shape = RequestShape.from_data(op["shape"]) if op.get("shape") is not None else None
        learned = op.get("learned_limit")
        if learned is not None and (not is_int(learned) or learned <= 0):
            raise InvalidInput("learned_limit", f"must be a positive integer, got {str(learned)[:40]!r}")
        basis = Basis.parse(op["basis"], self.state.revision)
        model = op.get("model", "whatif/model")
        fingerprint = op.get("fingerprint") or hashlib.sha256(str(basis).encode()).hexdigest()
        m = Measurement(
            basis=basis,
            model=ModelRef.from_data(model),
            fingerprint=fingerprint,
            input_tokens=op["input_tokens"],
            input_limit=op["input_limit"],
            quality=op.get("quality", "exact_local"),
        )
        outcome = decide_measure(
            self.state,
            self.policy,
            m,
            now=now,
            new_attempt_id=self._next_attempt_id(),
            compaction_threshold=op.get("compaction_threshold"),
            scope=op.get("scope"),
            scope_confidence=op.get("scope_confidence"),
            overhead_tokens=op.get("overhead_tokens"),
            calibration=calibration if self.calibrated else None,
            learned_limit=learned,
            shape=shape if self.calibrated else None,
        )
        d = outcome.decision
        if d is None:  # refused (stale basis, quality): recorded live, reported here
            assert outcome.error is not None
            return outcome, {}
        out: dict[str, Any] = {
            "pressure": d.pressure,
            "occupancy_bp": d.occupancy_bp,
            "action": d.action,
            "trigger": d.trigger,
            "threshold_bp": d.threshold_bp,
            "threshold_source": d.threshold_source,
            "compact_level": d.compact_level,
            "rearm_level": d.rearm_level,
            "attempt_id": d.attempt.attempt_id if d.attempt else None,
        }
        anchor = next(e for e in outcome.events if isinstance(e, ContextMeasured)).anchor
        if d.calibration is not None or learned is not None or d.rejected or anchor is not None:
            # the count and limit decided on, when they are not the line's own
            out["input_tokens"], out["input_limit"] = d.input_tokens, d.input_limit
        if d.calibration is not None:
            out["calibration"] = d.calibration
        if anchor is not None:
            out["anchor"] = anchor.to_data()
        if d.rejected:
            out["rejected"] = True
        if d.attempt:
            out["history_budget"] = d.attempt.history_budget
        return outcome, out


def _error(exc: TrackerError) -> dict[str, Any]:
    out: dict[str, Any] = {"error": exc.message or str(exc), "code": exc.code}
    field_name = getattr(exc, "field", None)
    if field_name:
        out["field"] = field_name
    return out
