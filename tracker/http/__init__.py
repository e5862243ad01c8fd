"""The HTTP API (``tracker serve``): the Tracker for polyglot fleets, over JSON.

One ``Tracker`` per server process, sync endpoints (FastAPI runs them on its thread pool;
the Tracker, the event store and the coordinators are thread-safe). Every session belongs
to one **fleet**; a request is authenticated with one of that fleet's API keys
(``Authorization: Bearer <token>``, see ``tracker fleet`` / ``tracker key``) and only ever
sees that fleet's sessions.

Isolation: the internal session id is ``"<fleet_id>:<session_id>"`` (fleet ids are 10
characters, so an external id has at most 189); the prefix is added on the way in and
stripped from everything on the way out (bodies, events, error messages). A key can
therefore neither read nor write another fleet's sessions: the same external id names a
different session in each fleet, and reading a session the caller's fleet does not have
answers 404 whether or not another fleet has one.

    app.py         create_app (wiring only) and serve (uvicorn)
    routes.py      the endpoints, as routers (the list is there)
    schemas.py     request models, response views of the core's dataclasses, wire limits
    errors.py      ERROR_STATUS (the one status table), the error body, exception handlers
    middleware.py  body limit, authentication, request metrics
    runtime.py     Runtime (the parts bootstrap.build_app built, readiness), Commands, Caller
    metrics.py     the Prometheus registry: request metrics, fleet and replica gauges read at scrape time
"""
