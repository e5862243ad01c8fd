"""Per-session coordination: who may run read → decide → append right now.

A lock here is an *optimisation*, never the guarantee. Correctness comes from
the event store: every append names the stream version its decision was made
on, and a moved version is a ``ConcurrencyConflict`` that makes the caller
re-read and re-decide. So when Redis loses its keys, is flushed, or is down,
two processes may both decide, but only one append lands and the other
re-decides on the new state (where the attempt is already open). The lock just
keeps such retries rare under contention.

* ``LocalCoordinator``: in-process locks (the embedded default).
* ``RedisCoordinator``: ``SET key token NX PX ttl`` to take, a Lua
  compare-and-delete to release, so a lock that expired and was taken by
  someone else is never released by the old holder. Waiters do not poll: a
  waiter blocks on the session's wake-up list (``BLPOP``), and a release pushes
  one wake-up onto it (the list keeps at most one, expiring with the lock's TTL),
  so the next waiter tries again at once. A waiter also re-tries every
  ``WAKE_CHECK_S`` on its own, which is how it notices a holder that died
  (its lock expires) or a flushed Redis. If Redis is unreachable it logs one
  warning and runs uncoordinated (the store still guards).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import redis

log = logging.getLogger("tracker.coordination")


Listener = Callable[[str], None]


class Coordinator(Protocol):
    def session_lock(self, session_id: str) -> AbstractContextManager[bool]:
        """Hold the session's lock; yields True when it is held, False when running uncoordinated."""

    def attempt_ended(self, session_id: str) -> None:
        """Tell the listeners (every process this coordinator reaches) that an attempt of the session ended.

        A hint that wakes long-polls early, never the truth: a listener re-reads the record, and
        one that misses a hint (Redis down, another coordinator) finds the end by polling.
        """

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(session_id)`` for every ended attempt (from another thread); returns ``stop``."""

    def close(self) -> None: ...


class _Listeners:
    """In-process listeners (called in the notifying thread; a failing one is logged and skipped)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._guard = threading.Lock()

    def add(self, listener: Listener) -> Callable[[], None]:
        with self._guard:
            self._listeners.append(listener)

        def stop() -> None:
            with self._guard:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def notify(self, session_id: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(session_id)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the command that notified
                log.exception("attempt-ended listener failed")


class LocalCoordinator:
    """One lock per session while anyone holds or waits for it; forgotten afterwards (bounded memory)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        self._guard = threading.Lock()
        self._listeners = _Listeners()

    @contextmanager
    def session_lock(self, session_id: str) -> Iterator[bool]:
        with self._guard:
            lock, users = self._locks.get(session_id, (None, 0))
            lock = lock or threading.Lock()
            self._locks[session_id] = (lock, users + 1)
        try:
            with lock:
                yield True
        finally:
            with self._guard:
                _, users = self._locks[session_id]
                if users <= 1:
                    del self._locks[session_id]
                else:
                    self._locks[session_id] = (lock, users - 1)

    def attempt_ended(self, session_id: str) -> None:
        self._listeners.notify(session_id)

    def listen(self, listener: Listener) -> Callable[[], None]:
        return self._listeners.add(listener)

    def close(self) -> None:
        pass


# KEYS: lock, wake-up list; ARGV: token, TTL in ms
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1])
  redis.call('lpush', KEYS[2], '1')
  redis.call('ltrim', KEYS[2], 0, 0)
  redis.call('pexpire', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

#: a waiter re-tries the lock at least this often without a wake-up (a holder that died, a flush)
WAKE_CHECK_S = 0.5


class RedisCoordinator:
    def __init__(
        self, url: str, *, ttl_s: float = 5.0, wait_s: float | None = None, prefix: str = "tracker:lock:"
    ) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        # waiting for a wake-up blocks longer than a command may take on the other client
        self._waiter = redis.Redis.from_url(url, socket_timeout=WAKE_CHECK_S + 0.5, socket_connect_timeout=0.5)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._wait_s = ttl_s if wait_s is None else wait_s
        self._prefix = prefix
        self._release = self._redis.register_script(_RELEASE)
        self._url = url
        self._channel = prefix + "attempt-ended"
        self._listeners = _Listeners()
        self._subscriber: threading.Thread | None = None
        self._subscriber_guard = threading.Lock()
        self._closed = threading.Event()
        self._down_since: float | None = None

    def _degraded(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "Redis unreachable (%s): deciding uncoordinated; the event store's version check still guards", exc
            )

    @contextmanager
    def session_lock(self, session_id: str) -> Iterator[bool]:
        key = self._prefix + session_id
        wake = key + ":wake"
        token = uuid.uuid4().hex
        held = False
        deadline = time.monotonic() + self._wait_s
        try:
            while True:
                if self._redis.set(key, token, nx=True, px=self._ttl_ms):
                    held = True
                    if self._down_since is not None:
                        log.warning("Redis reachable again: coordination restored")
                        self._down_since = None
                    break
                if time.monotonic() >= deadline:
                    log.warning(
                        "session lock %s not acquired in %.1fs: deciding uncoordinated", session_id, self._wait_s
                    )
                    break
                self._waiter.blpop([wake], timeout=min(WAKE_CHECK_S, max(0.001, deadline - time.monotonic())))
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._degraded(exc)
        try:
            yield held
        finally:
            if held:
                try:
                    self._release(keys=[key, wake], args=[token, self._ttl_ms])
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    self._degraded(exc)

    # -- attempt-ended hints: Redis pub/sub, one subscriber thread per process --------------------
    def attempt_ended(self, session_id: str) -> None:
        try:
            self._redis.publish(self._channel, session_id)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._degraded(exc)  # listeners fall back to polling

    def listen(self, listener: Listener) -> Callable[[], None]:
        stop = self._listeners.add(listener)
        with self._subscriber_guard:
            if self._subscriber is None:
                self._subscriber = threading.Thread(target=self._subscribe, name="tracker-attempt-ended", daemon=True)
                self._subscriber.start()
        return stop

    def _subscribe(self) -> None:
        """Receive hints until closed; reconnect with backoff when Redis goes away."""
        backoff = 0.1
        while not self._closed.is_set():
            client = redis.Redis.from_url(self._url, socket_timeout=None, socket_connect_timeout=1.0)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                backoff = 0.1
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message.get("type") == "message":
                        data = message["data"]
                        self._listeners.notify(data.decode() if isinstance(data, bytes) else str(data))
            except (redis.RedisError, OSError) as exc:
                log.debug("attempt-ended subscription lost (%s); retrying", exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    pubsub.close()
                    client.close()
                except (redis.RedisError, OSError):  # pragma: no cover - closing a dead connection
                    pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._redis.close()
            self._waiter.close()
        except (redis.RedisError, OSError):  # pragma: no cover - closing a dead connection
            pass


def coordinator_from_url(url: str | None, ttl_s: float = 5.0) -> Coordinator:
    return RedisCoordinator(url, ttl_s=ttl_s) if url else LocalCoordinator()
