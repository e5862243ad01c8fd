"""``tracker serve`` for the tests: a scratch PostgreSQL database at head, fleets and keys, the server.

    with api_server(fleets=("alpha", "beta"), TRACKER_ATTEMPT_LEASE_S="3600") as server:
        server.url, server.token_a, server.fleet_b["fleet_id"], server.env, server.db_url
        with server.client(server.token_a) as c:
            c.post(...)

Keyword arguments in capitals are ``TRACKER_*`` settings of the server. The server's environment is
this process's (or, with ``clean=True``, only what is given) with the scratch database, Redis at
``TRACKER_TEST_REDIS`` (unless ``redis=False``) and never a broker. Fleets are made through the store
(``via_cli=True``: with the real ``tracker fleet create`` / ``key create`` commands, the first key by
fleet name and the others by fleet id). ``seed(db_url, fleets)`` runs before the server starts.

The calls the API tests make: ``observe(client, session, basis, tokens)`` (status 200 unless
given), ``history``, ``assert_error(response, status, code, field)``, ``metric_values`` / ``metric``
(``/metrics`` parsed), ``max_position(db_url)``, and ``run_cli`` / ``cli_json`` (the real CLI).

A module that asks for the plugin's ``server`` fixture gets ``api_server(**API_SERVER)`` with the
module's own ``API_SERVER`` settings (tests/support/plugin.py), and ``a`` / ``b``: a client per fleet.

``settled_feed(client, done)`` reads a fleet's ``/v1/events`` until ``done(events)`` holds
(``tests.support.db.settled``: a read right after a write may not show it yet).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.bench import free_port, start_server, stop_server
from tests.support.cli import Cli, clean_env
from tests.support.db import REDIS_URL, scratch_database, settled
from tests.support.measurements import measure


@dataclass
class ApiServer:
    url: str
    db_url: str
    env: dict[str, str]
    proc: Any
    fleets: list[dict[str, Any]]  # the fleets' records (fleet_id, name, created_at), in the order asked for
    tokens: list[str]  # one key's token per fleet, in the same order
    operator: tuple[dict[str, Any], str] | None = None  # (record, token) of an operator key, when asked for
    log: Path | None = None
    _engine: Any = field(default=None, repr=False)

    @property
    def fleet_a(self) -> dict[str, Any]:
        return self.fleets[0]

    @property
    def fleet_b(self) -> dict[str, Any]:
        return self.fleets[1]

    @property
    def token_a(self) -> str:
        return self.tokens[0]

    @property
    def token_b(self) -> str:
        return self.tokens[1]

    @property
    def engine(self) -> Any:
        """An engine on the server's database (made on first use, disposed with the server)."""
        if self._engine is None:
            from tracker.store import make_engine

            self._engine = make_engine(self.db_url)
        return self._engine

    def client(self, token: str | None = None, timeout: float = 30) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def _make_fleets(env: dict[str, str], db_url: str, names: Sequence[str], via_cli: bool) -> tuple[list, list]:
    records: list[dict[str, Any]] = []
    tokens: list[str] = []
    if via_cli:
        cli = Cli(env)
        for i, name in enumerate(names):
            fleet = cli.json("fleet", "create", name, "--json")
            key = cli.json("key", "create", fleet["name"] if i == 0 else fleet["fleet_id"], "--json")
            records.append(fleet)
            tokens.append(key["token"])
        return records, tokens
    from tracker.store import make_engine
    from tracker.store.fleets import FleetStore

    engine = make_engine(db_url)
    try:
        fleets = FleetStore(engine)
        for name in names:
            fleet = fleets.create_fleet(name)
            records.append(fleet)
            tokens.append(fleets.create_key(fleet["fleet_id"])[1])
    finally:
        engine.dispose()
    return records, tokens


def _operator_key(db_url: str) -> tuple[dict[str, Any], str]:
    from tracker.store import make_engine
    from tracker.store.fleets import FleetStore

    engine = make_engine(db_url)
    try:
        return FleetStore(engine).create_operator_key()
    finally:
        engine.dispose()


@contextmanager
def api_server(
    *,
    fleets: Sequence[str] = ("alpha", "beta"),
    redis: bool = True,
    via_cli: bool = False,
    operator_key: bool = False,
    seed: Callable[[str, list[dict[str, Any]]], None] | None = None,
    clean: bool = False,
    log: Path | None = None,
    prefix: str = "ct",
    extra_args: Sequence[str] = (),
    admin_url: str | None = None,
    **settings: str,
) -> Iterator[ApiServer]:
    """A ``tracker serve`` subprocess on a free loopback port over a fresh, upgraded database (on the
    shared server, or on the one at ``admin_url``: a private cluster's)."""
    with scratch_database(prefix, upgrade=True, admin_url=admin_url) as db_url:
        env = clean_env() if clean else dict(os.environ)
        env.pop("TRACKER_BROKER_URL", None)
        env.pop("TRACKER_REDIS_URL", None)
        env["TRACKER_DATABASE_URL"] = db_url
        if redis:
            env["TRACKER_REDIS_URL"] = REDIS_URL
        env.update(settings)
        records, tokens = _make_fleets(env, db_url, fleets, via_cli)
        operator = _operator_key(db_url) if operator_key else None
        if seed is not None:
            seed(db_url, records)
        port = free_port()
        log_file = log.open("w") if log is not None else None
        server = None
        try:
            proc = start_server(env, port, *extra_args, log_file=log_file)
            server = ApiServer(f"http://127.0.0.1:{port}", db_url, env, proc, records, tokens, operator, log)
            yield server
        finally:
            if server is not None:
                stop_server(server.proc, grace_s=15)
                if server._engine is not None:
                    server._engine.dispose()
            if log_file is not None:
                log_file.close()


def settled_feed(
    client: httpx.Client,
    done: Callable[[list[dict[str, Any]]], bool],
    *,
    timeout_s: float = 30.0,
    **params: Any,
) -> list[dict[str, Any]]:
    """``GET /v1/events`` (``limit=1000`` unless given) until ``done(events)`` (see :func:`settled`)."""
    params.setdefault("limit", 1000)

    def read() -> list[dict[str, Any]]:
        r = client.get("/v1/events", params=params)
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()["events"]
        return events

    return settled(read, done, timeout_s=timeout_s)


def observe(c: httpx.Client, session: str, basis: str, tokens: int, status: int = 200, **extra: Any) -> dict[str, Any]:
    r = c.post(f"/v1/sessions/{session}/observe", json=measure(basis, tokens, **extra))
    assert r.status_code == status, r.text
    return r.json()


def history(c: httpx.Client, session: str) -> list[dict[str, Any]]:
    r = c.get(f"/v1/sessions/{session}/history", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return r.json()["events"]


def assert_error(r: httpx.Response, status: int, code: str, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    assert {"code", "error", "message"} <= set(body)
    if field is not None:
        assert body["field"] == field, body
    return body


def max_position(db_url: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT coalesce(max(position), 0) FROM events")).scalar_one())
    finally:
        engine.dispose()


def metric_values(c: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def run_cli(env: dict[str, str], *args: str, ok: bool = True) -> Any:
    return Cli(env, timeout=120).run(*args, ok=True if ok else None)


def cli_json(env: dict[str, str], *args: str) -> Any:
    return json.loads(run_cli(env, *args, "--json").stdout)
