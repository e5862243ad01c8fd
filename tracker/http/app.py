"""The ASGI app (wiring only: middleware, exception handlers, routers) and ``serve``."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from tracker import telemetry
from tracker.errors import TrackerError
from tracker.http.console import router as console_router
from tracker.http.errors import EXCEPTION_HANDLERS
from tracker.http.metrics import MULTIPROC_ENV
from tracker.http.middleware import ApiMiddleware
from tracker.http.routes import ROUTERS, hot_routes
from tracker.http.runtime import Runtime
from tracker.settings import Settings

log = logging.getLogger("tracker.http")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("context-tracker")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Size the request thread pool, check the database (connect, schema) and load the calibration
    book (so no request reads the log for it) if we can; close at shutdown."""
    import anyio.to_thread

    runtime: Runtime = app.state.runtime
    anyio.to_thread.current_default_thread_limiter().total_tokens = runtime.settings.api.api_threads
    try:
        await anyio.to_thread.run_sync(runtime.fleets)
        await anyio.to_thread.run_sync(lambda: runtime.tracker().calibrations.start())
    except TrackerError as exc:
        log.error("not ready yet: %s (%s); /readyz will say when it is", exc.message, exc.code)
    try:
        yield
    finally:
        runtime.close()


def create_app(runtime: Runtime | None = None, settings: Settings | None = None) -> FastAPI:
    """The ASGI app on ``runtime`` (default: a new one on ``settings``, default ``Settings.load()``).

    Its parts are built here, once (``tracker.bootstrap.build_app``), and connect to nothing yet,
    so the process starts (and /readyz says why) while the database is down or unmigrated.
    """
    if runtime is not None:
        settings = runtime.settings
    elif settings is None:
        settings = Settings.load()
    json_logs = settings.telemetry.log_format == "json"
    # first: the Tracker built next attaches the span hooks only when tracing is on
    telemetry.configure("tracker-api", log_format="json" if json_logs else None)  # text: uvicorn's own lines
    if runtime is None:
        runtime = Runtime(settings)
    app = FastAPI(
        title="Context Tracker",
        version=_version(),
        description="Decide when LLM agents must compact their context; one record for the whole fleet. "
        "Errors are `{code, error, message, ...}` with a stable `code`; the status table is "
        "`ERROR_STATUS` in tracker/http/errors.py.",
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        # FastAPI's /docs and /redoc pages load their scripts from a CDN (blank offline, and a third
        # party sees who reads them): off. /openapi.json is served; open it in any OpenAPI viewer.
        docs_url=None,
        redoc_url=None,
    )
    app.state.runtime = runtime
    generate = app.openapi

    def openapi() -> dict[str, Any]:  # generated once, then cached by FastAPI
        return app.openapi_schema or ApiMiddleware.document(generate())

    app.openapi = openapi  # type: ignore[method-assign]
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(console_router)  # the read-only web console, /console
    # one layer: metrics (every request) > auth (before any body is read) > body limit > the hot routes
    app.add_middleware(
        ApiMiddleware,
        runtime=runtime,
        max_bytes=runtime.settings.api.max_body_bytes,
        timeout_s=runtime.settings.api.body_timeout_s,
        hot_routes=hot_routes(),
    )
    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    workers: int = 1,
    settings: Settings | None = None,
    *,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Run the API on uvicorn; with ``workers > 1``, that many processes (metrics aggregated).

    One process serves an app built on ``settings`` (default ``Settings.load()``). Worker
    processes are started by uvicorn from the factory and each loads its own ``Settings``
    from the environment it inherits (the one ``settings`` was read from).
    """
    import uvicorn

    common: dict[str, Any] = dict(
        host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5
    )
    if (settings if settings is not None else Settings.load()).telemetry.log_format == "json":
        common["log_config"] = None  # uvicorn's lines go to the root logger: JSON, like the tracker's
    if workers <= 1:
        uvicorn.run(create_app(settings=settings), **common)
        return
    if not os.environ.get(MULTIPROC_ENV):
        import atexit
        import shutil
        import tempfile

        path = tempfile.mkdtemp(prefix="tracker-metrics-")
        os.environ[MULTIPROC_ENV] = path  # inherited by the worker processes
        atexit.register(shutil.rmtree, path, True)
    uvicorn.run("tracker.http.app:create_app", factory=True, workers=workers, **common)
