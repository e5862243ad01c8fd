"""The HTML replay report, opened in a real browser (headless Chromium from Debian's package).

A session is built through the real ``Tracker`` on SQLite with a committed
compaction, rejected ones, a count failure and a ``ContextLimitError``; the report
is written by the CLI (``tracker replay SID --html FILE``) and then

* screenshotted: a valid 1200×1000 PNG, not blank, with the marker colours drawn
  *in the chart* (below the legend, whose swatches use the same colours) and the
  blue used-tokens line;
* dumped as the rendered DOM: ``svg#timeline`` with the used / compact / rearm / hard
  paths, one ``g.marker.<kind>`` per committed / rejected attempt, count failure and
  context-limit error, and the event table with one row per event;
* checked to be self-contained: no scripts, no external stylesheets or images, no
  http(s) ``src`` / ``href`` / ``url()`` anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_tracker
from tests.support.measurements import measurement

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
TRACKER = shutil.which("tracker")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)"),
    pytest.mark.skipif(TRACKER is None, reason="the `tracker` console script is not installed"),
]

SID = "html-report-1"
LIMIT = 100_000
MARKER_COLOURS = {  # tracker/audit/chart.py COLOURS (rejected is purple: the hard limit is the only red)
    "committed": (0x2E, 0x7D, 0x32),
    "rejected": (0x7B, 0x1F, 0xA2),
    "count_failed": (0x00, 0x83, 0x8F),
    "context_limit": (0x00, 0x00, 0x00),
}
USED_BLUE = (0x15, 0x65, 0xC0)


def _m(basis: str, tokens: int) -> dict[str, Any]:
    return measurement(basis, tokens, LIMIT)


def build_session(url: str) -> None:
    from tracker import Tracker
    from tracker.errors import ContextLimitError, ContextLimitUnknown
    from tracker.settings import Settings
    from tracker.store import upgrade

    upgrade(url)
    with Tracker.from_settings(Settings.of(database_url=url)) as t:  # no broker: counts in-process
        assert t.observe(SID, measurement=_m("m1", 50_000)).action == "proceed"
        r = t.observe(SID, measurement=_m("m2", 85_000))
        assert r.action == "compact"
        t.commit(SID, r.attempt.attempt_id, r.attempt.fencing_token, tokens_after=30_000)  # -> revision 2
        assert t.observe(SID, measurement=_m("m3", 40_000)).action == "proceed"
        with pytest.raises(ContextLimitUnknown):  # recorded as CountFailed, decides nothing
            t.observe(SID, request={"messages": [{"role": "user", "content": "hi"}]}, model="no-such-model", basis="m4")
        for basis, tokens in (("m5", 88_000), ("m6", 92_000), ("m7", 95_000)):  # a compactor that keeps failing
            r = t.observe(SID, measurement=_m(basis, tokens))
            assert r.action == "compact", (basis, r.action)
            t.reject(SID, r.attempt.attempt_id, r.attempt.fencing_token, "summarizer_error")
        with pytest.raises(ContextLimitError):  # the loop breaker is spent and the request no longer fits
            t.observe(SID, measurement=_m("m8", 101_000))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("replay-html")
    url = f"sqlite:///{d / 'tracker.db'}"
    build_session(url)
    out_file = d / "report.html"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKER_")}
    env["TRACKER_DATABASE_URL"] = url
    out = run_tracker(
        [TRACKER, "replay", SID, "--html", str(out_file), "--json"],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout)
    history = [
        json.loads(line)
        for line in run_tracker(
            [TRACKER, "history", SID, "--json"], cwd=d, env=env, capture_output=True, text=True, timeout=120, check=True
        ).stdout.splitlines()
    ]
    return {"dir": d, "file": out_file, "counts": counts, "history": history}


def chromium(d: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={d / 'chromium-profile'}",
        *args,
    ]
    return subprocess.run(argv, cwd=d, capture_output=True, timeout=120)


def test_counts_of_the_recorded_session(report):
    c = report["counts"]
    assert c == {
        "html": str(report["file"]),
        "events": len(report["history"]),
        "measurements": 7,
        "attempts": 4,
        "committed": 1,
        "rejected": 3,
        "count_failed": 1,
        "context_limit": 1,
        "usage_reports": 0,
        "provider_rejections": 0,
    }


# -- PNG decoding (stdlib only) ---------------------------------------------------------------


def read_png(path: Path) -> tuple[int, int, list[bytes], int]:
    """(width, height, unfiltered rows, bytes per pixel) of an 8-bit RGB/RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0], (
            f"bad CRC in {kind!r}"
        )
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert ihdr is not None, "no IHDR chunk"
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (2, 6), ihdr
    bpp = 4 if ctype == 6 else 3
    raw = zlib.decompress(b"".join(idat))
    stride = w * bpp
    assert len(raw) == h * (stride + 1)
    prev = bytearray(stride)
    rows = []
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev, strict=True))
        elif f == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        else:
            assert f == 0, f"bad filter type {f}"
        rows.append(bytes(line))
        prev = line
    return w, h, rows, bpp


def test_screenshot_renders_the_chart(report):
    d = report["dir"]
    png = d / "replay.png"
    out = chromium(d, f"--screenshot={png}", "--window-size=1200,1000", report["file"].as_uri())
    assert out.returncode == 0 and png.exists(), out.stderr.decode(errors="replace")[-2000:]
    assert png.stat().st_size > 20_000, "the screenshot is (nearly) blank"
    w, h, rows, bpp = read_png(png)
    assert (w, h) == (1200, 1000)

    colours: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    wanted = set(MARKER_COLOURS.values())
    distinct: set[bytes] = set()
    blue_near: list[int] = []
    for y, row in enumerate(rows):
        for x in range(0, w * bpp, bpp):
            px = row[x : x + 3]
            distinct.add(px)
            rgb = (px[0], px[1], px[2])
            if rgb in wanted:
                colours.setdefault(rgb, []).append((x // bpp, y))
            if abs(rgb[0] - USED_BLUE[0]) + abs(rgb[1] - USED_BLUE[1]) + abs(rgb[2] - USED_BLUE[2]) < 60:
                blue_near.append(y)
    assert len(distinct) > 50, f"only {len(distinct)} colours: a blank or broken page"

    # The legend draws a swatch of every marker colour in one row near the top; the chart is below it.
    legend_y = min(y for _, y in colours[MARKER_COLOURS["committed"]])
    for kind, rgb in MARKER_COLOURS.items():
        in_chart = [p for p in colours.get(rgb, []) if p[1] > legend_y + 15]
        assert len(in_chart) >= 20, f"no {kind} marker drawn in the chart"
    assert sum(1 for y in blue_near if y > legend_y + 15) > 200, "the used-tokens line is not drawn"


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str], tuple[str, ...]]] = []  # (tag, attrs, ancestors)
        self.stack: list[str] = []
        self.text: list[str] = []

    VOID = {"meta", "br", "img", "link", "input", "hr", "source", "path", "circle", "line", "rect"}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a, tuple(self.stack)))
        if tag not in self.VOID:
            self.stack.append(tag + ("#" + a["id"] if "id" in a else ""))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, tuple(self.stack)))

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].split("#", 1)[0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_rendered_dom_has_chart_markers_and_table(report):
    d = report["dir"]
    out = chromium(d, "--dump-dom", report["file"].as_uri())
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    dom_text = out.stdout.decode()
    assert "<svg" in dom_text, "chromium rendered no document"
    dom = _Dom()
    dom.feed(dom_text)

    def find(tag: str, **attrs: str) -> list[tuple[str, dict[str, str], tuple[str, ...]]]:
        return [e for e in dom.elements if e[0] == tag and all(e[1].get(k) == v for k, v in attrs.items())]

    svgs = find("svg", id="timeline")
    assert len(svgs) == 1
    in_svg = [e for e in dom.elements if "svg#timeline" in e[2]]
    paths = {e[1].get("class"): e[1].get("d", "") for e in in_svg if e[0] == "path"}
    assert set(paths) >= {"used", "level compact", "level rearm", "level hard"}
    for cls, path_d in paths.items():
        assert path_d.startswith("M") and path_d.count("L") >= 6, f"path {cls} has too few points: {path_d[:80]}"

    markers: dict[str, int] = {}
    for tag, a, _ in in_svg:
        if tag == "g" and "marker" in a.get("class", "").split():
            kind = [c for c in a["class"].split() if c != "marker"]
            assert len(kind) == 1
            markers[kind[0]] = markers.get(kind[0], 0) + 1
    assert markers == {"committed": 1, "rejected": 3, "count_failed": 1, "context_limit": 1}
    titles = " ".join(dom.text)
    assert "ContextLimitError: 101000 ≥ 100000" in titles
    assert "ContextLimitUnknown" in titles and "summarizer_error" in titles

    rows = [e for e in dom.elements if e[0] == "tr" and any(s == "table#events" for s in e[2]) and "class" in e[1]]
    assert [r[1]["class"] for r in rows] == [e["type"] for e in report["history"]]
    summary = {e[1]["data-k"] for e in dom.elements if e[0] == "span" and "data-k" in e[1]}
    assert {"events", "committed", "rejected", "count_failed", "context_limit"} <= summary


def test_report_is_self_contained(report):
    text = report["file"].read_text(encoding="utf-8")
    dom = _Dom()
    dom.feed(text)
    tags = {e[0] for e in dom.elements}
    assert not tags & {"script", "link", "img", "iframe", "object", "embed", "image", "use"}, tags
    for tag, attrs, _ in dom.elements:
        for name, value in attrs.items():
            if name in ("src", "href", "xlink:href", "action", "srcset", "poster", "data"):
                raise AssertionError(f"<{tag} {name}={value!r}>: the report must not load anything")
            if name == "style":
                assert "url(" not in value
    assert "url(" not in text and "@import" not in text
    for scheme in ("http://", "https://", "//"):
        for attr in ("src=", "href="):
            assert f'{attr}"{scheme}' not in text and f"{attr}'{scheme}" not in text
    # the only URL in the file is the SVG namespace, which is a name, not a resource
    assert [u for u in ("http://", "https://") for _ in range(text.count(u))] == ["http://"]
    assert text.count("http://www.w3.org/2000/svg") == 1
