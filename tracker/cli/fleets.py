"""Fleet and API key commands: the HTTP API's tenants and their keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from tracker.cli._common import console, emit, fail, identifier, invalid, plain, plural, print_table, storage_open

fleet_app = typer.Typer(help="Fleets: the HTTP API's tenants (every session belongs to one).", no_args_is_help=True)
key_app = typer.Typer(
    help="Fleet API keys for the HTTP API (stored hashed; a token is shown once).", no_args_is_help=True
)

JSON = typer.Option(False, "--json")


def with_fleets(as_json: bool, call: Callable[[Any], Any]) -> Any:
    """Run ``call(fleets)`` on the fleet store; a typed error is printed (JSON with --json) and exits 2."""
    with storage_open(as_json) as db:
        return call(db.fleets)


@fleet_app.command("create")
def fleet_create(
    name: str = typer.Argument(..., help="fleet name, 1-100 of [A-Za-z0-9._-]", callback=identifier),
    as_json: bool = JSON,
) -> None:
    """Create a fleet."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.create_fleet(name)),
        as_json,
        lambda fleet: console.print(
            f"[green]fleet[/] {plain(fleet['name'])} id [bold]{plain(fleet['fleet_id'])}[/]; "
            f"next: tracker key create {plain(fleet['name'])}"
        ),
    )


@fleet_app.command("list")
def fleet_list(as_json: bool = JSON) -> None:
    """List fleets with their number of active keys."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.list_fleets()),
        as_json,
        lambda rows: print_table(
            plural(len(rows), "fleet"),
            ("fleet id", "name", "active keys", "created"),
            ((r["fleet_id"], r["name"], str(r["active_keys"]), str(r["created_at"])[:19]) for r in rows),
        ),
    )


OPERATOR = typer.Option(False, "--operator", help="an operator key: signs in to the console, sees every fleet")


@key_app.command("create")
def key_create(
    fleet: str | None = typer.Argument(None, help="fleet id or name (none with --operator)", callback=identifier),
    operator: bool = OPERATOR,
    as_json: bool = JSON,
) -> None:
    """Create an API key for a fleet (or, with --operator, a console key for every fleet); the token is shown once."""
    if operator == (fleet is not None):
        fail(invalid("fleet", "give a fleet, or --operator for an operator key (not both)"), as_json)
    if operator:
        record, token = with_fleets(as_json, lambda fleets: fleets.create_operator_key())
    else:
        record, token = with_fleets(as_json, lambda fleets: fleets.create_key(fleet))

    def human(record: dict[str, Any]) -> None:
        whose = (
            "operator key (console, every fleet)"
            if operator
            else f"for fleet {plain(record['fleet'])} ({plain(record['fleet_id'])})"
        )
        console.print(f"key [bold]{plain(record['key_id'])}[/] {whose}. The token is shown only now:")
        print(token)

    emit({**record, "token": token} if as_json else record, as_json, human)


@key_app.command("list")
def key_list(
    fleet: str | None = typer.Argument(None, help="fleet id or name (none with --operator)", callback=identifier),
    operator: bool = OPERATOR,
    as_json: bool = JSON,
) -> None:
    """List a fleet's keys, or with --operator the operator keys (ids and dates; tokens are never stored)."""
    if operator == (fleet is not None):
        fail(invalid("fleet", "give a fleet, or --operator for the operator keys (not both)"), as_json)
    emit(
        with_fleets(as_json, lambda fleets: fleets.list_operator_keys() if operator else fleets.list_keys(fleet)),
        as_json,
        lambda rows: print_table(
            plural(len(rows), "key"),
            ("key id", "fleet", "created", "revoked"),
            (
                (r["key_id"], r.get("fleet", "(operator)"), str(r["created_at"])[:19], str(r["revoked_at"] or "")[:19])
                for r in rows
            ),
        ),
    )


@key_app.command("revoke")
def key_revoke(
    key_id: str = typer.Argument(..., help="key id (from `tracker key list FLEET`)", callback=identifier),
    as_json: bool = JSON,
) -> None:
    """Revoke a key: servers refuse it (401) within TRACKER_API_KEY_CACHE_S (1 s by default)."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.revoke_key(key_id)),
        as_json,
        lambda result: console.print(
            f"[green]revoked[/] key {plain(key_id)}{' (it already was)' if result['already_revoked'] else ''}"
        ),
    )
