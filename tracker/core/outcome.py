"""What a decision returns: the ``Outcome`` of a call, the ``Decision`` it holds, and the refusals it records.

Every decision function (:mod:`tracker.core.decide`, :mod:`tracker.core.attempts`) returns an
``Outcome`` whose ``state`` is ``fold(state, events)``; the caller records ``events`` and then
raises ``error`` if there is one. An idempotent retry is answered from the recorded events
(:mod:`tracker.core.recorded`) with these same types and refusal constructors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tracker.core import events as ev
from tracker.core.model import Basis, built
from tracker.core.state import Attempt, SessionState, fold
from tracker.errors import ContextLimitError, StaleBasis, SummaryTooLarge, TrackerError


@dataclass(frozen=True)
class Decision(ev.Verdict):
    """What one measurement decided: the answer to ``observe``, and what its ``ContextMeasured`` records
    (the :class:`~tracker.core.events.Verdict` fields, then the basis and the counts)."""

    basis: str
    revision: int
    attempt: Attempt | None = None  # the attempt opened for this caller (action == compact)
    waiting_on: Attempt | None = None  # the open automatic attempt (action == wait)
    input_tokens: int = 0  # the count decided on: the counter's, corrected by ``calibration``
    counted_tokens: int = 0  # the counter's raw count
    input_limit: int = 0  # the limit decided against (the measurement's, or a learned lower one)
    calibration: dict[str, Any] | None = None  # the correction applied (factor_bp, samples, ...), or None
    rejected: bool = False  # the provider rejected this basis before: decided at the hard limit

    @classmethod
    def from_event(
        cls,
        e: ev.ContextMeasured,
        waiting_on: Attempt | None = None,
        attempt: Attempt | None = None,
        *,
        basis: Basis | None = None,
    ) -> Decision:
        """The decision a recorded ``ContextMeasured`` stands for (``basis``: its measurement's, when known)."""
        b = basis if basis is not None else e.measurement.basis
        recorded = e.__dict__
        values = {name: recorded[name] for name in _RECORDED}
        values["basis"], values["revision"] = str(b), b.revision
        values["attempt"], values["waiting_on"] = attempt, waiting_on
        values["input_tokens"], values["input_limit"] = e.decided_tokens, e.decided_limit
        values["counted_tokens"] = e.measurement.input_tokens
        values["calibration"] = None if e.calibration is None else e.calibration.to_data()
        return built(cls, values)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Decision:
        """The inverse of ``to_data`` (extra keys, e.g. an HTTP answer's ``session_id``, are ignored)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("attempt", "waiting_on"):
            values[key] = Attempt(**values[key]) if values.get(key) else None
        return cls(**values)

    def to_data(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["attempt"] = self.attempt.to_data() if self.attempt else None
        d["waiting_on"] = self.waiting_on.to_data() if self.waiting_on else None
        return d


#: the fields a decision takes from the ``ContextMeasured`` that records it, in the decision's order
#: (all but ``basis``, ``revision`` and the attempts)
_RECORDED = tuple(f.name for f in fields(Decision) if f.name in {g.name for g in fields(ev.ContextMeasured)})


@dataclass(frozen=True)
class Outcome:
    events: tuple[ev.DomainEvent, ...]
    state: SessionState
    decision: Decision | None = None
    attempt: Attempt | None = None  # for manual / commit / reject: the attempt acted on
    error: TrackerError | None = None  # raise after recording the events


def outcome(state: SessionState, events: list[ev.DomainEvent], **kw: Any) -> Outcome:
    """The ``Outcome`` of recording ``events`` on ``state`` (the new state is folded with ``apply``).
    Built without the frozen ``__init__``'s ``object.__setattr__`` per field (every decision makes one)."""
    unknown = kw.keys() - _OPTIONAL
    if unknown:
        raise TypeError(f"outcome() got unexpected keywords {sorted(unknown)}")
    values = {"events": tuple(events), "state": fold(events, state.session_id, state), **_NONE, **kw}
    return built(Outcome, values)


#: the ``Outcome`` fields a decision may leave out (None when not given)
_OPTIONAL = frozenset(f.name for f in fields(Outcome) if f.default is None)
_NONE = dict.fromkeys(_OPTIONAL)


# -- the refusals a decision can record (one constructor each; `recorded.py` rebuilds them too) --


def context_limit_error(basis: str, input_tokens: int, input_limit: int) -> ContextLimitError:
    return ContextLimitError(
        f"{input_tokens} tokens reach the input limit {input_limit} and no automatic compaction is eligible "
        f"for basis {basis}",
        basis=basis,
        input_tokens=input_tokens,
        input_limit=input_limit,
    )


def stale_basis_error(basis: str, current_revision: int) -> StaleBasis:
    return StaleBasis(
        f"basis {basis} is older than the session's revision r{current_revision}",
        basis=basis,
        current_revision=current_revision,
    )


def summary_too_large_error(
    attempt_id: str, tokens_after: int | None = None, input_limit: int | None = None
) -> SummaryTooLarge:
    if tokens_after is None:
        return SummaryTooLarge(
            f"attempt {attempt_id}: tokens_after >= input_limit; recorded as a rejection", attempt_id=attempt_id
        )
    return SummaryTooLarge(
        f"tokens_after {tokens_after} >= input_limit {input_limit}; recorded as a rejection",
        attempt_id=attempt_id,
        tokens_after=tokens_after,
        input_limit=input_limit,
    )
