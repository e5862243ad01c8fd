"""Value types of the decision core: session ids, bases, measurements, input limits.

Pure: no I/O, no clock, no globals beyond constants.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, TypeVar

from tracker.errors import ContextLimitUnknown, InvalidInput, InvalidSessionId, MalformedMeasurement

FULL_SCALE_BP = 10_000
WINDOW_CEILING = 300_000
JSON_SAFE_INT = 2**53 - 1  # the largest integer every JSON reader keeps exactly: the bound on counts at every door
HISTORY_SAFETY_FACTOR_PCT = 95  # HISTORY_SAFETY_FACTOR = 0.95, kept as an integer percentage
HISTORY_SAFETY_FACTOR = HISTORY_SAFETY_FACTOR_PCT / 100
MIN_SCOPE_CONFIDENCE = 0.5

# The closed vocabularies of the domain: one declaration each, used as types and as value sets.
Quality = Literal["exact_provider", "exact_local", "heuristic_estimate"]
Pressure = Literal["normal", "compact", "hard_limit"]
Action = Literal["proceed", "compact", "wait", "context_limit"]
Trigger = Literal["threshold", "hard_limit", "growth"]
Reason = Literal["automatic", "manual"]

QUALITY_EXACT_PROVIDER: Quality = "exact_provider"
QUALITY_EXACT_LOCAL: Quality = "exact_local"
QUALITY_HEURISTIC: Quality = "heuristic_estimate"
QUALITIES: tuple[Quality, ...] = (QUALITY_EXACT_PROVIDER, QUALITY_EXACT_LOCAL, QUALITY_HEURISTIC)
EXACT_QUALITIES: frozenset[str] = frozenset({QUALITY_EXACT_PROVIDER, QUALITY_EXACT_LOCAL})
PRESSURES: tuple[Pressure, ...] = ("normal", "compact", "hard_limit")
ACTIONS: tuple[Action, ...] = ("proceed", "compact", "wait", "context_limit")


_T = TypeVar("_T")


def built(cls: type[_T], values: dict[str, Any]) -> _T:
    """``cls(**values)`` for a frozen dataclass that validates nothing, given every one of its fields:
    one dict update instead of an ``object.__setattr__`` per field (the hot paths: every decision,
    every event decoded, every fold)."""
    new = object.__new__(cls)
    new.__dict__.update(values)
    return new


class Record:
    """A frozen dataclass of JSON-native scalar fields: its data is its fields, as they are
    (``dataclasses.asdict`` without the deep copy)."""

    def to_data(self) -> dict[str, Any]:
        return dict(self.__dict__)


_SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
# C0 and C1 control characters (NUL and ESC included) and lone surrogates (not encodable as UTF-8)
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_EXPLICIT_BASIS = re.compile(r"^r(\d+):(.+)$")


def check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str):
        raise InvalidSessionId(f"must be a string, got {type(session_id).__name__}")
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidSessionId(
            "must be 1-200 characters of [A-Za-z0-9._:-], got "
            + repr(session_id[:40] + ("…" if len(session_id) > 40 else ""))
        )
    return session_id


MAX_SESSION_ID_LEN = 200  # a stored session id, fleet prefix included
FLEET_ID_LEN = 10  # "f" + 9 hex digits (tracker.store.fleets draws them)
FLEET_SEP = ":"  # a stored id's fleet ends at its first FLEET_SEP: "<fleet_id>:<session_id>"


@dataclass(frozen=True)
class SessionScope:
    """Where a caller's session ids live in the one store: the one implementation of fleet-qualified ids.

    A fleet's sessions are stored as ``"<fleet_id>:<session_id>"``; a caller sees (and names) them without
    the prefix. The unscoped scope (``fleet_id=None``: the library, a local operator) sees ids as stored.
    Every door (the API, the console, the CLI's ``--fleet``) turns ids in and out through this type, so all
    of them enforce the same limits: the stored id must be a valid session id, prefix included.
    """

    fleet_id: str | None = None

    @property
    def prefix(self) -> str:
        return f"{self.fleet_id}{FLEET_SEP}" if self.fleet_id else ""

    @property
    def max_len(self) -> int:
        """The longest session id this scope's callers may name (200 less the prefix)."""
        return MAX_SESSION_ID_LEN - len(self.prefix)

    def internal(self, session_id: Any) -> str:
        """The stored id of a caller's ``session_id``; ``InvalidSessionId`` naming what is wrong."""
        if self.fleet_id is None:
            return check_session_id(session_id)
        if isinstance(session_id, str) and len(session_id) > self.max_len:
            raise InvalidSessionId(f"must be at most {self.max_len} characters in a fleet, got {len(session_id)}")
        check_session_id(session_id)
        return check_session_id(self.prefix + session_id)

    def external(self, stored: str) -> str:
        """The id a caller of this scope knows a stored session by."""
        p = self.prefix
        return stored[len(p) :] if p and stored.startswith(p) else stored

    def owns(self, stored: str) -> bool:
        return stored.startswith(self.prefix)

    def stored_prefix(self, match: str = "") -> str | None:
        """What the stored ids of this scope's sessions whose ids (as this scope shows them) start
        with ``match`` start with; None: every stored id (the unscoped scope, nothing to match)."""
        return (self.prefix + match) or None

    def start_policy(self) -> Any:
        """The ``Policy`` this scope's new sessions start with; None: the Tracker's (a fleet's caller
        says its fleet's: ``tracker.http.runtime.Caller``). (``Any``: policy.py builds on this module.)"""
        return None

    @staticmethod
    def fleet_of(stored: str) -> str:
        """The fleet of a stored id: the text before its first ``FLEET_SEP`` ('' without one).

        The one rule for every reader that files sessions by fleet: the calibration ledger, the
        per-fleet policy, the gauges (``tracker.store.views.fleet_of``, the same rule in SQL) and the
        events' ``fleet`` column (the per-fleet feed). A library id ``team:s1`` is in fleet ``team``
        for all of them (no HTTP fleet has that id, so the gauges count it under ``none``)."""
        head, sep, _ = stored.partition(FLEET_SEP)
        return head if sep else ""


def check_text(field: str, value: Any, max_len: int = 200) -> str:
    """A name, reason or key given by a caller: 1-``max_len`` characters, no control characters
    (they would reach an operator's terminal) and no lone surrogates (not text)."""
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        shown = "missing" if value is None else repr(value)[:60]
        raise InvalidInput(field, f"must be a string of 1-{max_len} characters, got {shown}")
    bad = _UNSAFE_TEXT.search(value)
    if bad is not None:
        raise InvalidInput(field, f"must not contain control characters or lone surrogates, got {bad.group()!r}")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, order=True)
class Basis:
    """What a count was computed over: compaction generation + last history item included."""

    revision: int
    through: str

    def __post_init__(self) -> None:
        if not is_int(self.revision) or self.revision < 1:
            raise InvalidInput("basis.revision", f"must be an integer >= 1, got {self.revision!r}")
        if not isinstance(self.through, str) or not self.through or len(self.through) > 200:
            raise InvalidInput(
                "basis.through", f"must be a non-empty string of at most 200 characters, got {self.through!r}"
            )
        if not self.through.isprintable():
            raise InvalidInput("basis.through", f"must be printable text (no control characters), got {self.through!r}")

    def __str__(self) -> str:
        return f"r{self.revision}:{self.through}"

    @classmethod
    def parse(cls, text: Any, current_revision: int = 1) -> Basis:
        """``r<revision>:<through>``, or a bare ``through`` at ``current_revision``."""
        if isinstance(text, Basis):
            return text
        if isinstance(text, dict):
            return cls(text.get("revision"), text.get("through"))  # type: ignore[arg-type]
        if not isinstance(text, str) or not text:
            raise InvalidInput("basis", f"must be a non-empty string like 'r2:msg-41', got {text!r}")
        m = _EXPLICIT_BASIS.match(text)
        if m:
            return cls(int(m.group(1)), m.group(2))
        return cls(current_revision, text)

    def to_data(self) -> str:
        return str(self)


@dataclass(frozen=True)
class ModelRef:
    provider: str
    name: str

    def to_data(self) -> dict[str, str]:
        return {"provider": self.provider, "name": self.name}

    @classmethod
    def from_data(cls, data: Any) -> ModelRef:
        if isinstance(data, ModelRef):
            return data
        if isinstance(data, str):
            check_text("model", data, 301)
            provider, _, name = data.rpartition("/")
            return cls(provider or "unknown", name)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise MalformedMeasurement("must be {'provider': ..., 'name': ...}", field="model")
        provider = data.get("provider") or "unknown"
        return cls(check_text("model.provider", provider, 100), check_text("model.name", data["name"]))


@dataclass(frozen=True)
class Measurement:
    """One count of one complete request (behaviour.md "Words")."""

    basis: Basis
    model: ModelRef
    fingerprint: str
    input_tokens: int
    input_limit: int
    quality: str

    def __post_init__(self) -> None:
        validate_measurement_fields(self.input_tokens, self.input_limit, self.quality, self.fingerprint)

    def to_data(self) -> dict[str, Any]:
        return {
            "basis": str(self.basis),
            "model": self.model.to_data(),
            "fingerprint": self.fingerprint,
            "input_tokens": self.input_tokens,
            "input_limit": self.input_limit,
            "quality": self.quality,
        }

    @classmethod
    def from_data(cls, data: Any, current_revision: int = 1) -> Measurement:
        if not isinstance(data, dict):
            raise MalformedMeasurement("must be an object", field="measurement")
        for key in ("basis", "input_tokens", "input_limit"):
            if key not in data:
                raise MalformedMeasurement("missing", field=key)
        return cls(
            basis=Basis.parse(data["basis"], current_revision),
            model=ModelRef.from_data(data.get("model", {"provider": "unknown", "name": "unknown"})),
            fingerprint=data.get("fingerprint", "0" * 64),
            input_tokens=data["input_tokens"],
            input_limit=data["input_limit"],
            quality=data.get("quality", "exact_local"),
        )


def recorded_measurement(data: Any) -> Measurement:
    """A recorded measurement (a stored event's ``measurement``): as ``Measurement.to_data`` wrote
    it, built without checking its values again (they were checked when it was recorded; every read
    of the log decodes each measurement through here); any other shape (the first writers' rows, a
    hand-made one) goes through ``Measurement.from_data``, which checks everything."""
    try:
        m = _EXPLICIT_BASIS.match(data["basis"])
        model = data["model"]
        if m is not None and type(model) is dict and len(data) == 6 and len(model) == 2:
            return built(
                Measurement,
                {
                    "basis": built(Basis, {"revision": int(m.group(1)), "through": m.group(2)}),
                    "model": built(ModelRef, {"provider": model["provider"], "name": model["name"]}),
                    "fingerprint": data["fingerprint"],
                    "input_tokens": data["input_tokens"],
                    "input_limit": data["input_limit"],
                    "quality": data["quality"],
                },
            )
    except (KeyError, TypeError):
        pass
    return Measurement.from_data(data)


def validate_measurement_fields(input_tokens: Any, input_limit: Any, quality: Any, fingerprint: Any) -> None:
    if not is_int(input_tokens) or input_tokens < 0:
        raise MalformedMeasurement(f"must be an integer >= 0, got {input_tokens!r}", field="input_tokens")
    if not is_int(input_limit) or input_limit <= 0:
        raise MalformedMeasurement(f"must be an integer > 0, got {input_limit!r}", field="input_limit")
    if quality not in QUALITIES:
        raise MalformedMeasurement(f"must be one of {', '.join(QUALITIES)}, got {quality!r}", field="quality")
    if not isinstance(fingerprint, str) or not _SHA256_HEX.match(fingerprint):
        raise MalformedMeasurement("must be 64 lowercase hex characters (SHA-256)", field="fingerprint")


def occupancy_bp(input_tokens: int, input_limit: int) -> int:
    """``min(10000, floor(input_tokens * 10000 / input_limit))`` in integer arithmetic."""
    if not is_int(input_limit) or input_limit <= 0:
        raise MalformedMeasurement(f"must be an integer > 0, got {input_limit!r}", field="input_limit")
    if not is_int(input_tokens) or input_tokens < 0:
        raise MalformedMeasurement(f"must be an integer >= 0, got {input_tokens!r}", field="input_tokens")
    return min(FULL_SCALE_BP, input_tokens * FULL_SCALE_BP // input_limit)


def resolve_input_limit(
    *,
    window: int | None,
    max_output_tokens: int | None,
    max_input_tokens: int | None,
    reserved_output: int,
    safety_margin: int,
    model: str = "model",
) -> int:
    """behaviour.md "Policy": the input limit of a model under a policy. Fails closed with ContextLimitUnknown."""
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ContextLimitUnknown(f"{model}: no context window known", model=model)
    reserve = reserved_output if max_output_tokens is None else min(reserved_output, max_output_tokens)
    if reserved_output >= window:
        raise ContextLimitUnknown(f"{model}: reserved_output {reserved_output} >= window {window}", model=model)
    raw = window - reserve
    if max_input_tokens is not None and max_input_tokens < raw:
        raw = max_input_tokens
    if raw <= 0:
        raise ContextLimitUnknown(f"{model}: no room for input (raw limit {raw})", model=model)
    if safety_margin >= raw:
        raise ContextLimitUnknown(f"{model}: safety_margin {safety_margin} >= raw limit {raw}", model=model)
    return raw - safety_margin


def ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def finite_number(value: Any) -> bool:
    """An int (not a bool) or a finite float."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


@lru_cache(maxsize=256)  # a memo of a pure function: same answer, less string parsing on the hot path
def exact(value: float | int | Fraction | Decimal) -> Fraction:
    """A number as the exact fraction the user wrote: 0.1 -> 1/10 (not 0.1000000000000000055...)."""
    if isinstance(value, float):
        return Fraction(repr(value))
    return Fraction(value)
