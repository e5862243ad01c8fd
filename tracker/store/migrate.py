"""Schema migrations (Alembic) and the schema-version check.

The migrations live in ``alembic/`` next to the ``tracker`` package (repository
root, for a checkout or an editable install) and ship inside the wheel as
``tracker/alembic``; Alembic is configured programmatically here, so ``tracker db
upgrade`` needs no ``alembic.ini`` and no paths from the user. A database that
cannot be reached gives ``StoreUnavailable`` (``tracker.store.errors``).

``check_schema(engine)`` is what ``open_store`` runs: the app refuses a database
whose schema is missing or older than the code (``SchemaOutOfDate``, telling the
user to run ``tracker db upgrade``), and one written by newer code it does not know.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from tracker.errors import IntegrityError, SchemaOutOfDate
from tracker.settings import normalize_database_url
from tracker.store.errors import map_db_errors

#: the ``tracker`` package directory (this file is tracker/store/migrate.py)
_PACKAGE = Path(__file__).resolve().parents[1]


def _find_alembic_dir() -> Path:
    """``tracker/alembic`` inside the package (where a built wheel ships the migrations), else
    ``alembic/`` next to the package (a source checkout or an editable install).

    The package's own copy is looked at first: next to an installed package sits
    site-packages, whose ``alembic/`` is the Alembic library itself.
    """
    for candidate in (_PACKAGE / "alembic", _PACKAGE.parent / "alembic"):
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    return _PACKAGE.parent / "alembic"


ALEMBIC_DIR = _find_alembic_dir()
UPGRADE_HINT = "run `tracker db upgrade`"
#: Alembic's table of the applied revision (its default name; alembic/env.py keeps it)
VERSION_TABLE = "alembic_version"
# Alembic's command API keeps global state (alembic.context / alembic.op): one run per
# process at a time. Across processes, env.py serialises upgrades with an advisory lock.
_ALEMBIC_LOCK = threading.RLock()


def alembic_config(url: str | None = None, *, connection: Any = None):
    from alembic.config import Config

    if not (ALEMBIC_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic migrations not found at {ALEMBIC_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(ALEMBIC_DIR))
    if url is not None:
        cfg.attributes["url"] = normalize_database_url(url)  # attributes: no ini '%' interpolation
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@lru_cache(maxsize=1)
def _script_directory():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


_REVISION = re.compile(r'^revision(?:: *[^=\n]+)? *= *"([^"]+)" *$', re.M)
_DOWN_REVISION = re.compile(r'^down_revision(?:: *[^=\n]+)? *= *(?:None|"([^"]+)") *$', re.M)


def migration_module(filename: str) -> ModuleType:
    """The migration ``alembic/versions/<filename>`` as a module of its own (executed afresh, never
    registered in ``sys.modules``): how a later migration reads an earlier one's SQL text, so that
    each function's text has one place."""
    path = ALEMBIC_DIR / "versions" / filename
    spec = importlib.util.spec_from_file_location(f"_ct_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def _heads_from_files() -> tuple[str, ...] | None:
    """The head revision(s), from the migration files' ``revision = "..."`` and ``down_revision = ...``
    lines, without importing them: Alembic imports every migration module to answer, which costs
    each process that checks its schema (every CLI command, ``tracker serve``, each worker) about
    0.2-0.5 s. None when a file does not have exactly one of each line in that form (a merge
    revision's tuple, say): then Alembic answers."""
    revisions, downs = set(), set()
    for path in sorted((ALEMBIC_DIR / "versions").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        rev, down = _REVISION.findall(text), _DOWN_REVISION.findall(text)
        if len(rev) != 1 or len(down) != 1:
            return None
        revisions.add(rev[0])
        if down[0]:
            downs.add(down[0])
    return tuple(sorted(revisions - downs))


def head_revision() -> str:
    heads = _heads_from_files() or tuple(_script_directory().get_heads())
    if len(heads) != 1:
        raise IntegrityError(f"the migrations have {len(heads)} heads {heads}; merge them")
    return heads[0]


def revisions() -> list[str]:
    """All revision ids, oldest first."""
    return [s.revision for s in reversed(list(_script_directory().walk_revisions()))]


def current_revisions(bind: Any) -> tuple[str, ...]:
    """The revision(s) recorded in the database (empty: never migrated). ``bind``: engine, connection or URL.

    Read from Alembic's ``alembic_version`` table with one query (importing Alembic's migration
    runtime to ask it costs a process about 0.3-0.5 s)."""
    from sqlalchemy import create_engine, inspect, pool, text
    from sqlalchemy.engine import Connection, Engine

    def read(conn: Connection) -> tuple[str, ...]:
        if not inspect(conn).has_table(VERSION_TABLE):
            return ()
        return tuple(row[0] for row in conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")))

    if isinstance(bind, Connection):
        return read(bind)
    engine = (
        bind if isinstance(bind, Engine) else create_engine(normalize_database_url(str(bind)), poolclass=pool.NullPool)
    )
    try:
        with map_db_errors("schema check"), engine.connect() as conn:
            return read(conn)
    finally:
        if engine is not bind:
            engine.dispose()


def current_revision(bind: Any) -> str | None:
    revs = current_revisions(bind)
    return revs[0] if revs else None


def upgrade(url: str, revision: str = "head") -> str | None:
    """Apply migrations up to ``revision`` (default: the newest). Idempotent. Returns the new revision."""
    from alembic import command

    with map_db_errors("upgrade"), _ALEMBIC_LOCK:
        command.upgrade(alembic_config(url), revision)
    return current_revision(url)


def downgrade(url: str, revision: str) -> str | None:
    from alembic import command

    with map_db_errors("downgrade"), _ALEMBIC_LOCK:
        command.downgrade(alembic_config(url), revision)
    return current_revision(url)


def check_schema(engine: Any) -> None:
    """Raise SchemaOutOfDate unless the database is at the code's head revision."""
    head = head_revision()
    current = current_revisions(engine)
    if head in current and len(current) == 1:
        return
    if not current:
        raise SchemaOutOfDate(f"the database has no tracker schema; {UPGRADE_HINT}", current=None, head=head)
    known = set(revisions())
    if all(rev in known for rev in current):
        raise SchemaOutOfDate(
            f"the database schema is at revision {', '.join(current)}, older than this code's {head}; {UPGRADE_HINT}",
            current=list(current),
            head=head,
        )
    raise SchemaOutOfDate(
        f"the database schema is at revision {', '.join(current)}, which this version of the tracker does not know "
        f"(written by newer code?); upgrade the tracker package (its head revision is {head})",
        current=list(current),
        head=head,
    )
