"""Counting backends: measure a complete request into a validated core ``Measurement``.

::

    backend.measure(request, model="gpt-4o", basis=Basis(1, "msg-7"), policy=policy) -> Measurement

Order of work (both backends, :class:`MeasuringBackend`):

1. the request is parsed into its canonical form (``InvalidInput`` naming the field);
2. the model is looked up and its input limit computed (``ContextLimitUnknown`` — before
   any counting);
3. the counter's declared quality is checked against ``policy.counter_policy``
   (``QualityMismatch`` — before any counting);
4. the counter runs under ``policy.count_timeout_s`` — in a worker thread
   (:class:`InProcessCounting`) or on a Celery worker
   (:class:`~tracker.counting.celery.CeleryCounting`, whose task body is
   :func:`run_count_task`); no valid count in time is ``CountTimeout``;
5. what it reported is validated by :func:`validate_count` (the one function both
   paths use) into a ``Measurement``.

Unexpected exceptions raised by a counter are reported as ``CountTimeout`` with
``cause="counter_error"``: no valid count was produced within the budget, and behaviour.md "Counting"
keeps failures to five kinds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tracker import telemetry
from tracker.core.anchor import RequestShape
from tracker.core.model import Basis, Measurement, ModelRef, is_int
from tracker.core.policy import Policy
from tracker.counting.base import CountingBackend, CountResult, ModelSpec, deadline_scope
from tracker.counting.counters import content_kind
from tracker.counting.registry import ModelRegistry
from tracker.counting.request import CanonicalRequest
from tracker.errors import (
    ContextLimitUnknown,
    CountError,
    CountTimeout,
    InvalidCountModel,
    InvalidInput,
    MalformedMeasurement,
    QualityMismatch,
)

__all__ = [
    "CountingBackend",
    "DaemonPool",
    "InProcessCounting",
    "MeasuringBackend",
    "run_before_deadline",
    "run_count_task",
    "run_counter",
    "RequestHistory",
    "history_of",
    "shape_of",
    "validate_count",
]

log = logging.getLogger(__name__)


# -- validation (shared by every path) -------------------------------------------------------


def validate_count(
    raw: CountResult | Mapping[str, Any] | Any,
    *,
    request: CanonicalRequest,
    spec: ModelSpec,
    declared_quality: str,
    policy: Policy,
    basis: Basis,
    input_limit: int,
) -> Measurement:
    """Turn what a counter reported into a ``Measurement``, or raise the typed failure.

    - model must be the model asked for                      -> else InvalidCountModel
    - quality must be the counter's declared quality and
      allowed by ``policy.counter_policy``                    -> else QualityMismatch
    - input_tokens an int >= 0                                -> else MalformedMeasurement
    - fingerprint the request's                               -> else MalformedMeasurement
    - input_limit from the registry (> 0)                     -> else MalformedMeasurement
    """
    if isinstance(raw, CountResult):
        data: Mapping[str, Any] = raw.to_data()
    elif isinstance(raw, Mapping):
        data = raw
    else:
        raise MalformedMeasurement(f"the counter reported {type(raw).__name__}, not a count", field="result")
    for key in ("model", "quality", "input_tokens", "fingerprint"):
        if key not in data or data[key] is None:
            raise MalformedMeasurement("missing from the count", field=key, model=spec.name)
    model = data["model"]
    if model != spec.name:
        raise InvalidCountModel(
            f"{spec.name}: the counter reported a count for {model!r}", model=spec.name, reported_model=str(model)
        )
    quality = data["quality"]
    if quality != declared_quality:
        raise QualityMismatch(
            f"{spec.name}: counter {spec.counter!r} declares {declared_quality!r} but reported {quality!r}",
            model=spec.name,
            quality=str(quality),
            declared_quality=declared_quality,
        )
    if not policy.allows_quality(quality):
        raise QualityMismatch(
            f"{spec.name}: quality {quality!r} is not allowed by counter_policy {policy.counter_policy!r}",
            model=spec.name,
            quality=quality,
            counter_policy=policy.counter_policy,
        )
    tokens = data["input_tokens"]
    if not is_int(tokens) or tokens < 0:
        raise MalformedMeasurement(f"must be an integer >= 0, got {tokens!r}", field="input_tokens", model=spec.name)
    if data["fingerprint"] != request.fingerprint:
        raise MalformedMeasurement(
            "the count is of another request (fingerprint differs from the request's)",
            field="fingerprint",
            model=spec.name,
            expected=request.fingerprint,
            reported=str(data["fingerprint"]),
        )
    if not is_int(input_limit) or input_limit <= 0:
        raise MalformedMeasurement(f"must be an integer > 0, got {input_limit!r}", field="input_limit", model=spec.name)
    return Measurement(
        basis=basis,
        model=ModelRef(spec.provider, spec.name),
        fingerprint=request.fingerprint,
        input_tokens=tokens,
        input_limit=input_limit,
        quality=quality,
    )


@dataclass(frozen=True)
class RequestHistory:
    """A counted request's history digests and kind of content: its :class:`RequestShape` at any
    position, without reading the request again (the position is the anchor's of the state a
    decision is made on, known only then)."""

    digests: tuple[str, ...]  # d[0] .. d[messages] (CanonicalRequest.history_digests)
    content: str

    def shape(self, at: int | None = None) -> RequestShape:
        """The shape, with the digest through ``at`` messages when the request has that many (else
        no position: a shorter request cannot extend the anchor)."""
        n = len(self.digests) - 1
        if at is None or not is_int(at) or not 0 <= at <= n:
            return RequestShape(n, self.digests[n], content=self.content)
        return RequestShape(n, self.digests[n], at, self.digests[at], self.content)


def history_of(request: CanonicalRequest) -> RequestHistory:
    return RequestHistory(request.history_digests(), content_kind(request))


def shape_of(request: CanonicalRequest, at: int | None = None) -> RequestShape:
    """The request's shape (:meth:`RequestHistory.shape`)."""
    return history_of(request).shape(at)


def as_request(request: Any) -> CanonicalRequest:
    return request if isinstance(request, CanonicalRequest) else CanonicalRequest.from_dict(request)


# -- running a counter (in process, or in a Celery worker) -----------------------------------


def run_counter(registry: ModelRegistry, request: CanonicalRequest, spec: ModelSpec, deadline: float | None) -> Any:
    """Run the model's counter under ``deadline``; counter bugs become ``CountTimeout``."""
    try:
        counter = registry.counter_for(spec)
        with deadline_scope(deadline):
            return counter.count(request, spec)
    except CountError:
        raise
    except Exception as exc:
        if type(exc).__name__ == "SoftTimeLimitExceeded":  # Celery's soft time limit hit the counter
            raise CountTimeout(
                f"{spec.name}: counter {spec.counter!r} hit the worker's soft time limit",
                model=spec.name,
                cause="timeout",
            ) from None
        log.exception("counter %s crashed counting %s", spec.counter, spec.name)
        raise CountTimeout(
            f"{spec.name}: counter {spec.counter!r} failed: {type(exc).__name__}: {exc}",
            model=spec.name,
            cause="counter_error",
        ) from None


def run_count_task(
    request_data: Any, model: str, *, timeout_s: float | None, registry: ModelRegistry
) -> dict[str, Any]:
    """The body of the Celery ``count`` task (``workers.tasks``), counting with the worker's ``registry``.

    Never raises a CountError: failures travel as data.

    Returns ``{"ok": true, "result": {input_tokens, model, quality, fingerprint}}`` or
    ``{"ok": false, "error": CountError.to_dict()}``.
    """
    started = time.monotonic()
    deadline = started + timeout_s if timeout_s else None
    try:
        try:
            spec = registry.get(model)
        except ContextLimitUnknown:
            raise InvalidCountModel(f"{model}: this worker's registry has no such model", model=model) from None
        try:
            request = CanonicalRequest.from_dict(request_data)
        except InvalidInput as exc:
            raise MalformedMeasurement(f"the worker could not read the request: {exc}", field="request") from None
        raw = run_counter(registry, request, spec, deadline)
        if isinstance(raw, CountResult):
            raw = raw.to_data()
        elif not isinstance(raw, Mapping):
            raise MalformedMeasurement(f"the counter reported {type(raw).__name__}, not a count", field="result")
        return {"ok": True, "result": dict(raw), "duration_ms": int((time.monotonic() - started) * 1000)}
    except CountError as err:
        return {"ok": False, "error": _error_data(err)}
    except InvalidInput as err:  # a bad models file in the worker
        return {"ok": False, "error": _error_data(InvalidCountModel(f"worker registry: {err}", model=model))}


def _error_data(err: CountError) -> dict[str, Any]:
    data = err.to_dict()
    data["kind"] = err.kind
    return data


# -- backends --------------------------------------------------------------------------------


class MeasuringBackend:
    """The :class:`~tracker.counting.base.CountingBackend` both backends share: everything but running
    the counter (``_count``), which the in-process and Celery backends each do their way."""

    registry: ModelRegistry

    def measure(
        self,
        request: dict[str, Any] | CanonicalRequest,
        *,
        model: str,
        basis: Basis | str,
        policy: Policy,
    ) -> Measurement:
        req = as_request(request)
        basis = basis if isinstance(basis, Basis) else Basis.parse(basis)
        spec = self.registry.get(model)
        input_limit = self.registry.input_limit(spec, policy)
        declared = self.registry.declared_quality(spec)
        if not policy.allows_quality(declared):
            raise QualityMismatch(
                f"{spec.name}: counter {spec.counter!r} gives {declared!r}, not allowed by counter_policy "
                f"{policy.counter_policy!r}",
                model=spec.name,
                quality=declared,
                counter_policy=policy.counter_policy,
            )
        with telemetry.span("tracker.count", model=spec.name) as s:
            raw = self._count(req, spec, policy.count_timeout_s)
            m = validate_count(
                raw,
                request=req,
                spec=spec,
                declared_quality=declared,
                policy=policy,
                basis=basis,
                input_limit=input_limit,
            )
            s.set(telemetry.QUALITY, m.quality)
            return m

    def measure_history(
        self,
        request: dict[str, Any] | CanonicalRequest,
        *,
        model: str,
        basis: Basis | str,
        policy: Policy,
    ) -> tuple[Measurement, RequestHistory]:
        """``measure``, and the request's history (its shape at any position: anchoring)."""
        req = as_request(request)
        return self.measure(req, model=model, basis=basis, policy=policy), history_of(req)

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:  # pragma: no cover
        raise NotImplementedError

    def warm(self) -> None:
        """Load what the first count would otherwise load (encodings)."""

    def close(self) -> None:
        pass


class DaemonPool:
    """Daemon worker threads, created on demand up to ``max_workers`` and then reused.

    Daemon threads, so a hung counter never blocks interpreter exit; reused, so a count
    does not pay for a thread start. ``submit`` refuses (returns False) when every
    thread is busy — with hung counters, say — instead of queueing behind them.
    """

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._total = 0

    def submit(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            elif self._total < self.max_workers:
                self._total += 1
                threading.Thread(target=self._run, name=f"tracker-count-{self._total}", daemon=True).start()
            else:
                return False
        self._queue.put(fn)
        return True

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except BaseException:  # pragma: no cover - fn reports its own errors
                log.exception("count thread failed")
            finally:
                with self._lock:
                    self._idle += 1


def run_before_deadline(
    pool: DaemonPool,
    fn: Callable[[], Any],
    deadline: float,
    spec: ModelSpec,
    timeout_s: float,
    *,
    saturated: str,
    late: str,
) -> Any:
    """Run ``fn`` on a daemon thread of ``pool``; its result or error, or ``CountTimeout`` at ``deadline``.

    The caller is never held past the deadline: a hung ``fn`` is abandoned to its thread.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller below
            box["error"] = exc
        finally:
            done.set()

    if not pool.submit(target):
        raise CountTimeout(f"{spec.name}: {saturated}", model=spec.name, cause="saturated")
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise CountTimeout(f"{spec.name}: {late}", model=spec.name, cause="timeout", timeout_s=timeout_s)
    if "error" in box:
        raise box["error"]
    return box["result"]


class InProcessCounting(MeasuringBackend):
    """Runs the counter on a daemon thread of this process, waiting at most ``count_timeout_s``.

    A hung counter never hangs the caller: its thread is abandoned to finish (or not) on
    its own. While ``max_inflight`` threads are all busy with hung counters, further
    counts fail at once with ``CountTimeout`` (cause ``saturated``).
    """

    def __init__(self, registry: ModelRegistry | None = None, *, max_inflight: int = 64) -> None:
        self.registry = registry if registry is not None else ModelRegistry.load()
        self.max_inflight = max_inflight
        self._pool = DaemonPool(max_inflight)

    def warm(self) -> None:
        from tracker.counting.counters import load_encoding

        for name in self.registry.encodings():
            load_encoding(name)

    def close(self) -> None:
        """The registry's counters let go of their connections (``Tracker.close`` calls this)."""
        self.registry.close()

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:
        if spec.encoding is not None:
            # the encoding is loaded once per process, before the clock starts: ``count_timeout_s``
            # bounds counting, not the tokenizer's one-time set-up (local files, it cannot hang)
            from tracker.counting.counters import load_encoding

            load_encoding(spec.encoding)
        deadline = time.monotonic() + timeout_s
        return run_before_deadline(
            self._pool,
            lambda: run_counter(self.registry, request, spec, deadline),
            deadline,
            spec,
            timeout_s,
            saturated=f"{self.max_inflight} counts already in flight (hung counters?)",
            late=f"counter {spec.counter!r} gave no count within {timeout_s:g}s",
        )
