"""Read-only surfaces over the record: formatting, replay, what-if and the HTML report.

* :mod:`tracker.audit.format`  ``event_summary`` (one line per event) and ``event_to_dict``
* :mod:`tracker.audit.replay`  ``replay_states`` (the state after each event), ``whatif_rows``
* :mod:`tracker.audit.whatif`  ``WhatIf``: a JSON-lines trace through the decision core, no database
* :mod:`tracker.audit.report`  ``render_html``: a self-contained HTML report of one session

Nothing here writes to the store; the CLI and the HTTP API both use these. Import the
module you need: ``tracker.audit.whatif`` needs only the core, not the store.
"""
