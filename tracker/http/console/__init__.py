"""The read-only web console, served under ``/console`` (``tracker serve``; ``tracker console``).

Server-rendered from the Jinja templates in ``tracker/http/console/templates`` and the session
page of :mod:`tracker.audit.pages`; a little plain JavaScript (``static/console.js``) and no CDN.

* :mod:`.auth`    signing in with a fleet or operator key, the signed cookie, the signed-in ``Viewer``
* :mod:`.views`   the view models of the pages (read through ``EventStore`` and ``SessionViews``)
* :mod:`.routes`  the routes, and ``run_local`` (``tracker console``: a one-time sign-in link)

    GET  /console/                                   fleet overview (?q= &pressure= &since=)
    GET  /console/sessions/{sid}                     session page (?type= &from= &limit= events; ?wi=1&… what-if)
    GET  /console/sessions/{sid}/attempts/{aid}      one attempt and the events around it
    GET  /console/sessions/{sid}/history.json        the JSON history, paged (?from_version= &limit=)
    GET  /console/sessions/{sid}/export.jsonl        every event, JSON lines
    GET  /console/sessions/{sid}/report.html         the session page as one self-contained file
    GET|POST /console/signin, GET /console/signin/ticket?t=, POST /console/signout
"""

from tracker.http.console.auth import COOKIE, LocalSignIn, Viewer
from tracker.http.console.routes import router, run_local
from tracker.http.console.views import STORIES as _STORIES  # the stories cache (the bench empties it)

__all__ = ["COOKIE", "LocalSignIn", "Viewer", "_STORIES", "router", "run_local"]
