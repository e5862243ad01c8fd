"""Operations: the schema, the counting worker, the HTTP server, the demo, what-if and the bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from tracker.cli._common import (
    COMPACT_AT,
    MAX_AUTO,
    OBSERVE_ONLY,
    REARM_BELOW,
    TURN_DELTA,
    console,
    emit,
    err_console,
    existing_file,
    fail,
    invalid,
    plain,
    policy_from_flags,
    pressure_cell,
    print_table,
    redact,
    settings,
    styled,
)
from tracker.errors import TrackerError

app = typer.Typer()
db_app = typer.Typer(help="Database schema commands.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(as_json: bool = typer.Option(False, "--json")) -> None:
    """Create or upgrade the database schema to the newest migration."""
    from tracker.settings import sqlite_path
    from tracker.store.migrate import upgrade

    url = settings().store.database_url
    path = sqlite_path(url)
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
def info(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Show the effective settings (secrets masked) and where the database is."""
    from tracker.settings import mask, sqlite_path

    s = settings()
    url = s.store.database_url
    path = sqlite_path(url)
    data = {
        "version": package_version(),
        "database": {
            "url": mask(url),
            "file": None if path is None else str(path.resolve()),
            "exists": None if path is None else path.exists(),
        },
        "settings": {variable: value for variable, value, _ in s.describe()},
    }

    def human(d: dict[str, Any]) -> None:
        db = d["database"]
        if db["file"] is None:
            where = db["url"]
        else:
            where = f"{db['file']} (embedded SQLite{'' if db['exists'] else ', not created yet'})"
        console.print(f"context-tracker {d['version']}; database: {plain(where)}", soft_wrap=True)
        print_table(
            "effective settings (TRACKER_*, secrets masked)",
            ("variable", "value", "section"),
            ((v, value, section) for v, value, section in s.describe()),
        )

    emit(data, as_json, human)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 21st …"""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("context-tracker")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without installing
        return "0+unknown"


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
            f"{steps} steps, real counting, store and coordination; one broken compactor and a slow counter "
            "are staged to show how failures are handled",
            soft_wrap=_unwrapped(),
        )
    try:
        result = run_demo(
            workers, sessions_per_worker, steps, console=None if as_json else console, settings=settings()
        )
    except TrackerError as exc:
        fail(exc, as_json)
    emit(result, as_json, _demo_table)


def _unwrapped() -> bool:
    """The demo's sentences are wrapped at words on a terminal; into a pipe or a file each stays one line
    (a reader or ``grep`` must never meet a sentence cut mid-phrase at an arbitrary width)."""
    return not console.is_terminal


def _demo_table(result: dict[str, Any]) -> None:
    def cells(r: dict[str, Any]) -> tuple[Any, ...]:
        limited = r["outcome"] == "ContextLimitError"
        outcome = styled("ContextLimitError", "bold red") if limited else styled("finished", "green")
        return (
            r["session_id"],
            str(r["measurements"]),
            f"{r['compactions_committed']}/{r['compactions_rejected']}",
            str(r["count_failures"]),
            str(r["revision"]),
            f"{r['tokens_now']} / {r['input_limit']}",
            pressure_cell(r["pressure"]),
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
    console.print(
        "[dim]measured: requests counted and decided · compactions ✓/✗: committed / rejected · count failures: "
        "counts that could not be trusted (recorded, nothing decided on a guess) · revision: compactions "
        "applied + 1 · tokens now / limit: the last measurement against the model's input limit · pressure: "
        "normal, compact (over compact_at_bp) or hard_limit · outcome: finished all steps, or stopped by "
        "ContextLimitError[/]",
        soft_wrap=_unwrapped(),
    )
    staged = result.get("staged") or {}
    notes = []
    if staged.get("broken_compactor"):
        notes.append(
            f"{', '.join(staged['broken_compactor'])} has a compactor that always fails: its attempts are "
            "rejected, pressure climbs to hard_limit and the tracker refuses the next request with "
            "ContextLimitError instead of letting the provider reject it"
        )
    if staged.get("slow_counter"):
        notes.append(
            f"every {ordinal(staged['slow_every'])} step of {', '.join(staged['slow_counter'])} is counted by a "
            f"counter that sleeps past count_timeout_s: a recorded CountTimeout (the count failures column)"
        )
    if staged.get("manual_compaction"):
        notes.append(f"{', '.join(staged['manual_compaction'])} asks for one manual compaction part way through")
    if notes:
        console.print("[bold]Staged on purpose[/] to show those paths (not faults):", soft_wrap=_unwrapped())
        for note in notes:
            console.print(f"  • {plain(note)}", soft_wrap=_unwrapped())
    from tracker.settings import sqlite_path

    path = sqlite_path(result["database_url"])
    where = f"the embedded database {path.resolve()}" if path is not None else redact(result["database_url"])
    console.print(f"Recorded in {plain(where)} (`tracker info` shows the settings). Try next:", soft_wrap=True)
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
    trace: Path | None = typer.Argument(
        None, help="JSON-lines trace (default: standard input)", callback=existing_file
    ),
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
            yield (str(runner.line_no), str(kind), "", "", "", "", "", "", "", styled(out["error"], "red"))
        elif kind == "measure":
            a = out["action"]
            yield (
                str(runner.line_no),
                kind,
                f"{op.get('input_tokens')} / {op.get('input_limit')}",
                str(out["occupancy_bp"]),
                out["pressure"],
                styled(a, WHATIF_COLOUR.get(a, "white")),
                out["trigger"] or "",
                f"{out['threshold_bp']} ({out['threshold_source']})",
                f"{out['compact_level']}/{out['rearm_level']}",
                out["attempt_id"] or "",
            )
        else:
            res = Text(f"revision {out['revision']}")
            if not out.get("ok"):
                res.append(Text.assemble(" ", styled(out.get("rejected"), "red")))
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


@app.command("console")
def console_command(
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(8090, "--port", help="TCP port (0: any free port)"),
) -> None:
    """The read-only web console on this machine: prints a one-time sign-in link (no key needed)."""
    if not 0 <= port <= 65535:
        fail(invalid("port", f"must be between 0 and 65535, got {port}"))
    s = settings()
    from tracker.http.app import create_app
    from tracker.http.console import run_local

    def announce(url: str) -> None:
        console.print("[bold]Context Tracker console[/] (Ctrl-C stops it). Open this link once to sign in:")
        print(url, flush=True)

    run_local(create_app(settings=s), host=host, port=port, announce=announce)
