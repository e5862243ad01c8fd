"""Fleet and API key commands: the HTTP API's tenants and their keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from tracker.cli._common import console, emit, print_table, store_open

fleet_app = typer.Typer(help="Fleets: the HTTP API's tenants (every session belongs to one).", no_args_is_help=True)
key_app = typer.Typer(
    help="Fleet API keys for the HTTP API (stored hashed; a token is shown once).", no_args_is_help=True
)

JSON = typer.Option(False, "--json")


def with_fleets(as_json: bool, call: Callable[[Any], Any]) -> Any:
    """Run ``call(fleets)`` on the fleet store; a typed error is printed (JSON with --json) and exits 2."""
    from tracker.store.fleets import FleetStore

    with store_open(as_json) as store:
        return call(FleetStore(store.engine))


@fleet_app.command("create")
def fleet_create(
    name: str = typer.Argument(..., help="fleet name, 1-100 of [A-Za-z0-9._-]"), as_json: bool = JSON
) -> None:
    """Create a fleet."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.create_fleet(name)),
        as_json,
        lambda fleet: console.print(
            f"[green]fleet[/] {fleet['name']} id [bold]{fleet['fleet_id']}[/]; next: tracker key create {fleet['name']}"
        ),
    )


@fleet_app.command("list")
def fleet_list(as_json: bool = JSON) -> None:
    """List fleets with their number of active keys."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.list_fleets()),
        as_json,
        lambda rows: print_table(
            f"{len(rows)} fleets",
            ("fleet id", "name", "active keys", "created"),
            ((r["fleet_id"], r["name"], str(r["active_keys"]), str(r["created_at"])[:19]) for r in rows),
        ),
    )


@key_app.command("create")
def key_create(fleet: str = typer.Argument(..., help="fleet id or name"), as_json: bool = JSON) -> None:
    """Create an API key for a fleet and print its token (shown only this once)."""
    record, token = with_fleets(as_json, lambda fleets: fleets.create_key(fleet))

    def human(record: dict[str, Any]) -> None:
        console.print(
            f"key [bold]{record['key_id']}[/] for fleet {record['fleet']} ({record['fleet_id']}). "
            "The token is shown only now:"
        )
        print(token)

    emit({**record, "token": token} if as_json else record, as_json, human)


@key_app.command("list")
def key_list(fleet: str = typer.Argument(..., help="fleet id or name"), as_json: bool = JSON) -> None:
    """List a fleet's keys (ids and dates; tokens are never stored)."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.list_keys(fleet)),
        as_json,
        lambda rows: print_table(
            f"{len(rows)} keys",
            ("key id", "fleet", "created", "revoked"),
            ((r["key_id"], r["fleet"], str(r["created_at"])[:19], str(r["revoked_at"] or "")[:19]) for r in rows),
        ),
    )


@key_app.command("revoke")
def key_revoke(
    key_id: str = typer.Argument(..., help="key id (from `tracker key list FLEET`)"), as_json: bool = JSON
) -> None:
    """Revoke a key: servers refuse it (401) within TRACKER_API_KEY_CACHE_S (1 s by default)."""
    emit(
        with_fleets(as_json, lambda fleets: fleets.revoke_key(key_id)),
        as_json,
        lambda result: console.print(
            f"[green]revoked[/] key {key_id}{' (it already was)' if result['already_revoked'] else ''}"
        ),
    )
