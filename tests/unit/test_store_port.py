"""The store's port and the session scope, read in-process: the ``EventStore`` port is narrow, the store
modules are small, no caller reaches for a store's engine, and the API's caller is a ``SessionScope``."""

from __future__ import annotations

import pytest

from tracker.core.model import FLEET_ID_LEN, MAX_SESSION_ID_LEN, SessionScope
from tracker.errors import InvalidSessionId
from tracker.http.runtime import Caller
from tracker.http.schemas import MAX_SESSION_ID
from tracker.store import MemoryEventStore
from tracker.store import sql as store_sql


def test_the_port_is_narrow_and_the_store_modules_are_small():
    """The EventStore port has at most ten methods and no engine; no store module passes 600 lines."""
    import ast
    from pathlib import Path

    import tracker.store as pkg
    from tracker.store.base import EventStore, SessionViews

    methods = [n for n in vars(EventStore) if not n.startswith("_")]
    assert len(methods) <= 10 and "engine" not in methods, methods
    assert {"list_sessions", "session_summary", "count_by_type", "read_types"} <= set(vars(SessionViews))
    for path in Path(pkg.__file__).parent.glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 600, path.name
    for impl in (MemoryEventStore, store_sql.SqlEventStore):
        assert set(methods) <= set(dir(impl)), impl
    # no caller reaches for a store's engine (the composition root builds views and fleets on it)
    root = Path(pkg.__file__).parents[1]
    for path in root.rglob("*.py"):
        if path.parent.name == "store" or path.name == "bootstrap.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                owner = getattr(node.value, "attr", getattr(node.value, "id", ""))
                assert owner != "store", f"{path}: store.engine"


def test_the_api_caller_is_the_session_scope():
    caller = Caller("f" + "0" * (FLEET_ID_LEN - 1))
    assert isinstance(caller, SessionScope)
    assert caller.max_len == MAX_SESSION_ID == MAX_SESSION_ID_LEN - FLEET_ID_LEN - 1 == 189
    assert caller.internal("s-1") == "f000000000:s-1" and caller.external("f000000000:s-1") == "s-1"
    assert caller.internal("x" * 189) == "f000000000:" + "x" * 189
    with pytest.raises(InvalidSessionId, match="at most 189"):
        caller.internal("x" * 190)
