"""Schema migrations (Alembic) and the schema-version check.

The migrations live in ``alembic/`` next to the ``tracker`` package (repository
root); Alembic is configured programmatically here, so ``tracker db upgrade``
needs no ``alembic.ini`` and no paths from the user.

``check_schema(engine)`` is what ``open_store`` runs: the app refuses a database
whose schema is missing or older than the code (``SchemaOutOfDate``, telling the
user to run ``tracker db upgrade``), and one written by newer code it does not know.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import tracker
from tracker.errors import IntegrityError, SchemaOutOfDate, StoreUnavailable



def _find_alembic_dir() -> Path:
    """``alembic/`` next to the ``tracker`` package (a source checkout or editable install);
    inside the package as a fallback, should the migrations ever be shipped in the wheel."""
    package = Path(tracker.__file__).resolve().parent
    for candidate in (package.parent / "alembic", package / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    return package.parent / "alembic"


ALEMBIC_DIR = _find_alembic_dir()
UPGRADE_HINT = "run `tracker db upgrade`"
# Alembic's command API keeps global state (alembic.context / alembic.op): one run per
# process at a time. Across processes, env.py serialises upgrades with an advisory lock.
_ALEMBIC_LOCK = threading.RLock()


def normalize_url(url: str) -> str:
    """Accept libpq-style URLs and pick the psycopg 3 driver for PostgreSQL."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def alembic_config(url: str | None = None, *, connection: Any = None):
    from alembic.config import Config

    if not (ALEMBIC_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic migrations not found at {ALEMBIC_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(ALEMBIC_DIR))
    if url is not None:
        cfg.attributes["url"] = normalize_url(url)  # attributes: no ini '%' interpolation
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@lru_cache(maxsize=1)
def _script_directory():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    heads = _script_directory().get_heads()
    if len(heads) != 1:
        raise IntegrityError(f"the migrations have {len(heads)} heads {heads}; merge them")
    return heads[0]


def revisions() -> list[str]:
    """All revision ids, oldest first."""
    return [s.revision for s in reversed(list(_script_directory().walk_revisions()))]


def _is_unavailable(exc: BaseException) -> bool:
    from sqlalchemy import exc as sa_exc

    return isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    )


def current_revisions(bind: Any) -> tuple[str, ...]:
    """The revision(s) recorded in the database (empty: never migrated). ``bind``: engine, connection or URL."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine, pool
    from sqlalchemy.engine import Connection, Engine

    if isinstance(bind, Connection):
        return tuple(MigrationContext.configure(bind).get_current_heads())
    engine = bind if isinstance(bind, Engine) else create_engine(normalize_url(str(bind)), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return tuple(MigrationContext.configure(conn).get_current_heads())
    except Exception as exc:
        if _is_unavailable(exc):
            raise StoreUnavailable(f"cannot reach the database: {exc.__class__.__name__}", cause=str(exc)[:500]) from exc
        raise
    finally:
        if engine is not bind:
            engine.dispose()


def current_revision(bind: Any) -> str | None:
    revs = current_revisions(bind)
    return revs[0] if revs else None


def upgrade(url: str, revision: str = "head") -> str | None:
    """Apply migrations up to ``revision`` (default: the newest). Idempotent. Returns the new revision."""
    from alembic import command

    try:
        with _ALEMBIC_LOCK:
            command.upgrade(alembic_config(url), revision)
    except Exception as exc:
        if _is_unavailable(exc):
            raise StoreUnavailable(f"cannot reach the database: {exc.__class__.__name__}", cause=str(exc)[:500]) from exc
        raise
    return current_revision(url)


def downgrade(url: str, revision: str) -> str | None:
    from alembic import command

    with _ALEMBIC_LOCK:
        command.downgrade(alembic_config(url), revision)
    return current_revision(url)


def check_schema(engine: Any) -> None:
    """Raise SchemaOutOfDate unless the database is at the code's head revision."""
    head = head_revision()
    current = current_revisions(engine)
    if head in current and len(current) == 1:
        return
    if not current:
        raise SchemaOutOfDate(
            f"the database has no tracker schema; {UPGRADE_HINT}", current=None, head=head
        )
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
