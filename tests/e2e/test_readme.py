"""The README works as written: its tour and its Python example, and the HTTP walkthrough of
docs/http-api.md, run as a newcomer runs them — in an empty folder, on the embedded default, with a private data directory
(``XDG_DATA_HOME``/``HOME`` point into the test's folder, no ``TRACKER_*`` inherited).

The blocks are read out of README.md and docs/http-api.md, so an edit that breaks a command fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
HTTP_API = (ROOT / "docs" / "http-api.md").read_text(encoding="utf-8")
TRACKER = shutil.which("tracker")

pytestmark = pytest.mark.skipif(TRACKER is None, reason="the `tracker` console script is not installed")


def section(title: str, doc: str = README) -> str:
    """The text of ``doc`` (the README unless given) from the heading ``title`` to the next heading
    of the same level, or to its end."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", doc, re.S | re.M)
    assert m, f"no section {title!r}"
    return m.group(1)


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def newcomer_env(home: Path) -> dict[str, str]:
    """A user's environment with nothing configured: no TRACKER_*, a home and data directory of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    (home / "home").mkdir(exist_ok=True)
    env.update(HOME=str(home / "home"), XDG_DATA_HOME=str(home / "data"), PYTHONDONTWRITEBYTECODE="1")
    return env


def run_lines(lines: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> list[str]:
    """Each line on its own ``bash -o pipefail -c``; fails on the first that exits non-zero."""
    outputs = []
    for line in lines:
        out = subprocess.run(
            ["bash", "-o", "pipefail", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, f"README line exited {out.returncode}:\n{line}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    return outputs


def command_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_two_commands_at_the_top_install_and_run_the_demo():
    top = blocks(README.split("## ", 1)[0], "bash")[0]
    assert "pip install -e '.[test]' && tracker demo" in top and "python3 -m pytest -q" in top


@pytest.mark.slow
def test_the_tour_runs_in_order_in_an_empty_folder(tmp_path):
    folder, other = tmp_path / "empty", tmp_path / "elsewhere"
    folder.mkdir()
    other.mkdir()
    env = newcomer_env(tmp_path)
    (tour,) = blocks(section("A short tour"), "bash")
    lines = command_lines(tour)
    assert len(lines) >= 10 and all(line.split()[0] in ("tracker", "echo") for line in lines), lines
    outputs = run_lines(lines, folder, env)

    # the embedded default lives in the user's data directory, and says so
    info = json.loads(run_lines(["tracker info --json"], other, env)[0])
    db = tmp_path / "data" / "context-tracker" / "tracker.db"
    assert info["database"] == {"url": f"sqlite:///{db}", "file": str(db), "exists": True}
    assert not (folder / ".tracker").exists()
    assert str(db) in outputs[0]  # `tracker info`, the tour's first line
    # ... so another folder sees the same sessions
    sessions = json.loads(run_lines(["tracker sessions --json"], other, env)[0])
    assert [s["session_id"] for s in sessions] == ["s1"]
    assert (folder / "replay.html").is_file()


def test_the_python_example_runs_in_an_empty_folder(tmp_path):
    (example,) = blocks(section("A short tour"), "python")
    assert "request = {" in example and "def my_compactor" in example
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    env = newcomer_env(tmp_path)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("compact "), out.stdout  # the example's request is over the compact level
    history = run_lines(["tracker history session-42 --json"], tmp_path, env)[0]
    types = [json.loads(line)["type"] for line in history.splitlines()]
    assert types == ["SessionStarted", "ContextMeasured", "CompactionStarted", "CompactionCommitted"]


def test_the_library_says_run_db_upgrade_on_an_unmigrated_database(tmp_path):
    """An existing database without the schema: the CLI's words, not a driver traceback (and nothing migrated)."""
    import sqlite3

    from tracker import Tracker
    from tracker.errors import SchemaOutOfDate
    from tracker.settings import Settings

    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    with pytest.raises(SchemaOutOfDate, match=r"run `tracker db upgrade`"):
        Tracker.from_settings(Settings.of(database_url=f"sqlite:///{empty}"))
    with sqlite3.connect(empty) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


@pytest.mark.postgres
def test_postgres_is_never_migrated_implicitly(pg_url):
    from sqlalchemy import create_engine, inspect

    from tracker import Tracker
    from tracker.errors import SchemaOutOfDate
    from tracker.settings import Settings

    with pytest.raises(SchemaOutOfDate, match=r"run `tracker db upgrade`"):
        Tracker.from_settings(Settings.of(database_url=pg_url))
    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_first_use_from_several_processes_makes_one_database(tmp_path):
    """The embedded default is created on first use; processes starting together all get the same, whole one."""
    code = (
        "import sys\nfrom tracker import Tracker\nfrom tracker.settings import Settings\n"
        "with Tracker.from_settings(Settings.of(database_url=sys.argv[1])) as t:\n"
        "    t.observe(sys.argv[2], measurement={'basis': 'm1', 'input_tokens': 10, 'input_limit': 100,"
        " 'quality': 'exact_local', 'model': {'provider': 'x', 'name': 'y'}, 'fingerprint': 'f' * 64})\n"
    )
    url = f"sqlite:///{tmp_path / 'nested' / 'dir' / 't.db'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, f"p{i}"], stderr=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    from tracker import Tracker, queries
    from tracker.bootstrap import build_views
    from tracker.settings import Settings

    with Tracker.from_settings(Settings.of(database_url=url)) as t:
        listed = sorted(s["session_id"] for s in queries.list_sessions(build_views(t.store)))
    assert listed == ["p0", "p1", "p2", "p3"]
    assert sorted(p.name for p in (tmp_path / "nested" / "dir").iterdir() if not p.name.startswith("t.db-")) == ["t.db"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_http_walkthrough_pastes_line_by_line(tmp_path):
    """docs/http-api.md's walkthrough, its bash block as one bash session (shell variables carry from line to line),
    against a real ``tracker serve``; curl fails on any HTTP error status."""
    (walk,) = [b for b in blocks(section("Walkthrough", HTTP_API), "bash") if "tracker serve" in b]
    port = _free_port()
    body = walk.replace("8080", str(port))
    assert "9f…" not in body and "$T" in body and "$A" in body
    script = tmp_path / "walkthrough.sh"
    script.write_text(
        "set -euo pipefail\n"
        # an HTTP error status fails the line (the readiness loop's own -f excepted: the two options clash)
        'curl() { case " $* " in *" -sf "*) command curl "$@" ;; *) command curl --fail-with-body "$@" ;; esac; }\n'
        + body,
        encoding="utf-8",
    )
    env = newcomer_env(tmp_path)
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, 15)  # the server, if the script stopped before `kill %1`
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert answers[0]["action"] == "compact" and answers[0]["attempt"]["fencing_token"] == 1
    assert any(a.get("outcome") == "committed" for a in answers)
    final = [a for a in answers if "recent_outcomes" in a][-1]  # the session's state, after the reject
    assert [outcome for _, outcome in final["recent_outcomes"]] == ["committed", "rejected:execution_failed"]
    assert final["revision"] == 2 and final["open_attempts"] == []


def test_models_doc_example_loads_and_states_its_limits():
    from tracker.core import Policy
    from tracker.counting.registry import ModelRegistry
    from tracker.errors import ContextLimitUnknown

    doc = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    (example,) = blocks(doc, "json")
    registry = ModelRegistry.load(json.loads(example))
    assert registry.input_limit("acme-coder", Policy()) == 20480 and "20480" in doc
    assert registry.input_limit("local-llama-128k", Policy()) == 91808 and "91808" in doc
    assert registry.get("gpt-4o").window == 64000 and "gemini-2.5-flash-lite" not in registry
    with pytest.raises(ContextLimitUnknown) as info:
        registry.get("no-such-model")
    assert "TRACKER_MODELS_FILE" in info.value.message and "docs/models.md" in info.value.message


def test_the_api_serves_no_cdn_docs_page_but_its_openapi_document(tmp_path):
    from fastapi.testclient import TestClient

    from tracker.http.app import create_app
    from tracker.settings import Settings

    app = create_app(settings=Settings.of(database_url=f"sqlite:///{tmp_path / 't.db'}"))
    with TestClient(app) as client:
        assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
        assert client.get("/openapi.json").json()["info"]["title"] == "Context Tracker"
