"""Read-only surfaces over the record: formatting, replay, what-if and the HTML report.

* :mod:`tracker.audit.format`  ``event_summary`` (one line per event) and ``event_to_dict``
* :mod:`tracker.audit.replay`  ``replay_states`` (the state after each event), ``whatif_rows``
* :mod:`tracker.audit.whatif`  ``WhatIf``: a JSON-lines trace through the decision core, no database
* :mod:`tracker.audit.builder` ``build_story``: everything a session's page shows, from one pass over a
  stream of events (``Story`` and the bounded series it keeps)
* :mod:`tracker.audit.story`   ``read_story``: the same through the store's narrow reads (not every
  event), and ``account``: how the session ended and why, in plain sentences
* :mod:`tracker.audit.chart`   ``render_chart``: the timeline as inline SVG
* :mod:`tracker.audit.pages`   the Jinja templates of the session page (console and static file)
* :mod:`tracker.audit.report`  ``render_store_html`` / ``render_html``: the session page as one self-contained file

Nothing here writes to the store; the CLI and the HTTP API both use these. Import the
module you need: ``tracker.audit.whatif`` needs only the core, not the store.
"""
