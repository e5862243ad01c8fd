"""Session state and ``fold``: the only way state comes into being.

``apply(state, event)`` is the single transition function. Live decisions,
the store's projection, replay and what-if all reach state through it, so a
cached state can always be checked against ``fold(events)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tracker.core import events as ev
from tracker.core.model import Pressure, Record, built
from tracker.core.policy import Policy

RECENT_ATTEMPTS_KEPT = 20
#: the measurements a usage report or a provider rejection can refer to: the session's last few bases
RECENT_BASES_KEPT = 8

#: the fields of an attempt's terms, in order
_TERMS = tuple(f.name for f in fields(ev.AttemptTerms))


@dataclass(frozen=True)
class Attempt(ev.AttemptTerms, Record):
    """An open attempt: the terms its ``CompactionStarted`` recorded."""

    @property
    def automatic(self) -> bool:
        return self.reason == "automatic"

    @classmethod
    def from_started(cls, e: ev.CompactionStarted) -> Attempt:
        started = e.__dict__
        return built(cls, {name: started[name] for name in _TERMS})


@dataclass(frozen=True)
class LastMeasurement(Record):
    basis: str
    revision: int
    input_tokens: int
    input_limit: int
    occupancy_bp: int
    action: str
    at: float


@dataclass(frozen=True)
class MeasuredBasis(Record):
    """What the last measurement of a basis counted: what a usage report or a rejection of it refers to."""

    basis: str
    model: str  # the measured model's name
    quality: str
    counted_tokens: int  # the counter's raw count
    input_limit: int  # the limit the measurement was decided against


@dataclass(frozen=True)
class SessionState:
    session_id: str
    version: int = 0
    policy: Policy | None = None
    revision: int = 1
    pressure: Pressure = "normal"
    exhausted: frozenset[str] = frozenset()  # automatic bases exhausted at the current revision
    open_attempts: tuple[Attempt, ...] = ()
    episode_automatic: int = 0
    attempts_opened: int = 0
    last: LastMeasurement | None = None
    # recent closed attempts: (attempt_id, outcome) newest last, bounded
    recent_outcomes: tuple[tuple[str, str], ...] = ()
    counts: dict[str, int] = field(default_factory=dict)
    # the last RECENT_BASES_KEPT measured bases, newest last (one entry per basis)
    measured: tuple[MeasuredBasis, ...] = ()
    # bases of the current revision the provider rejected as too long: never let through again
    rejected: frozenset[str] = frozenset()

    # -- queries -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.policy is not None

    @property
    def open_automatic(self) -> Attempt | None:
        return next((a for a in self.open_attempts if a.automatic), None)

    @property
    def open_manual(self) -> Attempt | None:
        return next((a for a in self.open_attempts if not a.automatic), None)

    def find_open(self, attempt_id: str) -> Attempt | None:
        return next((a for a in self.open_attempts if a.attempt_id == attempt_id), None)

    def measured_basis(self, basis: str) -> MeasuredBasis | None:
        """The last measurement of ``basis`` (``r<revision>:<through>``), if among the recent ones."""
        return next((m for m in reversed(self.measured) if m.basis == basis), None)

    def outcome_of(self, attempt_id: str) -> str | None:
        """'open', 'committed', 'rejected:<reason>' or None if not known (never opened, or long ago)."""
        if self.find_open(attempt_id):
            return "open"
        for aid, outcome in reversed(self.recent_outcomes):
            if aid == attempt_id:
                return outcome
        return None

    # -- (de)serialisation (the store's projection) ---------------------------------------
    def to_data(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "version": self.version,
            "policy": self.policy.to_data() if self.policy else None,
            "revision": self.revision,
            "pressure": self.pressure,
            "exhausted": sorted(self.exhausted),
            "open_attempts": [a.to_data() for a in self.open_attempts],
            "episode_automatic": self.episode_automatic,
            "attempts_opened": self.attempts_opened,
            "last": self.last.to_data() if self.last else None,
            "recent_outcomes": [list(x) for x in self.recent_outcomes],
            "counts": dict(sorted(self.counts.items())),
            "measured": [m.to_data() for m in self.measured],
            "rejected": sorted(self.rejected),
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> SessionState:
        return cls(
            session_id=data["session_id"],
            version=data["version"],
            policy=Policy.from_data(data["policy"]) if data.get("policy") else None,
            revision=data["revision"],
            pressure=data["pressure"],
            exhausted=frozenset(data["exhausted"]),
            open_attempts=tuple(Attempt(**a) for a in data["open_attempts"]),
            episode_automatic=data["episode_automatic"],
            attempts_opened=data["attempts_opened"],
            last=LastMeasurement(**data["last"]) if data.get("last") else None,
            recent_outcomes=tuple((a, o) for a, o in data.get("recent_outcomes", [])),
            counts=dict(data.get("counts", {})),
            measured=tuple(MeasuredBasis(**m) for m in data.get("measured", ())),
            rejected=frozenset(data.get("rejected", ())),
        )


def episode_after(pressure: str, episode_automatic: int) -> int:
    """The episode ends when pressure is back to normal: its automatic-attempt count restarts."""
    return 0 if pressure == "normal" else episode_automatic


def _bump(counts: dict[str, int], key: str) -> dict[str, int]:
    new = dict(counts)
    new[key] = new.get(key, 0) + 1
    return new


def _close(state: SessionState, attempt_id: str, outcome: str) -> SessionState:
    recent = (state.recent_outcomes + ((attempt_id, outcome),))[-RECENT_ATTEMPTS_KEPT:]
    return replace(
        state,
        open_attempts=tuple(a for a in state.open_attempts if a.attempt_id != attempt_id),
        recent_outcomes=recent,
    )


def _evolve(state: SessionState, changes: dict[str, Any]) -> SessionState:
    """``dataclasses.replace`` for ``SessionState`` without re-running ``__init__`` (the fields
    are already valid): one dict copy. ``apply`` runs once per event in every fold."""
    new = object.__new__(SessionState)
    d = new.__dict__
    d.update(state.__dict__)
    d.update(changes)
    return new


def apply(state: SessionState, event: ev.DomainEvent) -> SessionState:
    """The one transition function. Pure."""
    base = {"version": state.version + 1, "counts": _bump(state.counts, event.TYPE)}
    if isinstance(event, ev.ContextMeasured):
        m = event.measurement
        basis = str(m.basis)
        used, limit = event.decided_tokens, event.decided_limit
        entry = built(
            MeasuredBasis,
            {
                "basis": basis,
                "model": m.model.name,
                "quality": m.quality,
                "counted_tokens": m.input_tokens,
                "input_limit": limit,
            },
        )
        kept = tuple(x for x in state.measured if x.basis != basis)[-(RECENT_BASES_KEPT - 1) :]
        base.update(
            measured=(*kept, entry),
            pressure=event.pressure,
            episode_automatic=episode_after(event.pressure, state.episode_automatic),
            last=built(
                LastMeasurement,
                {
                    "basis": basis,
                    "revision": m.basis.revision,
                    "input_tokens": used,
                    "input_limit": limit,
                    "occupancy_bp": event.occupancy_bp,
                    "action": event.action,
                    "at": event.at,
                },
            ),
        )
        return _evolve(state, base)
    s = _evolve(state, base)
    if isinstance(event, ev.SessionStarted):
        return replace(s, policy=event.policy)
    if isinstance(event, ev.CompactionStarted):
        attempt = Attempt.from_started(event)
        return replace(
            s,
            open_attempts=s.open_attempts + (attempt,),
            attempts_opened=s.attempts_opened + 1,
            episode_automatic=s.episode_automatic + (1 if attempt.automatic else 0),
        )
    if isinstance(event, ev.CompactionCommitted):
        s = _close(s, event.attempt_id, "committed")
        # the history changed: a new revision, with nothing exhausted (or rejected) yet
        return replace(s, revision=event.new_revision, exhausted=frozenset(), rejected=frozenset())
    if isinstance(event, ev.CompactionRejected):
        s = _close(s, event.attempt_id, f"rejected:{event.reject_reason}")
        if event.reason == "automatic" and event.basis.startswith(f"r{s.revision}:"):
            s = replace(s, exhausted=s.exhausted | {event.basis})
        return s
    if isinstance(event, ev.ProviderRejected):
        if event.basis.startswith(f"r{s.revision}:"):
            return replace(s, rejected=s.rejected | {event.basis})
        return s
    if isinstance(event, (ev.CountFailed, ev.MeasurementRefused, ev.ContextLimitReached, ev.UsageReported)):
        return s
    raise TypeError(f"unknown event {event!r}")


def fold(events: Iterable[ev.DomainEvent], session_id: str, state: SessionState | None = None) -> SessionState:
    s = state if state is not None else SessionState(session_id=session_id)
    for e in events:
        s = apply(s, e)
    return s


class SessionProjector:
    """Adapter from ``apply`` to the store's projection interface (JSON in, JSON out)."""

    def initial(self, session_id: str) -> dict[str, Any]:
        return SessionState(session_id=session_id).to_data()

    def apply(self, state: dict[str, Any], event: Any) -> dict[str, Any]:
        return apply(SessionState.from_data(state), ev.event_from_data(event.type, event.data)).to_data()

    def apply_many(self, state: dict[str, Any], events: Iterable[Any]) -> dict[str, Any]:
        s = SessionState.from_data(state)
        for e in events:
            s = apply(s, ev.event_from_data(e.type, e.data))
        return s.to_data()

    def columns(self, state: dict[str, Any]) -> dict[str, Any]:
        last = state.get("last") or {}
        return {
            "pressure": state["pressure"],
            "revision": state["revision"],
            "occupancy_bp": last.get("occupancy_bp"),
            "open_attempts": len(state["open_attempts"]),
        }
