"""The session timeline as inline SVG, drawn on the server (no script, no network).

A real time axis (wall-clock ticks, UTC) and a token axis; the used tokens of each measurement
(the count decided on) and, where calibration corrected it, the counter's raw count as a dashed
line; what the provider billed (its usage reports) as dots beside them;
the compact, rearm and hard levels as step lines; each committed compaction an instant vertical
drop from tokens before to tokens after; rejected attempts, count failures, context-limit errors,
provider rejections and still-open attempts as markers of distinct shapes and colours, explained by a visible legend
(:data:`LEGEND`). Every marker is a ``<g class='marker KIND'>`` with a ``<title>``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

from markupsafe import Markup, escape

from tracker.audit.model import Marker, Point, Story

W, H = 1100, 380
PAD_L, PAD_R, PAD_T, PAD_B = 78, 112, 30, 52

COLOURS = {
    "used": "#1565c0",  # blue
    "counted": "#64b5f6",  # light blue, dashed: the raw count where calibration corrected it
    "billed": "#6d4c41",  # brown dots: what the provider billed
    "provider_rejected": "#d81b60",  # pink ▼: the provider refused the request as too long
    "compact": "#ef6c00",  # orange, dashed
    "rearm": "#757575",  # grey, dotted
    "hard": "#b71c1c",  # dark red, solid
    "committed": "#2e7d32",  # green drop
    "rejected": "#7b1fa2",  # purple ×
    "count_failed": "#00838f",  # teal ◆
    "context_limit": "#000000",  # black ■
    "open": "#f9a825",  # amber ●
}

#: (key, label, how it is drawn) -- the legend under the chart's title, in the same colours
#: (the provider's marks, :data:`PROVIDER_KEYS`, only where the session has them)
LEGEND = (
    ("used", "used tokens (each measurement; the count decided on)", "line"),
    ("counted", "counted (raw, before calibration)", "dash"),
    ("billed", "billed by the provider", "dot-mark"),
    ("compact", "compact level", "dash"),
    ("rearm", "rearm level", "dot"),
    ("hard", "hard limit", "line"),
    ("committed", "compaction committed (drop: before → after)", "drop"),
    ("rejected", "attempt rejected", "cross"),
    ("count_failed", "count failed", "diamond"),
    ("context_limit", "ContextLimitError", "square"),
    ("provider_rejected", "provider rejected as too long", "triangle"),
    ("open", "attempt still open", "circle"),
)

PROVIDER_KEYS = ("counted", "billed", "provider_rejected")


def legend_of(s: Story) -> list[tuple[str, str, str]]:
    """The legend's entries for ``s``: every mark, the provider's only where drawn."""
    shown = {
        "counted": any(p.counted is not None for p in s.points),
        "billed": bool(s.billed),
        "provider_rejected": any(m.kind == "provider_rejected" for m in s.markers),
    }
    return [entry for entry in LEGEND if shown.get(entry[0], True)]


_TIME_STEPS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    3 * 3600,
    6 * 3600,
    12 * 3600,
    86400,
    2 * 86400,
    7 * 86400,
    30 * 86400,
)


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1-2-5 step that cuts ``span`` into about ``ticks`` parts."""
    raw = span / max(ticks, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for f in (1, 2, 2.5, 5, 10):
        if raw <= f * mag:
            return f * mag
    return 10 * mag


def time_ticks(t0: float, t1: float, most: int = 8) -> tuple[list[float], str]:
    """Tick times (epoch seconds) in [t0, t1] and the strftime-like format of their labels."""
    span = max(t1 - t0, 1e-3)
    step = next((s for s in _TIME_STEPS if span / s <= most), _TIME_STEPS[-1])
    first = math.ceil(t0 / step) * step
    ticks: list[float] = []
    t = first
    while t <= t1 + 1e-9 and len(ticks) < 50:
        ticks.append(t)
        t += step
    if step < 1:
        fmt = "ms"
    elif step < 60:
        fmt = "%H:%M:%S"
    elif step < 86400 and span < 86400:
        fmt = "%H:%M"
    else:
        fmt = "%m-%d %H:%M"
    return ticks, fmt


def time_label(t: float, fmt: str) -> str:
    when = datetime.fromtimestamp(t, UTC)
    if fmt == "ms":
        return when.strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"
    return when.strftime(fmt)


def _num(n: float) -> str:
    return f"{int(round(n)):,}"


def render_chart(s: Story) -> Markup:
    """The timeline of ``s`` as an ``<svg id="timeline">`` element."""
    if not s.points:
        return Markup(
            f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{W}" height="60" viewBox="0 0 {W} 60">'
            "<text x='10' y='30'>no measurements recorded</text></svg>"
        )
    assert s.first_at is not None and s.last_at is not None
    t0, t1 = s.first_at.timestamp(), s.last_at.timestamp()
    if t1 - t0 < 1e-3:
        t1 = t0 + 1e-3
    top = max(max(p.used, p.hard, p.counted or 0) for p in s.points)
    top = max([top] + [m.y or 0 for m in s.drops] + [m.y or 0 for m in s.markers] + [b.billed for b in s.billed])
    ystep = nice_step(top * 1.05, 5)
    ymax = math.ceil(top * 1.05 / ystep) * ystep
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def sx(t: float) -> float:
        return PAD_L + (t - t0) / (t1 - t0) * plot_w

    def sy(y: float) -> float:
        return PAD_T + (1 - y / ymax) * plot_h

    def crisp(x: float) -> float:  # a 1-px line on a pixel centre draws in its exact colour
        return math.floor(x) + 0.5

    out: list[str] = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'role="img" aria-label="timeline: used tokens and levels over time, with compactions and failures">',
        f"<rect class='plot' x='{PAD_L}' y='{PAD_T}' width='{plot_w}' height='{plot_h}' fill='#fcfcfc' stroke='#bbb'/>",
    ]
    # token axis
    out.append("<g class='axis y-axis'>")
    y = 0.0
    while y <= ymax + 1e-9:
        yy = crisp(sy(y))
        out.append(f"<line class='grid' x1='{PAD_L}' x2='{PAD_L + plot_w}' y1='{yy}' y2='{yy}' stroke='#e6e6e6'/>")
        out.append(f"<text class='tick' x='{PAD_L - 6}' y='{yy + 4:.1f}' text-anchor='end'>{_num(y)}</text>")
        y += ystep
    out.append(
        f"<text class='axis-title' transform='translate(16 {PAD_T + plot_h / 2:.0f}) rotate(-90)' "
        "text-anchor='middle'>tokens (input)</text></g>"
    )
    # time axis
    ticks, fmt = time_ticks(t0, t1)
    out.append("<g class='axis x-axis'>")
    for t in ticks:
        xx = crisp(sx(t))
        out.append(
            f"<line class='grid' x1='{xx}' x2='{xx}' y1='{PAD_T}' y2='{PAD_T + plot_h + 5}' stroke='#e6e6e6'/>"
            f"<text class='tick' x='{xx}' y='{PAD_T + plot_h + 18}' text-anchor='middle'>{time_label(t, fmt)}</text>"
        )
    start = datetime.fromtimestamp(t0, UTC).strftime("%Y-%m-%d %H:%M:%S")
    out.append(
        f"<text class='axis-title' x='{PAD_L + plot_w / 2:.0f}' y='{H - 8}' text-anchor='middle'>"
        f"time (UTC; first event {start}, span {_span(t1 - t0)})</text></g>"
    )

    # levels, as step lines to the end of the time axis
    def step_path(attr: str) -> str:
        parts: list[str] = []
        prev: float | None = None
        for p in s.points:
            x, yv = sx(p.t), sy(getattr(p, attr))
            if prev is None:
                parts.append(f"M{x:.1f},{yv:.1f}")
            else:
                parts.append(f"L{x:.1f},{prev:.1f} L{x:.1f},{yv:.1f}")
            prev = yv
        parts.append(f"L{PAD_L + plot_w:.1f},{prev:.1f}")
        return " ".join(parts)

    styles = {"hard": "stroke-width='2'", "compact": "stroke-width='1.5' stroke-dasharray='8,4'", "rearm": ""}
    styles["rearm"] = "stroke-width='1.5' stroke-dasharray='2,3'"
    for key in ("hard", "compact", "rearm"):
        out.append(
            f"<path class='level {key}' d='{step_path(key)}' fill='none' stroke='{COLOURS[key]}' {styles[key]}/>"
        )
        last = getattr(s.points[-1], key)
        out.append(
            f"<text class='level-label {key}' x='{PAD_L + plot_w + 4}' y='{sy(last) + 4:.1f}' "
            f"fill='{COLOURS[key]}'>{key} {_num(last)}</text>"
        )
    # used tokens: straight between measurements, an instant vertical drop at each commit
    merged: list[tuple[int, int, Point | Marker]] = [(p.version, 1, p) for p in s.points]
    merged += [(m.version, 0, m) for m in s.drops if m.y is not None and m.y2 is not None]
    merged.sort(key=lambda item: (item[0], item[1]))
    parts: list[str] = []
    for _, _, item in merged:
        if isinstance(item, Point):
            parts.append(f"{'L' if parts else 'M'}{sx(item.t):.1f},{sy(item.used):.1f}")
        else:
            assert item.y is not None and item.y2 is not None
            x = crisp(sx(item.t))  # where its marker draws the drop
            parts.append(f"{'L' if parts else 'M'}{x:.1f},{sy(item.y):.1f} L{x:.1f},{sy(item.y2):.1f}")
    if any(p.counted is not None for p in s.points):  # the raw count, where calibration corrected it
        raw = " ".join(
            f"{'M' if i == 0 else 'L'}{sx(p.t):.1f},{sy(p.used if p.counted is None else p.counted):.1f}"
            for i, p in enumerate(s.points)
        )
        out.append(
            f"<path class='counted' d='{raw}' fill='none' stroke='{COLOURS['counted']}' stroke-width='1.5' "
            "stroke-dasharray='6,3'/>"
        )
    out.append(f"<path class='used' d='{' '.join(parts)}' fill='none' stroke='{COLOURS['used']}' stroke-width='2'/>")
    if s.billed:  # what the provider billed, one dot per usage report
        out.append(f"<g class='billed' fill='{COLOURS['billed']}'>")
        for b in s.billed:
            out.append(
                f"<circle cx='{sx(b.t):.1f}' cy='{sy(b.billed):.1f}' r='3' data-v='{b.version}'>"
                f"<title>{escape(b.basis)}: billed {b.billed:,}, counted {b.counted:,} (×{b.ratio:.3f}) (v{b.version})"
                "</title></circle>"
            )
        out.append("</g>")
    # markers
    for m in [*s.drops, *s.markers]:
        out.append(_marker(m, sx(m.t), sy, crisp))
    out.append("</svg>")
    return Markup("\n".join(out))


def _span(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _marker(m: Marker, x: float, sy: Callable[[float], float], crisp: Callable[[float], float]) -> str:
    c = COLOURS[m.kind]
    title = f"<title>{escape(m.label)} (v{m.version})</title>"
    guide = (
        f"<line class='guide' x1='{crisp(x)}' x2='{crisp(x)}' y1='{PAD_T}' y2='{H - PAD_B}' stroke='{c}' "
        "stroke-width='1' stroke-dasharray='4,3' shape-rendering='crispEdges' opacity='0.9'/>"
    )
    head = f"<g class='marker {m.kind}' data-v='{m.version}'>{title}"
    strip = PAD_T - 12  # markers without a height sit in the strip above the plot
    if m.kind == "committed" and m.y is not None and m.y2 is not None:
        y1, y2 = sy(m.y), sy(m.y2)
        xx = crisp(x)
        return (
            f"{head}<line x1='{xx}' x2='{xx}' y1='{y1:.1f}' y2='{y2:.1f}' stroke='{c}' stroke-width='3'/>"
            f"<polygon points='{xx - 6:.1f},{y2 - 8:.1f} {xx + 6:.1f},{y2 - 8:.1f} {xx:.1f},{y2:.1f}' fill='{c}'/>"
            f"<rect x='{xx - 4:.1f}' y='{strip - 4}' width='8' height='8' fill='{c}'/></g>"
        )
    cy = sy(m.y) if m.y is not None else strip  # at the marker's height, or in the strip without one
    if m.kind == "rejected":  # a cross
        shape = (
            f"<line x1='{x - 6:.1f}' y1='{cy - 6:.1f}' x2='{x + 6:.1f}' y2='{cy + 6:.1f}' stroke='{c}' stroke-width='3'/>"
            f"<line x1='{x - 6:.1f}' y1='{cy + 6:.1f}' x2='{x + 6:.1f}' y2='{cy - 6:.1f}' stroke='{c}' stroke-width='3'/>"
        )
    elif m.kind == "count_failed":  # a diamond in the strip
        shape = (
            f"<polygon points='{x:.1f},{strip - 7} {x + 7:.1f},{strip} {x:.1f},{strip + 7} {x - 7:.1f},{strip}' "
            f"fill='{c}'/>"
        )
    elif m.kind == "provider_rejected":  # a triangle pointing down at the height
        shape = (
            f"<polygon points='{x - 7:.1f},{cy - 12:.1f} {x + 7:.1f},{cy - 12:.1f} {x:.1f},{cy:.1f}' "
            f"fill='{c}' stroke='#fff' stroke-width='1'/>"
        )
    elif m.kind == "context_limit":  # a square
        shape = f"<rect x='{x - 6:.1f}' y='{cy - 6:.1f}' width='12' height='12' fill='{c}'/>"
    else:  # a dot in the strip
        shape = f"<circle cx='{x:.1f}' cy='{strip}' r='6' fill='{c}'/>"
    return f"{head}{guide}{shape}</g>"
