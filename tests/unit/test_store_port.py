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


def test_the_head_revision_read_from_the_migration_files_is_alembics(tmp_path, monkeypatch):
    """``head_revision`` reads the migration files' revision lines instead of importing them; it must
    name Alembic's own head, and a file it cannot read that way hands the answer back to Alembic."""
    from tracker.store import migrate

    migrate._heads_from_files.cache_clear()
    assert migrate._heads_from_files() == tuple(migrate._script_directory().get_heads())
    assert migrate.head_revision() == migrate._script_directory().get_heads()[0]
    # a merge revision (a tuple of down revisions) is not read from the file: Alembic answers
    versions = tmp_path / "versions"
    versions.mkdir()
    for path in (migrate.ALEMBIC_DIR / "versions").glob("*.py"):
        (versions / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (versions / "9999_merge.py").write_text('revision = "9999_merge"\ndown_revision = ("a", "b")\n', encoding="utf-8")
    monkeypatch.setattr(migrate, "ALEMBIC_DIR", tmp_path)
    migrate._heads_from_files.cache_clear()
    try:
        assert migrate._heads_from_files() is None
    finally:
        migrate._heads_from_files.cache_clear()
