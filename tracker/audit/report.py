"""The HTML report of one recorded session (``tracker replay SID --html FILE``).

One self-contained file: an inline SVG timeline (used tokens against the compact, rearm and
hard levels, with attempt and failure markers) and the event table. It streams: the chart
keeps at most ``MAX_POINTS`` points and ``MAX_MARKERS`` markers, the table ``MAX_TABLE_ROWS``
rows, so a 100k-event session renders in bounded memory.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

from tracker.audit.format import event_summary
from tracker.core import SessionState, apply, event_from_data

MAX_TABLE_ROWS = 5000
MAX_POINTS = 2000
MAX_MARKERS = 1000

_COLOURS = {
    "committed": "#2e7d32",
    "rejected": "#c62828",
    "open": "#f9a825",
    "count_failed": "#6a1b9a",
    "context_limit": "#000000",
}


class _Series:
    """Keeps at most ~MAX_POINTS chart points by merging neighbours (min/max kept) as it streams."""

    def __init__(self) -> None:
        self.points: list[tuple[int, int, int, int, int, int]] = []  # (x, used, limit, compact, rearm, hard)
        self.stride = 1
        self._pending: list[tuple[int, int, int, int, int, int]] = []

    def add(self, p: tuple[int, int, int, int, int, int]) -> None:
        self._pending.append(p)
        if len(self._pending) >= self.stride:
            self.points.append(max(self._pending, key=lambda q: q[1]))  # keep the peak of each bucket
            self._pending = []
        if len(self.points) > MAX_POINTS:
            self.points = [max(self.points[i : i + 2], key=lambda q: q[1]) for i in range(0, len(self.points), 2)]
            self.stride *= 2

    def finish(self) -> list[tuple[int, int, int, int, int, int]]:
        if self._pending:
            self.points.append(max(self._pending, key=lambda q: q[1]))
            self._pending = []
        return self.points


class _Markers:
    """Attempt / failure markers, at most ~MAX_MARKERS: as a session grows, markers of one kind that
    fall into the same bucket of versions merge into one (its label says how many and which versions).
    A chart 1000 px wide cannot show more anyway, and memory stays bounded on very long sessions."""

    def __init__(self) -> None:
        self.items: list[list[Any]] = []  # [x_first, x_last, kind, label_of_first, count]
        self.width = 1  # versions per bucket
        self._last: dict[str, list[Any]] = {}  # kind -> its newest item

    def add(self, x: int, kind: str, label: str) -> None:
        last = self._last.get(kind)
        if last is not None and last[0] // self.width == x // self.width:
            last[1], last[4] = x, last[4] + 1
            return
        item = [x, x, kind, label, 1]
        self.items.append(item)
        self._last[kind] = item
        if len(self.items) > MAX_MARKERS:
            self._coarsen()

    def _coarsen(self) -> None:
        while len(self.items) > MAX_MARKERS // 2:
            self.width *= 2
            merged: list[list[Any]] = []
            open_by_kind: dict[str, list[Any]] = {}
            for item in self.items:
                prev = open_by_kind.get(item[2])
                if prev is not None and prev[0] // self.width == item[0] // self.width:
                    prev[1], prev[4] = item[1], prev[4] + item[4]
                    continue
                merged.append(item)
                open_by_kind[item[2]] = item
            self.items = merged
            self._last = open_by_kind

    def finish(self) -> list[tuple[int, str, str]]:
        out = []
        for x0, x1, kind, label, n in self.items:
            if n > 1:
                label = f"{n} × {kind.replace('_', ' ')} in v{x0}–v{x1}; first: {label}"
            out.append((x0, kind, label))
        return out


def render_html(session_id: str, stored: Iterable[Any], out: Any, title: str | None = None) -> dict[str, int]:
    """Write one self-contained HTML file (inline SVG + CSS, no scripts or network) to ``out``.

    Returns counts of what was drawn, for tests and the CLI summary.
    """
    series = _Series()
    markers = _Markers()
    attempts: dict[str, int] = {}  # attempt_id -> x of start, while the attempt is open
    rows: list[str] = []
    counts = {
        "events": 0,
        "measurements": 0,
        "attempts": 0,
        "committed": 0,
        "rejected": 0,
        "count_failed": 0,
        "context_limit": 0,
    }
    state = SessionState(session_id=session_id)
    for e in stored:
        counts["events"] += 1
        state = apply(state, event_from_data(e.type, e.data))
        d = e.data
        x = e.version
        if e.type == "ContextMeasured":
            counts["measurements"] += 1
            m = d["measurement"]
            series.add((x, m["input_tokens"], m["input_limit"], d["compact_level"], d["rearm_level"], d["hard_level"]))
        elif e.type == "CompactionStarted":
            counts["attempts"] += 1
            attempts[d["attempt_id"]] = x
        elif e.type == "CompactionCommitted":
            counts["committed"] += 1
            attempts.pop(d["attempt_id"], None)
            markers.add(x, "committed", f"{d['reason']} attempt committed: {d['tokens_before']} → {d['tokens_after']}")
        elif e.type == "CompactionRejected":
            counts["rejected"] += 1
            attempts.pop(d["attempt_id"], None)
            markers.add(x, "rejected", f"{d['reason']} attempt rejected: {d['reject_reason']}")
        elif e.type == "CountFailed":
            counts["count_failed"] += 1
            markers.add(x, "count_failed", f"{d['kind']}: {d['detail']}")
        elif e.type == "ContextLimitReached":
            counts["context_limit"] += 1
            markers.add(x, "context_limit", f"ContextLimitError: {d['input_tokens']} ≥ {d['input_limit']}")
        if len(rows) < MAX_TABLE_ROWS:
            rows.append(
                f"<tr class='{html.escape(e.type)}'><td>{e.version}</td><td>{html.escape(e.recorded_at.isoformat()[:23])}</td>"
                f"<td>{html.escape(e.type)}</td><td>{html.escape(event_summary(e))}</td></tr>"
            )
    drawn = markers.finish()
    for aid, x in attempts.items():
        if state.find_open(aid):
            drawn.append((x, "open", f"attempt {aid[:12]} still open"))
    points = series.finish()
    svg = _chart(points, drawn, max(counts["events"], 1))
    more = counts["events"] - len(rows)
    legend = "".join(
        f"<span class='lg'><i style='background:{c}'></i>{html.escape(k.replace('_', ' '))}</span>"
        for k, c in _COLOURS.items()
    )
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title or "replay of " + session_id)}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:24px;color:#222}} h1{{font-size:20px}}
.summary span{{margin-right:18px}} .lg{{margin-right:14px}} .lg i{{display:inline-block;width:10px;height:10px;margin-right:4px}}
table{{border-collapse:collapse;margin-top:16px;width:100%}} td,th{{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;font-size:12px}}
tr.CompactionCommitted td{{background:#e8f5e9}} tr.CompactionRejected td{{background:#ffebee}}
tr.ContextLimitReached td{{background:#212121;color:#fff}} tr.CountFailed td{{background:#f3e5f5}}
svg text{{font-size:11px}}
</style></head><body>
<h1>Session {html.escape(session_id)}</h1>
<div class="summary" id="summary">{"".join(f"<span data-k='{k}'>{k.replace('_', ' ')}: <b>{v}</b></span>" for k, v in counts.items())}
<span>revision now: <b>{state.revision}</b></span><span>pressure now: <b>{state.pressure}</b></span></div>
<p>{legend}<span class='lg'><i style='background:#1565c0'></i>used tokens</span>
<span class='lg'><i style='background:#ef6c00'></i>compact level</span><span class='lg'><i style='background:#9e9e9e'></i>rearm level</span>
<span class='lg'><i style='background:#b71c1c'></i>hard limit</span></p>
{svg}
<table id="events"><thead><tr><th>v</th><th>recorded at</th><th>event</th><th>what happened</th></tr></thead><tbody>
{"".join(rows)}
</tbody></table>
{f"<p>… and {more} more events (see <code>tracker history {html.escape(session_id)}</code>).</p>" if more > 0 else ""}
</body></html>
"""
    out.write(doc)
    return counts


def _chart(
    points: list[tuple[int, int, int, int, int, int]], markers: list[tuple[int, str, str]], n_events: int
) -> str:
    W, H, PAD_L, PAD_B, PAD_T, PAD_R = 1000, 360, 70, 30, 10, 10
    if not points:
        return "<svg id='timeline' width='1000' height='60'><text x='10' y='30'>no measurements recorded</text></svg>"
    ymax = max(max(p[1], p[5]) for p in points) * 1.08
    x0, x1 = 1, max(n_events, 2)

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)

    def sy(y: float) -> float:
        return PAD_T + (1 - y / ymax) * (H - PAD_T - PAD_B)

    def path(idx: int) -> str:
        pts = []
        for i, p in enumerate(points):
            if i:
                pts.append(f"L{sx(p[0]):.1f},{sy(points[i - 1][idx]):.1f}")  # step line
            pts.append(f"{'M' if not i else 'L'}{sx(p[0]):.1f},{sy(p[idx]):.1f}")
        return " ".join(pts)

    used = " ".join(f"{'M' if i == 0 else 'L'}{sx(p[0]):.1f},{sy(p[1]):.1f}" for i, p in enumerate(points))
    marks = []
    for x, kind, label in markers:
        c = _COLOURS[kind]
        marks.append(
            f"<g class='marker {kind}'><line x1='{sx(x):.1f}' x2='{sx(x):.1f}' y1='{PAD_T}' y2='{H - PAD_B}' stroke='{c}' "
            f"stroke-dasharray='3,3' stroke-width='1'/><circle cx='{sx(x):.1f}' cy='{PAD_T + 6}' r='5' fill='{c}'>"
            f"<title>{html.escape(label)} (v{x})</title></circle></g>"
        )
    ticks = "".join(
        f"<text x='{PAD_L - 6}' y='{sy(ymax * f / 1.08):.1f}' text-anchor='end'>{int(ymax * f / 1.08):,}</text>"
        f"<line x1='{PAD_L}' x2='{W - PAD_R}' y1='{sy(ymax * f / 1.08):.1f}' y2='{sy(ymax * f / 1.08):.1f}' stroke='#eee'/>"
        for f in (0, 0.25, 0.5, 0.75, 1.0)
    )
    return f"""<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="occupancy timeline">
{ticks}
<path class="level hard" d="{path(5)}" fill="none" stroke="#b71c1c" stroke-width="1.5"/>
<path class="level compact" d="{path(3)}" fill="none" stroke="#ef6c00" stroke-width="1.5"/>
<path class="level rearm" d="{path(4)}" fill="none" stroke="#9e9e9e" stroke-width="1.5" stroke-dasharray="6,3"/>
<path class="used" d="{used}" fill="none" stroke="#1565c0" stroke-width="2"/>
{"".join(marks)}
<text x="{W / 2}" y="{H - 6}" text-anchor="middle">event version</text>
</svg>"""
