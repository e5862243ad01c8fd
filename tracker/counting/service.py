"""Counting backends: measure a complete request into a validated core ``Measurement``.

::

    backend.measure(request, model="gpt-4o", basis=Basis(1, "msg-7"), policy=policy) -> Measurement

Order of work (both backends):

1. the request is parsed into its canonical form (``InvalidInput`` naming the field);
2. the model is looked up and its input limit computed (``ContextLimitUnknown`` — before
   any counting);
3. the counter's declared quality is checked against ``policy.counter_policy``
   (``QualityMismatch`` — before any counting);
4. the counter runs under ``policy.count_timeout_s`` — in a worker thread
   (:class:`InProcessCounting`) or on a Celery worker (:class:`CeleryCounting`);
   no valid count in time is ``CountTimeout``;
5. what it reported is validated by :func:`validate_count` (the one function both
   paths use) into a ``Measurement``.

Unexpected exceptions raised by a counter are reported as ``CountTimeout`` with
``cause="counter_error"``: no valid count was produced within the budget, and SPEC §7
keeps failures to five kinds.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tracker.core.model import Basis, Measurement, ModelRef, is_int
from tracker.core.policy import Policy
from tracker.counting.counters import CountResult, deadline_scope
from tracker.counting.registry import ModelRegistry, ModelSpec
from tracker.counting.request import CanonicalRequest
from tracker.errors import (
    ContextLimitUnknown,
    CountError,
    CountTimeout,
    InvalidCountModel,
    InvalidInput,
    MalformedMeasurement,
    QualityMismatch,
    count_error_from_dict,
)

if TYPE_CHECKING:  # pragma: no cover
    from celery import Celery

log = logging.getLogger(__name__)

TASK_NAME = "workers.tasks.count"
DEFAULT_QUEUE = "tracker.count"
CELERY_SLACK_S = 0.25
HARD_LIMIT_EXTRA_S = 1.0


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
    request_data: Any, model: str, *, timeout_s: float | None, registry: ModelRegistry | None = None
) -> dict[str, Any]:
    """The body of the Celery ``count`` task. Never raises a CountError: failures travel as data.

    Returns ``{"ok": true, "result": {input_tokens, model, quality, fingerprint}}`` or
    ``{"ok": false, "error": CountError.to_dict()}``.
    """
    started = time.monotonic()
    deadline = started + timeout_s if timeout_s else None
    try:
        registry = registry or worker_registry()
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


_worker_registry: ModelRegistry | None = None
_worker_registry_lock = threading.Lock()


def worker_registry() -> ModelRegistry:
    """The registry of this worker process (defaults + TRACKER_MODELS_FILE), built once."""
    global _worker_registry
    if _worker_registry is None:
        with _worker_registry_lock:
            if _worker_registry is None:
                _worker_registry = ModelRegistry.from_settings()
    return _worker_registry


# -- backends --------------------------------------------------------------------------------


class CountingBackend:
    """Measure a complete request for a model under a policy. Raises the typed CountErrors."""

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
        raw = self._count(req, spec, policy.count_timeout_s)
        return validate_count(
            raw, request=req, spec=spec, declared_quality=declared, policy=policy, basis=basis, input_limit=input_limit
        )

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:  # pragma: no cover
        raise NotImplementedError

    def warm(self) -> None:
        """Load what the first count would otherwise load (encodings)."""

    def close(self) -> None:
        pass


class _DaemonPool:
    """Daemon worker threads, created on demand up to ``max_workers`` and then reused.

    Daemon threads, so a hung counter never blocks interpreter exit; reused, so a count
    does not pay for a thread start. ``submit`` refuses (returns False) when every
    thread is busy — with hung counters, say — instead of queueing behind them.
    """

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._queue: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
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


def _on_pool_before(pool: Any, fn: Callable[[], Any], deadline: float, spec: ModelSpec, timeout_s: float, *,
                    saturated: str, late: str) -> Any:
    """Run ``fn`` on a daemon thread of ``pool``; its result or error, or ``CountTimeout`` at ``deadline``.

    The caller is never held past the deadline: a hung ``fn`` is abandoned to its thread.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # delivered to the caller below
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


class InProcessCounting(CountingBackend):
    """Runs the counter on a daemon thread of this process, waiting at most ``count_timeout_s``.

    A hung counter never hangs the caller: its thread is abandoned to finish (or not) on
    its own. While ``max_inflight`` threads are all busy with hung counters, further
    counts fail at once with ``CountTimeout`` (cause ``saturated``).
    """

    def __init__(self, registry: ModelRegistry | None = None, *, max_inflight: int = 64) -> None:
        self.registry = registry or ModelRegistry.from_settings()
        self.max_inflight = max_inflight
        self._pool = _DaemonPool(max_inflight)

    def warm(self) -> None:
        from tracker.counting.counters import load_encoding

        for name in {self.registry.get(n).encoding for n in self.registry.names()} - {None}:
            load_encoding(name)  # type: ignore[arg-type]

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        return _on_pool_before(
            self._pool, lambda: run_counter(self.registry, request, spec, deadline), deadline, spec, timeout_s,
            saturated=f"{self.max_inflight} counts already in flight (hung counters?)",
            late=f"counter {spec.counter!r} gave no count within {timeout_s:g}s",
        )


class CeleryCounting(CountingBackend):
    """Sends the count to a Celery worker; waits at most ``count_timeout_s + slack_s``.

    The task carries ``expires`` and soft / hard time limits (``count_timeout_s`` /
    ``+1 s``). Past the wait the task is revoked and ``CountTimeout`` raised — whether
    the worker is slow, dead, killed mid-task or absent, or the broker / result backend
    is unreachable. A failure inside the worker comes back as data and is raised here as
    the same typed error.

    Sending and waiting run on a small pool of daemon threads (each with its own
    thread-local Celery result backend), so nothing the broker client does — connection
    retries included — can hold the caller past its deadline.
    """

    def __init__(
        self,
        app: "Celery",
        registry: ModelRegistry | None = None,
        *,
        queue: str | None = None,
        slack_s: float = CELERY_SLACK_S,
        max_inflight: int = 64,
    ) -> None:
        self.app = app
        self.registry = registry or ModelRegistry.from_settings()
        self.queue = queue or app.conf.task_default_queue or DEFAULT_QUEUE
        self.slack_s = slack_s
        self.max_inflight = max_inflight
        self._pool = _DaemonPool(max_inflight)
        self.owns_app = False  # counting_from_settings made the app: close() closes it

    def close(self) -> None:
        if self.owns_app:
            self.app.close()

    def _count(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s + self.slack_s
        return _on_pool_before(
            self._pool, lambda: self._send_and_wait(request, spec, timeout_s, deadline - 0.03), deadline, spec,
            timeout_s,
            saturated=f"{self.max_inflight} counts already waiting on Celery",
            late=f"no count from Celery within {timeout_s:g}s (+{self.slack_s:g}s slack)",
        )

    def _send_and_wait(self, request: CanonicalRequest, spec: ModelSpec, timeout_s: float, deadline: float) -> Any:
        from celery.exceptions import TimeoutError as CeleryTimeout

        try:
            result = self.app.send_task(
                TASK_NAME,
                args=[request.to_dict(), spec.name],
                kwargs={"timeout_s": timeout_s},
                queue=self.queue,
                expires=timeout_s,
                soft_time_limit=timeout_s,
                time_limit=timeout_s + HARD_LIMIT_EXTRA_S,
                retry=False,
            )
        except Exception as exc:
            raise CountTimeout(
                f"{spec.name}: could not send the count: {type(exc).__name__}: {' '.join(str(exc).split())}",
                model=spec.name,
                cause="broker",
            ) from None
        try:
            payload = _wait_for_result(result, max(0.001, deadline - time.monotonic()))
        except CeleryTimeout:
            self._abandon(result)
            raise CountTimeout(
                f"{spec.name}: no count from a worker within {timeout_s:g}s (+{self.slack_s:g}s slack)",
                model=spec.name,
                cause="timeout",
                timeout_s=timeout_s,
                task_id=result.id,
            ) from None
        except Exception as exc:  # result backend trouble
            self._abandon(result)
            raise CountTimeout(
                f"{spec.name}: result backend failed: {type(exc).__name__}: {' '.join(str(exc).split())}",
                model=spec.name,
                cause="result_backend",
            ) from None
        if isinstance(payload, BaseException):  # the task itself failed (time limit, worker lost …)
            raise CountTimeout(
                f"{spec.name}: the count task failed: {type(payload).__name__}: {payload}",
                model=spec.name,
                cause="worker_error",
                task_id=result.id,
            )
        if not isinstance(payload, Mapping) or not isinstance(payload.get("ok"), bool):
            raise MalformedMeasurement(f"the worker returned {type(payload).__name__}, not a count", field="result")
        if not payload["ok"]:
            error = payload.get("error")
            if not isinstance(error, Mapping):
                raise MalformedMeasurement("the worker reported a failure without an error", field="error")
            raise count_error_from_dict(dict(error))
        return payload.get("result")

    def _abandon(self, result: Any) -> None:
        """Stop listening for the result and revoke the task (on this pool thread, not the caller's)."""
        try:
            remove = getattr(result.backend, "remove_pending_result", None)
            if remove is not None:
                remove(result)
        except Exception:  # pragma: no cover - best effort
            pass
        try:
            result.revoke()
        except Exception:  # pragma: no cover - broker down: the task expires anyway
            pass


WAIT_INTERVAL_S = 0.02


def _wait_for_result(result: Any, timeout: float) -> Any:
    """``AsyncResult.get(timeout, propagate=False)``, but precise to ~20 ms.

    Celery's ``get`` drains the Redis result channel in fixed one-second waits, so a
    timeout can overshoot by up to a second. This subscribes the same way, then drains
    in short waits (no extra Redis commands: it only waits on the subscribed socket).
    """
    from celery.exceptions import TimeoutError as CeleryTimeout

    backend = result.backend
    consumer = getattr(backend, "result_consumer", None)
    drainer = getattr(consumer, "drainer", None)
    if drainer is None or not hasattr(backend, "add_pending_result"):  # polling backends
        return result.get(timeout=timeout, propagate=False, interval=WAIT_INTERVAL_S)
    backend.add_pending_result(result)
    try:
        consumer.on_wait_for_pending(result)  # a result stored before we subscribed
        for _ in drainer.drain_events_until(result.on_ready, timeout=timeout, interval=min(WAIT_INTERVAL_S, timeout)):
            pass
    except socket.timeout:
        raise CeleryTimeout(f"no result within {timeout:.3f}s") from None
    value = result.maybe_throw(propagate=False)
    try:
        backend.remove_pending_result(result)
    except Exception:  # pragma: no cover - best effort unsubscribe
        pass
    return value


def counting_from_settings(
    env: Mapping[str, str] | None = None, *, registry: ModelRegistry | None = None
) -> CountingBackend:
    """Celery when ``TRACKER_BROKER_URL`` is set, else in-process counting."""
    env = dict(os.environ) if env is None else dict(env)
    registry = registry or ModelRegistry.from_settings(env)
    if env.get("TRACKER_BROKER_URL"):
        from workers.app import make_app

        backend = CeleryCounting(make_app(env), registry, queue=env.get("TRACKER_COUNT_QUEUE") or None)
        backend.owns_app = True
        return backend
    return InProcessCounting(registry)
