"""End to end: the installed ``tracker verify`` catches an event edited or reordered in place.

A real database (SQLite file, then PostgreSQL) written by real ``tracker observe`` runs; the log is
then tampered with by raw SQL, and ``tracker verify`` (its own process) exits 1 naming the session,
the version and what happened -- and 0 again once the row is put back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.support.cli import Cli, clean_env
from tracker.settings import normalize_database_url

pytestmark = pytest.mark.skipif(shutil.which("tracker") is None, reason="the `tracker` console script is not installed")


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 't.db'}"
    return request.getfixturevalue("pg_url")


def _sql(url: str, sql: str, **params: Any) -> Any:
    engine = create_engine(normalize_database_url(url))
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql), params)
            return result.all() if result.returns_rows else None
    finally:
        engine.dispose()


def _data(url: str, version: int) -> dict[str, Any]:
    (raw,) = _sql(url, "SELECT data FROM events WHERE session_id = 's1' AND version = :v", v=version)[0]
    return json.loads(raw) if isinstance(raw, str) else raw


def _put_data(url: str, version: int, data: dict[str, Any]) -> None:
    value = "CAST(:d AS jsonb)" if url.startswith("postgresql") else ":d"
    _sql(
        url, f"UPDATE events SET data = {value} WHERE session_id = 's1' AND version = :v", d=json.dumps(data), v=version
    )


def _swap(url: str, a: int, b: int) -> None:
    for frm, to in ((a, 1_000_000), (b, a), (1_000_000, b)):
        _sql(url, "UPDATE events SET version = :to WHERE session_id = 's1' AND version = :frm", to=to, frm=frm)


def test_tracker_verify_names_an_edited_and_a_reordered_event(url, tmp_path: Path):
    cli = Cli(clean_env(PYTHONDONTWRITEBYTECODE="1", TRACKER_DATABASE_URL=url), tmp_path, script=True)
    cli.run("db", "upgrade")
    for i in (1, 2, 3):
        cli.run("observe", "s1", "--basis", f"m{i}", "--input-tokens", 10 * i, "--input-limit", 100)
    ok = cli.json("verify", "--json")
    assert ok["ok"] is True and ok["broken"] == [] and (ok["chains"], ok["events"]) == (1, 4)
    assert "1 hash chain of 4 events intact" in cli.run("verify").stdout

    # an edit in place: one measurement's timestamp moved by a second
    original = _data(url, 3)
    _put_data(url, 3, {**original, "at": original["at"] + 1})
    out = cli.run("verify", "--json", ok=False)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["ok"] is False
    assert [(b["session_id"], b["version"], b["what"]) for b in report["broken"]] == [("s1", 3, "edited")]
    human = cli.run("verify", ok=False)
    assert human.returncode == 1
    assert "broken chain" in human.stderr and "session s1 version 3: edited" in human.stderr

    _put_data(url, 3, original)  # put back: the chain is whole again
    assert cli.json("verify", "--json")["ok"] is True

    # a reorder in place: the last two measurements trade versions
    _swap(url, 3, 4)
    out = cli.run("verify", "--json", ok=False)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert [(b["session_id"], b["version"], b["what"]) for b in report["broken"]] == [("s1", 3, "reordered")]
    assert "session s1 version 3: reordered" in cli.run("verify", ok=False).stderr
