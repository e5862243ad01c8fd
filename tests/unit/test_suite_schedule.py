"""The suite's own schedule (tests/conftest.py, from tests/support/schedule.py): the modules that run beside the races without the
``pg`` lock really never reach the PostgreSQL server."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.schedule import ALONE_MODULES, NO_POSTGRES_MODULES, SERIAL_MODULES

ROOT = Path(__file__).resolve().parents[2]
# what a module that reaches the server says: its fixtures, helpers, URLs or marker
REACHES_POSTGRES = re.compile(
    r"pg_url|db_url|postgres|api_server|scratch_database|create_pg_database|TRACKER_TEST_PG|PG_URL|5432"
)


def _source(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")


def test_the_modules_without_the_pg_lock_never_name_postgres():
    for module in sorted(NO_POSTGRES_MODULES):
        found = REACHES_POSTGRES.search(_source(module))
        assert found is None, (
            f"{module} says {found.group(0)!r}: it needs the pg lock (drop it from NO_POSTGRES_MODULES)"
        )


def test_the_alone_modules_are_serial_and_every_listed_module_exists():
    assert SERIAL_MODULES | {"tests.e2e.test_topology_balancer"} >= ALONE_MODULES
    for module in NO_POSTGRES_MODULES | SERIAL_MODULES | ALONE_MODULES:
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
