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
  someone else is never released by the old holder. If Redis is unreachable
  it logs one warning and runs uncoordinated (the store still guards).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import redis

log = logging.getLogger("tracker.coordination")


class Coordinator(Protocol):
    def session_lock(self, session_id: str) -> AbstractContextManager[bool]:
        """Hold the session's lock; yields True when it is held, False when running uncoordinated."""

    def close(self) -> None: ...


class LocalCoordinator:
    """One lock per session while anyone holds or waits for it; forgotten afterwards (bounded memory)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[threading.Lock, int]] = {}
        self._guard = threading.Lock()

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

    def close(self) -> None:
        pass


_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class RedisCoordinator:
    def __init__(
        self, url: str, *, ttl_s: float = 5.0, wait_s: float | None = None, prefix: str = "tracker:lock:"
    ) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._wait_s = ttl_s if wait_s is None else wait_s
        self._prefix = prefix
        self._release = self._redis.register_script(_RELEASE)
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
        token = uuid.uuid4().hex
        held = False
        deadline = time.monotonic() + self._wait_s
        delay = 0.001
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
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.005)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._degraded(exc)
        try:
            yield held
        finally:
            if held:
                try:
                    self._release(keys=[key], args=[token])
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    self._degraded(exc)

    def close(self) -> None:
        try:
            self._redis.close()
        except (redis.RedisError, OSError):  # pragma: no cover - closing a dead connection
            pass


def coordinator_from_url(url: str | None, ttl_s: float = 5.0) -> Coordinator:
    return RedisCoordinator(url, ttl_s=ttl_s) if url else LocalCoordinator()
