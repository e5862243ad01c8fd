"""Everything a session's page shows (the console's and the static report's).

:func:`read_story` (the pages) does not read every event: it reads the counts by type, the
lifecycle events (attempts, count failures, context-limit errors) and a sample of the
measurements through the store's narrow reads, so a 100k-event page costs about what a 10k-event
one does. :func:`build_story` reads a stream of events once, in order (an attempt's window of
events, a replay up to an earlier version, a store without projections). Both keep bounded
memory however long the session is: the chart keeps at most ``MAX_POINTS`` measurements (peaks and troughs of merged
buckets), ``MAX_DROPS`` compaction drops and ``MAX_MARKERS`` markers; the attempts table the
newest ``MAX_ATTEMPT_ROWS`` attempts, the count-failure table the newest ``MAX_FAILURE_ROWS``; the
event table (static report only) the first ``MAX_TABLE_ROWS`` events. Events are read as the
core's typed classes (:func:`tracker.queries.decode`) and every figure is read off them (and, for
the loop breaker's episode, the session's projection).

:func:`account` turns the story into the plain-language paragraph at the top of the page: how
the session ended and why. Why nothing was eligible when it met its hard limit is not restated
here: the core's own rule (:func:`tracker.core.decide.eligibility`) is asked, on the core's state
of the session at that point (its projection, or the fold of its log through the core's ``apply``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tracker.audit.format import summary
from tracker.core import Policy, SessionState, apply, fold
from tracker.core.decide import Eligibility, eligibility
from tracker.core.events import (
    CompactionCommitted,
    CompactionRejected,
    CompactionStarted,
    ContextLimitReached,
    ContextMeasured,
    CountFailed,
    DomainEvent,
    SessionStarted,
)
from tracker.queries import Recorded, Unrecognised, decode, decode_all, type_names
from tracker.store import StoredEvent
from tracker.store.base import SessionViews

MAX_TABLE_ROWS = 5000
MAX_POINTS = 2000
MAX_MARKERS = 590
MAX_DROPS = 400
MAX_ATTEMPT_ROWS = 500
MAX_FAILURE_ROWS = 200

COUNT_KEYS = ("events", "measurements", "attempts", "committed", "rejected", "count_failed", "context_limit")

NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def _n(count: int) -> str:
    return NUMBERS.get(count, f"{count:,}")


def _revision_of(basis: str) -> int | None:
    head, _, _ = basis.partition(":")
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else None


@dataclass
class Attempt:
    """One compaction attempt, from ``CompactionStarted`` to its commit or rejection."""

    attempt_id: str
    reason: str
    trigger: str
    basis: str
    fencing_token: int
    opened_v: int
    opened_at: datetime
    tokens_before: int | None
    ended_v: int | None = None
    ended_at: datetime | None = None
    duration_ms: int | None = None
    tokens_after: int | None = None
    outcome: str = "open"  # open | committed | rejected
    reject_reason: str | None = None

    @property
    def revision(self) -> int | None:
        return _revision_of(self.basis)


@dataclass
class Marker:
    t: float  # seconds since the epoch
    kind: str  # committed | rejected | count_failed | context_limit | open
    label: str
    version: int
    y: int | None = None  # tokens, when the marker has a height
    y2: int | None = None  # committed: tokens after the drop
    count: int = 1
    last_version: int = 0


@dataclass(frozen=True)
class Failure:
    """One ``CountFailed``, as the count-failure table shows it."""

    version: int
    at: datetime
    kind: str
    model: str
    basis: str | None
    duration_ms: int
    detail: str


@dataclass(frozen=True)
class Limit:
    """The last ``ContextLimitReached``: where and what did not fit."""

    version: int
    at: datetime
    basis: str
    input_tokens: int
    input_limit: int


@dataclass
class Point:
    t: float
    used: int
    limit: int
    compact: int
    rearm: int
    hard: int
    version: int


class _Series:
    """At most ~MAX_POINTS points: as it streams, neighbours merge two by two, keeping each pair's
    peak and trough (in time order), so a rise to the hard level or a fall is never smoothed away."""

    def __init__(self, cap: int = MAX_POINTS) -> None:
        self.cap = cap
        self.points: list[Point] = []
        self.stride = 1
        self._pending: list[Point] = []

    def add(self, p: Point) -> None:
        self._pending.append(p)
        if len(self._pending) >= self.stride:
            self._flush()
        if len(self.points) > self.cap:
            merged: list[Point] = []
            for i in range(0, len(self.points), 4):
                merged.extend(_extremes(self.points[i : i + 4]))
            self.points = merged
            self.stride *= 2

    def _flush(self) -> None:
        self.points.extend(_extremes(self._pending))
        self._pending = []

    def finish(self) -> list[Point]:
        if self._pending:
            self._flush()
        return self.points


def _extremes(group: list[Point]) -> list[Point]:
    if len(group) <= 2:
        return list(group)
    hi = max(group, key=lambda q: q.used)
    lo = min(group, key=lambda q: q.used)
    return [hi] if hi is lo else sorted((hi, lo), key=lambda q: q.version)


class _Markers:
    """At most ~MAX_MARKERS markers: markers of one kind in the same bucket of versions merge into
    one (its label says how many and which versions) as the session grows."""

    def __init__(self, cap: int = MAX_MARKERS) -> None:
        self.cap = cap
        self.items: list[Marker] = []
        self.width = 1
        self._last: dict[str, Marker] = {}

    def add(self, m: Marker) -> None:
        m.last_version = m.version
        last = self._last.get(m.kind)
        if last is not None and last.version // self.width == m.version // self.width:
            last.count += 1
            last.last_version = m.version
            return
        self.items.append(m)
        self._last[m.kind] = m
        if len(self.items) > self.cap:
            while len(self.items) > self.cap // 2:
                self.width *= 2
                merged: list[Marker] = []
                by_kind: dict[str, Marker] = {}
                for item in self.items:
                    prev = by_kind.get(item.kind)
                    if prev is not None and prev.version // self.width == item.version // self.width:
                        prev.count += item.count
                        prev.last_version = item.last_version
                        continue
                    merged.append(item)
                    by_kind[item.kind] = item
                self.items = merged
                self._last = by_kind

    def finish(self) -> list[Marker]:
        for m in self.items:
            if m.count > 1:
                m.label = f"{m.count} × {m.kind.replace('_', ' ')} in v{m.version}–v{m.last_version}; first: {m.label}"
        return self.items


@dataclass
class Story:
    """What the session page shows, read off the log in one pass."""

    session_id: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    points: list[Point] = field(default_factory=list)
    drops: list[Marker] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)  # the newest MAX_ATTEMPT_ROWS, in order
    failures: list[Failure] = field(default_factory=list)  # the newest MAX_FAILURE_ROWS count failures
    failure_kinds: dict[str, int] = field(default_factory=dict)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    rows: list[tuple[int, str, str, str]] = field(default_factory=list)  # (version, recorded at, type, summary)
    first_at: datetime | None = None
    last_at: datetime | None = None
    version: int = 0
    revision: int = 1
    pressure: str = "normal"
    occupancy_bp: int = 0
    last_tokens: int | None = None
    last_limit: int | None = None
    policy: dict[str, Any] = field(default_factory=dict)
    limit_event: Limit | None = None  # the last ContextLimitReached
    # the core's state of the session right after it (what the decision saw), while the session ended there
    limit_state: SessionState | None = None
    episode: list[Attempt] = field(default_factory=list)  # automatic attempts since the last commit
    last_commit: Attempt | None = None
    sampled: bool = False  # the chart's points are a sample of the measurements (read_story)

    @property
    def open_attempts(self) -> list[Attempt]:
        return [a for a in self.attempts if a.outcome == "open"]

    @property
    def ended_at_limit(self) -> bool:
        """Whether the session's last call (or the one before the last event) met its hard limit."""
        return self.limit_event is not None and self.version - self.limit_event.version <= 1


def build_story(session_id: str, stored: Iterable[StoredEvent], *, table_rows: int = MAX_TABLE_ROWS) -> Story:
    """Read ``stored`` (the session's events, in version order) once; see the module docstring."""
    b = _Builder(session_id, table_rows, fold=True)
    for r in decode_all(stored):
        b.add(r)
    return b.finish()


class _Builder:
    """The story of events fed in version order (all of them: :func:`build_story`; the lifecycle
    events and a sample of the measurements: :func:`read_story`).

    ``fold``: also fold the events through the core's ``apply`` (while they run from version 1
    without a gap), for the state at the hard limit; :func:`read_story` has the projection instead."""

    def __init__(self, session_id: str, table_rows: int, *, fold: bool = False) -> None:
        self.s = Story(session_id=session_id)
        self.table_rows = table_rows
        self.series = _Series()
        self.markers = _Markers()
        self.drops = _Markers(MAX_DROPS)
        self.open_: dict[str, Attempt] = {}
        self.done: deque[Attempt] = deque(maxlen=MAX_ATTEMPT_ROWS)
        self.failures: deque[Failure] = deque(maxlen=MAX_FAILURE_ROWS)
        self.state: SessionState | None = SessionState(session_id=session_id) if fold else None

    def measured(self, r: Recorded) -> None:
        """A ``ContextMeasured``: a point of the chart, and where the session stands."""
        e = r.event
        if not isinstance(e, ContextMeasured):
            return
        s, m = self.s, e.measurement
        self.series.add(
            Point(
                r.recorded_at.timestamp(),
                m["input_tokens"],
                m["input_limit"],
                e.compact_level,
                e.rearm_level,
                e.hard_level,
                r.version,
            )
        )
        s.pressure, s.occupancy_bp = e.pressure, e.occupancy_bp
        s.last_tokens, s.last_limit = m["input_tokens"], m["input_limit"]
        if e.pressure == "normal":  # the loop breaker's episode ends when pressure is back to normal
            s.episode = []

    def _fold(self, r: Recorded) -> None:
        st = self.state
        if st is None:
            return
        if isinstance(r.event, Unrecognised) or r.version != st.version + 1:
            self.state = None  # not a stream the core can fold (a window, or another writer's event)
        else:
            self.state = apply(st, r.event)

    def add(self, r: Recorded) -> None:
        s = self.s
        counts = s.counts
        counts["events"] += 1
        v = r.version
        at = r.recorded_at
        t = at.timestamp()
        if s.first_at is None:
            s.first_at = at
        s.last_at = at
        s.version = v
        self._fold(r)
        event = r.event
        match event:
            case ContextMeasured():
                counts["measurements"] += 1
                self.measured(r)
            case CompactionStarted():
                counts["attempts"] += 1
                a = Attempt(
                    attempt_id=event.attempt_id,
                    reason=event.reason,
                    trigger=event.trigger,
                    basis=event.basis,
                    fencing_token=event.fencing_token,
                    opened_v=v,
                    opened_at=at,
                    tokens_before=event.tokens_before,
                )
                self.open_[a.attempt_id] = a
                if a.reason == "automatic":
                    s.episode.append(a)
                    if len(s.episode) > 50:
                        del s.episode[0]
            case CompactionCommitted() | CompactionRejected():
                self._ended(event, v, at, t)
            case CountFailed():
                counts["count_failed"] += 1
                s.failure_kinds[event.kind] = s.failure_kinds.get(event.kind, 0) + 1
                self.failures.append(
                    Failure(v, at, event.kind, event.model, event.basis, event.duration_ms, event.detail)
                )
                self.markers.add(Marker(t, "count_failed", f"{event.kind}: {event.detail}", v))
            case ContextLimitReached():
                counts["context_limit"] += 1
                s.limit_event = Limit(v, at, event.basis, event.input_tokens, event.input_limit)
                s.limit_state = self.state
                s.pressure = "hard_limit"
                self.markers.add(
                    Marker(
                        t,
                        "context_limit",
                        f"ContextLimitError: {event.input_tokens} ≥ {event.input_limit}",
                        v,
                        y=min(event.input_tokens, event.input_limit),
                    )
                )
            case SessionStarted():
                s.policy = dict(event.policy or {})
        if len(s.rows) < self.table_rows:
            s.rows.append((v, at.isoformat()[:23], r.type, summary(event)))

    def _ended(self, e: CompactionCommitted | CompactionRejected, v: int, at: datetime, t: float) -> None:
        """A commit or a rejection: the attempt's end (an attempt opened before the events read starts here)."""
        s, counts = self.s, self.s.counts
        found = self.open_.pop(e.attempt_id, None)
        a = found or Attempt(
            attempt_id=e.attempt_id,
            reason=e.reason,
            trigger="?",
            basis=e.basis,
            fencing_token=0,
            opened_v=v,
            opened_at=at,
            tokens_before=e.tokens_before if isinstance(e, CompactionCommitted) else None,
        )
        a.ended_v, a.ended_at, a.duration_ms = v, at, e.duration_ms
        if isinstance(e, CompactionCommitted):
            counts["committed"] += 1
            a.outcome, a.tokens_after = "committed", e.tokens_after
            if e.tokens_before is not None:
                a.tokens_before = e.tokens_before
            s.revision = e.new_revision
            s.last_commit = a
            s.episode = []
            self.drops.add(
                Marker(
                    t,
                    "committed",
                    f"{a.reason} compaction committed: {a.tokens_before} → {a.tokens_after} tokens, now r{s.revision}",
                    v,
                    y=a.tokens_before,
                    y2=a.tokens_after,
                )
            )
        else:
            counts["rejected"] += 1
            a.outcome, a.reject_reason = "rejected", e.reject_reason
            s.reject_reasons[e.reject_reason] = s.reject_reasons.get(e.reject_reason, 0) + 1
            self.markers.add(
                Marker(t, "rejected", f"{a.reason} attempt rejected: {e.reject_reason}", v, y=a.tokens_before)
            )
        self.done.append(a)

    def finish(self) -> Story:
        s = self.s
        s.points = self.series.finish()
        s.drops = self.drops.finish()
        s.markers = self.markers.finish()
        still_open = sorted(self.open_.values(), key=lambda a: a.opened_v)
        for a in still_open:
            s.markers.append(
                Marker(
                    a.opened_at.timestamp(), "open", f"{a.reason} attempt {a.attempt_id[:12]} still open", a.opened_v
                )
            )
        s.attempts = sorted([*self.done, *still_open], key=lambda a: a.opened_v)[-MAX_ATTEMPT_ROWS:]
        s.failures = list(self.failures)
        if not s.ended_at_limit:
            s.limit_state = None  # kept only for the account of a session that ended at its limit
        return s


#: the events :func:`read_story` reads in full (few, however long the session): everything but measurements
LIFECYCLE_EVENTS: tuple[type[DomainEvent], ...] = (
    SessionStarted,
    CompactionStarted,
    CompactionCommitted,
    CompactionRejected,
    CountFailed,
    ContextLimitReached,
)
LIFECYCLE = type_names(*LIFECYCLE_EVENTS)
MEASURED = ContextMeasured.TYPE
SAMPLE_POINTS = 1500  # measurements picked evenly for the chart ...
PEAK_POINTS = 1000  # ... plus at most this many of those that opened an attempt or met the limit


def read_story(
    store: Any,
    session_id: str,
    *,
    views: SessionViews,
    shown: str | None = None,
    table_rows: int = 0,
) -> Story:
    """The story of ``session_id`` at its current version without reading every event: the counts
    by type (one grouped read of an index), the lifecycle events (:data:`LIFECYCLE`: attempts, count
    failures, context-limit errors), an even sample of the measurements plus the ones that opened an
    attempt or met the limit (the peaks) for the chart, the newest measurement, and the loop
    breaker's episode from the projection. What it shows is what :func:`build_story` shows, except
    that the chart is drawn through sampled measurements instead of every one. ``shown``: the
    session id the page shows (default ``session_id``); ``table_rows``: the first events as a table.

    ``store`` is the event store (the projection, the log); ``views`` the read side's narrow reads
    (:class:`tracker.store.base.SessionViews`).
    """
    narrow = views
    state, version = store.load(session_id)
    if version == 0:
        return Story(session_id=shown or session_id)
    if not isinstance(state, dict) or state.get("version") != version:  # no projection: read the log
        return build_story(shown or session_id, store.read_stream(session_id, 1, version), table_rows=table_rows)
    by_type = narrow.count_by_type(session_id, version)
    b = _Builder(shown or session_id, table_rows=0)
    peaks: list[int] = []
    for r in decode_all(narrow.read_types(session_id, LIFECYCLE, 1, version)):
        b.add(r)
        if isinstance(r.event, (CompactionStarted, ContextLimitReached)):
            peaks.append(r.version - 1)  # the measurement that opened it / met the limit
    s = b.s
    if len(peaks) > PEAK_POINTS:
        step = len(peaks) / PEAK_POINTS
        peaks = sorted({peaks[int(i * step)] for i in range(PEAK_POINTS)} | {peaks[-1]})
    last_limit = s.limit_event.version if s.limit_event else 0
    pressure = s.pressure
    episode = list(s.episode)
    if by_type.get(MEASURED):
        total = by_type[MEASURED]
        sample = narrow.sample_of_type(session_id, MEASURED, SAMPLE_POINTS, version, total=total)
        at_peaks = narrow.read_versions(session_id, peaks, [MEASURED])
        seen: set[int] = set()
        for e in heapq.merge(sample, at_peaks, key=lambda x: x.version):
            if e.version not in seen:
                seen.add(e.version)
                b.measured(decode(e))
        last = decode(sample[-1])  # the sample always holds the newest measurement
        if last.version < last_limit:
            pressure = "hard_limit"
        elif isinstance(last.event, ContextMeasured):
            pressure = last.event.pressure
    # the episode: the automatic attempts since the last commit (the builder's) that are also
    # among the ``episode_automatic`` since pressure was last back to normal (the projection's)
    since_normal = int(state.get("episode_automatic") or 0)
    s.episode = episode[-since_normal:] if since_normal else []
    story = b.finish()
    story.pressure = pressure
    story.sampled = True
    story.counts = dict.fromkeys(COUNT_KEYS, 0) | {
        "events": sum(by_type.values()),
        "measurements": by_type.get(MEASURED, 0),
        "attempts": by_type.get(CompactionStarted.TYPE, 0),
        "committed": by_type.get(CompactionCommitted.TYPE, 0),
        "rejected": by_type.get(CompactionRejected.TYPE, 0),
        "count_failed": by_type.get(CountFailed.TYPE, 0),
        "context_limit": by_type.get(ContextLimitReached.TYPE, 0),
    }
    ends = narrow.read_versions(session_id, [1, version])
    story.first_at, story.last_at, story.version = ends[0].recorded_at, ends[-1].recorded_at, version
    if story.limit_event is not None and story.ended_at_limit:
        story.limit_state = _state_at(store, session_id, state, story.limit_event.version)
    if table_rows:
        story.rows = [
            (r.version, r.recorded_at.isoformat()[:23], r.type, summary(r.event))
            for r in decode_all(store.read_stream(session_id, 1, min(version, table_rows)))
        ]
    return story


def _state_at(store: Any, session_id: str, projection: dict[str, Any], version: int) -> SessionState | None:
    """The core's state of the session at ``version``: its projection when that is the current version,
    else the fold of its log up to there through the core (rare: one event after a limit)."""
    if projection.get("version") == version:
        return SessionState.from_data(projection)
    events = []
    for r in decode_all(store.read_stream(session_id, 1, version)):
        if isinstance(r.event, Unrecognised):
            return None
        events.append(r.event)
    return fold(events, session_id)


# -- the account ----------------------------------------------------------------------------------


def _reasons(reasons: Iterable[str | None]) -> str:
    seen: dict[str, int] = {}
    for r in reasons:
        if r:
            seen[r] = seen.get(r, 0) + 1
    return ", ".join(f"{r}" if n == 1 or len(seen) == 1 else f"{r} ×{n}" for r, n in seen.items())


def _plural(n: int, one: str, many: str | None = None) -> str:
    return one if n == 1 else (many or one + "s")


def account(s: Story) -> list[str]:
    """How the session ended and why, in plain sentences (the first one is the headline)."""
    c = s.counts
    if c["events"] == 0:
        return [f"Session {s.session_id} has no recorded events."]
    out: list[str] = []
    limit = s.limit_event
    if limit is not None and s.ended_at_limit:
        head = (
            f"Session {s.session_id} reached its hard limit at v{limit.version}: a request of "
            f"{limit.input_tokens:,} tokens did not fit its {limit.input_limit:,}-token input limit, "
            f"so the caller got ContextLimitError instead of a request the provider would reject."
        )
        out.append(head)
        out.append(_why_nothing_eligible(s, limit))
    else:
        occ = f"{s.occupancy_bp / 100:.1f}%"
        tokens = (
            f" ({s.last_tokens:,} of {s.last_limit:,} tokens)" if s.last_tokens is not None and s.last_limit else ""
        )
        head = f"Session {s.session_id} is at v{s.version}, revision r{s.revision}, pressure {s.pressure}, {occ} full{tokens}."
        if s.open_attempts:
            a = s.open_attempts[-1]
            head += f" A {a.reason} compaction on {a.basis} is still open (opened at v{a.opened_v})."
        out.append(head)
        if limit is not None:
            out.append(
                f"It hit its hard limit {_n(c['context_limit'])} {_plural(c['context_limit'], 'time')}, "
                f"the last at v{limit.version} ({limit.input_tokens:,} ≥ {limit.input_limit:,} tokens), "
                "and went on after that."
            )
    tail = [
        f"{_n(c['attempts'])} compaction {_plural(c['attempts'], 'attempt')}: "
        f"{c['committed']} committed, {c['rejected']} rejected"
    ]
    if s.reject_reasons:
        tail[0] += f" ({_reasons(r for r, n in s.reject_reasons.items() for _ in range(n))})"
    if c["count_failed"]:
        kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(s.failure_kinds.items()))
        tail.append(f"{_n(c['count_failed'])} count {_plural(c['count_failed'], 'failure')} ({kinds})")
    out.append("Over its life: " + "; ".join(tail) + f" across {c['events']:,} {_plural(c['events'], 'event')}.")
    return out


def why_at_limit(s: Story) -> Eligibility | None:
    """The core's answer (:func:`tracker.core.decide.eligibility`) to whether an automatic attempt was
    eligible when the session met its hard limit, on the state the decision saw; None without that state."""
    limit, state = s.limit_event, s.limit_state
    if limit is None or state is None:
        return None
    # a ContextLimitReached is recorded only at hard_limit pressure (which needs no growth to be due)
    return eligibility(state, state.policy or Policy(), basis=limit.basis, pressure="hard_limit", grew=False)


def ineligible_because(why: Eligibility | None, basis: str, policy: Policy | None) -> str:
    """The clause of the account that says which of the core's conditions failed (``why.reason``)."""
    match None if why is None else why.reason:
        case "observe_only":
            return "the session's policy is observe-only, so no automatic attempt could open"
        case "not_under_pressure":
            return "pressure was not compact or hard_limit and the growth trigger did not fire, so no attempt was due"
        case "basis_exhausted":
            return f"the basis {basis} had already had its attempt and nothing else was eligible"
        case "attempt_open":
            return "an automatic attempt was still open, so no other could start"
        case "episode_cap":
            cap = policy.max_automatic_per_episode if policy is not None else "?"
            return (
                f"the loop breaker allowed no more ({cap} automatic attempts per episode), "
                f"so basis {basis} was not eligible and nothing else was"
            )
    return f"no attempt was eligible on {basis}"


def _why_nothing_eligible(s: Story, limit: Limit) -> str:
    basis = limit.basis
    rev = _revision_of(basis)
    rejected = [a for a in s.episode if a.outcome == "rejected" and (rev is None or a.revision == rev)]
    parts: list[str] = []
    if rejected:
        reasons = _reasons(a.reject_reason for a in rejected)
        versions = ", ".join(f"v{a.opened_v}" for a in rejected[-6:])
        parts.append(
            f"{_n(len(rejected)).capitalize()} automatic {_plural(len(rejected), 'attempt')} on r{rev} "
            f"{_plural(len(rejected), 'was', 'were')} rejected ({reasons}; opened at {versions})"
        )
    policy = s.limit_state.policy if s.limit_state is not None else None
    parts.append(ineligible_because(why_at_limit(s), basis, policy))
    if s.last_commit is not None:
        lc = s.last_commit
        before = f"{lc.tokens_before:,}" if lc.tokens_before is not None else "?"
        after = f"{lc.tokens_after:,}" if lc.tokens_after is not None else "?"
        parts.append(f"the last successful compaction was at v{lc.ended_v} ({before} → {after} tokens)")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."
