"""Anchoring a decision on the session's own billed count (behaviour.md "Anchoring").

The request an agent is about to send is, most of the time, the request it sent last plus a few
new messages. When the provider billed that earlier request (a usage report), the count decided on
is ``billed(prefix) + estimate(new messages)``: only the new part is estimated, so the decision is
about as accurate as the provider's own count whatever the kind of content.

* :class:`RequestShape`: what the counting layer says about a counted request beyond its count:
  how many messages it has, the digest of its history (system prompt, tools and every message,
  chained message by message), and, for the position a caller asked about (the anchor's message
  count), the digest of its first that many messages. Recorded in ``ContextMeasured.shape``, so a
  replay re-decides with the same facts.
* :class:`AnchorPoint`: the session's anchor (the fold of its log): the last usage report of the
  current revision whose request's shape is known: its basis, model, message count, digest, the
  counter's raw count of it and what the provider billed. A commit (a new revision) or a
  measurement of another model clears it.
* :func:`anchor_decision`: the anchored count of a measurement, or None when the request does not
  extend the anchor's (another revision, model or quality, a different prefix, fewer messages).
  The new messages' raw count is ``counted - anchor.counted`` (the counters count a request
  message by message, so this is their count of the new messages), corrected by the session's
  own ratio ``billed / counted`` of the anchor, plus ``MIN_MARGIN`` (3 %), rounded up to a basis
  point and bounded to ``[FACTOR_MIN, FACTOR_MAX]``: a session's own ratio follows its mix of
  content and a provider's billing change at once. The result is recorded as :class:`Anchor`.

Pure: no I/O, no clock, exact integer arithmetic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tracker.core.calibration import FACTOR_GRID, FACTOR_MAX, FACTOR_MIN, MIN_MARGIN
from tracker.core.model import JSON_SAFE_INT, ceil_div, is_int
from tracker.errors import InvalidInput, an_object

#: the kinds of content a request's shape names (``tracker.counting.counters.content_kind``)
CONTENT_KINDS = ("latin", "cjk", "other_script")

__all__ = [
    "CONTENT_KINDS",
    "Anchor",
    "AnchorPoint",
    "RequestShape",
    "anchor_decision",
    "delta_estimate",
    "delta_factor",
]

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _int(field: str, value: Any, low: int = 0) -> int:
    if not is_int(value) or not low <= value <= JSON_SAFE_INT:
        raise InvalidInput(field, f"must be an integer in [{low}, {JSON_SAFE_INT}], got {str(value)[:40]!r}")
    return value


def _digest(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise InvalidInput(field, "must be 64 lowercase hex characters (SHA-256)")
    return value


@dataclass(frozen=True)
class RequestShape:
    """A counted request's messages: their number, the digest of the whole history, and the digest
    of its first ``at`` messages (``at``: the position asked about, None when none was)."""

    messages: int
    chain: str
    at: int | None = None
    at_chain: str | None = None
    content: str | None = None  # the request's kind of content (calibration is kept per kind too)

    def __post_init__(self) -> None:
        _int("shape.messages", self.messages)
        if self.content is not None and self.content not in CONTENT_KINDS:
            raise InvalidInput("shape.content", f"must be one of {', '.join(CONTENT_KINDS)}, got {self.content!r}")
        _digest("shape.chain", self.chain)
        if (self.at is None) != (self.at_chain is None):
            raise InvalidInput("shape.at", "at and at_chain are given together or not at all")
        if self.at is not None:
            _int("shape.at", self.at)
            if self.at > self.messages:
                raise InvalidInput("shape.at", f"{self.at} is past the request's {self.messages} messages")
            _digest("shape.at_chain", self.at_chain)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"messages": self.messages, "chain": self.chain}
        if self.at is not None:
            data["at"], data["at_chain"] = self.at, self.at_chain
        if self.content is not None:
            data["content"] = self.content
        return data

    @classmethod
    def from_data(cls, data: Any) -> RequestShape:
        get = an_object("shape", data).get
        return cls(get("messages"), get("chain"), get("at"), get("at_chain"), get("content"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class AnchorPoint:
    """The session's last billed request whose shape is known (part of ``SessionState``)."""

    basis: str
    model: str
    quality: str
    messages: int
    chain: str
    counted: int  # the counter's raw count of that request
    billed: int  # what the provider billed for it: input + cache read + cache write

    def to_data(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Anchor:
    """What an anchored decision rests on (``ContextMeasured.anchor``): the anchor's basis, what the
    provider billed for it and the counter's raw count of it, the factor of the new messages and
    their estimate. The count decided on is ``billed + estimated_delta``."""

    basis: str
    billed: int
    counted: int
    factor_bp: int
    estimated_delta: int

    def __post_init__(self) -> None:
        if not isinstance(self.basis, str) or not self.basis:
            raise InvalidInput("anchor.basis", "must be a basis")
        _int("anchor.billed", self.billed)
        _int("anchor.counted", self.counted, 1)
        _int("anchor.factor_bp", self.factor_bp, 1)
        _int("anchor.estimated_delta", self.estimated_delta)

    @property
    def decided(self) -> int:
        return min(JSON_SAFE_INT, self.billed + self.estimated_delta)

    def to_data(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_data(cls, data: Any) -> Anchor:
        get = an_object("anchor", data).get
        return cls(get("basis"), get("billed"), get("counted"), get("factor_bp"), get("estimated_delta"))  # type: ignore[arg-type]


def delta_factor(billed: int, counted: int) -> int:
    """The factor (basis points) of a session's new messages: its own ``billed / counted`` plus
    ``MIN_MARGIN``, rounded up to a basis point, within ``[FACTOR_MIN, FACTOR_MAX]``."""
    k = Fraction(billed, counted) * (1 + MIN_MARGIN)
    bp = ceil_div(k.numerator * FACTOR_GRID, k.denominator)
    return min(int(FACTOR_MAX * FACTOR_GRID), max(int(FACTOR_MIN * FACTOR_GRID), bp))


def delta_estimate(counted: int, anchor_counted: int, factor_bp: int) -> int:
    """The estimate of the new messages: ``ceil((counted - anchor_counted) x factor)``."""
    return ceil_div((counted - anchor_counted) * factor_bp, FACTOR_GRID)


def anchor_decision(
    point: AnchorPoint | None,
    shape: RequestShape | None,
    *,
    basis_revision: int,
    model: str,
    quality: str,
    counted: int,
) -> Anchor | None:
    """The anchored decision of a measurement (raw count ``counted`` of a request of ``shape``), or
    None when its request does not extend the anchor's request."""
    if point is None or shape is None or shape.at is None:
        return None
    if not point.basis.startswith(f"r{basis_revision}:") or point.model != model or point.quality != quality:
        return None
    if shape.at != point.messages or shape.at_chain != point.chain or counted < point.counted:
        return None
    factor_bp = delta_factor(point.billed, point.counted)
    delta = delta_estimate(counted, point.counted, factor_bp)
    return Anchor(point.basis, point.billed, point.counted, factor_bp, delta)
