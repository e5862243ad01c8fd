"""The console tests' browser: Debian's Chromium driven by Playwright, signing in, screenshots.

``browser`` and ``page`` are fixtures of tests/support/plugin.py; a console module's ``server`` is a
dict with ``base`` (the server's URL), ``keys`` (who -> token) and ``shots`` (folders for screenshots).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

#: a console module's marks: it needs Chromium, the ``tracker`` console script and PostgreSQL
CONSOLE_MARKS = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (.ci/run installs it)"),
    pytest.mark.skipif(shutil.which("tracker") is None, reason="the `tracker` console script is not installed"),
]


@contextmanager
def launch() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield b
        finally:
            b.close()


def new_page(browser: Any) -> Any:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    return pg


def sign_in(page: Any, server: dict[str, Any], who: str) -> None:
    """Open the console signed out (it sends the browser to the sign-in page) and sign in as ``who``."""
    page.goto(server["base"] + "/console/")
    assert page.url.endswith("/console/signin"), page.url
    page.fill("#key", server["keys"][who])
    page.click("#signin")
    page.wait_for_url(server["base"] + "/console/")


def shoot(page: Any, server: dict[str, Any], name: str, **kwargs: Any) -> Path:
    """A screenshot ``name`` in every folder of ``server["shots"]`` (a real PNG); the first one's path."""
    first = None
    for d in server["shots"]:
        path = d / name
        page.screenshot(path=str(path), **kwargs)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, f"{path} is not a real screenshot"
        first = first or path
    assert first is not None
    return first


def shot_folders(d: Path) -> list[Path]:
    """``d/shots``, and ``$TRACKER_CONSOLE_SHOTS`` when it is set (made if missing)."""
    shots = [d / "shots"]
    if os.environ.get("TRACKER_CONSOLE_SHOTS"):
        shots.append(Path(os.environ["TRACKER_CONSOLE_SHOTS"]))
    for s in shots:
        s.mkdir(parents=True, exist_ok=True)
    return shots
