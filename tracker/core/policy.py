"""The compaction policy (SPEC §3): defaults, validation, and (de)serialisation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from tracker.core.model import FULL_SCALE_BP, is_int
from tracker.errors import InvalidPolicy

COUNTER_POLICIES = ("allow_conservative", "require_exact")


@dataclass(frozen=True)
class Policy:
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
        for name in ("compact_at_bp", "rearm_below_bp", "reserved_output", "safety_margin", "max_automatic_per_episode"):
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
            raise bad("safety_margin", "must be > 0 when heuristic counts are allowed (counter_policy allow_conservative)")
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
            return quality in ("exact_provider", "exact_local")
        return quality in ("exact_provider", "exact_local", "heuristic_estimate")

    def to_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> "Policy":
        if data is None:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidPolicy(unknown[0], "is not a policy field")
        return cls(**dict(data))

    def replace(self, **changes: Any) -> "Policy":
        return Policy.from_data({**self.to_data(), **{k: v for k, v in changes.items()}})

    @classmethod
    def from_env(cls, env: Mapping[str, str], prefix: str = "TRACKER_") -> "Policy":
        """Read every policy field from ``TRACKER_<FIELD>`` (upper case)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(prefix + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse_env(f.name, raw)
        return cls(**values)


def _positive_finite(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0


def _parse_env(name: str, raw: str) -> Any:
    default = getattr(Policy(), name)
    try:
        if name == "automatic":
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if name == "turn_delta":
            return None if raw.strip().lower() in ("none", "null", "off") else float(raw)
        if isinstance(default, bool):
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return raw
    except ValueError:
        raise InvalidPolicy(name, f"cannot parse TRACKER_{name.upper()}={raw!r}") from None
