"""The session page's templates (Jinja2, shipped in ``tracker/audit/templates``) and their filters.

One template, ``session_body.html.j2``, is the session page of the console (``tracker serve``
under ``/console``; its router adds links, the event filters and the what-if form) and of the
self-contained file ``tracker replay SID --html FILE`` (``report.html.j2``: inline CSS, no script,
nothing loaded from anywhere). :func:`environment` is the one Jinja environment; the console
passes its own template folder to it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2

from tracker.audit.chart import COLOURS, legend_of, render_chart
from tracker.audit.model import Story
from tracker.audit.story import account

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _hms(value: datetime | None) -> str:
    return value.strftime("%H:%M:%S.") + f"{value.microsecond // 1000:03d}" if value is not None else ""


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else ""


def _epoch(value: float | None) -> str:
    """Seconds since the epoch as ``YYYY-MM-DD HH:MM:SS`` (UTC); empty for none or 0."""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _ms(value: int | None) -> str:
    if value is None:
        return ""
    return f"{value:,} ms" if value < 10_000 else f"{value / 1000:,.1f} s"


def _tokens(value: int | None) -> str:
    return f"{value:,}" if value is not None else "–"


def _plural(count: int, one: str, many: str | None = None) -> str:
    """``1 error``, ``2 errors`` (``many``: the plural when it is not ``one`` + s), with thousands separated."""
    return f"{count:,} {one if count == 1 else many or one + 's'}"


def environment(*extra: Path) -> jinja2.Environment:
    """The Jinja environment: ``extra`` template folders first, then the session page's own."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([*map(str, extra), str(TEMPLATES)]),
        autoescape=True,
        trim_blocks=False,
        lstrip_blocks=False,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(hms=_hms, when=_when, epoch=_epoch, ms=_ms, tokens=_tokens, plural=_plural)
    return env


def session_context(story: Story) -> dict[str, Any]:
    """What ``session_body.html.j2`` needs besides ``page``."""
    ended = story.ended_at_limit
    return {
        "story": story,
        "account": account(story),
        "ended_at_limit": ended,
        "chart": render_chart(story),
        "legend": [(key, label, shape, COLOURS[key]) for key, label, shape in legend_of(story)],
        "attempts_skipped": story.counts["attempts"] - len(story.attempts),
    }


_ENV: jinja2.Environment | None = None


def render_report(story: Story, title: str | None = None) -> str:
    """The self-contained HTML file of one session (``tracker replay SID --html FILE``)."""
    global _ENV
    if _ENV is None:
        _ENV = environment()
    ctx = session_context(story)
    return _ENV.get_template("report.html.j2").render(title=title or f"replay of {story.session_id}", page=None, **ctx)
