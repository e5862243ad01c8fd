"""The compaction policy (behaviour.md "Policy"): defaults, validation, and (de)serialisation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tracker.core.model import EXACT_QUALITIES, FULL_SCALE_BP, QUALITIES, Record, finite_number, is_int
from tracker.errors import InvalidPolicy

COUNTER_POLICIES = ("allow_conservative", "require_exact")

# What each field means; the settings tree, `tracker info` and the docs read it from here.
POLICY_DOCS: dict[str, str] = {
    "automatic": "false = observe-only: pressure is never `compact` and no automatic attempt opens",
    "compact_at_bp": "compact when occupancy reaches this many basis points of the input limit",
    "rearm_below_bp": "after compacting, pressure stays `compact` until occupancy drops below this",
    "counter_policy": "`allow_conservative` also accepts heuristic counts; `require_exact` only exact ones",
    "reserved_output": "tokens kept free for the model's reply",
    "safety_margin": "tokens kept free beside the reply (must be > 0 when heuristic counts are allowed)",
    "count_timeout_s": "seconds a count may take before it fails as `CountTimeout`",
    "turn_delta": "growth trigger: compact when one turn grows usage by this fraction of the window (none = off)",
    "max_automatic_per_episode": "loop breaker: automatic attempts allowed before pressure returns to normal",
    "attempt_lease_s": "seconds an attempt may stay open before it is rejected as `lease_expired`",
}


@dataclass(frozen=True)
class Policy(Record):
    automatic: bool = True
    compact_at_bp: int = 8000
    rearm_below_bp: int = 6000
    counter_policy: str = "allow_conservative"
    reserved_output: int = 16384
    safety_margin: int = 8192
    count_timeout_s: float = 2.0
    turn_delta: float | None = None
    max_automatic_per_episode: int = 3
    attempt_lease_s: float = 60.0

    def __post_init__(self) -> None:
        def bad(field: str, problem: str) -> InvalidPolicy:
            return InvalidPolicy(field, f"{problem}, got {getattr(self, field)!r}")

        if not isinstance(self.automatic, bool):
            raise bad("automatic", "must be true or false")
        for name in (
            "compact_at_bp",
            "rearm_below_bp",
            "reserved_output",
            "safety_margin",
            "max_automatic_per_episode",
        ):
            if not is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        if not 0 < self.compact_at_bp < FULL_SCALE_BP:
            raise bad("compact_at_bp", f"must be in (0, {FULL_SCALE_BP})")
        if not 0 <= self.rearm_below_bp < FULL_SCALE_BP:
            raise bad("rearm_below_bp", f"must be in [0, {FULL_SCALE_BP})")
        if self.automatic and not 0 < self.rearm_below_bp < self.compact_at_bp:
            raise InvalidPolicy(
                "rearm_below_bp",
                f"must satisfy 0 < rearm_below_bp < compact_at_bp ({self.compact_at_bp}) when automatic, got {self.rearm_below_bp}",
            )
        if self.counter_policy not in COUNTER_POLICIES:
            raise bad("counter_policy", f"must be one of {', '.join(COUNTER_POLICIES)}")
        if self.reserved_output < 0:
            raise bad("reserved_output", "must be >= 0")
        if self.safety_margin < 0:
            raise bad("safety_margin", "must be >= 0")
        if self.counter_policy == "allow_conservative" and self.safety_margin <= 0:
            raise bad(
                "safety_margin", "must be > 0 when heuristic counts are allowed (counter_policy allow_conservative)"
            )
        if not _positive_finite(self.count_timeout_s):
            raise bad("count_timeout_s", "must be a finite number > 0")
        if self.turn_delta is not None and not (_positive_finite(self.turn_delta) and self.turn_delta <= 1):
            raise bad("turn_delta", "must be null (off) or a number in (0, 1]")
        if self.max_automatic_per_episode < 1:
            raise bad("max_automatic_per_episode", "must be >= 1")
        if not _positive_finite(self.attempt_lease_s):
            raise bad("attempt_lease_s", "must be a finite number > 0")

    def allows_quality(self, quality: str) -> bool:
        if self.counter_policy == "require_exact":
            return quality in EXACT_QUALITIES
        return quality in QUALITIES

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> Policy:
        if data is None:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidPolicy(unknown[0], "is not a policy field")
        return cls(**dict(data))

    def replace(self, **changes: Any) -> Policy:
        return Policy.from_data({**self.to_data(), **{k: v for k, v in changes.items()}})


def _positive_finite(value: Any) -> bool:
    return finite_number(value) and value > 0
