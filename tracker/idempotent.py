"""Idempotent retries: a call repeated with its ``idempotency_key`` gets its original answer.

The answer is rebuilt from the events the first call recorded (``recorded_answer``), never
decided again; an ``observe`` retried with the same key must be the same call (``same_request``).
The service (``tracker.service``) asks here before it decides anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tracker.core import Basis, Measurement, Outcome, SessionState
from tracker.core.events import ContextMeasured
from tracker.core.recorded import recorded_outcome, succeeded
from tracker.core.state import fold
from tracker.counting.request import CanonicalRequest
from tracker.errors import InvalidInput, TrackerError
from tracker.store.base import EventStore
from tracker.store.decoding import events_of


def recorded_answer(
    store: EventStore,
    session_id: str,
    idempotency_key: str,
    op: str,
    decide: Callable[[SessionState], Outcome] | None,
) -> tuple[Outcome, int] | None:
    """The original answer (and the version it left) of the call recorded under ``idempotency_key``;
    None when no call was."""
    earlier = store.find_idempotent(session_id, idempotency_key)
    if earlier is None:
        return None
    return answer_from(store, session_id, earlier, op, decide), earlier.last_version


def answer_from(
    store: EventStore, session_id: str, result: Any, op: str, decide: Callable[[SessionState], Outcome] | None
) -> Outcome:
    """An idempotent retry: the original outcome, rebuilt from the events it recorded."""
    before = fold(events_of(store.read_stream(session_id, 1, result.first_version - 1)), session_id)
    events = list(events_of(store.read_stream(session_id, result.first_version, result.last_version)))
    out = recorded_outcome(before, events, op)
    if out.error is None and not succeeded(op, events) and decide is not None:
        # The original call was refused after recording only side effects (an expired lease):
        # its refusal is a pure function of the state it left, so decide it again, recording nothing.
        try:
            again = decide(out.state)
        except TrackerError as exc:
            again = dataclasses.replace(out, error=exc)
        if again.error is not None:
            out = dataclasses.replace(out, error=again.error)
    return out


def same_request(
    outcome: Outcome,
    measurement: Any,
    request: Any,
    basis: Any,
    *,
    threshold: Any,
    scope: Any,
    confidence: Any,
    overhead: Any,
) -> None:
    """A key is bound to the whole call: reused with a different measurement or request, basis,
    threshold, scope, confidence or overhead, it is refused, not answered with the old result."""
    measured = next((e for e in outcome.events if isinstance(e, ContextMeasured)), None)
    if measured is None:
        return  # a refused or failed count: nothing to compare with
    recorded = measured.measurement
    revision = recorded.basis.revision
    if measurement is not None:
        m = measurement if isinstance(measurement, Measurement) else Measurement.from_data(measurement, 1)
        raw_basis = measurement.basis if isinstance(measurement, Measurement) else measurement["basis"]
        given: tuple[Any, ...] = (m.input_tokens, m.input_limit, m.fingerprint, m.quality, m.model.to_data())
        was: tuple[Any, ...] = (
            recorded.input_tokens,
            recorded.input_limit,
            recorded.fingerprint,
            recorded.quality,
            recorded.model.to_data(),
        )
    else:
        raw_basis = basis
        given, was = (CanonicalRequest.from_dict(request).fingerprint,), (recorded.fingerprint,)
    inputs = dict(compaction_threshold=threshold, scope=scope, scope_confidence=confidence, overhead_tokens=overhead)
    same = (
        given == was
        and Basis.parse(raw_basis, revision) == recorded.basis
        and {k: v for k, v in inputs.items() if v is not None} == (measured.inputs or {})
    )
    if not same:
        raise InvalidInput("idempotency_key", "was already used for a different call on this session")
