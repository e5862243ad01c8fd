"""Operations: the schema, the counting worker, the HTTP server, the demo, what-if and the bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from tracker.cli._common import (
    COMPACT_AT,
    MAX_AUTO,
    OBSERVE_ONLY,
    REARM_BELOW,
    TURN_DELTA,
    console,
    emit,
    err_console,
    fail,
    invalid,
    policy_from_flags,
    print_table,
    redact,
    settings,
    sqlite_file,
)
from tracker.errors import TrackerError

app = typer.Typer()
db_app = typer.Typer(help="Database schema commands.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(as_json: bool = typer.Option(False, "--json")) -> None:
    """Create or upgrade the database schema to the newest migration."""
    from tracker.store.migrate import upgrade

    url = settings().store.database_url
    path = sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)  # e.g. the embedded default .tracker/tracker.db
    try:
        revision = upgrade(url)
    except TrackerError as exc:
        fail(exc, as_json)
    emit(
        {"ok": True, "database_url": redact(url), "revision": revision},
        as_json,
        lambda r: console.print(f"[green]schema at revision {r['revision']}[/] ({r['database_url']})"),
    )


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
            fail(invalid(name, f"must be between {low} and 1000, got {value}"), as_json)
    if not as_json:
        console.print(
            f"[bold]Context Tracker demo[/]: {workers} worker processes × {sessions_per_worker} sessions × "
            f"{steps} steps, real counting, store and coordination"
        )
    try:
        result = run_demo(
            workers, sessions_per_worker, steps, console=None if as_json else console, settings=settings()
        )
    except TrackerError as exc:
        fail(exc, as_json)
    emit(result, as_json, _demo_table)


def _demo_table(result: dict[str, Any]) -> None:
    from tracker.audit.format import pressure_markup

    def cells(r: dict[str, Any]) -> tuple[str, ...]:
        outcome = "[bold red]ContextLimitError[/]" if r["outcome"] == "ContextLimitError" else "[green]finished[/]"
        return (
            r["session_id"],
            str(r["measurements"]),
            f"{r['compactions_committed']}/{r['compactions_rejected']}",
            str(r["count_failures"]),
            str(r["revision"]),
            f"{r['tokens_now']} / {r['input_limit']}",
            pressure_markup(r["pressure"]),
            outcome,
        )

    print_table(
        f"demo run {result['run_id']} — {result['elapsed_s']} s",
        (
            "session",
            "measured",
            "compactions ✓/✗",
            "count failures",
            "revision",
            "tokens now / limit",
            "pressure",
            "outcome",
        ),
        map(cells, result["sessions"]),
    )
    where = "embedded SQLite" if result["database_url"].startswith("sqlite") else redact(result["database_url"])
    console.print(f"Recorded in {where}. Try next:")
    first = result["sessions"][0]["session_id"]
    broken = next((r["session_id"] for r in result["sessions"] if r["outcome"] == "ContextLimitError"), first)
    for cmd in (
        "tracker sessions",
        f"tracker history {broken}",
        f"tracker replay {broken} --html replay.html",
        f"tracker replay {first} --compact-at 7000 --rearm-below 5000",
        "tracker verify",
        "tracker export --since 0 | head",
        "tracker whatif examples/coding-session.jsonl --table",
    ):
        console.print(f"  [cyan]{cmd}[/]")


@app.command()
def whatif(
    trace: Path | None = typer.Argument(None, help="JSON-lines trace (default: standard input)"),
    compact_at: int | None = COMPACT_AT,
    rearm_below: int | None = REARM_BELOW,
    turn_delta: float | None = TURN_DELTA,
    observe_only: bool = OBSERVE_ONLY,
    max_automatic_per_episode: int | None = MAX_AUTO,
    table: bool = typer.Option(False, "--table", help="show a readable table instead of JSON lines"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON lines output (the default)"),
) -> None:
    """Replay a JSON-lines trace through the decision core, with no database."""
    from tracker.audit.whatif import WhatIf

    try:
        policy = policy_from_flags(compact_at, rearm_below, turn_delta, observe_only, max_automatic_per_episode)
    except TrackerError as exc:
        fail(exc)
    if trace is not None and not trace.exists():
        err_console.print(f"[bold red]error[/]: trace file {escape(str(trace))} does not exist")
        raise typer.Exit(2)
    runner = WhatIf(policy=policy, keep_events=False)
    lines = trace.open(encoding="utf-8") if trace is not None else sys.stdin
    if not table:
        for out in runner.run(lines):
            print(json.dumps(out), flush=True)
        return
    print_table(
        f"what-if: {trace or 'stdin'}  (compact at {policy.compact_at_bp} bp, rearm below {policy.rearm_below_bp} bp)",
        ("#", "op", "used / limit", "occ bp", "pressure", "action", "trigger", "threshold", "levels c/r", "result"),
        _whatif_rows(runner, lines),
    )


WHATIF_COLOUR = {"proceed": "green", "compact": "yellow", "wait": "cyan", "context_limit": "bold red"}


def _whatif_rows(runner: Any, lines: Any) -> Any:
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
            yield (str(runner.line_no), str(kind), "", "", "", "", "", "", "", f"[red]{out['error']}[/]")
        elif kind == "measure":
            a = out["action"]
            yield (
                str(runner.line_no),
                kind,
                f"{op.get('input_tokens')} / {op.get('input_limit')}",
                str(out["occupancy_bp"]),
                out["pressure"],
                f"[{WHATIF_COLOUR.get(a, 'white')}]{a}[/]",
                out["trigger"] or "",
                f"{out['threshold_bp']} ({out['threshold_source']})",
                f"{out['compact_level']}/{out['rearm_level']}",
                out["attempt_id"] or "",
            )
        else:
            res = f"revision {out['revision']}" + ("" if out.get("ok") else f" [red]{out.get('rejected')}[/]")
            yield (str(runner.line_no), kind, "", "", "", "", "", "", "", res)


@app.command()
def bench(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    quick: bool = typer.Option(False, "--quick", help="smaller runs (about two minutes on 2 cores)"),
    sections: str | None = typer.Option(None, "--only", help="comma-separated sections to run"),
) -> None:
    """Measure the core, store, counting, service and HTTP layers; prints figures."""
    from tracker.bench import run_bench

    try:
        result = run_bench(
            quick=quick,
            only=set(sections.split(",")) if sections else None,
            progress=None if as_json else err_console,
            settings=settings(),
        )
    except TrackerError as exc:
        fail(exc, as_json)
    emit(result, as_json, lambda r: console.print_json(json.dumps(r)))
    if not result["ok"]:  # a section could not run: its error is in the output above
        raise typer.Exit(1)


@app.command()
def worker(
    concurrency: int = typer.Option(2, "--concurrency", "-c"),
    queues: str | None = typer.Option(None, "--queues", "-Q"),
    loglevel: str = typer.Option("info", "--loglevel"),
) -> None:
    """Start a Celery counting worker (prefork pool) on TRACKER_BROKER_URL."""
    s = settings()
    from workers.app import start_worker

    names = [q for q in queues.split(",") if q] if queues else [s.counting.count_queue]
    try:
        start_worker(concurrency, names, loglevel, settings=s)
    except TrackerError as exc:  # e.g. a models file that cannot be read
        fail(exc, False)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind"),
    port: int = typer.Option(8080, "--port", help="TCP port"),
    workers: int = typer.Option(1, "--workers", help="server processes (each with its own Tracker)"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    access_log: bool = typer.Option(True, "--access-log/--no-access-log", help="log every request"),
) -> None:
    """Serve the HTTP API (FastAPI on uvicorn): per-fleet keys, /healthz, /readyz, /metrics, /openapi.json."""
    if not 1 <= workers <= 256:
        fail(invalid("workers", f"must be between 1 and 256, got {workers}"))
    if not 0 <= port <= 65535:
        fail(invalid("port", f"must be between 0 and 65535, got {port}"))
    s = settings()
    from tracker.http.app import serve as run_server

    run_server(host=host, port=port, workers=workers, settings=s, log_level=log_level, access_log=access_log)
