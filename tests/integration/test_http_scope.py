"""A fleet's scope over HTTP: the caller (``tracker.http.runtime.Caller``) says the policy its new
sessions start with, and an error about a session shows it as its caller knows it (``error_body``)."""

from __future__ import annotations

from tracker.core.model import SessionScope
from tracker.core.policy import Policy
from tracker.errors import UnknownAttempt
from tracker.http.errors import error_body
from tracker.http.runtime import Caller


def test_a_scope_says_the_policy_its_new_sessions_start_with():
    assert SessionScope().start_policy() is None
    own = Policy(compact_at_bp=7000, rearm_below_bp=5000)
    asked: list[str] = []

    def policies(fleet_id: str) -> Policy | None:
        asked.append(fleet_id)
        return own

    caller = Caller("fabc", policies)
    assert asked == []  # looked up only when a command may start a session
    assert caller.start_policy() == own and asked == ["fabc"]
    assert caller == Caller("fabc") and caller.internal("s") == "fabc:s"


def test_an_error_body_shows_the_session_as_its_caller_knows_it():
    scope = SessionScope("fabc")
    # a session a fleet named like a fleet id: only the field is mapped, once, and the message is left as it is
    stored = scope.internal("fabc:s")
    exc = UnknownAttempt("no open attempt a1 in this session", attempt_id="a1", session_id=stored)
    status, body = error_body(exc, scope)
    assert status == 404 and body["session_id"] == "fabc:s" and body["message"] == exc.message
    assert error_body(exc)[1]["session_id"] == stored  # no scope: as stored
