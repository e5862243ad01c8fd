"""Fleet and API key commands: the HTTP API's tenants, their keys and their policies."""

from __future__ import annotations

import functools
import getpass
import inspect
import socket
from collections.abc import Callable
from typing import Any

import typer
from typer.models import ArgumentInfo

from tracker.cli._common import (
    COMPACT_AT,
    MAX_AUTO,
    POLICY_INT,
    REARM_BELOW,
    console,
    emit,
    fail,
    identifier,
    invalid,
    plain,
    plural,
    print_table,
    settings,
    storage_open,
)

fleet_app = typer.Typer(help="Fleets: the HTTP API's tenants (every session belongs to one).", no_args_is_help=True)
key_app = typer.Typer(
    help="Fleet API keys for the HTTP API (stored hashed; a token is shown once).", no_args_is_help=True
)

JSON = typer.Option(False, "--json")


def with_fleets(as_json: bool, call: Callable[[Any], Any]) -> Any:
    """Run ``call(fleets)`` on the fleet store; a typed error is printed (JSON with --json) and exits 2."""
    with storage_open(as_json) as db:
        return call(db.fleets)


def run(as_json: bool, call: Callable[[Any], Any], human: Callable[[Any], None]) -> None:
    """``call(fleets)``, its result printed: JSON with --json, else ``human(result)``."""
    emit(with_fleets(as_json, call), as_json, human)


# -- policy options: every field of the core's Policy (the whatif flags, and the others) ---------

AUTOMATIC = typer.Option(
    None, "--observe-only/--automatic", help="observe-only: never compact automatically (automatic=false)"
)
COUNTER_POLICY = typer.Option(None, "--counter-policy", help="allow_conservative or require_exact")
RESERVED_OUTPUT = typer.Option(None, "--reserved-output", help="tokens kept free for the reply", callback=POLICY_INT)
SAFETY_MARGIN = typer.Option(None, "--safety-margin", help="tokens kept free beside the reply", callback=POLICY_INT)
COUNT_TIMEOUT = typer.Option(None, "--count-timeout-s", help="seconds a count may take")
POLICY_TURN_DELTA = typer.Option(None, "--turn-delta", help="growth trigger in (0, 1], or `off`")
LEASE = typer.Option(None, "--attempt-lease-s", help="seconds an attempt may stay open")
BY = typer.Option(None, "--by", help="who makes the change, for the policy's history (default: user@host)")


def _turn_delta(text: str | None) -> float | None | str:
    """``--turn-delta``: a number, or ``off``/``none`` (the growth trigger off); "" when not given."""
    from tracker.errors import InvalidPolicy

    if text is None:
        return ""
    if text.strip().lower() in ("off", "none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        raise InvalidPolicy("turn_delta", f"must be `off` or a number in (0, 1], got {text!r}") from None


#: every policy flag: (its parameter, its type, its option, the policy field it sets)
_FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("automatic", bool | None, AUTOMATIC, "automatic"),
    ("compact_at", int | None, COMPACT_AT, "compact_at_bp"),
    ("rearm_below", int | None, REARM_BELOW, "rearm_below_bp"),
    ("counter_policy", str | None, COUNTER_POLICY, "counter_policy"),
    ("reserved_output", int | None, RESERVED_OUTPUT, "reserved_output"),
    ("safety_margin", int | None, SAFETY_MARGIN, "safety_margin"),
    ("count_timeout_s", float | None, COUNT_TIMEOUT, "count_timeout_s"),
    ("turn_delta", str | None, POLICY_TURN_DELTA, "turn_delta"),
    ("max_automatic_per_episode", int | None, MAX_AUTO, "max_automatic_per_episode"),
    ("attempt_lease_s", float | None, LEASE, "attempt_lease_s"),
)
POLICY_FLAGS: Any = None  # the placeholder of ``changes`` in a command's signature (see ``policy_flags``)


def policy_changes(**flags: Any) -> dict[str, Any]:
    """The policy fields the flags given set (an empty dict: none given)."""
    changes = {field: flags[name] for name, _, _, field in _FLAGS if flags[name] is not None}
    if "automatic" in changes:
        changes["automatic"] = not changes["automatic"]  # the flag says observe-only
    delta = _turn_delta(flags["turn_delta"])
    if delta != "":
        changes["turn_delta"] = delta
    else:
        changes.pop("turn_delta", None)
    return changes


def policy_flags(command: Callable[..., None]) -> Callable[..., None]:
    """A command with every policy flag in place of its ``changes`` parameter, which it receives as
    ``policy_changes(...)`` of them (typer reads the signature made here)."""
    sig = inspect.signature(command)
    own = [p for p in sig.parameters.values() if p.name != "changes"]
    flags = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=o, annotation=t) for n, t, o, _ in _FLAGS]

    @functools.wraps(command)
    def call(**kwargs: Any) -> None:
        given = {name: kwargs.pop(name) for name, _, _, _ in _FLAGS}
        command(changes=policy_changes(**given), **kwargs)

    own_kw = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    arguments = [p for p in own_kw if isinstance(p.default, ArgumentInfo)]  # the flags after them
    ordered = [*arguments, *flags, *(p for p in own_kw if p not in arguments)]
    call.__signature__ = sig.replace(parameters=ordered)  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in ordered}
    return call


def actor(by: str | None) -> str:
    """Who makes a policy change: ``--by``, else ``user@host`` of this process."""
    if by is not None:
        return by
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (a bare container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _server_policy() -> Any:
    """The policy of this configuration (``TRACKER_*``): what a fleet without its own starts from."""
    return settings().policy


def _policy_lines(record: dict[str, Any], heading: str) -> None:
    own = record["policy"]
    if own is None:
        source = "the server's policy (this configuration's): the fleet has none of its own"
    else:
        source = f"version {record['version']}, set by {plain(record['actor'])} at {plain(str(record['at'])[:19])}"
    console.print(f"{heading} fleet {plain(record['fleet'])} ({plain(record['fleet_id'])}): {source}")
    values = own if own is not None else _server_policy().to_data()
    print_table("policy", ("field", "value"), ((k, str(v)) for k, v in values.items()))


@fleet_app.command("create")
@policy_flags
def fleet_create(
    name: str = typer.Argument(..., help="fleet name, 1-100 of [A-Za-z0-9._-]", callback=identifier),
    changes: dict[str, Any] = POLICY_FLAGS,
    by: str | None = BY,
    as_json: bool = JSON,
) -> None:
    """Create a fleet; with policy flags, with a policy of its own (the other fields: this configuration's)."""
    policy = _server_policy().replace(**changes) if changes else None  # InvalidPolicy before any write
    run(
        as_json,
        lambda fleets: fleets.create_fleet(name, policy, actor=actor(by)),
        lambda fleet: console.print(
            f"[green]fleet[/] {plain(fleet['name'])} id [bold]{plain(fleet['fleet_id'])}[/]"
            f"{' with a policy of its own' if fleet['policy'] else ''}; "
            f"next: tracker key create {plain(fleet['name'])}"
        ),
    )


@fleet_app.command("policy")
@policy_flags
def fleet_policy(
    fleet: str = typer.Argument(..., help="fleet id or name", callback=identifier),
    changes: dict[str, Any] = POLICY_FLAGS,
    reset: bool = typer.Option(False, "--reset", help="back to the server's policy (recorded as a version)"),
    history: bool = typer.Option(False, "--history", help="every version: who changed it, when, to what"),
    by: str | None = BY,
    as_json: bool = JSON,
) -> None:
    """Show the fleet's policy; with flags, change it (a new version; new sessions only: started ones keep theirs)."""
    if sum((bool(changes), reset, history)) > 1:
        fail(invalid("policy", "give policy flags, --reset or --history (one of them)"), as_json)
    if history:
        run(as_json, lambda fleets: fleets.policy_history(fleet), _print_history)
        return
    if not changes and not reset:
        run(as_json, lambda fleets: fleets.current_policy(fleet), lambda r: _policy_lines(r, "policy of"))
        return

    def change(fleets: Any) -> dict[str, Any]:
        if reset:
            return fleets.set_policy(fleet, None, actor=actor(by))
        from tracker.core import Policy

        own = fleets.current_policy(fleet)["policy"]
        base = _server_policy() if own is None else Policy.from_data(own)
        return fleets.set_policy(fleet, base.replace(**changes), actor=actor(by))

    run(as_json, change, lambda r: _policy_lines(r, "[green]changed[/]: new sessions of"))


def _print_history(rows: list[dict[str, Any]]) -> None:
    def what(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
        if after is None:
            return "the server's policy"
        if before is None:
            return ", ".join(f"{k}={v}" for k, v in after.items())
        return ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in after.items() if before.get(k) != v) or "no change"

    print_table(
        plural(len(rows), "policy version"),
        ("version", "at", "by", "policy"),
        (
            (str(r["version"]), str(r["at"])[:19], r["actor"], what(rows[i - 1]["policy"] if i else None, r["policy"]))
            for i, r in enumerate(rows)
        ),
    )


@fleet_app.command("list")
def fleet_list(as_json: bool = JSON) -> None:
    """List fleets with their number of active keys."""
    run(
        as_json,
        lambda fleets: fleets.list_fleets(),
        lambda rows: print_table(
            plural(len(rows), "fleet"),
            ("fleet id", "name", "active keys", "created"),
            ((r["fleet_id"], r["name"], str(r["active_keys"]), str(r["created_at"])[:19]) for r in rows),
        ),
    )


OPERATOR = typer.Option(False, "--operator", help="an operator key: signs in to the console, sees every fleet")
KEY_FLEET = typer.Argument(None, help="fleet id or name (none with --operator)", callback=identifier)


def fleet_or_operator(fleet: str | None, operator: bool, what: str, as_json: bool) -> None:
    """Exactly one of a fleet and --operator (else ``InvalidInput`` naming ``fleet``, exit 2)."""
    if operator == (fleet is not None):
        fail(invalid("fleet", f"give a fleet, or --operator for {what} (not both)"), as_json)


@key_app.command("create")
def key_create(fleet: str | None = KEY_FLEET, operator: bool = OPERATOR, as_json: bool = JSON) -> None:
    """Create an API key for a fleet (or, with --operator, a console key for every fleet); the token is shown once."""
    fleet_or_operator(fleet, operator, "an operator key", as_json)
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
def key_list(fleet: str | None = KEY_FLEET, operator: bool = OPERATOR, as_json: bool = JSON) -> None:
    """List a fleet's keys, or with --operator the operator keys (ids and dates; tokens are never stored)."""
    fleet_or_operator(fleet, operator, "the operator keys", as_json)
    run(
        as_json,
        lambda fleets: fleets.list_operator_keys() if operator else fleets.list_keys(fleet),
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
    run(
        as_json,
        lambda fleets: fleets.revoke_key(key_id),
        lambda result: console.print(
            f"[green]revoked[/] key {plain(key_id)}{' (it already was)' if result['already_revoked'] else ''}"
        ),
    )
