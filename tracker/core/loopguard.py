"""Loop-guard reclaim plan (behaviour.md "Loop-guard reclaim plan"): what to shrink or drop when an agent loop outgrows its window.

Inside one turn an agent loop keeps appending tool calls and tool results. When
the projected request crosses ``threshold_ratio`` of the available input budget,
this module decides how to get back under ``low_water_ratio`` of it:

* Stage 1 shrinks old ``tool_result`` entries to their preview (oldest first).
* Stage 2 drops the oldest whole tool batches when previews are not enough.

The caller maps its provider-specific history onto :class:`LoopGuardEntry`
values, calls :func:`plan_reclaim` and applies the returned indices. The module
is pure: no I/O, no clock, no state; all arithmetic is exact.

Invariants the plan never violates:

* entry 0 (the task) and the newest ``protected_tail`` entries are never touched;
  the mutable window is indices ``1 … n - protected_tail - 1``;
* a tool batch is dropped whole or not at all, so a ``tool_call`` never loses its
  ``tool_result`` (providers reject the orphan) and vice versa.

Tool batches
------------
A batch is one agent step: a run of ``tool_call`` entries followed by the run of
``tool_result`` entries that answers it. It is *not* any maximal run of tool
entries: ``call, result, call, result`` is two batches. Batches are found by
partitioning the **whole** list (not just the window), oldest first, so a batch
is exactly the same unit whatever the window is. A batch is droppable only if it
lies entirely inside the mutable window:

* A batch reaching into the protected tail is never dropped or split, and since
  every later batch starts at or after its end, nothing after it is droppable.
* A batch that *starts with results* (no call before them in the batch) arises
  in two ways. If the results directly follow a non-tool entry they are orphans
  already (their call is gone): such a results-only run is its own batch and may
  be dropped like any other, as in the reference implementation; dropping them
  cannot orphan anything. If instead they directly follow entry 0 and entry 0 is
  itself a tool entry, they belong to entry 0's batch; entry 0 is never touched,
  so that batch (and those results) is never dropped, otherwise entry 0's call
  would lose its results. They may still be truncated in Stage 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from tracker.core.model import exact, is_int
from tracker.errors import InvalidInput

__all__ = [
    "DEFAULT_CALIBRATION",
    "DEFAULT_LOW_WATER_RATIO",
    "DEFAULT_PROTECTED_TAIL",
    "DEFAULT_THRESHOLD_RATIO",
    "ENTRY_KINDS",
    "LoopGuardEntry",
    "ReclaimPlan",
    "plan_reclaim",
]

EntryKind = Literal["other", "tool_call", "tool_result"]
ENTRY_KINDS: tuple[str, ...] = ("other", "tool_call", "tool_result")

#: Fraction of the available input budget at which the guard fires.
DEFAULT_THRESHOLD_RATIO = 0.8
#: Fraction the guard reclaims *down to* once it fires (deeper than the threshold,
#: so the next step does not immediately cross it again and rewrite the prefix).
DEFAULT_LOW_WATER_RATIO = 0.6
#: Newest entries (the live working set) the guard never modifies.
DEFAULT_PROTECTED_TAIL = 4
DEFAULT_CALIBRATION = 1.0

_ENTRY_KEYS = frozenset({"kind", "tokens", "preview_tokens"})


def _check_entry_fields(kind: Any, tokens: Any, preview_tokens: Any, prefix: str) -> None:
    if not isinstance(kind, str) or kind not in ENTRY_KINDS:
        raise InvalidInput(f"{prefix}kind", f"must be one of {', '.join(ENTRY_KINDS)}, got {kind!r}")
    if not is_int(tokens) or tokens < 0:
        raise InvalidInput(f"{prefix}tokens", f"must be an integer >= 0, got {tokens!r}")
    if preview_tokens is not None and (not is_int(preview_tokens) or preview_tokens < 0):
        raise InvalidInput(f"{prefix}preview_tokens", f"must be null or an integer >= 0, got {preview_tokens!r}")


@dataclass(frozen=True)
class LoopGuardEntry:
    """One history item as the loop guard sees it.

    ``preview_tokens`` is what a ``tool_result`` would cost after truncation to a
    head/tail preview; ``None`` means it cannot be truncated. It is ignored for
    other kinds.
    """

    kind: EntryKind
    tokens: int
    preview_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_entry_fields(self.kind, self.tokens, self.preview_tokens, "")


@dataclass(frozen=True)
class ReclaimPlan:
    """The decision. ``fire`` false means: leave the history completely untouched.

    ``truncate``: indices to replace by their preview (ascending, disjoint from
    ``drop``). ``drop``: indices to remove (ascending, whole batches).
    ``projected_tokens``: overhead + the kept entries at their effective size.
    Unpacks as ``fire, truncate, drop, projected_tokens = plan``.
    """

    fire: bool
    truncate: tuple[int, ...]
    drop: tuple[int, ...]
    projected_tokens: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.fire, self.truncate, self.drop, self.projected_tokens))


def _normalise_entries(entries: Any) -> list[LoopGuardEntry]:
    if entries is None or isinstance(entries, (str, bytes, bytearray, Mapping)) or not isinstance(entries, Iterable):
        raise InvalidInput("entries", f"must be a sequence of entries, got {type(entries).__name__}")
    out: list[LoopGuardEntry] = []
    for i, entry in enumerate(entries):
        prefix = f"entries[{i}]."
        if isinstance(entry, LoopGuardEntry):
            # Re-check: a frozen dataclass can still be forced with object.__setattr__.
            _check_entry_fields(entry.kind, entry.tokens, entry.preview_tokens, prefix)
            out.append(entry)
        elif isinstance(entry, Mapping):
            unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
            if unknown:
                raise InvalidInput(
                    f"entries[{i}]", f"unknown key(s) {', '.join(unknown)}; allowed: kind, tokens, preview_tokens"
                )
            for key in ("kind", "tokens"):
                if key not in entry:
                    raise InvalidInput(f"{prefix}{key}", "is required")
            kind, tokens, preview = entry["kind"], entry["tokens"], entry.get("preview_tokens")
            _check_entry_fields(kind, tokens, preview, prefix)
            out.append(LoopGuardEntry(kind, tokens, preview))
        else:
            raise InvalidInput(f"entries[{i}]", f"must be a LoopGuardEntry or a mapping, got {type(entry).__name__}")
    return out


def _exact(field: str, value: Any) -> Fraction:
    """A finite real as an exact fraction; floats by their shortest repr (0.8 → 4/5)."""
    if isinstance(value, bool):
        raise InvalidInput(field, f"must be a number, got {value!r}")
    if isinstance(value, (int, Fraction)):
        return exact(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(field, f"must be finite, got {value!r}")
        return exact(value)
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise InvalidInput(field, f"must be finite, got {value!r}")
        return exact(value)
    raise InvalidInput(field, f"must be a number, got {type(value).__name__}")


def _ratio(field: str, value: Any) -> Fraction:
    r = _exact(field, value)
    if not 0 < r <= 1:
        raise InvalidInput(field, f"must be in (0, 1], got {value!r}")
    return r


def _tool_batches(entries: list[LoopGuardEntry]) -> list[tuple[int, int]]:
    """Partition the whole list into tool batches ``(start, end_exclusive)``, oldest first.

    From each tool entry not yet in a batch: the run of ``tool_call`` entries,
    then the run of ``tool_result`` entries answering them. Either run may be
    empty (calls awaiting results; orphaned results), not both.
    """
    batches: list[tuple[int, int]] = []
    n = len(entries)
    i = 0
    while i < n:
        if entries[i].kind == "other":
            i += 1
            continue
        start = i
        while i < n and entries[i].kind == "tool_call":
            i += 1
        while i < n and entries[i].kind == "tool_result":
            i += 1
        batches.append((start, i))
    return batches


def plan_reclaim(
    entries: Iterable[LoopGuardEntry | Mapping[str, Any]],
    available_input_tokens: int,
    fixed_overhead_tokens: int,
    threshold_ratio: float = DEFAULT_THRESHOLD_RATIO,
    low_water_ratio: float = DEFAULT_LOW_WATER_RATIO,
    protected_tail: int = DEFAULT_PROTECTED_TAIL,
    calibration: float = DEFAULT_CALIBRATION,
) -> ReclaimPlan:
    """Decide what to reclaim, if anything (behaviour.md "Loop-guard reclaim plan").

    ``threshold = floor(avail * threshold_ratio / cal)`` and
    ``low = floor(avail * low_water_ratio / cal)``, exactly, with ``cal =
    calibration`` if it is > 0 else 1. If ``overhead + Σ tokens <= threshold``
    the plan does not fire and nothing is touched. Otherwise Stage 1 truncates
    and Stage 2 drops whole batches, oldest first, until the total is at or
    below ``low`` or nothing more may be touched.

    Raises :class:`~tracker.errors.InvalidInput` naming the bad field.
    """
    items = _normalise_entries(entries)
    if not is_int(available_input_tokens) or available_input_tokens <= 0:
        raise InvalidInput("available_input_tokens", f"must be an integer > 0, got {available_input_tokens!r}")
    if not is_int(fixed_overhead_tokens) or fixed_overhead_tokens < 0:
        raise InvalidInput("fixed_overhead_tokens", f"must be an integer >= 0, got {fixed_overhead_tokens!r}")
    threshold_r = _ratio("threshold_ratio", threshold_ratio)
    low_r = _ratio("low_water_ratio", low_water_ratio)
    if low_r > threshold_r:
        raise InvalidInput(
            "low_water_ratio", f"must be <= threshold_ratio ({threshold_ratio!r}), got {low_water_ratio!r}"
        )
    if not is_int(protected_tail) or protected_tail < 0:
        raise InvalidInput("protected_tail", f"must be an integer >= 0, got {protected_tail!r}")
    cal = _exact("calibration", calibration)
    if cal <= 0:
        cal = Fraction(1)

    threshold = math.floor(available_input_tokens * threshold_r / cal)
    low = math.floor(available_input_tokens * low_r / cal)
    total = fixed_overhead_tokens + sum(e.tokens for e in items)

    if total <= threshold:
        return ReclaimPlan(False, (), (), total)

    n = len(items)
    lo, hi = 1, max(1, n - protected_tail)  # mutable window: lo <= i < hi

    # Stage 1: shrink old tool outputs to their previews, oldest first.
    truncated: set[int] = set()
    for i in range(lo, hi):
        if total <= low:
            break
        e = items[i]
        if e.kind == "tool_result" and e.preview_tokens is not None and e.preview_tokens < e.tokens:
            truncated.add(i)
            total -= e.tokens - e.preview_tokens

    # Stage 2: drop whole batches, oldest first, while still above the low-water mark.
    dropped: list[int] = []
    if total > low:
        for start, end in _tool_batches(items):
            if total <= low or end > hi:
                # A batch reaching into the protected tail is kept whole, and every
                # later batch starts at or after its end: nothing more is droppable.
                break
            if start < lo:
                continue  # contains entry 0 (the task): never touched
            for i in range(start, end):
                e = items[i]
                total -= e.preview_tokens if i in truncated and e.preview_tokens is not None else e.tokens
                dropped.append(i)

    dropped_set = set(dropped)
    truncate = tuple(sorted(truncated - dropped_set))
    drop = tuple(sorted(dropped_set))
    return ReclaimPlan(bool(truncate or drop), truncate, drop, total)
