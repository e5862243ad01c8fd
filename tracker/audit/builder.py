"""The story of a session read off a stream of its events in one pass (:func:`build_story`).

The stream is an attempt's window of events, a replay up to an earlier version, a store without
projections, or (through :class:`StoryBuilder`, from :func:`tracker.audit.story.read_story`) the
lifecycle events and a sample of the measurements. Memory stays bounded however long the session
is: the chart keeps at most ``MAX_POINTS`` measurements (peaks and troughs of merged buckets),
``MAX_DROPS`` compaction drops, ``MAX_MARKERS`` markers and ``MAX_POINTS`` billed counts (the
provider's usage reports); the attempts table the newest ``MAX_ATTEMPT_ROWS`` attempts, the
count-failure table the newest ``MAX_FAILURE_ROWS``, the measurements table the newest
``MAX_MEASURED_ROWS`` measurements (each beside what the provider billed for it, or its
rejection); the event table (static report only) the first ``MAX_TABLE_ROWS`` events. Events are read as the core's
typed classes (:func:`tracker.queries.decode`) and every figure is read off them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from datetime import datetime

from tracker.audit.format import summary
from tracker.audit.model import (
    Attempt,
    Billed,
    Failure,
    Limit,
    Marker,
    MeasuredRow,
    Point,
    Rejection,
    Story,
    rejection_of,
)
from tracker.core import SessionState, apply
from tracker.core import events as ev
from tracker.queries import Recorded, Unrecognised, decode_all
from tracker.store import StoredEvent

MAX_TABLE_ROWS = 5000
MAX_POINTS = 2000
MAX_MARKERS = 590
MAX_DROPS = 400
MAX_ATTEMPT_ROWS = 500
MAX_FAILURE_ROWS = 200
MAX_MEASURED_ROWS = 50
MAX_REJECTIONS = 200


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


def build_story(session_id: str, stored: Iterable[StoredEvent], *, table_rows: int = MAX_TABLE_ROWS) -> Story:
    """Read ``stored`` (the session's events, in version order) once; see the module docstring."""
    b = StoryBuilder(session_id, table_rows, fold=True)
    for r in decode_all(stored):
        b.add(r)
    return b.finish()


class StoryBuilder:
    """The story of events fed in version order (all of them: :func:`build_story`; the lifecycle
    events and a sample of the measurements: :func:`tracker.audit.story.read_story`).

    ``fold``: also fold the events through the core's ``apply`` (while they run from version 1
    without a gap), for the state at the hard limit; ``read_story`` has the projection instead."""

    def __init__(self, session_id: str, table_rows: int, *, fold: bool = False) -> None:
        self.s = Story(session_id=session_id)
        self.table_rows = table_rows
        self.series = _Series()
        self.markers = _Markers()
        self.drops = _Markers(MAX_DROPS)
        self.open_: dict[str, Attempt] = {}
        self.done: deque[Attempt] = deque(maxlen=MAX_ATTEMPT_ROWS)
        self.failures: deque[Failure] = deque(maxlen=MAX_FAILURE_ROWS)
        self.billed: list[Billed] = []
        self.billed_stride = 1
        self.billed_seen = 0
        self.rejections: deque[Rejection] = deque(maxlen=MAX_REJECTIONS)
        self.rows: deque[MeasuredRow] = deque(maxlen=MAX_MEASURED_ROWS)
        self.row_of: dict[str, MeasuredRow] = {}  # basis -> its newest row (while in ``rows``)
        self.state: SessionState | None = SessionState(session_id=session_id) if fold else None

    def measured(self, r: Recorded) -> None:
        """A ``ContextMeasured``: a point of the chart, and where the session stands."""
        e = r.event
        if not isinstance(e, ev.ContextMeasured):
            return
        s = self.s
        used, raw = e.decided_tokens, e.measurement.input_tokens
        self.series.add(
            Point(
                r.recorded_at.timestamp(),
                used,
                e.decided_limit,
                e.compact_level,
                e.rearm_level,
                e.hard_level,
                r.version,
                counted=raw if raw != used else None,
            )
        )
        s.pressure, s.occupancy_bp = e.pressure, e.occupancy_bp
        s.last_tokens, s.last_limit = used, e.decided_limit
        if e.pressure == "normal":  # the loop breaker's episode ends when pressure is back to normal
            s.episode = []

    def usage(self, r: Recorded) -> None:
        """A ``UsageReported``: a billed dot of the chart (every ``billed_stride``-th, at most ~MAX_POINTS)."""
        e = r.event
        if not isinstance(e, ev.UsageReported):
            return
        self.billed_seen += 1
        if (self.billed_seen - 1) % self.billed_stride:
            return
        self.billed.append(Billed(r.recorded_at.timestamp(), r.version, e.basis, e.billed_tokens, e.counted_tokens))
        if len(self.billed) > MAX_POINTS:
            self.billed = self.billed[::2]
            self.billed_stride *= 2

    def provider_rejected(self, r: Recorded) -> Rejection | None:
        """A ``ProviderRejected``: its marker on the chart and a row of the rejections."""
        e = r.event
        if not isinstance(e, ev.ProviderRejected):
            return None
        rej = rejection_of(r, e)
        self.rejections.append(rej)
        y = e.input_tokens if e.input_tokens is not None else e.counted_tokens
        self.markers.add(Marker(r.recorded_at.timestamp(), "provider_rejected", rej.label(), r.version, y=y))
        return rej

    def table_row(self, r: Recorded) -> None:
        """The measurements table: a ``ContextMeasured`` opens a row, the basis's report fills it in."""
        e = r.event
        if isinstance(e, ev.ContextMeasured):
            m, cal = e.measurement, e.calibration
            row = MeasuredRow(
                r.version,
                r.recorded_at,
                str(m.basis),
                m.model.name,
                m.quality,
                m.input_tokens,
                e.decided_tokens,
                e.decided_limit,
                None if cal is None else cal.factor_bp / 10_000,
                e.action,
                anchor=e.anchor,
            )
            if len(self.rows) == self.rows.maxlen:
                gone = self.rows[0]
                if self.row_of.get(gone.basis) is gone:
                    del self.row_of[gone.basis]
            self.rows.append(row)
            self.row_of[row.basis] = row
        elif isinstance(e, ev.UsageReported | ev.ProviderRejected):
            reported = self.row_of.get(e.basis)
            if reported is None:  # a report on a measurement before the rows read
                return
            if isinstance(e, ev.UsageReported):
                reported.billed = e.billed_tokens
            else:
                reported.rejection = rejection_of(r, e)

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
            case ev.ContextMeasured():
                counts["measurements"] += 1
                self.measured(r)
                self.table_row(r)
            case ev.UsageReported():
                counts["usage_reports"] += 1
                self.usage(r)
                self.table_row(r)
            case ev.ProviderRejected():
                counts["provider_rejections"] += 1
                self.provider_rejected(r)
                self.table_row(r)
            case ev.CompactionStarted():
                counts["attempts"] += 1
                a = Attempt.opened(
                    event,
                    v,
                    at,
                    trigger=event.trigger,
                    fencing_token=event.fencing_token,
                    tokens_before=event.tokens_before,
                )
                self.open_[a.attempt_id] = a
                if a.reason == "automatic":
                    s.episode.append(a)
                    if len(s.episode) > 50:
                        del s.episode[0]
            case ev.CompactionCommitted() | ev.CompactionRejected():
                self._ended(event, v, at, t)
            case ev.CountFailed():
                counts["count_failed"] += 1
                s.failure_kinds[event.kind] = s.failure_kinds.get(event.kind, 0) + 1
                self.failures.append(
                    Failure(v, at, event.kind, event.model, event.basis, event.duration_ms, event.detail)
                )
                self.markers.add(Marker(t, "count_failed", f"{event.kind}: {event.detail}", v))
            case ev.ContextLimitReached():
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
            case ev.SessionStarted():
                s.policy = event.policy
        if len(s.rows) < self.table_rows:
            s.rows.append((v, at.isoformat()[:23], r.type, summary(event)))

    def _ended(self, e: ev.CompactionCommitted | ev.CompactionRejected, v: int, at: datetime, t: float) -> None:
        """A commit or a rejection: the attempt's end (an attempt opened before the events read starts here)."""
        s, counts = self.s, self.s.counts
        found = self.open_.pop(e.attempt_id, None)
        before = e.tokens_before if isinstance(e, ev.CompactionCommitted) else None  # a rejection has none
        a = found or Attempt.opened(e, v, at, tokens_before=before)
        a.ended_v, a.ended_at, a.duration_ms = v, at, e.duration_ms
        if isinstance(e, ev.CompactionCommitted):
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
        s.billed = self.billed
        s.rejections = list(self.rejections)
        s.measured_rows = list(self.rows)
        if not s.ended_at_limit:
            s.limit_state = None  # kept only for the account of a session that ended at its limit
        return s
