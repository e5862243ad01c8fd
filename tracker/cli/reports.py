"""The provider's numbers: usage, rejection (write a report on a session), calibration (read what they taught).

``usage`` and ``rejection`` write through the Tracker (the primary), as ``observe`` does;
``calibration`` folds the log's provider reports on the read side (the replica, if any).
With ``--fleet`` a command is about one fleet's HTTP sessions, by the ids its agents use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tracker.cli._common import (
    console,
    emit,
    existing_file,
    fail,
    identifier,
    int_between,
    invalid,
    plain,
    plural,
    print_table,
    settings,
    storage_open,
    styled,
)
from tracker.cli.sessions import FLEET, _scope
from tracker.core.model import SessionScope
from tracker.errors import TrackerError

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.ledger import ModelSummary
    from tracker.core.reports import Report
    from tracker.service import Tracker

app = typer.Typer()

TOKENS = int_between(0)
BASIS = typer.Option(
    ..., "--basis", help="the measured basis the request covered (r<revision>:<through>, or a bare through)"
)
MODEL = typer.Option(None, "--model", help="the model (name or provider/name): the measured one", callback=identifier)
KEY = typer.Option(
    None, "--idempotency-key", help="a retry with the same key records nothing more", callback=identifier
)


def _report(session_id: str, fleet: str | None, as_json: bool, write: Callable[[Tracker, str], Report]) -> None:
    """``write(tracker, stored_id)`` on the session (``--fleet``: the fleet's), the report printed.
    The Tracker is the composition root's writer: a report counts nothing, so none is built to count."""
    from tracker.bootstrap import build_writer

    try:
        writer = build_writer(settings())  # checks the schema
    except TrackerError as exc:
        fail(exc, as_json)
    try:
        scope = _scope(writer.fleets, fleet, as_json) if fleet is not None else SessionScope()
        report = write(writer.tracker, scope.internal(session_id))
    except TrackerError as exc:
        fail(exc, as_json)
    finally:
        writer.close()
    if as_json:
        print(json.dumps({**report.to_data(), "session_id": session_id}))
        return
    from tracker.audit.format import summary

    console.print(f"{plain(session_id)} v{report.version}: {plain(summary(report.event))}")


@app.command()
def usage(
    session_id: str = typer.Argument(..., help="session id"),
    basis: str = BASIS,
    input_tokens: int = typer.Option(
        ..., "--input-tokens", help="input tokens billed (uncached; cache tokens apart)", callback=TOKENS
    ),
    output_tokens: int | None = typer.Option(None, "--output-tokens", callback=TOKENS),
    cache_read_tokens: int | None = typer.Option(None, "--cache-read-tokens", callback=TOKENS),
    cache_write_tokens: int | None = typer.Option(None, "--cache-write-tokens", callback=TOKENS),
    model: str | None = MODEL,
    idempotency_key: str | None = KEY,
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Record what the provider billed for the request of a measured basis (a calibration sample)."""
    _report(
        session_id,
        fleet,
        as_json,
        lambda t, sid: t.report_usage(
            sid,
            basis=basis,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens,
            cache_write_tokens=cache_write_tokens,
            model=model,
            idempotency_key=idempotency_key,
        ),
    )


@app.command()
def rejection(
    session_id: str = typer.Argument(..., help="session id"),
    basis: str = BASIS,
    message: str | None = typer.Option(None, "--message", help="the provider's error message"),
    message_file: Path | None = typer.Option(
        None, "--message-file", help="a file holding the provider's error message", callback=existing_file
    ),
    input_tokens: int | None = typer.Option(
        None, "--input-tokens", help="the provider's count (else read from the message)", callback=TOKENS
    ),
    input_limit: int | None = typer.Option(
        None, "--input-limit", help="the provider's limit (else read from the message)", callback=int_between(1)
    ),
    model: str | None = MODEL,
    idempotency_key: str | None = KEY,
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Record that the provider refused the request of a measured basis as too long for the model."""
    if message is not None and message_file is not None:
        fail(invalid("message", "give --message or --message-file, not both"), as_json)
    if message_file is not None:
        try:
            message = message_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            fail(invalid("message-file", f"cannot read {message_file}: {exc}"), as_json)
    _report(
        session_id,
        fleet,
        as_json,
        lambda t, sid: t.report_rejection(
            sid,
            basis=basis,
            message=message or None,
            input_tokens=input_tokens,
            input_limit=input_limit,
            model=model,
            idempotency_key=idempotency_key,
        ),
    )


def _ratio(value: float | Fraction | None) -> str:
    return "" if value is None else f"{float(value):.3f}"


@app.command()
def calibration(
    fleet: str | None = FLEET,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What the provider's reports taught, per fleet, model and counter kind: samples, median and p90 of
    billed / counted, the factor decisions use (and each kind of content's), how many reported decisions
    were anchored on the session's own billed count, drift of exact counters, the learned limit."""
    from tracker.calibrations import ledger_of

    with storage_open(as_json, read=True) as db:
        scope = _scope(db.fleets, fleet, as_json)
        names = {f["fleet_id"]: f["name"] for f in db.fleets.list_fleets()}
        ledger = ledger_of(db.store, scope=scope)
        rows = ledger.summaries(scope.fleet_id if scope.prefix else None)
    data = [{**r.to_data(), "fleet_name": names.get(r.fleet)} for r in rows]

    def table(_: Any) -> None:
        def cells(r: ModelSummary) -> tuple[Any, ...]:
            factor = "" if r.calibration is None else _ratio(r.calibration.factor)
            per_kind = ", ".join(f"{k} {_ratio(c.factor) if c else '-'}" for k, c, _ in r.contents)
            drift = _ratio(r.drift)
            return (
                names.get(r.fleet, r.fleet or "(none)"),
                r.model,
                r.kind,
                str(r.usage_reports),
                str(r.anchored) if r.kind == "estimate" else "",
                str(r.rejections),
                str(r.samples) + (f" (+{r.ignored} ignored)" if r.ignored else ""),
                _ratio(r.median),
                _ratio(r.p90),
                factor + (f" ({per_kind})" if per_kind else ""),
                styled(f"{drift} drifted", "bold red") if r.drifted else drift,
                "" if r.learned_limit is None else f"{r.learned_limit:,}",
            )

        if not rows:
            console.print(
                "no usage reports or provider rejections recorded" + (f" in fleet {plain(fleet)}" if fleet else "")
            )
            return
        print_table(
            f"calibration: {plural(len(rows), 'model')}",
            (
                "fleet",
                "model",
                "counter",
                "usage reports",
                "anchored",
                "rejections",
                "samples",
                "median billed/counted",
                "p90",
                "factor in use (per kind)",
                "drift",
                "learned limit",
            ),
            map(cells, rows),
        )

    emit(data, as_json, table)
