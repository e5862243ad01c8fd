"""The ``tracker`` command line (Typer + Rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
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

console = Console()
err_console = Console(stderr=True)


def _fail(exc: TrackerError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(exc.to_dict()))
    else:
        err_console.print(f"[bold red]error[/] ({exc.code}): {exc.message or exc}")
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
    runner = WhatIf(policy=policy)
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

    result = run_bench(quick=quick, only=set(sections.split(",")) if sections else None,
                       progress=None if as_json else err_console)
    if as_json:
        print(json.dumps(result))
    else:
        console.print_json(json.dumps(result))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
