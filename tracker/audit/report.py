"""The HTML report of one recorded session (``tracker replay SID --html FILE``).

The same session page the console shows (:mod:`tracker.audit.pages`, templates in
``tracker/audit/templates``) as one self-contained file: inline CSS and SVG, no script, nothing
loaded from anywhere. :func:`render_store_html` (the CLI and the console's download) reads the
session through the store's narrow reads (:func:`tracker.audit.story.read_story`: counts by type,
lifecycle events, a sample of the measurements, the first ``MAX_TABLE_ROWS`` events), so a
100k-event session costs about what a 10k-event one does; :func:`render_html` reads a stream of
events once. Both keep bounded memory (chart points, markers, attempts and table rows are capped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tracker.audit.builder import MAX_MARKERS, MAX_POINTS, MAX_TABLE_ROWS, build_story
from tracker.audit.pages import render_report
from tracker.audit.story import read_story
from tracker.store import StoredEvent
from tracker.store.base import EventStore, SessionViews

__all__ = ["MAX_MARKERS", "MAX_POINTS", "MAX_TABLE_ROWS", "render_html", "render_store_html"]


def render_html(session_id: str, stored: Iterable[StoredEvent], out: Any, title: str | None = None) -> dict[str, int]:
    """Write the session page of ``stored`` (the session's events, in order) to ``out``.

    Returns counts of what was recorded (events, measurements, attempts, committed, rejected,
    count_failed, context_limit), for tests and the CLI summary.
    """
    story = build_story(session_id, stored)
    out.write(render_report(story, title))
    return dict(story.counts)


def render_store_html(
    store: EventStore,
    session_id: str,
    out: Any,
    *,
    views: SessionViews,
    shown: str | None = None,
    title: str | None = None,
) -> dict[str, int]:
    """Write the session page of ``session_id`` at its current version to ``out``, read through the
    read side's narrow reads (``views``); ``shown``: the id
    the page shows. Returns the counts as :func:`render_html`."""
    story = read_story(store, session_id, shown=shown, table_rows=MAX_TABLE_ROWS, views=views)
    out.write(render_report(story, title))
    return dict(story.counts)
