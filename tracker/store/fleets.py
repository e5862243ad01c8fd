"""Fleets and their API keys (the HTTP API's tenants).

A **fleet** is a group of agents sharing sessions; every session belongs to one
fleet, and is stored as ``"<fleet_id>:<session_id>"`` (``tracker.core.model.SessionScope``;
``fleet_id`` is ``f`` + 9 hex digits, ``FLEET_ID_LEN``). Its API keys are sent as ``Authorization: Bearer <token>``.

Tokens look like ``ctk_<key_id>_<secret>``: ``key_id`` (12 hex characters) is
public and names the key (``tracker key list`` / ``revoke``), ``secret`` is 32
random bytes (``secrets.token_urlsafe``). Only ``SHA-256(token)`` is stored; a
token is checked by looking up its ``key_id`` and comparing the hashes with
``hmac.compare_digest``. A token is shown once, when it is created.

A fleet may have a **policy** of its own (behaviour.md "Per-fleet policy"): new sessions of the
fleet start with it instead of the server's. Every change is a row of ``fleet_policy_events``
(``version``, the complete policy -- NULL for "the server's" --, ``actor``, ``at``), only ever
inserted: the newest version is in force, the rows are its history. A policy is validated by the
core's ``Policy`` before anything is written (``InvalidPolicy`` naming the field).

Tables: ``fleets``, ``api_keys`` and ``fleet_policy_events`` in ``tracker.store.schema``
(migrations ``0002_fleets``, ``0007_fleet_policies``); database errors go through
``tracker.store.errors.map_db_errors``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, insert, select, update

from tracker.core.model import FLEET_ID_LEN, check_text
from tracker.core.policy import Policy
from tracker.errors import FleetExists, InvalidInput, StoreError, UnknownFleet, UnknownKey
from tracker.store.errors import map_db_errors
from tracker.store.schema import api_keys, fleet_policy_events, fleets, operator_keys

__all__ = [
    "KEY_ID_LEN",
    "OPERATOR_TOKEN_PREFIX",
    "TOKEN_PREFIX",
    "FleetStore",
    "hash_token",
]

KEY_ID_LEN = 12
TOKEN_PREFIX = "ctk_"
OPERATOR_TOKEN_PREFIX = "cto_"  # operator keys: the console, every fleet (never the /v1 API)
_FLEET_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
_KEY_ID = re.compile(r"[0-9a-f]{12}")
_TOKEN = re.compile(r"ctk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})")
_OPERATOR_TOKEN = re.compile(r"cto_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


MAX_ACTOR_LEN = 200


def _checked_policy(policy: Policy | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The complete policy as stored (validated by the core's ``Policy``: ``InvalidPolicy`` naming the field)."""
    if policy is None:
        return None
    if not isinstance(policy, Policy):
        if not isinstance(policy, Mapping):
            raise InvalidInput("policy", "must be a policy (an object of policy fields) or null")
        policy = Policy.from_data(policy)
    return policy.to_data()


def _key_row(row: Any, **owner: Any) -> dict[str, Any]:
    """A key's record as listed: its id, whose it is (``owner``), when made and revoked, whether valid."""
    return {
        "key_id": row.key_id,
        **owner,
        "created_at": _iso(row.created_at),
        "revoked_at": _iso(row.revoked_at),
        "active": row.revoked_at is None,
    }


def _policy_row(row: Any, fleet: dict[str, Any]) -> dict[str, Any]:
    return {
        "fleet_id": fleet["fleet_id"],
        "fleet": fleet["name"],
        "version": row.version,
        "policy": row.policy,
        "actor": row.actor,
        "at": _iso(row.at),
    }


def _checked_actor(actor: str | None) -> str:
    """Who makes a policy change (the audit record's ``actor``): 1-200 characters of text."""
    if actor is None or actor == "":
        raise InvalidInput("actor", "is required: who makes the change")
    return check_text("actor", actor, max_len=MAX_ACTOR_LEN)


class FleetStore:
    """Fleets and keys on the event store's database (any SQLAlchemy engine of it).

    ``authenticate`` caches a *valid* key for ``cache_s`` seconds (default 1), so a
    revoked key is refused at most that long after ``revoke_key``; unknown, malformed
    and revoked tokens are never cached and always cost a lookup by primary key.
    ``policy_of`` caches a fleet's policy as long.
    """

    def __init__(self, engine: Any, *, cache_s: float = 1.0) -> None:
        self.engine = engine
        self.cache_s = cache_s
        self._cache: dict[str, tuple[str, float]] = {}  # token hash -> (fleet_id, valid until)
        self._policies: dict[str, tuple[Policy | None, float]] = {}  # fleet_id -> (its policy, valid until)
        self._lock = threading.Lock()

    def _run(self, what: str, fn: Any, write: bool = False) -> Any:
        with map_db_errors(what), self.engine.connect() as conn:
            if not write:
                return fn(conn)
            conn = conn.execution_options(ct_write=True)  # BEGIN IMMEDIATE on SQLite
            with conn.begin():
                return fn(conn)

    # -- fleets ------------------------------------------------------------------------------
    def create_fleet(
        self, name: str, policy: Policy | Mapping[str, Any] | None = None, *, actor: str | None = None
    ) -> dict[str, Any]:
        """A new fleet; with ``policy``, its first policy version (by ``actor``) in the same transaction."""
        if not isinstance(name, str) or not _FLEET_NAME.fullmatch(name):
            raise InvalidInput("name", "must be 1-100 characters of [A-Za-z0-9._-]")
        stored = _checked_policy(policy)
        if stored is not None:
            actor = _checked_actor(actor)
        fleet_id = "f" + secrets.token_hex(5)[: FLEET_ID_LEN - 1]
        now = datetime.now(UTC)

        def do(conn: Any) -> None:
            if conn.execute(select(fleets.c.fleet_id).where(fleets.c.name == name)).first() is not None:
                raise FleetExists(f"a fleet named {name!r} already exists", name=name)
            conn.execute(insert(fleets).values(fleet_id=fleet_id, name=name, created_at=now))
            if stored is not None:
                conn.execute(
                    insert(fleet_policy_events).values(fleet_id=fleet_id, version=1, policy=stored, actor=actor, at=now)
                )

        try:
            self._run("create_fleet", do, write=True)
        except StoreError as exc:
            if isinstance(exc.__cause__, sa_exc.IntegrityError):  # a concurrent create won the unique name
                raise FleetExists(f"a fleet named {name!r} already exists", name=name) from exc
            raise
        return {"fleet_id": fleet_id, "name": name, "created_at": now.isoformat(), "policy": stored}

    def list_fleets(self) -> list[dict[str, Any]]:
        def do(conn: Any) -> list[dict[str, Any]]:
            rows = conn.execute(select(fleets).order_by(fleets.c.created_at, fleets.c.name)).all()
            keys: dict[str, int] = {}
            for fid, revoked in conn.execute(select(api_keys.c.fleet_id, api_keys.c.revoked_at)).all():
                if revoked is None:
                    keys[fid] = keys.get(fid, 0) + 1
            return [
                {
                    "fleet_id": r.fleet_id,
                    "name": r.name,
                    "created_at": _iso(r.created_at),
                    "active_keys": keys.get(r.fleet_id, 0),
                }
                for r in rows
            ]

        return self._run("list_fleets", do)

    def get_fleet(self, fleet: str) -> dict[str, Any]:
        """A fleet by id or by name."""
        if not isinstance(fleet, str) or not fleet or len(fleet) > 100:
            raise InvalidInput("fleet", "must be a fleet id or name")

        def do(conn: Any) -> Any:
            by_id = conn.execute(select(fleets).where(fleets.c.fleet_id == fleet)).first()
            return by_id or conn.execute(select(fleets).where(fleets.c.name == fleet)).first()

        row = self._run("get_fleet", do)
        if row is None:
            raise UnknownFleet(f"no fleet {fleet!r} (by id or name)", fleet=fleet)
        return {"fleet_id": row.fleet_id, "name": row.name, "created_at": _iso(row.created_at)}

    # -- policies ----------------------------------------------------------------------------
    def set_policy(self, fleet: str, policy: Policy | Mapping[str, Any] | None, *, actor: str | None) -> dict[str, Any]:
        """Record the fleet's (id or name) new policy (None: the server's again) as its next version.
        New sessions of the fleet start with it; sessions already started keep theirs."""
        stored = _checked_policy(policy)
        who = _checked_actor(actor)
        f = self.get_fleet(fleet)
        p = fleet_policy_events.c

        def do(conn: Any) -> Any:
            # the fleet's row locked (PostgreSQL; SQLite writes one at a time): its changes take turns
            conn.execute(select(fleets.c.fleet_id).where(fleets.c.fleet_id == f["fleet_id"]).with_for_update())
            last = conn.execute(select(func.max(p.version)).where(p.fleet_id == f["fleet_id"])).scalar()
            version = (last or 0) + 1
            now = datetime.now(UTC)
            conn.execute(
                insert(fleet_policy_events).values(
                    fleet_id=f["fleet_id"], version=version, policy=stored, actor=who, at=now
                )
            )
            return version, now

        version, at = self._run("set_policy", do, write=True)
        with self._lock:
            self._policies.pop(f["fleet_id"], None)
        return {
            "fleet_id": f["fleet_id"],
            "fleet": f["name"],
            "version": version,
            "policy": stored,
            "actor": who,
            "at": at.isoformat(),
        }

    def policy_history(self, fleet: str) -> list[dict[str, Any]]:
        """Every version of the fleet's policy, oldest first (an empty list: it never had one)."""
        f = self.get_fleet(fleet)
        p = fleet_policy_events.c
        stmt = select(fleet_policy_events).where(p.fleet_id == f["fleet_id"]).order_by(p.version)
        return [_policy_row(r, f) for r in self._run("policy_history", lambda conn: conn.execute(stmt).all())]

    def current_policy(self, fleet: str) -> dict[str, Any]:
        """The fleet's policy in force: its newest version (``policy`` None, ``version`` 0: never set)."""
        f = self.get_fleet(fleet)
        row = self._newest_policy(f["fleet_id"])
        if row is None:
            return {
                "fleet_id": f["fleet_id"],
                "fleet": f["name"],
                "version": 0,
                "policy": None,
                "actor": None,
                "at": None,
            }
        return _policy_row(row, f)

    def policy_of(self, fleet_id: str) -> Policy | None:
        """The policy new sessions of ``fleet_id`` start with (None: the server's), cached ``cache_s``
        seconds per process: a change reaches a server's new sessions at most that long after."""
        now = time.monotonic()
        with self._lock:
            hit = self._policies.get(fleet_id)
        if hit is not None and hit[1] > now:
            return hit[0]
        row = self._newest_policy(fleet_id)
        policy = Policy.from_data(row.policy) if row is not None and row.policy is not None else None
        if self.cache_s > 0:
            with self._lock:
                if len(self._policies) > 10_000:
                    self._policies.clear()
                self._policies[fleet_id] = (policy, now + self.cache_s)
        return policy

    def _newest_policy(self, fleet_id: str) -> Any:
        p = fleet_policy_events.c
        stmt = select(fleet_policy_events).where(p.fleet_id == fleet_id).order_by(p.version.desc()).limit(1)
        return self._run("policy", lambda conn: conn.execute(stmt).first())

    # -- keys --------------------------------------------------------------------------------
    def create_key(self, fleet: str) -> tuple[dict[str, Any], str]:
        """A new key for the fleet (id or name): (its record, the token -- shown only now)."""
        f = self.get_fleet(fleet)
        key_id, token, now = self._mint("create_key", api_keys, TOKEN_PREFIX, fleet_id=f["fleet_id"])
        return {
            "key_id": key_id,
            "fleet_id": f["fleet_id"],
            "fleet": f["name"],
            "created_at": now.isoformat(),
            "revoked_at": None,
        }, token

    def _mint(self, what: str, table: Any, prefix: str, **columns: Any) -> tuple[str, str, datetime]:
        """A new key in ``table`` (its hash stored, with ``columns``): (its id, the token, when made)."""
        key_id = secrets.token_hex(KEY_ID_LEN // 2)
        token = f"{prefix}{key_id}_{secrets.token_urlsafe(32)}"
        now = datetime.now(UTC)
        row = dict(key_id=key_id, token_hash=hash_token(token), created_at=now, **columns)
        self._run(what, lambda conn: conn.execute(insert(table).values(**row)), write=True)
        return key_id, token, now

    def list_keys(self, fleet: str) -> list[dict[str, Any]]:
        f = self.get_fleet(fleet)
        k = api_keys.c
        stmt = (
            select(k.key_id, k.created_at, k.revoked_at)
            .where(k.fleet_id == f["fleet_id"])
            .order_by(k.created_at, k.key_id)
        )
        rows = self._run("list_keys", lambda conn: conn.execute(stmt).all())
        return [_key_row(r, fleet_id=f["fleet_id"], fleet=f["name"]) for r in rows]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            raise InvalidInput("key_id", f"must be {KEY_ID_LEN} hex characters (see `tracker key list FLEET`)")
        k = api_keys.c
        if (
            self._run("revoke_key", lambda conn: conn.execute(select(k.key_id).where(k.key_id == key_id)).first())
            is None
        ):
            return self.revoke_operator_key(key_id)
        row, revoked_at, already = self._revoke("revoke_key", api_keys, key_id)
        with self._lock:
            self._cache.clear()
        return {"key_id": key_id, "fleet_id": row.fleet_id, "revoked_at": _iso(revoked_at), "already_revoked": already}

    def _revoke(self, what: str, table: Any, key_id: str) -> tuple[Any, datetime, bool]:
        """Revoke the key ``key_id`` of ``table`` unless it already is: (its row, when revoked, whether it already was)."""
        now = datetime.now(UTC)
        k = table.c

        def do(conn: Any) -> Any:
            row = conn.execute(select(table).where(k.key_id == key_id)).first()
            if row is None:
                raise UnknownKey(f"no key {key_id}", key_id=key_id)
            if row.revoked_at is None:
                conn.execute(update(table).where(k.key_id == key_id).values(revoked_at=now))
                return row, now, False
            return row, row.revoked_at, True

        return self._run(what, do, write=True)

    def cached(self, token: str | None) -> str | None:
        """The fleet of a token validated less than ``cache_s`` ago, without any I/O (else None)."""
        if not token or len(token) > 200:
            return None
        digest = hash_token(token)
        with self._lock:
            hit = self._cache.get(digest)
        return hit[0] if hit is not None and hit[1] > time.monotonic() else None

    def authenticate(self, token: str | None) -> str | None:
        """The fleet id a token belongs to, or None (malformed, unknown, revoked)."""
        if not token or len(token) > 200:
            return None
        m = _TOKEN.fullmatch(token)
        if m is None:
            return None
        digest = hash_token(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        k = api_keys.c
        stmt = select(k.fleet_id, k.token_hash, k.revoked_at).where(k.key_id == m.group(1))
        row = self._run("authenticate", lambda conn: conn.execute(stmt).first())
        if row is None or row.revoked_at is not None or not hmac.compare_digest(row.token_hash, digest):
            with self._lock:
                self._cache.pop(digest, None)
            return None
        if self.cache_s > 0:
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[digest] = (row.fleet_id, now + self.cache_s)
        return row.fleet_id

    # -- operator keys (the console: every fleet) --------------------------------------------
    def create_operator_key(self) -> tuple[dict[str, Any], str]:
        """A new operator key: (its record, the token -- shown only now). It signs in to the console
        and sees every fleet; the ``/v1`` API never accepts it."""
        key_id, token, now = self._mint("create_operator_key", operator_keys, OPERATOR_TOKEN_PREFIX)
        return {"key_id": key_id, "operator": True, "created_at": now.isoformat(), "revoked_at": None}, token

    def list_operator_keys(self) -> list[dict[str, Any]]:
        k = operator_keys.c
        stmt = select(k.key_id, k.created_at, k.revoked_at).order_by(k.created_at, k.key_id)
        rows = self._run("list_operator_keys", lambda conn: conn.execute(stmt).all())
        return [_key_row(r, operator=True) for r in rows]

    def revoke_operator_key(self, key_id: str) -> dict[str, Any]:
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            raise InvalidInput("key_id", f"must be {KEY_ID_LEN} hex characters (see `tracker key list --operator`)")
        _, revoked_at, already = self._revoke("revoke_operator_key", operator_keys, key_id)
        return {"key_id": key_id, "operator": True, "revoked_at": _iso(revoked_at), "already_revoked": already}

    def console_identity(self, token: str | None) -> tuple[str, str | None, str] | None:
        """Who a key signs in to the console as: ``("fleet", fleet_id, key_id)`` for a valid fleet key,
        ``("operator", None, key_id)`` for a valid operator key, None otherwise (never cached)."""
        if not token or len(token) > 200:
            return None
        m = _OPERATOR_TOKEN.fullmatch(token)
        if m is None:
            m = _TOKEN.fullmatch(token)
            if m is None:
                return None
            found = self.key_secret("fleet", m.group(1))
        else:
            found = self.key_secret("operator", m.group(1))
        if found is None or not hmac.compare_digest(found[0], hash_token(token)):
            return None
        return ("fleet" if token.startswith(TOKEN_PREFIX) else "operator", found[1], m.group(1))

    def key_secret(self, kind: str, key_id: str) -> tuple[str, str | None] | None:
        """``(token_hash, fleet_id)`` of a valid (unrevoked) fleet or operator key, else None. The console
        signs its cookies with the hash, so revoking the key ends every console sign-in made with it."""
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            return None
        if kind == "operator":
            o = operator_keys.c
            stmt = select(o.token_hash, o.revoked_at).where(o.key_id == key_id)
            row = self._run("key_secret", lambda conn: conn.execute(stmt).first())
            return (row.token_hash, None) if row is not None and row.revoked_at is None else None
        if kind == "fleet":
            k = api_keys.c
            stmt2 = select(k.token_hash, k.revoked_at, k.fleet_id).where(k.key_id == key_id)
            row = self._run("key_secret", lambda conn: conn.execute(stmt2).first())
            return (row.token_hash, row.fleet_id) if row is not None and row.revoked_at is None else None
        return None
