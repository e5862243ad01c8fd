"""Who is looking: sign-in with a key, the signed cookie, and the signed-in viewer.

A fleet key (``ctk_…``: that fleet's sessions) or an operator key (``cto_…``: every fleet) is POSTed
once; the answer is a cookie ``tracker_console`` (HttpOnly, SameSite=Strict, path ``/console``)
holding ``KIND.KEY_ID.EXPIRES.SIG`` where SIG is an HMAC keyed by the key's stored SHA-256, so the
key itself is never in a URL, a cookie or a log, every server process can check the cookie, and
revoking the key ends the sign-in. ``tracker console`` adds a one-time ticket (:class:`LocalSignIn`)
that signs in as the local operator with a secret of that process.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tracker.core.model import SessionScope
from tracker.errors import TrackerError

PREFIX = "/console"  # the console's routes, and the path its cookie is sent on
COOKIE = "tracker_console"
COOKIE_TTL_S = 12 * 3600
MAX_COOKIE_LEN = 300


@dataclass(frozen=True)
class Viewer:
    """A signed-in reader: a fleet (sees its sessions, ids without the fleet prefix) or an operator.

    Ids go in and out through the viewer's :class:`~tracker.core.model.SessionScope`, the one
    implementation of fleet-qualified ids (and of their length limit) the API uses too."""

    kind: str  # fleet | operator | local
    key_id: str
    scope: SessionScope = SessionScope()
    fleet_name: str | None = None

    @property
    def fleet_id(self) -> str | None:
        return self.scope.fleet_id

    def internal(self, session_id: str) -> str:
        """The stored id of a session id as the viewer names it (``InvalidSessionId`` if it cannot be one)."""
        return self.scope.internal(session_id)

    def external(self, stored: str) -> str:
        """The id the viewer knows a stored session by."""
        return self.scope.external(stored)

    @property
    def label(self) -> str:
        if self.kind == "fleet":
            return f"fleet {self.fleet_name or self.fleet_id}"
        return "operator (every fleet)" if self.kind == "operator" else "local operator (every fleet)"


@dataclass
class LocalSignIn:
    """``tracker console``'s one-time ticket and the secret its cookies are signed with (this process only)."""

    ticket: str | None = field(default_factory=lambda: secrets.token_urlsafe(24))
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def redeem(self, ticket: str) -> bool:
        with self.lock:
            ok = self.ticket is not None and hmac.compare_digest(self.ticket, ticket)
            if ok:
                self.ticket = None
            return ok


def _sign(secret: bytes, payload: str) -> str:
    return hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()


def cookie_value(kind: str, key_id: str, secret: bytes) -> str:
    """A signed cookie for ``kind.key_id`` that expires in ``COOKIE_TTL_S``."""
    payload = f"{kind}.{key_id}.{int(time.time()) + COOKIE_TTL_S}"
    return f"{payload}.{_sign(secret, payload)}"


def local_sign_in(request: Request) -> LocalSignIn | None:
    """The ticket of ``tracker console`` (None when the app was not started by it)."""
    return getattr(request.app.state, "console_local", None)


@dataclass(frozen=True)
class SignIn:
    """The outcome of signing in with a key: the cookie to set, or what to tell the person."""

    cookie: str | None = None
    error: str | None = None


def sign_in_with_key(fleets: Any, token: str) -> SignIn:
    """Check a fleet or operator key against the fleet store (blocking: call it off the event loop).
    A ``TrackerError`` of the store (e.g. unavailable) is raised."""
    who = fleets.console_identity(token)
    if who is None:
        return SignIn(error="That key is malformed, unknown or revoked.")
    kind, _, key_id = who
    found = fleets.key_secret(kind, key_id)
    if found is None:  # revoked in between
        return SignIn(error="That key was revoked.")
    return SignIn(cookie=cookie_value(kind, key_id, found[0].encode()))


def viewer_of(request: Request) -> Viewer | None:
    """The signed-in viewer from the cookie (checked against the key's current record), else None."""
    raw = request.cookies.get(COOKIE)
    if not raw or len(raw) > MAX_COOKIE_LEN:
        return None
    parts = raw.split(".")
    if len(parts) != 4 or not parts[2].isdigit() or int(parts[2]) < time.time():
        return None
    kind, key_id, _, sig = parts
    payload = ".".join(parts[:3])
    if kind == "local":
        local = local_sign_in(request)
        if local is None or not hmac.compare_digest(_sign(local.secret, payload), sig):
            return None
        return Viewer("local", key_id)
    if kind not in ("fleet", "operator"):
        return None
    fleets = request.app.state.runtime.fleets()
    found = fleets.key_secret(kind, key_id)
    if found is None or not hmac.compare_digest(_sign(found[0].encode(), payload), sig):
        return None
    name = None
    if found[1] is not None:
        try:
            name = fleets.get_fleet(found[1])["name"]
        except TrackerError:
            name = None
    return Viewer(kind, key_id, scope=SessionScope(found[1]), fleet_name=name)


def set_cookie(request: Request, response: Response, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        max_age=COOKIE_TTL_S,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
