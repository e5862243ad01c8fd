"""The ``tracker`` command line (Typer + Rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tracker.errors import TrackerError

app = typer.Typer(
    name="tracker",
    help="Context Tracker: decide when LLM agents must compact their context, and keep the record.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")

console = Console(width=None if sys.stdout.isatty() else 150)
err_console = Console(stderr=True)


def _fail(exc: TrackerError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(exc.to_dict()))
    else:
        # soft_wrap: a hint such as `tracker db upgrade` must not be broken across lines;
        # escape: the message may quote user input, which is not Rich markup
        err_console.print(f"[bold red]error[/] ({exc.code}): {escape(str(exc.message or exc))}", soft_wrap=True)
    raise typer.Exit(2)


def _policy_from_flags(
    compact_at: Optional[int], rearm_below: Optional[int], turn_delta: Optional[float], observe_only: bool,
    max_automatic_per_episode: Optional[int], base: Any = None,
) -> Any:
    from tracker.core.policy import Policy

    policy = base or Policy()
    changes: dict[str, Any] = {}
    if compact_at is not None:
        changes["compact_at_bp"] = compact_at
    if rearm_below is not None:
        changes["rearm_below_bp"] = rearm_below
    if turn_delta is not None:
        changes["turn_delta"] = turn_delta
    if observe_only:
        changes["automatic"] = False
    if max_automatic_per_episode is not None:
        changes["max_automatic_per_episode"] = max_automatic_per_episode
    return policy.replace(**changes) if changes else policy


COMPACT_AT = typer.Option(None, "--compact-at", help="compact_at_bp (basis points, default 8000)")
REARM_BELOW = typer.Option(None, "--rearm-below", help="rearm_below_bp (basis points, default 6000)")
TURN_DELTA = typer.Option(None, "--turn-delta", help="growth trigger in (0, 1]; off by default")
OBSERVE_ONLY = typer.Option(False, "--observe-only", help="never compact automatically (automatic=false)")
MAX_AUTO = typer.Option(None, "--max-automatic-per-episode", help="loop breaker (default 3)")


@app.command()
def demo(
    workers: int = typer.Option(3, "--workers", help="agent worker processes"),
    sessions_per_worker: int = typer.Option(2, "--sessions", help="sessions per worker process"),
    steps: int = typer.Option(40, "--steps", help="agent steps per session"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run a small simulated agent fleet through the real Tracker (the main job)."""
    from tracker.demo import run_demo

    for name, value, low in (("workers", workers, 1), ("sessions", sessions_per_worker, 1), ("steps", steps, 1)):
        if value < low or value > 1000:
            _fail(_invalid(name, f"must be between {low} and 1000, got {value}"), as_json)
    if not as_json:
        console.print(f"[bold]Context Tracker demo[/]: {workers} worker processes × {sessions_per_worker} sessions × "
                      f"{steps} steps, real counting, store and coordination")
    try:
        result = run_demo(workers, sessions_per_worker, steps, console=None if as_json else console)
    except TrackerError as exc:
        _fail(exc, as_json)
    if as_json:
        print(json.dumps(result))
        return
    t = Table(title=f"demo run {result['run_id']} — {result['elapsed_s']} s")
    for col in ("session", "measured", "compactions ✓/✗", "count failures", "revision", "tokens now / limit",
                "pressure", "outcome"):
        t.add_column(col)
    for r in result["sessions"]:
        outcome = "[bold red]ContextLimitError[/]" if r["outcome"] == "ContextLimitError" else "[green]finished[/]"
        t.add_row(r["session_id"], str(r["measurements"]), f"{r['compactions_committed']}/{r['compactions_rejected']}",
                  str(r["count_failures"]), str(r["revision"]), f"{r['tokens_now']} / {r['input_limit']}",
                  _pressure_text(r["pressure"]), outcome)
    console.print(t)
    where = "embedded SQLite" if result["database_url"].startswith("sqlite") else _redact(result["database_url"])
    console.print(f"Recorded in {where}. Try next:")
    first = result["sessions"][0]["session_id"]
    broken = next((r["session_id"] for r in result["sessions"] if r["outcome"] == "ContextLimitError"), first)
    for cmd in ("tracker sessions", f"tracker history {broken}", f"tracker replay {broken} --html replay.html",
                f"tracker replay {first} --compact-at 7000 --rearm-below 5000", "tracker verify",
                "tracker export --since 0 | head", "tracker whatif examples/coding-session.jsonl --table"):
        console.print(f"  [cyan]{cmd}[/]")


@app.command()
def whatif(
    trace: Optional[Path] = typer.Argument(None, help="JSON-lines trace (default: standard input)"),
    compact_at: Optional[int] = COMPACT_AT,
    rearm_below: Optional[int] = REARM_BELOW,
    turn_delta: Optional[float] = TURN_DELTA,
    observe_only: bool = OBSERVE_ONLY,
    max_automatic_per_episode: Optional[int] = MAX_AUTO,
    table: bool = typer.Option(False, "--table", help="show a readable table instead of JSON lines"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON lines output (the default)"),
) -> None:
    """Replay a JSON-lines trace through the decision core, with no database."""
    from tracker.whatif import WhatIf

    try:
        policy = _policy_from_flags(compact_at, rearm_below, turn_delta, observe_only, max_automatic_per_episode)
    except TrackerError as exc:
        _fail(exc)
    if trace is not None and not trace.exists():
        err_console.print(f"[bold red]error[/]: trace file {trace} does not exist")
        raise typer.Exit(2)
    runner = WhatIf(policy=policy, keep_events=False)
    lines = trace.open(encoding="utf-8") if trace is not None else sys.stdin
    if not table:
        for out in runner.run(lines):
            print(json.dumps(out), flush=True)
        return
    t = Table(title=f"what-if: {trace or 'stdin'}  (compact at {policy.compact_at_bp} bp, rearm below {policy.rearm_below_bp} bp)")
    for col in ("#", "op", "used / limit", "occ bp", "pressure", "action", "trigger", "threshold", "levels c/r", "result"):
        t.add_column(col)
    colour = {"proceed": "green", "compact": "yellow", "wait": "cyan", "context_limit": "bold red"}
    for line in lines:
        if not line.strip():
            continue
        try:
            op = json.loads(line)
        except json.JSONDecodeError:
            op = {}
        out = runner.step_line(line)
        kind = op.get("op", "?") if isinstance(op, dict) else "?"
        if "error" in out:
            t.add_row(str(runner.line_no), str(kind), "", "", "", "", "", "", "", f"[red]{out['error']}[/]")
        elif kind == "measure":
            a = out["action"]
            t.add_row(
                str(runner.line_no), kind, f"{op.get('input_tokens')} / {op.get('input_limit')}", str(out["occupancy_bp"]),
                out["pressure"], f"[{colour.get(a, 'white')}]{a}[/]", out["trigger"] or "",
                f"{out['threshold_bp']} ({out['threshold_source']})", f"{out['compact_level']}/{out['rearm_level']}",
                out["attempt_id"] or "",
            )
        else:
            res = f"revision {out['revision']}" + ("" if out.get("ok") else f" [red]{out.get('rejected')}[/]")
            t.add_row(str(runner.line_no), kind, "", "", "", "", "", "", "", res)
    console.print(t)


@app.command()
def bench(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    quick: bool = typer.Option(False, "--quick", help="smaller runs (well under a minute)"),
    sections: Optional[str] = typer.Option(None, "--only", help="comma-separated sections to run"),
) -> None:
    """Measure the core, store, counting, service and HTTP layers; prints figures."""
    from tracker.bench import run_bench

    try:
        result = run_bench(quick=quick, only=set(sections.split(",")) if sections else None,
                           progress=None if as_json else err_console)
    except TrackerError as exc:
        _fail(exc, as_json)
    if as_json:
        print(json.dumps(result))
    else:
        console.print_json(json.dumps(result))


def _settings() -> Any:
    from tracker.settings import Settings

    try:
        return Settings.from_env()
    except TrackerError as exc:
        _fail(exc)


def _sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for other databases and in-memory SQLite)."""
    if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(url[len("sqlite:///"):].split("?", 1)[0])


def _open_store(check_schema: bool = True, as_json: bool = False) -> Any:
    from tracker.core import SessionProjector
    from tracker.errors import SchemaOutOfDate
    from tracker.store import open_store

    s = _settings()
    try:
        path = _sqlite_file(s.database_url)
        if check_schema and path is not None and not path.exists():
            # opening it would create an empty file (or fail on a missing directory with a bare OperationalError)
            raise SchemaOutOfDate(f"no database at {path}; run `tracker db upgrade`", database=str(path))
        return open_store(s.database_url, projector=SessionProjector(), check_schema=check_schema)
    except TrackerError as exc:
        _fail(exc, as_json)


TABLE_MAX_ROWS = 2000


def _print_rows(title: str, columns: tuple[str, ...], rows: Any, stream: bool) -> None:
    """A Rich table for small outputs; for long ones, one line per row as it comes (constant memory)."""
    if stream:
        console.print(f"[bold]{title}[/]  " + " | ".join(columns))
        for row in rows:
            console.print(" | ".join(row), highlight=False)
        return
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*row)
    console.print(t)


@db_app.command("upgrade")
def db_upgrade(as_json: bool = typer.Option(False, "--json")) -> None:
    """Create or upgrade the database schema to the newest migration."""
    from tracker.store.migrate import upgrade

    s = _settings()
    path = _sqlite_file(s.database_url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)  # e.g. the embedded default .tracker/tracker.db
    try:
        revision = upgrade(s.database_url)
    except TrackerError as exc:
        _fail(exc, as_json)
    if as_json:
        print(json.dumps({"ok": True, "database_url": _redact(s.database_url), "revision": revision}))
    else:
        console.print(f"[green]schema at revision {revision}[/] ({_redact(s.database_url)})")


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


@app.command()
def verify(as_json: bool = typer.Option(False, "--json")) -> None:
    """Re-fold every session from the log and compare with the stored projection. Exit 1 on any difference."""
    from tracker.core import SessionProjector
    from tracker.store import verify_projections

    store = _open_store(as_json=as_json)
    try:
        diffs = verify_projections(store, SessionProjector())
        n = sum(1 for _ in store.session_ids())
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()
    if as_json:
        print(json.dumps({"ok": not diffs, "sessions": n, "differences": diffs}, default=str))
    elif diffs:
        for d in diffs:
            err_console.print(f"[red]differs[/] {d}")
    else:
        console.print(f"[green]ok[/]: {n} sessions, every projection equals the fold of its log")
    if diffs:
        raise typer.Exit(1)


@app.command()
def observe(
    session_id: str = typer.Argument(..., help="session id"),
    basis: str = typer.Option(..., "--basis", help="r<revision>:<through>, or a bare 'through' at the current revision"),
    input_tokens: Optional[int] = typer.Option(None, "--input-tokens", help="a measurement you counted yourself"),
    input_limit: Optional[int] = typer.Option(None, "--input-limit"),
    request_file: Optional[Path] = typer.Option(None, "--request", help="JSON file of the complete request to count"),
    model: Optional[str] = typer.Option(None, "--model", help="model name from the registry"),
    quality: str = typer.Option("exact_local", "--quality"),
    compaction_threshold: Optional[float] = typer.Option(None, "--compaction-threshold"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Record one measurement of a session and print the decision."""
    import hashlib

    from tracker.service import Tracker

    if request_file is not None:
        try:
            request = json.loads(request_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            _fail(_invalid("request", f"cannot read a JSON request from {request_file}: {exc}"), as_json)
    store = _open_store(as_json=as_json)  # a missing or old schema: a clear message, nothing created
    store.close()
    try:
        tracker = Tracker.from_settings(_settings())
    except TrackerError as exc:
        _fail(exc, as_json)
    try:
        if request_file is not None:
            result = tracker.observe(session_id, request=request, model=model, basis=basis,
                                     compaction_threshold=compaction_threshold)
        else:
            if input_tokens is None or input_limit is None:
                raise typer.BadParameter("give --request FILE, or --input-tokens and --input-limit")
            m = {"basis": basis, "input_tokens": input_tokens, "input_limit": input_limit, "quality": quality,
                 "model": {"provider": "cli", "name": model or "unknown"},
                 "fingerprint": hashlib.sha256(f"{session_id}:{basis}".encode()).hexdigest()}
            result = tracker.observe(session_id, measurement=m, compaction_threshold=compaction_threshold)
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        tracker.close()
    if as_json:
        print(json.dumps(result.to_data()))
    else:
        d = result.decision
        console.print(f"{session_id} v{result.version}: [bold]{d.action}[/] (pressure {d.pressure}, "
                      f"{d.occupancy_bp} bp, compact at {d.compact_level}, rearm below {d.rearm_level})")
        if d.attempt:
            console.print(f"  attempt {d.attempt.attempt_id} fencing token {d.attempt.fencing_token}, "
                          f"history budget {d.attempt.history_budget}")


@app.command()
def sessions(
    pressure: Optional[str] = typer.Option(None, "--pressure", help="normal | compact | hard_limit"),
    since: Optional[str] = typer.Option(None, "--since", help="active since: ISO time, or a duration like 15m, 2h, 1d"),
    limit: int = typer.Option(100, "--limit"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List sessions: pressure, occupancy, revision, open attempts, last activity."""
    from tracker.core.decide import PRESSURES

    if pressure is not None and pressure not in PRESSURES:
        _fail(_invalid("pressure", f"must be one of {', '.join(PRESSURES)}, got {pressure!r}"), as_json)
    active_since = _parse_since(since, as_json) if since else None
    store = _open_store(as_json=as_json)
    try:
        rows = store.list_sessions(pressure=pressure, active_since=active_since, limit=limit)
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()
    if as_json:
        print(json.dumps(rows, default=str))
        return
    t = Table(title=f"{len(rows)} sessions")
    for col in ("session", "pressure", "occupancy", "revision", "open attempts", "events", "last activity"):
        t.add_column(col)
    for r in rows:
        occ = r.get("occupancy_bp")
        t.add_row(r["session_id"], _pressure_text(r["pressure"]), "" if occ is None else f"{occ / 100:.1f}%",
                  str(r["revision"]), str(r["open_attempts"]), str(r["version"]), str(r["updated_at"])[:19])
    console.print(t)


def _invalid(field: str, problem: str) -> TrackerError:
    from tracker.errors import InvalidInput

    return InvalidInput(field, problem)


def _pressure_text(p: str) -> str:
    return {"normal": "[green]normal[/]", "compact": "[yellow]compact[/]", "hard_limit": "[bold red]hard_limit[/]"}.get(p, p)


def _parse_since(text: str, as_json: bool) -> Any:
    import datetime as dt
    import re

    m = re.fullmatch(r"(\d+)([smhd])", text.strip())
    now = dt.datetime.now(dt.timezone.utc)
    if m:
        n, unit = int(m.group(1)), m.group(2)
        return now - dt.timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: n})
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        _fail(_invalid("since", f"must be an ISO time or a duration like 15m, got {text!r}"), as_json)
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def _event_row(e: Any) -> dict[str, Any]:
    return {"position": e.position, "session_id": e.session_id, "version": e.version, "type": e.type,
            "recorded_at": e.recorded_at.isoformat(), "data": e.data}


def _summary(e: Any) -> str:
    d = e.data
    if e.type == "ContextMeasured":
        m = d["measurement"]
        return (f"{m['basis']} {m['input_tokens']}/{m['input_limit']} ({d['occupancy_bp']} bp) "
                f"{d['pressure_before']}→{d['pressure']} → {d['action']}" + (f" [{d['trigger']}]" if d.get("trigger") else ""))
    if e.type == "CompactionStarted":
        return f"{d['reason']} attempt {d['attempt_id'][:12]} on {d['basis']} ({d['trigger']}), budget {d['history_budget']}"
    if e.type == "CompactionCommitted":
        return f"attempt {d['attempt_id'][:12]} committed {d['tokens_before']}→{d['tokens_after']}, now r{d['new_revision']}"
    if e.type == "CompactionRejected":
        return f"attempt {d['attempt_id'][:12]} rejected: {d['reject_reason']}"
    if e.type == "CountFailed":
        return f"{d['kind']} for {d['model']}: {d['detail']}"
    if e.type == "ContextLimitReached":
        return f"{d['input_tokens']} tokens ≥ limit {d['input_limit']} on {d['basis']}"
    if e.type == "MeasurementRefused":
        return f"{d['kind']}: {d['basis']} (session at r{d['current_revision']})"
    if e.type == "SessionStarted":
        p = d["policy"]
        return f"policy compact at {p['compact_at_bp']} bp, rearm below {p['rearm_below_bp']} bp, automatic={p['automatic']}"
    return json.dumps(d)[:100]


def _open_session(session_id: str, as_json: bool) -> Any:
    """The store, for a session id that is valid and exists (else a clear error and exit 2)."""
    from tracker.core import check_session_id
    from tracker.errors import UnknownSession

    try:
        check_session_id(session_id)
    except TrackerError as exc:
        _fail(exc, as_json)
    store = _open_store(as_json=as_json)
    try:
        if store.stream_version(session_id) == 0:
            _fail(UnknownSession(f"no session {session_id}", session_id=session_id), as_json)
    except TrackerError as exc:
        store.close()
        _fail(exc, as_json)
    except typer.Exit:
        store.close()
        raise
    return store


@app.command()
def history(
    session_id: str = typer.Argument(...),
    from_version: int = typer.Option(1, "--from-version"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """The audit trail of one session (streams; works on very long sessions)."""
    store = _open_session(session_id, as_json)
    try:
        events = store.read_stream(session_id, from_version)
        if as_json:
            for e in events:
                print(json.dumps(_event_row(e)))
            return
        rows = ((str(e.version), e.recorded_at.strftime("%H:%M:%S.%f")[:-3], e.type, escape(_summary(e))) for e in events)
        _print_rows(f"history of {session_id}", ("v", "time", "event", "what happened"), rows,
                    stream=store.stream_version(session_id) > TABLE_MAX_ROWS)
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()


@app.command()
def replay(
    session_id: str = typer.Argument(...),
    at: Optional[int] = typer.Option(None, "--at", help="stop at this version and show the state then"),
    html_file: Optional[Path] = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    compact_at: Optional[int] = COMPACT_AT,
    rearm_below: Optional[int] = REARM_BELOW,
    turn_delta: Optional[float] = TURN_DELTA,
    observe_only: bool = OBSERVE_ONLY,
    max_automatic_per_episode: Optional[int] = MAX_AUTO,
    as_json: bool = typer.Option(False, "--json", help="JSON lines, streamed"),
) -> None:
    """Rebuild a session's state event by event; with policy flags, what-if on the recorded measurements."""
    from tracker.replay import render_html, replay_states, whatif_rows

    store = _open_session(session_id, as_json)
    try:
        policy_flags = (compact_at, rearm_below, turn_delta, observe_only or None, max_automatic_per_episode)
        if html_file is not None:
            with html_file.open("w", encoding="utf-8") as fh:
                counts = render_html(session_id, store.read_stream(session_id, 1, at), fh)
            if as_json:
                print(json.dumps({"html": str(html_file), **counts}))
            else:
                console.print(f"[green]wrote[/] {html_file}: {counts['events']} events, {counts['attempts']} attempts "
                              f"({counts['committed']} committed, {counts['rejected']} rejected), "
                              f"{counts['count_failed']} count failures, {counts['context_limit']} context-limit errors")
            return
        if any(f is not None for f in policy_flags):
            first = next(iter(store.read_stream(session_id, 1, 1)))
            from tracker.core import Policy

            try:
                recorded = Policy.from_data(first.data["policy"])
                policy = _policy_from_flags(compact_at, rearm_below, turn_delta, observe_only,
                                            max_automatic_per_episode, base=recorded)
            except TrackerError as exc:
                _fail(exc, as_json)
            changed = [0]
            wrows = whatif_rows(store.read_stream(session_id, 1, at), policy, session_id)
            if as_json:
                for row in wrows:
                    print(json.dumps(row))
                return

            def table_rows() -> Any:
                for row in wrows:
                    changed[0] += bool(row.get("changed"))
                    w = row["whatif"]
                    if row["op"] == "measure" and "error" not in w:
                        mark = "[bold yellow]" if row["changed"] else ""
                        yield (str(row["version"]), "measure", row["recorded_action"], f"{mark}{w['action']}",
                               w["pressure"], f"{w['compact_level']}/{w['rearm_level']}")
                    else:
                        yield (str(row["version"]), row["op"], "", escape(json.dumps(w)), "", "")

            _print_rows(f"what-if for {session_id}: compact at {policy.compact_at_bp}, rearm below {policy.rearm_below_bp}",
                        ("v", "op", "recorded", "what-if", "pressure", "levels c/r"), table_rows(),
                        stream=store.stream_version(session_id) > TABLE_MAX_ROWS)
            console.print(f"{changed[0]} decisions would change under this policy")
            return
        last: list[Any] = [None]

        def steps() -> Any:
            for step in replay_states(store.read_stream(session_id, 1, at), session_id, at):
                last[0] = step
                yield step

        if as_json:
            for step in steps():
                print(json.dumps({"version": step.event.version, "type": step.event.type, "state": step.state.to_data()}))
            return
        rows = ((str(st.state.version), st.event.type, _pressure_text(st.state.pressure), str(st.state.revision),
                 str(len(st.state.open_attempts)), escape(", ".join(sorted(st.state.exhausted)))) for st in steps())
        _print_rows(f"replay of {session_id}" + (f" up to v{at}" if at else ""),
                    ("v", "event", "pressure", "revision", "open attempts", "exhausted"), rows,
                    stream=store.stream_version(session_id) > TABLE_MAX_ROWS)
        if last[0] is not None:
            console.print_json(json.dumps(last[0].state.to_data()))
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()


@app.command()
def export(
    since: int = typer.Option(0, "--since", help="global position to resume after (the last one you saw)"),
    limit: int = typer.Option(0, "--limit", help="stop after this many events (0 = all)"),
    as_json: bool = typer.Option(False, "--json", help="errors as JSON too (events are always JSON lines)"),
) -> None:
    """All events as JSON lines in global commit order; resumable with --since."""
    store = _open_store(as_json=as_json)
    written = 0
    try:
        position = since
        while True:
            batch = store.read_all(after_position=position, limit=1000)
            if not batch:
                break
            for e in batch:
                print(json.dumps(_event_row(e)))
                position = e.position
                written += 1
                if limit and written >= limit:
                    return
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()


@app.command()
def worker(
    concurrency: int = typer.Option(2, "--concurrency", "-c"),
    queues: Optional[str] = typer.Option(None, "--queues", "-Q"),
    loglevel: str = typer.Option("info", "--loglevel"),
) -> None:
    """Start a Celery counting worker (prefork pool) on TRACKER_BROKER_URL."""
    from workers.app import start_worker

    start_worker(concurrency=concurrency, queues=queues.split(",") if queues else None, loglevel=loglevel)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind"),
    port: int = typer.Option(8080, "--port", help="TCP port"),
    workers: int = typer.Option(1, "--workers", help="server processes (each with its own Tracker)"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    access_log: bool = typer.Option(True, "--access-log/--no-access-log", help="log every request"),
) -> None:
    """Serve the HTTP API (FastAPI on uvicorn): per-fleet keys, /healthz, /readyz, /metrics, /openapi.json."""
    from tracker.api import ApiConfig, serve as run_server

    if not 1 <= workers <= 256:
        _fail(_invalid("workers", f"must be between 1 and 256, got {workers}"))
    if not 0 <= port <= 65535:
        _fail(_invalid("port", f"must be between 0 and 65535, got {port}"))
    _settings()
    try:
        ApiConfig.from_env()
    except TrackerError as exc:
        _fail(exc)
    run_server(host=host, port=port, workers=workers, log_level=log_level, access_log=access_log)


fleet_app = typer.Typer(help="Fleets: the HTTP API's tenants (every session belongs to one).", no_args_is_help=True)
key_app = typer.Typer(help="Fleet API keys for the HTTP API (stored hashed; a token is shown once).", no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
app.add_typer(key_app, name="key")


def _with_fleets(as_json: bool, call: Any) -> Any:
    """Run ``call(fleets)`` on the fleet store; a typed error is printed (JSON with --json) and exits 2."""
    from tracker.fleets import FleetStore

    store = _open_store(as_json=as_json)
    try:
        return call(FleetStore(store.engine))
    except TrackerError as exc:
        _fail(exc, as_json)
    finally:
        store.close()


@fleet_app.command("create")
def fleet_create(name: str = typer.Argument(..., help="fleet name, 1-100 of [A-Za-z0-9._-]"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Create a fleet."""
    fleet = _with_fleets(as_json, lambda fleets: fleets.create_fleet(name))
    if as_json:
        print(json.dumps(fleet))
    else:
        console.print(f"[green]fleet[/] {fleet['name']} id [bold]{fleet['fleet_id']}[/]; next: tracker key create {fleet['name']}")


@fleet_app.command("list")
def fleet_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """List fleets with their number of active keys."""
    rows = _with_fleets(as_json, lambda fleets: fleets.list_fleets())
    if as_json:
        print(json.dumps(rows))
        return
    t = Table(title=f"{len(rows)} fleets")
    for col in ("fleet id", "name", "active keys", "created"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["fleet_id"], r["name"], str(r["active_keys"]), str(r["created_at"])[:19])
    console.print(t)


@key_app.command("create")
def key_create(fleet: str = typer.Argument(..., help="fleet id or name"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Create an API key for a fleet and print its token (shown only this once)."""
    record, token = _with_fleets(as_json, lambda fleets: fleets.create_key(fleet))
    if as_json:
        print(json.dumps({**record, "token": token}))
    else:
        console.print(f"key [bold]{record['key_id']}[/] for fleet {record['fleet']} ({record['fleet_id']}). "
                      "The token is shown only now:")
        print(token)


@key_app.command("list")
def key_list(fleet: str = typer.Argument(..., help="fleet id or name"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """List a fleet's keys (ids and dates; tokens are never stored)."""
    rows = _with_fleets(as_json, lambda fleets: fleets.list_keys(fleet))
    if as_json:
        print(json.dumps(rows))
        return
    t = Table(title=f"{len(rows)} keys")
    for col in ("key id", "fleet", "created", "revoked"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["key_id"], r["fleet"], str(r["created_at"])[:19], str(r["revoked_at"] or "")[:19])
    console.print(t)


@key_app.command("revoke")
def key_revoke(key_id: str = typer.Argument(..., help="key id (from `tracker key list FLEET`)"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Revoke a key: servers refuse it (401) within TRACKER_API_KEY_CACHE_S (1 s by default)."""
    result = _with_fleets(as_json, lambda fleets: fleets.revoke_key(key_id))
    if as_json:
        print(json.dumps(result))
    else:
        note = " (it already was)" if result["already_revoked"] else ""
        console.print(f"[green]revoked[/] key {key_id}{note}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
