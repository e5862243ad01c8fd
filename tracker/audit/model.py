"""The session page's model: the values a :class:`Story` is made of (attempts, markers, chart
points, billed counts, rejections, measurement rows), as :mod:`tracker.audit.builder` reads them
off a session's events in one pass and the pages (:mod:`tracker.audit.pages`, the console) show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction

from tracker.core import SessionState
from tracker.core import events as ev
from tracker.core.anchor import Anchor
from tracker.core.calibration import drifted
from tracker.core.ledger import kind_of
from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.errors import InvalidInput
from tracker.store.decoding import Recorded

COUNT_KEYS = (
    "events",
    "measurements",
    "attempts",
    "committed",
    "rejected",
    "count_failed",
    "context_limit",
    "usage_reports",
    "provider_rejections",
)


def revision_of(basis: str) -> int | None:
    """The revision of a recorded basis (``r<revision>:<through>``, read by ``core.Basis.parse``);
    None for text that is not one."""
    try:
        return Basis.parse(basis, 0).revision  # a bare ``through`` has no revision: 0 is refused
    except InvalidInput:
        return None


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

    @classmethod
    def opened(
        cls,
        e: ev.CompactionStarted | ev.CompactionCommitted | ev.CompactionRejected,
        v: int,
        at: datetime,
        *,
        trigger: str = "?",
        fencing_token: int = 0,
        tokens_before: int | None = None,
    ) -> Attempt:
        """The attempt ``e`` names, opened at ``v``/``at``: from its ``CompactionStarted`` (which alone
        says the trigger and token), or from its end alone when the events read start after it opened."""
        return cls(e.attempt_id, e.reason, trigger, e.basis, fencing_token, v, at, tokens_before)

    @property
    def revision(self) -> int | None:
        return revision_of(self.basis)


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
    used: int  # the count decided on (the counter's, corrected by calibration)
    limit: int  # the input limit decided against
    compact: int
    rearm: int
    hard: int
    version: int
    counted: int | None = None  # the counter's raw count, when calibration corrected it


@dataclass(frozen=True)
class Billed:
    """One ``UsageReported``: what the provider billed for a measured request (a dot on the chart)."""

    t: float
    version: int
    basis: str
    billed: int
    counted: int  # the measurement's raw count

    @property
    def ratio(self) -> float:
        return self.billed / self.counted if self.counted else 0.0


@dataclass(frozen=True)
class Rejection:
    """One ``ProviderRejected``: the provider refused a request as too long."""

    version: int
    at: datetime
    basis: str
    model: str
    counted: int
    measured_limit: int
    input_tokens: int | None  # the provider's numbers, when its message stated them
    input_limit: int | None
    learned_limit: int | None

    @property
    def numbers(self) -> str:
        """``"201,000 > 200,000"``: the provider's count and limit, as far as known."""
        given = self.input_tokens is not None or self.input_limit is not None
        if not given:
            return "no numbers given"
        got = "?" if self.input_tokens is None else f"{self.input_tokens:,}"
        limit = "?" if self.input_limit is None else f"{self.input_limit:,}"
        return f"{got} > {limit}"

    def label(self) -> str:
        learned = f"; learned limit {self.learned_limit:,}" if self.learned_limit is not None else ""
        return f"provider rejected {self.basis} as too long: {self.numbers} (counted {self.counted:,}){learned}"


def rejection_of(r: Recorded, e: ev.ProviderRejected) -> Rejection:
    return Rejection(
        r.version,
        r.recorded_at,
        e.basis,
        e.model,
        e.counted_tokens,
        e.measured_limit,
        e.input_tokens,
        e.input_limit,
        e.learned_limit,
    )


@dataclass
class MeasuredRow:
    """A row of the measurements table: the count, the decision's count, and the provider's numbers."""

    version: int
    at: datetime
    basis: str
    model: str
    quality: str
    counted: int  # the counter's raw count
    decided: int  # the count decided on
    limit: int  # the input limit decided against
    factor: float | None  # the calibration factor applied (None: none)
    action: str
    billed: int | None = None  # the provider's billed input for this request (its usage report)
    rejection: Rejection | None = None
    anchor: Anchor | None = None  # what an anchored decision rested on (the session's billed count)

    @property
    def decided_over_billed(self) -> float | None:
        """decided on ÷ billed: how far the decision was from the provider's own count (per turn)."""
        return None if not self.billed else self.decided / self.billed

    @property
    def ratio(self) -> float | None:
        """billed ÷ counted (the raw count), when the provider reported usage."""
        return None if self.billed is None or not self.counted else self.billed / self.counted

    @property
    def kind(self) -> str:
        """The counter's kind: ``estimate`` (calibrated) or ``exact`` (whose billed ÷ counted is drift)."""
        return kind_of(self.quality)

    @property
    def drifted(self) -> bool:
        """An exact count the provider billed more than the drift threshold away from."""
        billed = self.billed
        return (
            self.kind == "exact" and billed is not None and self.counted > 0 and drifted(Fraction(billed, self.counted))
        )


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
    billed: list[Billed] = field(default_factory=list)  # the provider's usage reports (at most MAX_POINTS)
    rejections: list[Rejection] = field(default_factory=list)  # the newest MAX_REJECTIONS provider rejections
    measured_rows: list[MeasuredRow] = field(default_factory=list)  # the newest MAX_MEASURED_ROWS measurements
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
    policy: Policy | None = None  # the policy the session started with (None: no SessionStarted read)
    limit_event: Limit | None = None  # the last ev.ContextLimitReached
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
