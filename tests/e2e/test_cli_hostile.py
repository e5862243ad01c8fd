"""Hostile input at the command line (issue 11, findings 8-10): ``python -m tracker.cli`` in
subprocesses, on a SQLite database in a private folder.

* Recorded strings that an old or foreign writer put in the log (escape sequences, lone surrogates,
  Rich markup in a model name or a reject reason) reach the terminal escaped: ``\\x1b`` is shown,
  never sent; markup is shown as typed. So are paths and what-if ops.
* Identifiers with control characters are refused at the door, naming the option.
* Bad values are one-line typed errors naming the option (exit 2, JSON with ``--json``), never a
  traceback: durations and integers beyond any range, ``--html`` into a missing folder or onto a
  folder, a request file nested too deeply.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import Cli as HarnessCli
from tests.support.cli import clean_env

ESC = "\x1b"
HOSTILE_MODEL = f"{ESC}]0;pwned{ESC}\\{ESC}[31mred{ESC}[0m [bold]m[/] :smile:"
# SURROGATE becomes a lone surrogate (\ud800) in the stored JSON text: the store itself refuses to
# write one, a foreign writer may have
HOSTILE_REASON = f"{ESC}[2J{ESC}[Hcleared\r\x07 SURROGATE [/] [link=x]y[/link]"


class Cli(HarnessCli):
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.url = f"sqlite:///{tmp_path / 'tracker.db'}"
        env = clean_env(
            TRACKER_DATABASE_URL=self.url,
            XDG_DATA_HOME=str(tmp_path / "xdg"),
            HOME=str(tmp_path),
            COLUMNS="200",
            PYTHONDONTWRITEBYTECODE="1",
        )
        super().__init__(env, tmp_path, text=False, timeout=120)

    def run(self, *args: Any, **kw: Any) -> subprocess.CompletedProcess[bytes]:  # type: ignore[override]
        return super().run(*args, ok=None, **kw)

    def ok(self, *args: Any) -> str:
        out = self.run(*args)
        assert out.returncode == 0, (args, out.stderr.decode(errors="replace"))
        assert b"Traceback" not in out.stderr
        return out.stdout.decode()


def refused(cli: Cli, *args: Any, names: str) -> str:
    """The command exits 2 with one line on stderr naming ``names`` (and as JSON with --json)."""
    out = cli.run(*args)
    err = out.stderr.decode(errors="replace")
    assert out.returncode == 2, (args, out.returncode, err, out.stdout[-500:])
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert names in err and err.startswith("error ("), err
    assert ESC.encode() not in out.stderr
    j = cli.run(*args, "--json")
    assert j.returncode == 2 and b"Traceback" not in j.stderr, (args, j.stderr)
    body = json.loads(j.stdout)
    assert body["code"].startswith("invalid") and names in body["message"], body
    return err


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    c = Cli(tmp_path)
    c.ok("db", "upgrade")
    return c


def append_foreign(url: str, session_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Append events as an old version or another writer might have: straight into the store,
    past the service's checks at the door."""
    from tracker.core import SessionProjector
    from tracker.store import NewEvent, open_store

    store = open_store(url, projector=SessionProjector())
    try:
        for start in range(0, len(events), 1000):  # the store's most per append
            version = store.stream_version(session_id)
            store.append(session_id, version, [NewEvent(t, d) for t, d in events[start : start + 1000]])
    finally:
        store.close()
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        db.execute("UPDATE events SET data = replace(data, 'SURROGATE', '\\ud800')")


# -- finding 8: recorded strings reach the terminal escaped ----------------------------------------


def test_recorded_escape_sequences_and_markup_are_shown_escaped(cli):
    started = json.loads(cli.ok("observe", "s1", "--basis", "a", "--input-tokens", 95, "--input-limit", 100, "--json"))
    attempt = started["attempt"]
    append_foreign(
        cli.url,
        "s1",
        [
            (
                "CountFailed",
                {"kind": "CountTimeout", "model": HOSTILE_MODEL, "detail": HOSTILE_REASON, "duration_ms": 1},
            ),
            (
                "CompactionRejected",
                {
                    "attempt_id": attempt["attempt_id"],
                    "reason": "automatic",
                    "basis": "r1:a",
                    "reject_reason": HOSTILE_REASON,
                    "duration_ms": 1,
                },
            ),
        ],
    )
    history = cli.run("history", "s1")
    assert history.returncode == 0 and b"Traceback" not in history.stderr, history.stderr
    raw = history.stdout
    assert ESC.encode() not in raw and b"\x07" not in raw and b"\r" not in raw, raw
    text = raw.decode()  # valid UTF-8: the lone surrogate is shown as its escape
    assert "\\x1b[31mred\\x1b[0m" in text and "\\x1b]0;pwned" in text
    assert "\\x1b[2J\\x1b[Hcleared\\r\\x07 \\ud800" in text
    assert "[bold]m[/]" in text and "[/] [link=x]y[/link]" in text and ":smile:" in text  # markup as typed
    assert text.count("rejected: ") == 1

    # the same through the streaming table (one line per row) and the JSON forms: JSON escapes
    for args in (("history", "s1", "--json"), ("export",), ("replay", "s1", "--json")):
        assert ESC.encode() not in cli.run(*args).stdout, args
    exported = [json.loads(line) for line in cli.ok("export").splitlines()]
    assert any(e["data"].get("model") == HOSTILE_MODEL for e in exported)  # kept as recorded

    replay = cli.run("replay", "s1")
    assert replay.returncode == 0 and ESC.encode() not in replay.stdout, replay.stderr
    whatif = cli.run("replay", "s1", "--compact-at", 7000)
    assert whatif.returncode == 0 and ESC.encode() not in whatif.stdout, whatif.stderr
    (cli.tmp / "[bold]report[").mkdir()
    html = cli.tmp / "[bold]report[/].html"  # Rich markup in a path: written and named as typed
    out = cli.ok("replay", "s1", "--html", html)
    assert html.exists() and f"wrote {html}:" in " ".join(out.split())


def test_streamed_history_escapes_too(cli):
    """Beyond TABLE_MAX_ROWS the table is printed line by line: the same escaping applies."""
    cli.ok("observe", "s2", "--basis", "a", "--input-tokens", 10, "--input-limit", 100)
    failed = {"kind": "CountTimeout", "model": HOSTILE_MODEL, "detail": HOSTILE_REASON, "duration_ms": 1}
    from tracker.cli._common import TABLE_MAX_ROWS

    append_foreign(cli.url, "s2", [("CountFailed", failed)] * (TABLE_MAX_ROWS + 1))
    out = cli.run("history", "s2", "--from-version", TABLE_MAX_ROWS)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    assert ESC.encode() not in out.stdout and b"\\x1b[31mred" in out.stdout
    assert b"[bold]m[/]" in out.stdout and b" | " in out.stdout  # the line-by-line form


def test_whatif_table_shows_markup_and_escapes_as_typed(cli):
    trace = cli.tmp / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(op)
            for op in (
                {"op": "[bold red]x[/]", "input_tokens": 1},
                {"op": "measure", "input_tokens": 5, "input_limit": 10, "basis": "a"},
                {"op": "[/]"},
                {"op": f"{ESC}[31mevil"},
                {"op": "measure", "input_tokens": 9, "input_limit": 10, "basis": "b"},
            )
        )
        + "\n"
    )
    out = cli.run("whatif", trace, "--table")
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    text = out.stdout.decode()
    assert ESC not in text and "\\x1b[31mevil" in text
    assert "[bold red]x[/]" in text and "[/]" in text
    assert text.count("proceed") == 1 and "compact" in text  # the later lines are answered
    refused(cli, "whatif", cli.tmp, "--table", names="trace")
    refused(cli, "whatif", cli.tmp / "missing.jsonl", names="trace")


# -- finding 8: identifiers with control characters are refused at the door -------------------------


@pytest.mark.parametrize(
    "args, names",
    [
        (("observe", "s1", "--basis", f"a{ESC}[31m", "--input-tokens", 1, "--input-limit", 9), "basis"),
        (("observe", "s1", "--basis", "a", "--model", f"m{ESC}[2J", "--input-tokens", 1, "--input-limit", 9), "model"),
        (("observe", "s1", "--basis", "a", "--quality", "q\x01", "--input-tokens", 1, "--input-limit", 9), "quality"),
        (("sessions", "--fleet", f"f{ESC}[31m"), "fleet"),
        (("history", "s1", "--fleet", "f\x9b31m"), "fleet"),
        (("sessions", "--pressure", f"normal{ESC}"), "pressure"),
        (("history", f"s{ESC}[31m"), "session_id"),
        (("replay", "s\r"), "session_id"),
        (("fleet", "create", f"f{ESC}x"), "name"),
        (("key", "list", f"f{ESC}x"), "fleet"),
        (("key", "revoke", f"k{ESC}x"), "key_id"),
    ],
)
def test_identifiers_with_control_characters_are_refused_at_the_door(cli, args, names):
    err = refused(cli, *args, names=names)
    assert "\\x" in err or "\\r" in err  # the character is named, escaped


# -- findings 9 and 10: one-line errors naming the option, no tracebacks ----------------------------


BIG = "1" + "0" * 20  # beyond SQLite's and Postgres' 64-bit integers
DIGITS_400 = "9" * 400


@pytest.mark.parametrize(
    "args, names",
    [
        (("sessions", "--since", "99999999999d"), "since"),
        (("sessions", "--since", f"{DIGITS_400}s"), "since"),
        (("sessions", "--limit", BIG), "limit"),
        (("sessions", "--limit", -1), "limit"),
        (("sessions", "--limit", "9" * 5000), "limit"),  # more digits than Python converts
        (("sessions", "--limit", "abc"), "limit"),
        (("export", "--since", BIG), "since"),
        (("export", "--limit", BIG), "limit"),
        (("history", "s1", "--from-version", BIG), "from-version"),
        (("replay", "s1", "--at", BIG), "at"),
        (("replay", "s1", "--compact-at", BIG), "compact-at"),
        (("observe", "s1", "--basis", "a", "--input-tokens", DIGITS_400, "--input-limit", 100), "input-tokens"),
        (("observe", "s1", "--basis", "a", "--input-tokens", 1, "--input-limit", DIGITS_400), "input-limit"),
        (("observe", "s1", "--basis", "a", "--input-tokens", 2**53, "--input-limit", 2**53), "input-tokens"),
        (("observe", "s1", "--input-tokens", 1, "--input-limit", 100), "basis"),  # a missing option
        (("observe", "s1", "--basis", "a"), "input-tokens"),
    ],
)
def test_out_of_range_values_are_one_line_errors_naming_the_option(cli, args, names):
    refused(cli, *args, names=names)


def test_input_tokens_at_the_json_bound_are_recorded_and_replayable(cli):
    bound = 2**53 - 1
    cli.ok("observe", "big", "--basis", "a", "--input-tokens", bound, "--input-limit", bound)
    assert f"{bound}/{bound}" in " ".join(cli.ok("history", "big").split())
    cli.ok("replay", "big", "--html", cli.tmp / "big.html")


def test_html_into_a_missing_folder_onto_a_folder_or_nowhere(cli):
    cli.ok("observe", "s1", "--basis", "a", "--input-tokens", 10, "--input-limit", 100)
    (cli.tmp / "[").mkdir()
    for target in (cli.tmp / "missing" / "r.html", cli.tmp, "", "/x/[/]r.html", cli.tmp / "[" / "x" / "r.html"):
        refused(cli, "replay", "s1", "--html", target, names="html")
    assert not (cli.tmp / "missing").exists()
    # an unknown session is named before any file is written
    refused_unknown = cli.run("replay", "nope", "--html", cli.tmp / "nope.html")
    assert refused_unknown.returncode == 2 and b"no session nope" in refused_unknown.stderr
    assert not (cli.tmp / "nope.html").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file permissions")
def test_an_unwritable_html_file_is_a_one_line_error(cli):
    cli.ok("observe", "s1", "--basis", "a", "--input-tokens", 10, "--input-limit", 100)
    locked = cli.tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        refused(cli, "replay", "s1", "--html", locked / "r.html", names="file")
    finally:
        locked.chmod(0o700)


def test_a_request_file_nested_too_deeply_is_refused_naming_request(cli):
    deep = cli.tmp / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    refused(cli, "observe", "s1", "--basis", "a", "--request", deep, "--model", "gpt-4o", names="request")

    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(900):
        inner["a"] = {}
        inner = inner["a"]
    body = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": nested}}],
    }
    request = cli.tmp / "request.json"
    request.write_text(json.dumps(body))
    refused(cli, "observe", "s1", "--basis", "a", "--request", request, "--model", "gpt-4o", names="nests deeper")
    assert "no session" in cli.run("history", "s1").stderr.decode()  # nothing recorded


def test_usage_errors_are_one_line(cli):
    refused(cli, "sessions", "--bogus", names="--bogus")
    refused(cli, "history", "s1", "extra", names="extra")
