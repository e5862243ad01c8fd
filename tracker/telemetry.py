"""Traces and structured logs: the one module that touches OpenTelemetry and the log format.

Tracing is configured only by the standard ``OTEL_*`` variables, read once per process by
:func:`configure` (``tracker serve`` and ``tracker worker`` call it; so does an embedding app
that wants it). With none of ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (or ``OTEL_SDK_DISABLED=true``) nothing is
installed, and :func:`span` returns one shared no-op object: the hot path pays a function
call and a flag test. A tracer provider installed by the host application (a test's in-memory
exporter, say) is used as it is.

    with telemetry.span("tracker.append", session_id=sid) as s:
        ...
        s.set("tracker.action", "compact")  # attributes are set only when the span records

The ids of the current operation (fleet, session, attempt) are kept in a context variable and
go into every log line, with the trace and span ids, when ``TRACKER_LOG_FORMAT=json``
(:class:`JsonFormatter`: one JSON object per line); the default format is human-readable.
Log lines never carry settings, URLs or keys: only the message and these ids.

The Tracker's own spans and log lines come from :class:`TelemetryHooks`, a hook of the service
(``tracker.hooks``) that ``Tracker.from_settings`` attaches when tracing or id-logging is on.

The Celery count task joins the caller's trace through :func:`inject` / :func:`extract`
(W3C ``traceparent`` in the task message's headers).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from tracker.core.events import CompactionStarted, ContextMeasured
from tracker.errors import TrackerError
from tracker.hooks import TrackerHooks

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.outcome import Outcome

log = logging.getLogger("tracker")
op_log = logging.getLogger("tracker.service")  # one line per command, when logging or tracing is on

# attribute names (one vocabulary for every span)
FLEET = "tracker.fleet"
SESSION = "tracker.session_id"
BASIS = "tracker.basis"
ACTION = "tracker.action"
PRESSURE = "tracker.pressure"
OCCUPANCY = "tracker.occupancy_bp"
ATTEMPT = "tracker.attempt_id"
QUALITY = "tracker.count_quality"
ERROR_CODE = "tracker.error_code"
MODEL = "tracker.model"

_IDS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("tracker_log_ids", default=None)
_OP: contextvars.ContextVar[Span | None] = contextvars.ContextVar("tracker_operation", default=None)
_LOG_KEYS = {FLEET: "fleet", SESSION: "session_id", ATTEMPT: "attempt_id"}

_state = {"tracing": False, "ids": False, "configured": False}


# -- configuration ------------------------------------------------------------------------------


def tracing_requested(env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters the standard ``OTEL_*`` variables ask for ([] = tracing off)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            return []
        names = "otlp"
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def configure(service_name: str, *, log_format: str | None = None, log_level: int = logging.INFO) -> None:
    """Install tracing from ``OTEL_*`` (if asked for) and the log format, once per process.

    ``service_name`` is the default ``service.name`` (``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` win). ``log_format`` ``json`` or ``text`` configures the
    root logger; ``None`` leaves logging to the host.
    """
    if log_format is not None:
        configure_logging(log_format, log_level)
    if _state["configured"]:
        return
    _state["configured"] = True
    exporters = tracing_requested()
    if not exporters:
        return
    from importlib.metadata import entry_points

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in attrs
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": service_name}))
    found = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    found.setdefault("otlp", found.get("otlp_proto_http"))  # type: ignore[arg-type]
    for name in exporters:
        ep = found.get(name)
        if ep is None:
            log.error("OTEL_TRACES_EXPORTER names %r, which is not installed; no spans go there", name[:40])
            continue
        provider.add_span_processor(BatchSpanProcessor(ep.load()()))
    trace.set_tracer_provider(provider)


def configure_logging(fmt: str, level: int = logging.INFO) -> None:
    """Root logging to stderr as ``json`` (one object per line) or ``text`` (the default)."""
    root = logging.getLogger()
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    for handler in root.handlers:
        if getattr(handler, "_tracker", False):
            handler.setFormatter(formatter)
            break
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler._tracker = True  # type: ignore[attr-defined]
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)
    _state["ids"] = True


def tracing() -> bool:
    """Whether spans go anywhere: a real tracer provider is installed (by :func:`configure` or the host)."""
    if _state["tracing"]:
        return True
    trace = sys.modules.get("opentelemetry.trace")  # (no import machinery on the hot path)
    if trace is None:
        return False
    if isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return False
    _state["tracing"] = True
    return True


# -- spans --------------------------------------------------------------------------------------


class _NoSpan:
    """What :func:`span` returns when neither tracing nor id-logging is on."""

    __slots__ = ()
    recording = False

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        return None

    def decided(self, result: Any) -> None:
        return None

    def rename(self, name: str) -> None:
        return None


NO_SPAN = _NoSpan()


class Span:
    """A span (when tracing) and the ids it names bound into the log context, for one ``with``."""

    __slots__ = ("name", "attributes", "_cm", "_span", "_token", "_ctx", "recording", "carrier", "kind")

    def __init__(self, name: str, attributes: dict[str, Any], *, carrier: Any = None, kind: Any = None) -> None:
        self.name = name
        self.attributes = attributes
        self.carrier = carrier  # headers whose trace context this span continues (a server span)
        self.kind = kind
        self._cm: Any = None
        self._span: Any = None
        self._token: Any = None
        self._ctx: Any = None
        self.recording = False

    def __enter__(self) -> Span:
        ids = {_LOG_KEYS[k]: str(v) for k, v in self.attributes.items() if k in _LOG_KEYS}
        if ids:
            self._token = _IDS.set({**(_IDS.get() or {}), **ids})
        if tracing():
            from opentelemetry import trace

            current = _IDS.get() or {}
            if "fleet" in current and FLEET not in self.attributes:
                self.attributes[FLEET] = current["fleet"]
            if self.carrier is not None:
                outer = trace.get_current_span()
                if outer.is_recording():  # the web framework's own server span (FastAPI's): use it
                    self._span, self.recording = outer, True
                    for k, v in self.attributes.items():
                        outer.set_attribute(k, v)
                    return self
                from opentelemetry import context
                from opentelemetry.propagate import extract

                self._ctx = context.attach(extract(_headers(self.carrier)))
            extra = {"kind": self.kind} if self.kind is not None else {}
            self._cm = trace.get_tracer("tracker").start_as_current_span(
                self.name,
                attributes=self.attributes,
                record_exception=False,
                set_status_on_exception=False,
                **extra,
            )
            self._span = self._cm.__enter__()
            self.recording = self._span.is_recording()
        return self

    def set(self, key: str, value: Any) -> None:
        if key in _LOG_KEYS and value is not None:
            ids = _IDS.get()
            if ids is not None:
                ids[_LOG_KEYS[key]] = str(value)  # this operation's own dict (copied on enter)
        if self.recording and value is not None and self._span.is_recording():  # (an adopted span may have ended)
            self._span.set_attribute(key, value)

    def rename(self, name: str) -> None:
        if self.recording and self._cm is not None:  # not the framework's span: it names its own
            self._span.update_name(name)

    def decided(self, result: Any) -> None:
        """Attributes of an observe's ``Result``: action, pressure, occupancy, basis, attempt."""
        d = getattr(result, "decision", None)
        if d is None:
            return
        self.set(ACTION, d.action)
        self.set(PRESSURE, d.pressure)
        self.set(OCCUPANCY, d.occupancy_bp)
        self.set(BASIS, d.basis)
        attempt = d.attempt or d.waiting_on
        if attempt is not None:
            self.set(ATTEMPT, attempt.attempt_id)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._span is not None and exc is not None and self.recording:
                from opentelemetry.trace import Status, StatusCode

                if isinstance(exc, TrackerError):
                    self._span.set_attribute(ERROR_CODE, exc.code)
                    self._span.set_status(Status(StatusCode.ERROR, exc.code))
                else:
                    self._span.record_exception(exc)
                    self._span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        finally:
            if self._cm is not None:
                self._cm.__exit__(exc_type, exc, tb)
            if self._ctx is not None:
                from opentelemetry import context

                context.detach(self._ctx)
            if self._token is not None:
                _IDS.reset(self._token)


def active() -> bool:
    """Whether :func:`span` makes spans now (tracing or id-logging is on): a caller that opens
    several spans in a row can ask once and skip building them when it is off."""
    return _state["tracing"] or _state["ids"] or tracing()


def span(name: str, **attributes: Any) -> Span | _NoSpan:
    """A span named ``name`` with ``attributes`` (keys: ``session_id`` … or ``tracker.*`` names).

    Short keys map to the vocabulary above (``session_id`` → ``tracker.session_id``); ``None``
    values are left out. No-op (the shared :data:`NO_SPAN`) unless tracing or id-logging is on.
    """
    if not (_state["tracing"] or _state["ids"] or tracing()):
        return NO_SPAN
    attrs = {_SHORT.get(k, k): v for k, v in attributes.items() if v is not None}
    return Span(name, attrs)


def route_selected(method: str, template: str) -> None:
    """A request answered without the framework's router (the API's hot routes): name the current
    server span by its route, as the router does when it selects one. Before the response is sent:
    the framework ends its span with the response, and an ended span keeps its name."""
    if not tracing():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.update_name(f"{method} {template}")
        span.set_attribute("http.route", template)


def server_span(method: str, headers: Any) -> Span | _NoSpan:
    """The span of one HTTP request: the framework's own server span when it made one (FastAPI
    does, when tracing is on), else a new SERVER span continuing the caller's ``traceparent``.
    Binds a fresh log context for the request either way."""
    if not (_state["tracing"] or _state["ids"] or tracing()):
        return NO_SPAN
    kind = None
    if _state["tracing"]:
        from opentelemetry.trace import SpanKind

        kind = SpanKind.SERVER
    return Span(method, {"http.request.method": method}, carrier=headers or (), kind=kind)


def _headers(carrier: Mapping[str, Any] | Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    if isinstance(carrier, Mapping):
        return {k: v for k, v in carrier.items() if isinstance(v, str)}
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in carrier}


_SHORT = {
    "fleet": FLEET,
    "session_id": SESSION,
    "basis": BASIS,
    "action": ACTION,
    "pressure": PRESSURE,
    "occupancy_bp": OCCUPANCY,
    "attempt_id": ATTEMPT,
    "quality": QUALITY,
    "error_code": ERROR_CODE,
    "model": MODEL,
}


# -- the service's hook: a span per command and per phase, one log line per command ------------------


class TelemetryHooks(TrackerHooks):
    """The Tracker's spans and log lines (attached when tracing or id-logging is on).

    A command is a span (``tracker.observe``, ``tracker.manual``, ``tracker.commit``,
    ``tracker.reject``, ``tracker.wait``) with the session, attempt and basis, then what it
    recorded (action, pressure, occupancy, count quality, the attempt it opened) and returned,
    or the code of its refusal; inside it ``tracker.coordination`` > (``tracker.decide``,
    ``tracker.append``). One log line per command: ``observe: compact``, ``commit refused: …``.
    """

    def command(
        self, name: str, session_id: str, attempt_id: str | None, basis: str | None
    ) -> AbstractContextManager[Any] | None:
        s = span("tracker." + name)
        if not isinstance(s, Span):
            return None
        s.attributes[SESSION] = session_id
        if attempt_id is not None:
            s.attributes[ATTEMPT] = attempt_id
        if basis is not None:
            s.attributes[BASIS] = basis
        return _Command(name, s)

    def after_command(self, name: str, session_id: str, result: Any) -> None:
        op = _OP.get()
        if op is None:
            return
        op.decided(result)
        attempt = getattr(result, "attempt_id", None)
        if isinstance(attempt, str):
            op.set(ATTEMPT, attempt)
        pressure = getattr(result, "pressure", None)
        if isinstance(pressure, str):
            op.set(PRESSURE, pressure)
        action = getattr(result, "action", None)
        op_log.info("%s: %s", name, action if isinstance(action, str) else "ok")

    def phase(self, name: str) -> AbstractContextManager[Any] | None:
        s = span("tracker." + name)
        return s if isinstance(s, Span) else None

    def after_record(self, op: str, session_id: str, outcome: Outcome) -> None:
        """The decision's attributes go on the command's span."""
        span_ = _OP.get()
        if span_ is None:
            return
        for e in outcome.events:
            if isinstance(e, ContextMeasured):  # the decision
                span_.set(ACTION, e.action)
                span_.set(PRESSURE, e.pressure)
                span_.set(OCCUPANCY, e.occupancy_bp)
                span_.set(BASIS, str(e.measurement.basis))
                span_.set(QUALITY, e.measurement.quality)
            elif isinstance(e, CompactionStarted):  # an attempt opened
                span_.set(ATTEMPT, e.attempt_id)


class _Command:
    """One command's span, current (and the span :meth:`TelemetryHooks.after_record` annotates) for its ``with``."""

    __slots__ = ("name", "span", "_token")

    def __init__(self, name: str, span: Span) -> None:
        self.name = name
        self.span = span
        self._token: Any = None

    def __enter__(self) -> _Command:
        self.span.__enter__()
        self._token = _OP.set(self.span)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._token is not None:
                _OP.reset(self._token)
            if isinstance(exc, TrackerError):
                op_log.info("%s refused: %s", self.name, exc.code)
        finally:
            self.span.__exit__(exc_type, exc, tb)


@contextmanager
def bound(**ids: str | None) -> Iterator[None]:
    """Bind log ids (``fleet=``, ``session_id=``, ``attempt_id=``) for the ``with`` body."""
    token = _IDS.set({**(_IDS.get() or {}), **{k: str(v) for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _IDS.reset(token)


def annotate(key: str, value: Any) -> None:
    """Set an attribute (``tracker.*`` name) on the current span and, for an id, in the log context."""
    if value is None:
        return
    if key in _LOG_KEYS:
        ids = _IDS.get()
        if ids is not None:
            ids[_LOG_KEYS[key]] = str(value)
    if _state["tracing"]:
        from opentelemetry import trace

        current = trace.get_current_span()
        if current.is_recording():
            current.set_attribute(key, value)


def current_ids() -> dict[str, str]:
    """The log ids bound now, with the current trace and span ids when a span records."""
    out = dict(_IDS.get() or {})
    if _state["tracing"]:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
            out["span_id"] = format(ctx.span_id, "016x")
    return out


# -- propagation across the Celery boundary ------------------------------------------------------


def inject() -> dict[str, str]:
    """The current trace context as message headers ({} when not tracing)."""
    if not tracing():
        return {}
    from opentelemetry.propagate import inject as _inject

    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


@contextmanager
def extracted(carrier: Mapping[str, Any] | Sequence[tuple[bytes, bytes]] | None) -> Iterator[None]:
    """Run the ``with`` body in the trace context the headers carry (a mapping, or ASGI's byte pairs)."""
    if not carrier or not tracing():
        yield
        return
    from opentelemetry import context
    from opentelemetry.propagate import extract

    token = context.attach(extract(_headers(carrier)))
    try:
        yield
    finally:
        context.detach(token)


# -- log formats --------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the ids of the operation."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(current_ids())
        if record.exc_info and record.exc_info[1] is not None:
            out["error"] = type(record.exc_info[1]).__name__
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; the operation's ids follow in brackets when there are any."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = current_ids()
        if ids:
            line += " [" + " ".join(f"{k}={v}" for k, v in ids.items()) + "]"
        return line
