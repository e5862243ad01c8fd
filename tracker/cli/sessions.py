"""Session commands: observe, sessions, history, replay, export, verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

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
    invalid,
    parse_since,
    policy_from_flags,
    print_json_lines,
    print_rows,
    print_table,
    require_database_file,
    settings,
    store_open,
)
from tracker.errors import TrackerError

app = typer.Typer()


@app.command()
def verify(as_json: bool = typer.Option(False, "--json")) -> None:
    """Re-fold every session from the log and compare with the stored projection. Exit 1 on any difference."""
    from tracker import queries

    with store_open(as_json) as store:
        report = queries.verify(store)
    if as_json:
        print(json.dumps(report, default=str))
    elif report["differences"]:
        for d in report["differences"]:
            err_console.print(f"[red]differs[/] {d}")
    else:
        console.print(f"[green]ok[/]: {report['sessions']} sessions, every projection equals the fold of its log")
    if not report["ok"]:
        raise typer.Exit(1)


@app.command()
def observe(
    session_id: str = typer.Argument(..., help="session id"),
    basis: str = typer.Option(
        ..., "--basis", help="r<revision>:<through>, or a bare 'through' at the current revision"
    ),
    input_tokens: int | None = typer.Option(None, "--input-tokens", help="a measurement you counted yourself"),
    input_limit: int | None = typer.Option(None, "--input-limit"),
    request_file: Path | None = typer.Option(None, "--request", help="JSON file of the complete request to count"),
    model: str | None = typer.Option(None, "--model", help="model name from the registry"),
    quality: str = typer.Option("exact_local", "--quality"),
    compaction_threshold: float | None = typer.Option(None, "--compaction-threshold"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Record one measurement of a session and print the decision."""
    from tracker.service import Tracker

    if request_file is not None:
        try:
            request = json.loads(request_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            fail(invalid("request", f"cannot read a JSON request from {request_file}: {exc}"), as_json)
    s = settings()
    try:
        require_database_file(s.store.database_url)  # a missing file: a clear message, nothing created
        tracker = Tracker.from_settings(s)  # checks the schema
    except TrackerError as exc:
        fail(exc, as_json)
    try:
        if request_file is not None:
            result = tracker.observe(
                session_id, request=request, model=model, basis=basis, compaction_threshold=compaction_threshold
            )
        else:
            if input_tokens is None or input_limit is None:
                raise typer.BadParameter("give --request FILE, or --input-tokens and --input-limit")
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
    pressure: str | None = typer.Option(None, "--pressure", help="normal | compact | hard_limit"),
    since: str | None = typer.Option(None, "--since", help="active since: ISO time, or a duration like 15m, 2h, 1d"),
    limit: int = typer.Option(100, "--limit"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List sessions: pressure, occupancy, revision, open attempts, last activity."""
    from tracker import queries

    try:
        queries.check_pressure(pressure)  # before the database: a usage error
    except TrackerError as exc:
        fail(exc, as_json)
    active_since = parse_since(since, as_json) if since else None
    with store_open(as_json) as store:
        rows = queries.list_sessions(store, pressure=pressure, since=active_since, limit=limit)

    def table(rows: list[dict[str, Any]]) -> None:
        from tracker.audit.format import pressure_markup

        def cells(r: dict[str, Any]) -> tuple[str, ...]:
            occ = r.get("occupancy_bp")
            return (
                r["session_id"],
                pressure_markup(r["pressure"]),
                "" if occ is None else f"{occ / 100:.1f}%",
                str(r["revision"]),
                str(r["open_attempts"]),
                str(r["version"]),
                str(r["updated_at"])[:19],
            )

        print_table(
            f"{len(rows)} sessions",
            ("session", "pressure", "occupancy", "revision", "open attempts", "events", "last activity"),
            map(cells, rows),
        )

    emit(rows, as_json, table)


def _require_session(store: Any, session_id: str, as_json: bool) -> int:
    """The session's version, for a session id that is valid and exists (else a clear error and exit 2)."""
    from tracker import queries

    try:
        return queries.require_session(store, session_id)
    except TrackerError as exc:
        fail(exc, as_json)


@app.command()
def history(
    session_id: str = typer.Argument(...),
    from_version: int = typer.Option(1, "--from-version"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """The audit trail of one session (streams; works on very long sessions)."""
    from tracker import queries
    from tracker.audit.format import event_summary

    with store_open(as_json) as store:
        version = _require_session(store, session_id, as_json)
        events = queries.read_history(store, session_id, from_version)
        if as_json:
            print_json_lines(queries.event_to_dict(e) for e in events)
            return
        rows = (
            (str(e.version), e.recorded_at.strftime("%H:%M:%S.%f")[:-3], e.type, escape(event_summary(e)))
            for e in events
        )
        print_rows(
            f"history of {session_id}", ("v", "time", "event", "what happened"), rows, stream=version > TABLE_MAX_ROWS
        )


@app.command()
def replay(
    session_id: str = typer.Argument(...),
    at: int | None = typer.Option(None, "--at", help="stop at this version and show the state then"),
    html_file: Path | None = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    compact_at: int | None = COMPACT_AT,
    rearm_below: int | None = REARM_BELOW,
    turn_delta: float | None = TURN_DELTA,
    observe_only: bool = OBSERVE_ONLY,
    max_automatic_per_episode: int | None = MAX_AUTO,
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """Rebuild a session's state event by event; with policy flags, what-if on the recorded measurements."""
    from tracker import queries

    with store_open(as_json) as store:
        version = _require_session(store, session_id, as_json)
        stream = version > TABLE_MAX_ROWS
        events = queries.read_history(store, session_id, 1, at)
        if html_file is not None:
            _replay_html(session_id, events, html_file, as_json)
        elif any(
            f is not None
            for f in (compact_at, rearm_below, turn_delta, observe_only or None, max_automatic_per_episode)
        ):
            from tracker.core import Policy

            first = next(iter(queries.read_history(store, session_id, 1, 1)))
            try:
                policy = policy_from_flags(
                    compact_at,
                    rearm_below,
                    turn_delta,
                    observe_only,
                    max_automatic_per_episode,
                    base=Policy.from_data(first.data["policy"]),
                )
            except TrackerError as exc:
                fail(exc, as_json)
            _replay_whatif(session_id, events, policy, as_json, stream)
        else:
            _replay_states(session_id, events, at, as_json, stream)


def _replay_html(session_id: str, events: Any, html_file: Path, as_json: bool) -> None:
    from tracker.audit.report import render_html

    with html_file.open("w", encoding="utf-8") as fh:
        counts = render_html(session_id, events, fh)
    if as_json:
        print(json.dumps({"html": str(html_file), **counts}))
    else:
        console.print(
            f"[green]wrote[/] {html_file}: {counts['events']} events, {counts['attempts']} attempts "
            f"({counts['committed']} committed, {counts['rejected']} rejected), "
            f"{counts['count_failed']} count failures, {counts['context_limit']} context-limit errors"
        )


def _replay_whatif(session_id: str, events: Any, policy: Any, as_json: bool, stream: bool) -> None:
    from tracker.audit.replay import whatif_rows

    rows = whatif_rows(events, policy, session_id)
    if as_json:
        print_json_lines(rows)
        return
    changed = 0

    def table_rows() -> Any:
        nonlocal changed
        for row in rows:
            changed += bool(row.get("changed"))
            w = row["whatif"]
            if row["op"] == "measure" and "error" not in w:
                mark = "[bold yellow]" if row["changed"] else ""
                yield (
                    str(row["version"]),
                    "measure",
                    row["recorded_action"],
                    f"{mark}{w['action']}",
                    w["pressure"],
                    f"{w['compact_level']}/{w['rearm_level']}",
                )
            else:
                yield (str(row["version"]), row["op"], "", escape(json.dumps(w)), "", "")

    print_rows(
        f"what-if for {session_id}: compact at {policy.compact_at_bp}, rearm below {policy.rearm_below_bp}",
        ("v", "op", "recorded", "what-if", "pressure", "levels c/r"),
        table_rows(),
        stream=stream,
    )
    console.print(f"{changed} decisions would change under this policy")


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
                pressure_markup(st.state.pressure),
                str(st.state.revision),
                str(len(st.state.open_attempts)),
                escape(", ".join(sorted(st.state.exhausted))),
            )

    print_rows(
        f"replay of {session_id}" + (f" up to v{at}" if at else ""),
        ("v", "event", "pressure", "revision", "open attempts", "exhausted"),
        rows(),
        stream=stream,
    )
    if last is not None:
        console.print_json(json.dumps(last.state.to_data()))


@app.command()
def export(
    since: int = typer.Option(0, "--since", help="global position to resume after (the last one you saw)"),
    limit: int = typer.Option(0, "--limit", help="stop after this many events (0 = all)"),
    as_json: bool = typer.Option(False, "--json", help="errors as JSON too (events are always JSON lines)"),
) -> None:
    """All events as JSON lines in global commit order; resumable with --since."""
    from tracker import queries

    with store_open(as_json) as store:
        print_json_lines(queries.export_events(store, since, limit))
