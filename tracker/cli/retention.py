"""Retention: ``tracker archive`` and ``tracker restore`` (docs/operations.md "Retention"); the work is
``tracker.store.archive`` / ``tracker.store.restore``."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from tracker.cli._common import console, emit, err_console, fail, invalid, parse_since, plain, plural, storage_open
from tracker.cli.sessions import FLEET, _scope
from tracker.errors import TrackerError

app = typer.Typer()

DURATION = re.compile(r"\d+[smhd]")


@contextmanager
def _progress(label: str, show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on a terminal (stderr), else nothing: ``progress(done, total)`` in events."""
    if not show or not err_console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        label, BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err_console, transient=True
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _cutoff(idle_for: str | None, before: str | None, as_json: bool) -> dt.datetime:
    if (idle_for is None) == (before is None):
        fail(invalid("idle_for", "give exactly one of --idle-for DURATION and --before TIMESTAMP"), as_json)
    if idle_for is not None:
        if not DURATION.fullmatch(idle_for.strip()):
            fail(invalid("idle_for", f"must be a duration like 30d, 12h or 90m, got {idle_for!r}"), as_json)
        return parse_since(idle_for, as_json)
    assert before is not None
    return parse_since(before, as_json)


@app.command()
def archive(
    to: Path = typer.Option(..., "--to", help="the archive directory (made if missing; shared by runs)"),
    idle_for: str | None = typer.Option(None, "--idle-for", help="sessions with no event for this long: 30d, 12h"),
    before: str | None = typer.Option(None, "--before", help="sessions with no event since this ISO time"),
    fleet: str | None = FLEET,
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would move; write nothing"),
    batch_events: int = typer.Option(
        100_000, "--batch-events", min=1, help="about this many events per segment and per transaction"
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON summary"),
) -> None:
    """Move whole idle sessions to verified Parquet segments; the live log keeps one SessionArchived
    record each (docs/operations.md "Retention")."""
    from tracker.store.archive import archive_sessions

    cutoff = _cutoff(idle_for, before, as_json)
    with storage_open(as_json) as db:
        prefix = _scope(db.fleets, fleet, as_json).prefix if fleet is not None else None
        with _progress("archiving", not dry_run and not as_json) as progress:
            try:
                report = archive_sessions(
                    db.store,
                    to,
                    before=cutoff,
                    session_prefix=prefix,
                    dry_run=dry_run,
                    batch_events=batch_events,
                    progress=progress,
                )
            except (TrackerError, OSError) as exc:
                fail(exc if isinstance(exc, TrackerError) else invalid("to", str(exc)), as_json)
    report["before"] = cutoff.isoformat()
    emit(report, as_json, _said_archive)


def _said_archive(r: dict[str, Any]) -> None:
    verb = "would archive" if r["dry_run"] else "archived"
    where = "" if r["dry_run"] else f" to {plain(r['archive'])} ({plural(len(r['segments']), 'segment')})"
    console.print(
        f"{verb} {plural(r['sessions'], 'session')} ({plural(r['events'], 'event')}) idle since {r['before']}{where}"
        f" in {r['seconds']} s"
    )
    for s in r["skipped"]:
        err_console.print(f"[yellow]skipped[/] {plain(s['session_id'])}: {plain(s['reason'])}")


@app.command()
def restore(
    directory: Path = typer.Argument(..., help="the archive directory (its manifest.json)"),
    session: str | None = typer.Option(None, "--session", help="only this session (default: every one archived)"),
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json", help="one JSON summary"),
) -> None:
    """Bring archived sessions back into the live log, unchanged; a second run changes nothing."""
    from tracker.store.restore import restore_sessions

    with storage_open(as_json) as db:
        stored = None
        if session is not None:
            stored = _scope(db.fleets, fleet, as_json).internal(session) if fleet is not None else session
        with _progress("restoring", not as_json) as progress:
            try:
                report = restore_sessions(db.store, directory, session_id=stored, progress=progress)
            except (TrackerError, OSError) as exc:
                fail(exc if isinstance(exc, TrackerError) else invalid("directory", str(exc)), as_json)
    emit(
        report,
        as_json,
        lambda r: console.print(
            f"restored {plural(r['restored'], 'session')} ({plural(r['events'], 'event')}) from "
            f"{plain(r['archive'])} in {r['seconds']} s; {r['live']} already live"
        ),
    )
