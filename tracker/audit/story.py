"""Everything a session's page shows (the console's and the static report's), and its account.

:func:`read_story` (the pages) does not read every event: it reads the counts by type, the
lifecycle events (attempts, count failures, context-limit errors) and a sample of the
measurements through the store's narrow reads, so a 100k-event page costs about what a 10k-event
one does; it builds the same :class:`~tracker.audit.builder.Story` that
:func:`~tracker.audit.builder.build_story` builds from a stream of every event, with the same
bounds, and reads the loop breaker's episode off the session's projection.

:func:`account` turns the story into the plain-language paragraph at the top of the page: how
the session ended and why. Why nothing was eligible when it met its hard limit is not restated
here: the core's own rule (:func:`tracker.core.decide.eligibility`) is asked, on the core's state
of the session at that point (its projection, or the fold of its log through the core's ``apply``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from tracker.audit.builder import MAX_MEASURED_ROWS, MAX_POINTS, StoryBuilder, build_story
from tracker.audit.format import summary
from tracker.audit.model import COUNT_KEYS, Limit, Story, revision_of
from tracker.core import Policy, SessionState, fold
from tracker.core import events as ev
from tracker.core.decide import Eligibility, eligibility
from tracker.queries import Unrecognised, decode, decode_all, type_names
from tracker.store.base import EventStore, SessionViews

__all__ = [
    "MAX_POINTS",  # the chart's cap, with the story's other names (tracker.audit.builder)
    "Limit",
    "Story",
    "account",
    "build_story",
    "ineligible_because",
    "read_story",
    "why_at_limit",
]

#: the events :func:`read_story` reads in full (few, however long the session): everything but
#: measurements and usage reports (one each per request)
LIFECYCLE_EVENTS: tuple[type[ev.DomainEvent], ...] = (
    ev.SessionStarted,
    ev.CompactionStarted,
    ev.CompactionCommitted,
    ev.CompactionRejected,
    ev.CountFailed,
    ev.ContextLimitReached,
    ev.ProviderRejected,
)
LIFECYCLE = type_names(*LIFECYCLE_EVENTS)
MEASURED = ev.ContextMeasured.TYPE
USAGE = ev.UsageReported.TYPE
#: the measurements table's events: the newest measurements and the provider's reports on them
TABLE_TYPES = type_names(ev.ContextMeasured, ev.UsageReported, ev.ProviderRejected)
SAMPLE_POINTS = 1500  # measurements picked evenly for the chart ...
PEAK_POINTS = 1000  # ... plus at most this many of those that opened an attempt or met the limit


def read_story(
    store: EventStore,
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
    b = StoryBuilder(shown or session_id, table_rows=0)
    peaks: list[int] = []
    for r in decode_all(narrow.read_types(session_id, LIFECYCLE, 1, version)):
        b.add(r)
        if isinstance(r.event, (ev.CompactionStarted, ev.ContextLimitReached)):
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
        for rec in decode_all(narrow.last_of_types(session_id, TABLE_TYPES, 3 * MAX_MEASURED_ROWS, version)):
            b.table_row(rec)
        last = decode(sample[-1])  # the sample always holds the newest measurement
        if last.version < last_limit:
            pressure = "hard_limit"
        elif isinstance(last.event, ev.ContextMeasured):
            pressure = last.event.pressure
    if by_type.get(USAGE):  # the billed dots: an even sample of the usage reports
        for rec in decode_all(narrow.sample_of_type(session_id, USAGE, SAMPLE_POINTS, version, total=by_type[USAGE])):
            b.usage(rec)
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
        "attempts": by_type.get(ev.CompactionStarted.TYPE, 0),
        "committed": by_type.get(ev.CompactionCommitted.TYPE, 0),
        "rejected": by_type.get(ev.CompactionRejected.TYPE, 0),
        "count_failed": by_type.get(ev.CountFailed.TYPE, 0),
        "context_limit": by_type.get(ev.ContextLimitReached.TYPE, 0),
        "usage_reports": by_type.get(USAGE, 0),
        "provider_rejections": by_type.get(ev.ProviderRejected.TYPE, 0),
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


def _state_at(store: EventStore, session_id: str, projection: dict[str, Any], version: int) -> SessionState | None:
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


NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def _n(count: int) -> str:
    return NUMBERS.get(count, f"{count:,}")


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
    out.extend(provider_lines(s))
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


def provider_lines(s: Story) -> list[str]:
    """What the provider said about the session's requests: what it billed against what was counted,
    the calibration decisions used, and each rejection's numbers and the limit it taught."""
    c = s.counts
    out: list[str] = []
    if c.get("usage_reports"):
        n = c["usage_reports"]
        ratios = sorted(b.ratio for b in s.billed if b.counted)
        line = f"The provider billed {_n(n)} {_plural(n, 'request')} of this session"
        if ratios:
            median = quantile_of(ratios, 0.5)
            spread = (
                f" (10–90 %: {quantile_of(ratios, 0.1):.3f}–{quantile_of(ratios, 0.9):.3f})" if len(ratios) >= 5 else ""
            )
            line += f": billed ÷ counted {median:.3f} at the median{spread}"
        factored = [r for r in s.measured_rows if r.factor is not None]
        if factored:
            last = factored[-1]
            line += (
                f"; the last calibrated decision (v{last.version}) counted {last.counted:,} tokens and decided on "
                f"{last.decided:,} (factor {last.factor:.4f})"
            )
        out.append(line + ".")
        anchored = [r for r in s.measured_rows if r.anchor is not None]
        if anchored:
            close = sorted(x for x in (r.decided_over_billed for r in anchored) if x is not None)
            out.append(
                f"{_n(len(anchored))} of the newest {_n(len(s.measured_rows))} decisions were anchored on the"
                " session's own billed count (the last billed request they extend, plus an estimate of the new"
                " messages)" + (f": decided ÷ billed {close[0]:.3f}–{close[-1]:.3f}" if close else "") + "."
            )
    for rej in s.rejections[-3:]:
        learned = (
            f"; the tracker learned a limit of {rej.learned_limit:,} tokens for {rej.model}"
            if rej.learned_limit is not None
            else "; no lower limit was learned from it"
        )
        out.append(
            f"At v{rej.version} the provider rejected the request of {rej.basis} as too long: {rej.numbers} "
            f"(the tracker had counted {rej.counted:,} against a limit of {rej.measured_limit:,}){learned}."
        )
    earlier = c.get("provider_rejections", 0) - min(3, len(s.rejections))
    if earlier > 0:
        out.append(f"The provider rejected {_n(earlier)} earlier {_plural(earlier, 'request')} as too long too.")
    return out


def quantile_of(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of an ascending list (nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def why_at_limit(s: Story) -> Eligibility | None:
    """The core's answer (:func:`tracker.core.decide.eligibility`) to whether an automatic attempt was
    eligible when the session met its hard limit, on the state the decision saw; None without that state."""
    limit, state = s.limit_event, s.limit_state
    if limit is None or state is None:
        return None
    # a ev.ContextLimitReached is recorded only at hard_limit pressure (which needs no growth to be due)
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
    rev = revision_of(basis)
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
