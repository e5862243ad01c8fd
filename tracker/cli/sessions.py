"""Session commands: observe, sessions, history, replay, export, verify.

The read commands (sessions, history, replay, export) read the read side: the replica of
``TRACKER_READ_DATABASE_URL`` when it is set. ``observe`` writes and ``verify`` reads the primary.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tracker.cli._common import (
    COMPACT_AT,
    MAX_AUTO,
    OBSERVE_ONLY,
    REARM_BELOW,
    TABLE_MAX_ROWS,
    TURN_DELTA,
    console,
    emit,
    err_console,
    fail,
    identifier,
    int_between,
    invalid,
    new_file,
    parse_since,
    plain,
    plural,
    policy_from_flags,
    pressure_cell,
    print_json_lines,
    print_rows,
    print_table,
    settings,
    storage_open,
    store_open,
    styled,
)
from tracker.core.model import SessionScope
from tracker.errors import TrackerError

if TYPE_CHECKING:  # pragma: no cover
    from tracker.bootstrap import Storage
    from tracker.store.fleets import FleetStore

app = typer.Typer()

FLEET = typer.Option(
    None,
    "--fleet",
    help="a fleet's name or id: its HTTP API sessions, by the ids its agents use (session-42)",
    callback=identifier,
)


def _scope(fleets: FleetStore, fleet: str | None, as_json: bool) -> SessionScope:
    """The ``SessionScope`` of ``--fleet`` (by name or id): its ids are checked as the API checks
    them (at most ``max_len`` characters); without it, the unscoped scope (ids as stored)."""
    if fleet is None:
        return SessionScope()
    try:
        return SessionScope(fleets.get_fleet(fleet)["fleet_id"])
    except TrackerError as exc:
        fail(exc, as_json)


@app.command()
def verify(
    as_json: bool = typer.Option(False, "--json"),
    archive: Path | None = typer.Option(
        None, "--archive", help="check this archive directory against its manifest instead of the live log"
    ),
) -> None:
    """Re-fold every session from the log and compare with the stored projection, and check every
    session's hash chain (the tamper-evident log). Exit 1 on any difference or broken chain.
    ``--archive DIR``: re-fold every archived session and check its chain against the manifest."""
    from tracker import queries

    if archive is not None:
        _verify_archive(archive, as_json)
        return
    with store_open(as_json) as store:
        report = queries.verify(store)
    if as_json:
        print(json.dumps(report, default=str))
    elif not report["ok"]:
        for b in report["broken"]:
            err_console.print(
                f"[red]broken chain[/] session {plain(b['session_id'])} version {b['version']}: "
                f"{b['what']} ({plain(b['detail'])})"
            )
        for d in report["differences"]:
            err_console.print(f"[red]differs[/] {plain(d)}")
    else:
        console.print(
            f"[green]ok[/]: {plural(report['sessions'], 'session')}, every projection equals the fold of its log; "
            f"{plural(report['chains'], 'hash chain')} of {plural(report['events'], 'event')} intact"
        )
    if not report["ok"]:
        raise typer.Exit(1)


def _verify_archive(directory: Path, as_json: bool) -> None:
    from tracker.core import SessionProjector
    from tracker.store.restore import verify_archive

    try:
        report = verify_archive(directory, SessionProjector())
    except TrackerError as exc:
        fail(exc, as_json)
    if as_json:
        print(json.dumps(report, default=str))
    elif not report["ok"]:
        for p in report["problems"]:
            who = "" if p["session_id"] is None else f" session {plain(p['session_id'])}"
            err_console.print(f"[red]archive[/] {plain(p['segment'])}{who}: {plain(p['problem'])}")
    else:
        console.print(
            f"[green]ok[/]: {plural(report['segments'], 'segment')} of {plain(report['archive'])} "
            f"{'matches' if report['segments'] == 1 else 'match'} the manifest; "
            f"{plural(report['sessions'], 'archived session')} ({plural(report['events'], 'event')}) fold to their "
            "digests and their hash chains are intact"
        )
    if not report["ok"]:
        raise typer.Exit(1)


def _archived_note(db: Storage, scope: SessionScope, session_id: str) -> None:
    """On stderr: where an archived session's events went, and how to bring them back."""
    from tracker.store.restore import archived_marker

    marker = archived_marker(db.store, scope.internal(session_id))
    if marker is not None:
        fleet = f" --fleet {scope.prefix[:-1]}" if scope.prefix else ""
        err_console.print(
            f"[yellow]archived[/]: versions 1-{marker['final_version']} of {plain(session_id)} are in "
            f"{plain(marker['archive'])}/{plain(marker['segment'])}; bring them back with "
            f"`tracker restore {plain(marker['archive'])} --session {plain(session_id)}{fleet}`"
        )


@app.command()
def observe(
    session_id: str = typer.Argument(..., help="session id"),
    basis: str = typer.Option(
        ..., "--basis", help="r<revision>:<through>, or a bare 'through' at the current revision", callback=identifier
    ),
    input_tokens: int | None = typer.Option(
        None, "--input-tokens", help="a measurement you counted yourself", callback=int_between(0)
    ),
    input_limit: int | None = typer.Option(None, "--input-limit", callback=int_between(1)),
    request_file: Path | None = typer.Option(None, "--request", help="JSON file of the complete request to count"),
    model: str | None = typer.Option(None, "--model", help="model name from the registry", callback=identifier),
    quality: str = typer.Option("exact_local", "--quality", callback=identifier),
    compaction_threshold: float | None = typer.Option(None, "--compaction-threshold"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Record one measurement of a session and print the decision."""
    from tracker.bootstrap import build_tracker

    if request_file is not None:
        try:
            request = json.loads(request_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            fail(invalid("request", f"cannot read a JSON request from {request_file}: {exc}"), as_json)
        except RecursionError:
            fail(invalid("request", f"{request_file} nests too deeply to read"), as_json)
    s = settings()
    try:
        tracker = build_tracker(s)  # checks the schema; creates the embedded default on first use
    except TrackerError as exc:
        fail(exc, as_json)
    try:
        if request_file is not None:
            result = tracker.observe(
                session_id, request=request, model=model, basis=basis, compaction_threshold=compaction_threshold
            )
        else:
            if input_tokens is None or input_limit is None:
                raise invalid("input-tokens", "give --request FILE, or --input-tokens and --input-limit")
            m = {
                "basis": basis,
                "input_tokens": input_tokens,
                "input_limit": input_limit,
                "quality": quality,
                "model": {"provider": "cli", "name": model or "unknown"},
                "fingerprint": hashlib.sha256(f"{session_id}:{basis}".encode()).hexdigest(),
            }
            result = tracker.observe(session_id, measurement=m, compaction_threshold=compaction_threshold)
    except TrackerError as exc:
        fail(exc, as_json)
    finally:
        tracker.close()
    if as_json:
        print(json.dumps(result.to_data()))
        return
    d = result.decision
    console.print(
        f"{session_id} v{result.version}: [bold]{d.action}[/] (pressure {d.pressure}, "
        f"{d.occupancy_bp} bp, compact at {d.compact_level}, rearm below {d.rearm_level})"
    )
    if d.attempt:
        console.print(
            f"  attempt {d.attempt.attempt_id} fencing token {d.attempt.fencing_token}, "
            f"history budget {d.attempt.history_budget}"
        )


@app.command()
def sessions(
    pressure: str | None = typer.Option(None, "--pressure", help="normal | compact | hard_limit", callback=identifier),
    since: str | None = typer.Option(
        None, "--since", help="active since: ISO time, or a duration like 15m, 2h, 1d", callback=identifier
    ),
    limit: int = typer.Option(100, "--limit", callback=int_between(0)),
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List sessions: pressure, occupancy, revision, open attempts, last activity (--fleet: one fleet's)."""
    from tracker import queries

    try:
        queries.check_pressure(pressure)  # before the database: a usage error
    except TrackerError as exc:
        fail(exc, as_json)
    active_since = parse_since(since, as_json) if since else None
    with storage_open(as_json, read=True) as db:
        scope = _scope(db.fleets, fleet, as_json)
        filters: dict[str, Any] = {"pressure": pressure, "since": active_since, "limit": limit, "scope": scope}
        if as_json:  # one JSON array, written as the rows come (constant memory at any --limit)
            stream_json_array(queries.iter_sessions(db.views, **filters))
            return
        rows = queries.list_sessions(db.views, **filters)

    def table(rows: list[dict[str, Any]]) -> None:
        def cells(r: dict[str, Any]) -> tuple[Any, ...]:
            occ = r.get("occupancy_bp")
            return (
                r["session_id"],
                pressure_cell(r["pressure"]),
                "" if occ is None else f"{occ / 100:.1f}%",
                str(r["revision"]),
                str(r["open_attempts"]),
                str(r["version"]),
                str(r["updated_at"])[:19],
            )

        print_table(
            plural(len(rows), "session"),
            ("session", "pressure", "occupancy", "revision", "open attempts", "events", "last activity"),
            map(cells, rows),
        )

    emit(rows, as_json, table)


def stream_json_array(rows: Iterable[dict[str, Any]]) -> None:
    """``rows`` as one JSON array on stdout, one row per line, written as they come."""
    out = sys.stdout
    out.write("[")
    for i, row in enumerate(rows):
        out.write(("\n" if i == 0 else ",\n") + json.dumps(row, default=str))
    out.write("\n]\n")
    out.flush()


@contextmanager
def _session_open(session_id: str, fleet: str | None, as_json: bool) -> Iterator[tuple[Storage, SessionScope, int]]:
    """``storage_open`` for a command about one session: the storage, the scope of ``--fleet`` and
    the session's version (``_require_session``); a read command, so on the read side (the replica, if any)."""
    with storage_open(as_json, read=True) as db:
        yield (db, *_require_session(db, session_id, fleet, as_json))


def _require_session(db: Storage, session_id: str, fleet: str | None, as_json: bool) -> tuple[SessionScope, int]:
    """The scope of ``--fleet`` and the session's version, for a session id that is valid and exists
    (else a clear error and exit 2).

    Without ``--fleet``, an unknown id that a fleet's agents use over HTTP gets a hint: ``--fleet NAME``.
    """
    from tracker import queries
    from tracker.errors import UnknownSession

    scope = _scope(db.fleets, fleet, as_json)
    try:
        return scope, queries.require_session(db.store, session_id, scope=scope)
    except UnknownSession as unknown:
        fleets = [] if scope.prefix else _fleets_with(db, session_id)
        if not fleets:
            fail(unknown, as_json)
        hint = " or ".join(f"--fleet {name}" for name in fleets)
        message = f"no session {session_id}; a fleet's HTTP session has this id: add {hint}"
        fail(UnknownSession(message, session_id=session_id, fleets=fleets), as_json)
    except TrackerError as exc:
        fail(exc, as_json)


def _fleets_with(db: Storage, session_id: str) -> list[str]:
    """The names of the fleets that have a session ``session_id`` over HTTP."""
    from tracker import queries

    found = []
    for f in db.fleets.list_fleets():
        try:
            if queries.session_exists(db.store, session_id, scope=SessionScope(f["fleet_id"])):
                found.append(f["name"])
        except TrackerError:  # too long once namespaced: no fleet can have it
            continue
    return found


@app.command()
def history(
    session_id: str = typer.Argument(...),
    from_version: int = typer.Option(1, "--from-version", callback=int_between(0)),
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """The audit trail of one session (streams; works on very long sessions)."""
    from tracker import queries
    from tracker.audit.format import event_summary

    with _session_open(session_id, fleet, as_json) as (db, scope, version):
        _archived_note(db, scope, session_id)
        events = queries.read_history(db.store, session_id, from_version, scope=scope)
        if as_json:
            print_json_lines(queries.event_to_dict(e, scope=scope) for e in events)
            return
        rows = (
            (str(e.version), e.recorded_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3], e.type, event_summary(e))
            for e in events
        )
        print_rows(
            f"history of {session_id}",
            ("v", "time (UTC)", "event", "what happened"),
            rows,
            stream=version > TABLE_MAX_ROWS,
        )


@app.command()
def replay(
    session_id: str = typer.Argument(...),
    at: int | None = typer.Option(
        None, "--at", help="stop at this version and show the state then", callback=int_between(0)
    ),
    html_file: Path | None = typer.Option(
        None, "--html", help="write a self-contained HTML report here", callback=new_file
    ),
    compact_at: int | None = COMPACT_AT,
    rearm_below: int | None = REARM_BELOW,
    turn_delta: float | None = TURN_DELTA,
    observe_only: bool = OBSERVE_ONLY,
    max_automatic_per_episode: int | None = MAX_AUTO,
    fleet: str | None = FLEET,
    without_calibration: bool = typer.Option(
        False,
        "--without-calibration",
        help="what-if: beside each re-decided measurement, the decision on its raw count (no calibration factor)",
    ),
    from_log: bool = typer.Option(
        False,
        "--calibration-from-log",
        help="what-if: beside each, the decision with the calibration this version folds from the log's reports up to it",
    ),
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """Rebuild a session's state event by event; with policy flags, what-if on the recorded measurements
    (each re-decided with the calibration it recorded; ``--without-calibration``: and without, side by side;
    ``--calibration-from-log``: and with the calibration folded again from the log)."""
    from tracker import queries

    with _session_open(session_id, fleet, as_json) as (db, scope, version):
        _archived_note(db, scope, session_id)
        stream = version > TABLE_MAX_ROWS
        events = queries.read_history(db.store, session_id, 1, at, scope=scope)
        if html_file is not None:
            # at the head: the store's narrow reads (the console's page); up to --at: the stream
            source = (db, scope.internal(session_id)) if at is None or at >= version else events
            _replay_html(session_id, source, html_file, as_json)
        elif (
            without_calibration
            or from_log
            or any(
                f is not None
                for f in (compact_at, rearm_below, turn_delta, observe_only or None, max_automatic_per_episode)
            )
        ):
            from tracker.core import Policy
            from tracker.core.events import SessionStarted

            try:
                first = queries.event_of(next(iter(queries.read_history(db.store, session_id, 1, 1, scope=scope))))
                policy = policy_from_flags(
                    compact_at,
                    rearm_below,
                    turn_delta,
                    observe_only,
                    max_automatic_per_episode,
                    base=first.policy if isinstance(first, SessionStarted) else Policy(),
                )
            except TrackerError as exc:
                fail(exc, as_json)
            from tracker.calibrations import provider_reports

            reports = (
                provider_reports(db.store, scope=scope) if from_log else None
            )  # (the ledger keeps fleets apart anyway)
            _replay_whatif(session_id, events, policy, as_json, stream, without_calibration, reports)
        else:
            _replay_states(session_id, events, at, as_json, stream)


def _replay_html(session_id: str, events: Any, html_file: Path, as_json: bool) -> None:
    from tracker.audit.report import render_html, render_store_html

    # backslashreplace: a lone surrogate an old writer recorded is written as its escape, not a crash
    with html_file.open("w", encoding="utf-8", errors="backslashreplace") as fh:
        if isinstance(events, tuple):
            db = events[0]
            counts = render_store_html(db.store, events[1], fh, shown=session_id, views=db.views)
        else:
            counts = render_html(session_id, events, fh)
    if as_json:
        print(json.dumps({"html": str(html_file), **counts}))
    else:
        console.print(
            f"[green]wrote[/] {plain(html_file)}: {plural(counts['events'], 'event')}, "
            f"{plural(counts['attempts'], 'attempt')} ({counts['committed']} committed, {counts['rejected']} rejected), "
            f"{plural(counts['count_failed'], 'count failure')}, "
            f"{plural(counts['context_limit'], 'context-limit error')}"
        )


def _replay_whatif(
    session_id: str,
    events: Any,
    policy: Any,
    as_json: bool,
    stream: bool,
    uncalibrated: bool = False,
    reports: Any = None,
) -> None:
    from tracker.audit.replay import whatif_rows

    rows = whatif_rows(events, policy, session_id, uncalibrated=uncalibrated, reports=reports)
    if as_json:
        print_json_lines(rows)
        return
    changed = changed_raw = changed_log = 0
    refold = reports is not None

    def table_rows() -> Any:
        nonlocal changed, changed_raw, changed_log
        for row in rows:
            changed += bool(row.get("changed"))
            changed_raw += bool(row.get("changed_uncalibrated"))
            changed_log += bool(row.get("changed_refolded"))
            w = row["whatif"]
            extra: tuple[Any, ...] = ()
            if row["op"] == "measure" and "error" not in w:
                if uncalibrated:
                    raw = row.get("uncalibrated") or {}
                    shown = raw.get("action", raw.get("error", ""))
                    extra = (
                        str(w.get("input_tokens", "")),
                        styled(str(shown), "bold yellow" if row.get("changed_uncalibrated") else ""),
                    )
                if refold:
                    log = row.get("refolded") or {}
                    shown = log.get("action", log.get("error", ""))
                    extra += (styled(str(shown), "bold yellow" if row.get("changed_refolded") else ""),)
                yield (
                    str(row["version"]),
                    "measure",
                    row["recorded_action"],
                    styled(w["action"], "bold yellow" if row["changed"] else ""),
                    w["pressure"],
                    f"{w['compact_level']}/{w['rearm_level']}",
                    *extra,
                )
            else:
                blanks = ("", "") * uncalibrated + ("",) * refold
                yield (str(row["version"]), row["op"], "", json.dumps(w), "", "", *blanks)

    columns: tuple[str, ...] = ("v", "op", "recorded", "what-if", "pressure", "levels c/r")
    if uncalibrated:
        columns += ("decided on", "no calibration")
    if refold:
        columns += ("log's calibration",)
    print_rows(
        f"what-if for {session_id}: compact at {policy.compact_at_bp}, rearm below {policy.rearm_below_bp}",
        columns,
        table_rows(),
        stream=stream,
    )
    console.print(f"{plural(changed, 'decision')} would change under this policy")
    if uncalibrated:
        console.print(f"{plural(changed_raw, 'decision')} would change without calibration")
    if refold:
        console.print(f"{plural(changed_log, 'decision')} would change with the calibration folded from the log")


def _replay_states(session_id: str, events: Any, at: int | None, as_json: bool, stream: bool) -> None:
    from tracker.audit.format import pressure_markup
    from tracker.audit.replay import replay_states

    steps = replay_states(events, session_id, at)
    if as_json:
        print_json_lines(
            {"version": st.event.version, "type": st.event.type, "state": st.state.to_data()} for st in steps
        )
        return
    last = None

    def rows() -> Any:
        nonlocal last
        for st in steps:
            last = st
            yield (
                str(st.state.version),
                st.event.type,
                pressure_cell(st.state.pressure),
                str(st.state.revision),
                str(len(st.state.open_attempts)),
                ", ".join(sorted(st.state.exhausted)),
            )

    print_rows(
        f"replay of {session_id}" + (f" up to v{at}" if at else ""),
        ("v", "event", "pressure", "revision", "open attempts", "exhausted"),
        rows(),
        stream=stream,
    )
    if last is not None:  # one closing line, not a second rendering (--json has the whole state)
        st = last.state
        tokens = f", last measured {st.last.input_tokens} / {st.last.input_limit}" if st.last else ""
        console.print(
            f"state at v{st.version}: pressure {pressure_markup(plain(st.pressure))}, revision {st.revision}{tokens}, "
            f"{plural(len(st.open_attempts), 'open attempt')}, {plural(len(st.exhausted), 'exhausted basis', 'exhausted bases')}"
        )


@app.command()
def export(
    since: int = typer.Option(
        0, "--since", help="global position to resume after (the last one you saw)", callback=int_between(0)
    ),
    limit: int = typer.Option(0, "--limit", help="stop after this many events (0 = all)", callback=int_between(0)),
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json", help="errors as JSON too (events are always JSON lines)"),
) -> None:
    """All events as JSON lines in global commit order; resumable with --since (--fleet: one fleet's)."""
    from tracker import queries

    with storage_open(as_json, read=True) as db:
        store = db.store
        scope = _scope(db.fleets, fleet, as_json)
        print_json_lines(queries.export_events(store, since, limit, scope=scope))
        if not limit:  # the whole log was asked for: say what the feed's horizon still holds back
            held, waited = queries.feed_held(db.views, time.time())
            if held:
                err_console.print(
                    f"note: {plural(held, 'committed event')} (of any session) not exported yet (the oldest "
                    f"committed {waited:.0f} s ago): a "
                    "transaction open on the database server since before them holds the feed back "
                    '(docs/operations.md, "The event feed\'s horizon"); run again with --since the last '
                    "position exported once it has ended",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
