"""Session state and ``fold``: the only way state comes into being.

``apply(state, event)`` is the single transition function. Live decisions,
the store's projection, replay and what-if all reach state through it, so a
cached state can always be checked against ``fold(events)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from tracker.core import events as ev
from tracker.core.anchor import AnchorPoint
from tracker.core.calibration import CalibrationSample
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
    messages: int | None = None  # the request's shape, when its count came with one (anchoring)
    chain: str | None = None
    content: str | None = None
    anchored: bool = False  # the measurement was decided anchored
    decided_tokens: int | None = None  # the count it was decided on (recorded with the shape)

    def to_data(self) -> dict[str, Any]:
        # the anchoring fields only when set (projections written before anchoring have none)
        data = dict(self.__dict__)
        if data["messages"] is None:
            del data["messages"], data["chain"], data["decided_tokens"]
        if data["content"] is None:
            del data["content"]
        if not data["anchored"]:
            del data["anchored"]
        return data


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
    # where the session's events went (``SessionArchived``): {"archive", "segment", "final_version",
    # "digest"}; None while the session is live (and then absent from ``to_data``)
    archived: dict[str, Any] | None = None
    # the last billed request of the current revision whose shape is known: decisions on requests
    # that extend it are anchored on its billed count (tracker.core.anchor)
    anchor: AnchorPoint | None = None

    # -- queries -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.policy is not None

    @property
    def open_automatic(self) -> Attempt | None:
        if not self.open_attempts:
            return None
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
        data = {
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
            **({"anchor": self.anchor.to_data()} if self.anchor is not None else {}),
        }
        if self.archived is not None:
            data["archived"] = dict(self.archived)
        return data

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
            archived=data.get("archived"),
            anchor=AnchorPoint(**data["anchor"]) if data.get("anchor") else None,
        )


def episode_after(pressure: str, episode_automatic: int) -> int:
    """The episode ends when pressure is back to normal: its automatic-attempt count restarts."""
    return 0 if pressure == "normal" else episode_automatic


def _close(d: dict[str, Any], attempt_id: str, outcome: str) -> None:
    d["open_attempts"] = tuple(a for a in d["open_attempts"] if a.attempt_id != attempt_id)
    d["recent_outcomes"] = (d["recent_outcomes"] + ((attempt_id, outcome),))[-RECENT_ATTEMPTS_KEPT:]


def _step(d: dict[str, Any], event: ev.DomainEvent) -> None:
    """The transition of one event, on ``d``: the fields of a state, in a dict (and a ``counts``)
    that no state holds (:func:`apply` and :func:`fold` copy them first). Pure but for ``d``."""
    d["version"] += 1
    counts = d["counts"]
    name = event.TYPE
    counts[name] = counts.get(name, 0) + 1
    if isinstance(event, ev.ContextMeasured):
        # the typed event's own fields, read once (``decided_tokens`` / ``decided_limit`` inlined)
        e = event.__dict__
        m = e["measurement"]
        b = m.basis
        basis = str(b)
        used, limit = e["input_tokens"], e["input_limit"]
        if used is None:
            used = m.input_tokens
        if limit is None:
            limit = m.input_limit
        pressure = e["pressure"]
        shape = e["shape"]
        anchor = d["anchor"]
        if anchor is not None and anchor.model != m.model.name:  # another model: the anchor is not its
            d["anchor"] = None
        measured = d["measured"]
        for x in measured:
            if x.basis == basis:  # measured again: its entry moves to the end
                measured = tuple([x for x in measured if x.basis != basis])
                break
        d["measured"] = measured[-(RECENT_BASES_KEPT - 1) :] + (
            built(
                MeasuredBasis,
                {
                    "basis": basis,
                    "model": m.model.name,
                    "quality": m.quality,
                    "counted_tokens": m.input_tokens,
                    "input_limit": limit,
                    "messages": None if shape is None else shape.messages,
                    "chain": None if shape is None else shape.chain,
                    "content": None if shape is None else shape.content,
                    "anchored": e["anchor"] is not None,
                    "decided_tokens": None if shape is None else used,
                },
            ),
        )
        d["pressure"] = pressure
        d["episode_automatic"] = episode_after(pressure, d["episode_automatic"])
        d["last"] = built(
            LastMeasurement,
            {
                "basis": basis,
                "revision": b.revision,
                "input_tokens": used,
                "input_limit": limit,
                "occupancy_bp": e["occupancy_bp"],
                "action": e["action"],
                "at": e["at"],
            },
        )
    elif isinstance(event, ev.SessionStarted):
        d["policy"] = event.policy
    elif isinstance(event, ev.CompactionStarted):
        attempt = Attempt.from_started(event)
        d["open_attempts"] = d["open_attempts"] + (attempt,)
        d["attempts_opened"] += 1
        if attempt.automatic:
            d["episode_automatic"] += 1
    elif isinstance(event, ev.CompactionCommitted):
        _close(d, event.attempt_id, "committed")
        # the history changed: a new revision, with nothing exhausted (or rejected) yet
        d["revision"] = event.new_revision
        d["exhausted"] = frozenset()
        d["rejected"] = frozenset()
        d["anchor"] = None
    elif isinstance(event, ev.CompactionRejected):
        _close(d, event.attempt_id, f"rejected:{event.reject_reason}")
        if event.reason == "automatic" and event.basis.startswith(f"r{d['revision']}:"):
            d["exhausted"] = d["exhausted"] | {event.basis}
    elif isinstance(event, ev.ProviderRejected):
        if event.basis.startswith(f"r{d['revision']}:"):
            d["rejected"] = d["rejected"] | {event.basis}
    elif isinstance(event, ev.SessionArchived):
        # the events before it left the live log: a fresh state at this version, naming where they went
        d.update(_working(SessionState(session_id=d["session_id"])))
        d["version"] = event.final_version + 1
        d["counts"] = {name: 1}
        d["archived"] = {
            "archive": event.archive,
            "segment": event.segment,
            "final_version": event.final_version,
            "digest": event.digest,
        }
    elif isinstance(event, ev.UsageReported):
        _anchor_on(d, event)
    elif not isinstance(event, (ev.CountFailed, ev.MeasurementRefused, ev.ContextLimitReached)):
        raise TypeError(f"unknown event {event!r}")


def _anchor_on(d: dict[str, Any], event: ev.UsageReported) -> None:
    """A usage report of the current revision whose request's shape is known anchors the session,
    when its sample is one calibration would use (a plausible ratio, a request of some size)."""
    if event.chain is None or event.messages is None or not event.basis.startswith(f"r{d['revision']}:"):
        return
    billed = event.billed_tokens
    if event.counted_tokens <= 0 or not CalibrationSample(event.counted_tokens, billed).usable:
        return
    d["anchor"] = AnchorPoint(
        basis=event.basis,
        model=event.model,
        quality=event.quality,
        messages=event.messages,
        chain=event.chain,
        counted=event.counted_tokens,
        billed=billed,
    )


def _working(state: SessionState) -> dict[str, Any]:
    """The fields of ``state`` as a dict :func:`_step` may change (``counts`` copied too)."""
    d = dict(state.__dict__)
    d["counts"] = dict(d["counts"])
    return d


def apply(state: SessionState, event: ev.DomainEvent) -> SessionState:
    """The one transition function. Pure: a new state, ``state`` unchanged."""
    d = _working(state)
    _step(d, event)
    return built(SessionState, d)


def fold(events: Iterable[ev.DomainEvent], session_id: str, state: SessionState | None = None) -> SessionState:
    """``apply`` of each event in turn; the states in between are never built (one copy of the
    fields, changed in place by each step, then one new state: the same state as the ``apply``s)."""
    s = state if state is not None else SessionState(session_id=session_id)
    d: dict[str, Any] | None = None
    for e in events:
        if d is None:
            d = _working(s)
        _step(d, e)
    return s if d is None else built(SessionState, d)


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
