"""``tracker verify``: does every stored projection equal the fold of its log (``verify_projections``),
does every decision agree with its own record (``verify_decisions``), is every hash chain intact
(``verify_chains``)?

The first two read through the ``EventStore`` port only (``log_versions``, ``projection_row``,
``fold_stream``, ``read_all``); the chains also through ``chain_links`` (both stores have it; it
is not on the port), so any event store can be verified (SQL or in memory).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from tracker.core.anchor import delta_estimate
from tracker.core.calibration import apply
from tracker.core.events import ContextMeasured, SessionArchived
from tracker.errors import TrackerError
from tracker.store.base import PROJECTION_COLUMNS, EventStore, Projector
from tracker.store.chain import GENESIS, canonical, link
from tracker.store.decoding import event_of

__all__ = ["ChainLog", "verify_chains", "verify_decisions", "verify_projections"]

BATCH = 1000


def _normal(value: Any) -> Any:
    """``value`` as the store keeps it: through a compact JSON round trip."""
    return json.loads(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False))


def verify_projections(store: EventStore, projector: Projector) -> list[dict[str, Any]]:
    """Re-fold every session from the log and compare with its stored projection.

    Returns the differences (empty list = every projection equals the fold), each
    ``{"session_id", "field", "stored", "expected"}`` where field is ``row`` (a
    projection row without events or events without a projection row),
    ``version``, ``state`` or one of the listing columns.
    """
    diffs: list[dict[str, Any]] = []
    for sid, version in store.log_versions():
        row = store.projection_row(sid)
        if version == 0:  # a projection row without events
            if row is not None:
                diffs.append({"session_id": sid, "field": "row", "stored": "projection row", "expected": "no events"})
            continue
        if row is None:
            diffs.append(
                {"session_id": sid, "field": "row", "stored": None, "expected": f"projection at version {version}"}
            )
            continue
        state, folded_version = store.fold_stream(sid, None, projector)
        if folded_version != version:  # the log moved on while we read it; re-check this one
            version = folded_version
            row = store.projection_row(sid) or row
        expected_state = _normal(state)
        if row["version"] != version:
            diffs.append({"session_id": sid, "field": "version", "stored": row["version"], "expected": version})
            continue  # a newer append raced us, or the row is stale: the rest would only repeat it
        if row["state"] != expected_state:
            diffs.append({"session_id": sid, "field": "state", "stored": row["state"], "expected": expected_state})
        cols = projector.columns(state) or {}
        for name in PROJECTION_COLUMNS:
            want = cols.get(name)
            if name == "open_attempts":
                want = int(want or 0)
            if row[name] != want:
                diffs.append({"session_id": sid, "field": name, "stored": row[name], "expected": want})
    return diffs


def _decision_diff(e: ContextMeasured) -> tuple[str, Any, Any] | None:
    """(field, recorded, expected) when a measurement's decision contradicts its own record, else None."""
    raw, limit = e.measurement.input_tokens, e.measurement.input_limit
    if e.input_tokens is None:  # no decided count recorded: decided on the raw count
        return None
    if e.anchor is not None:
        a = e.anchor
        delta = delta_estimate(raw, a.counted, a.factor_bp)
        if a.estimated_delta != delta:
            return "anchor.estimated_delta", a.estimated_delta, delta
        expected = a.decided
    else:
        expected = apply(raw, e.calibration)
    if e.input_tokens != expected:
        return "input_tokens", e.input_tokens, expected
    if e.input_limit is not None and not 0 < e.input_limit <= limit:
        return "input_limit", e.input_limit, f"in [1, {limit}] (the measurement's limit)"
    return None


def verify_decisions(store: EventStore) -> list[dict[str, Any]]:
    """Check every ``ContextMeasured`` against itself: the count it decided on is its raw count
    corrected by the calibration it records (``calibration.apply``), and the limit it decided
    against is at most the measurement's (a learned limit is only ever lower). One pass over the
    log's measurements. Differences are ``{"session_id", "version", "field", "stored", "expected"}``."""
    diffs: list[dict[str, Any]] = []
    position = 0
    while True:
        batch = store.read_all(position, BATCH, types=[ContextMeasured.TYPE])
        for stored in batch:
            try:
                event = event_of(stored)
            except TrackerError as exc:
                diffs.append(
                    {
                        "session_id": stored.session_id,
                        "version": stored.version,
                        "field": "event",
                        "stored": stored.type,
                        "expected": str(exc),
                    }
                )
                continue
            diff = _decision_diff(event)  # type: ignore[arg-type]
            if diff is not None:
                field, recorded, expected = diff
                diffs.append(
                    {
                        "session_id": stored.session_id,
                        "version": stored.version,
                        "field": field,
                        "stored": recorded,
                        "expected": expected,
                    }
                )
        if batch:
            position = batch[-1].position
        if len(batch) < BATCH:
            return diffs


# -- the hash chains (tracker.store.chain) ---------------------------------------------------------

#: a chain link as a store reads it: (version, type, data, hash)
Link = tuple[int, str, dict[str, Any], bytes | None]


class ChainLog(Protocol):
    """What ``verify_chains`` reads: every stream, its links in version order, its projection row."""

    def log_versions(self) -> Iterator[tuple[str, int]]: ...

    def chain_links(self, session_id: str) -> Iterator[Link]: ...

    def projection_row(self, session_id: str) -> dict[str, Any] | None: ...


def _broken(sid: str, version: int, what: str, detail: str) -> dict[str, Any]:
    return {"session_id": sid, "version": version, "what": what, "detail": detail}


def _diagnose(sid: str, version: int, prev: bytes, here: Link, rest: Iterator[Link]) -> dict[str, Any]:
    """The link at ``version`` does not follow ``prev``: reordered (another event of the stream is
    the one whose hash follows ``prev`` at this version) or edited (none is)."""
    for other in rest:
        v, t, d, h = other
        if h is not None and h == link(prev, canonical(sid, version, t, d)):
            return _broken(
                sid, version, "reordered", f"the event chained at version {version} is stored at version {v}"
            )
    return _broken(sid, version, "edited", "its content or hash is not what was chained")


def _archived_head(version: int, type_: str, data: dict[str, Any]) -> bytes | None:
    """The chain head a stream's first link continues from when it is the ``SessionArchived`` record
    of an archived session (its events before it are in an archive: ``tracker verify --archive``)."""
    if type_ != SessionArchived.TYPE or data.get("final_version") != version - 1:
        return None
    try:
        head = bytes.fromhex(str(data.get("chain_head")))
    except ValueError:
        return None
    return head if len(head) == len(GENESIS) else None


def check_chain(sid: str, links: Iterator[Link]) -> tuple[dict[str, Any] | None, int, int]:
    """(the first broken link of one session's chain or None, how many events, last version). An
    archived session's stream starts at its ``SessionArchived`` record, chained to the archived head."""
    prev = GENESIS
    expected = 1
    n = 0
    for here in links:
        n += 1
        version, type_, data, stored = here
        if n == 1 and version > 1:
            head = _archived_head(version, type_, data)
            if head is not None:
                prev, expected = head, version
        if version != expected:
            missing = f"version {expected}" if version == expected + 1 else f"versions {expected}-{version - 1}"
            return _broken(sid, expected, "deleted (gap)", f"{missing} missing before {version}"), n, version
        if stored is None:
            return _broken(sid, version, "unchained", "the event has no hash"), n, version
        if stored != link(prev, canonical(sid, version, type_, data)):
            return _diagnose(sid, version, prev, here, links), n, version
        prev, expected = stored, expected + 1
    return None, n, expected - 1


def verify_chains(store: ChainLog) -> dict[str, Any]:
    """Recompute every session's hash chain. ``{"chains", "events", "broken"}``: ``broken`` holds
    the first broken event of each broken chain, ``{"session_id", "version", "what", "detail"}``,
    ``what`` one of ``edited``, ``deleted (gap)`` (also: the projection is ahead of the log's last
    event), ``reordered``, ``unchained``; sessions in id order."""
    chains = events = 0
    broken: list[dict[str, Any]] = []
    for sid, version in store.log_versions():
        if not version:  # a projection row with no events: nothing chained
            continue
        chains += 1
        finding, n, last = check_chain(sid, iter(store.chain_links(sid)))
        events += n
        if finding is None:
            row = store.projection_row(sid)
            if row is not None and row["version"] > last:
                detail = f"the log ends at version {last}, its projection is at {row['version']}"
                finding = _broken(sid, last + 1, "deleted (gap)", detail)
        if finding is not None:
            broken.append(finding)
    return {"chains": chains, "events": events, "broken": broken}
