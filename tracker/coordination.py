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

Topologies (``TRACKER_REDIS_URL``, parsed by ``tracker.settings.parse_redis_url``):

* ``redis://``, ``rediss://``, ``unix://``: one server.
* ``redis+cluster://host:port[,host:port…]``: Redis Cluster (redis-py's ``RedisCluster``). A
  session's keys carry a hash tag, ``<prefix>{<session>}:lock`` and ``<prefix>{<session>}:wake``,
  so both live in one slot and the release script (two keys) is legal on a cluster. The
  attempt-ended hint is classic ``PUBLISH``: a cluster forwards it to every node over its bus,
  so one subscription on any node (the one ``ClusterPubSub`` picks for the channel) hears
  every publisher. Sharded pub/sub (``SPUBLISH``) would save that fan-out but ties the
  subscriber to one shard and drops it when the slot moves; the hint's rate (one per ended
  attempt) does not need it.
* ``redis+sentinel://host:port[,host:port…]/service``: the primary that Sentinel names
  (``Sentinel.master_for``). A connection to a primary that was demoted fails (``READONLY``)
  and reconnects to the new one; but after a *graceful* failover (``SENTINEL FAILOVER``) the
  old primary keeps answering as a primary until Sentinel reconfigures it, ~10 s later, so
  the coordinator also asks Sentinel who the primary is, at most every ``SENTINEL_CHECK_S``,
  and moves its connections (and the hint subscription) when the answer changed.

The cluster client is built lazily (``RedisCluster`` connects in its constructor): with the
cluster down a process still starts and runs uncoordinated, exactly as with one server down.
A failover is the same kind of outage: commands fail for a moment (connection refused,
``READONLY`` from a demoted primary, ``CLUSTERDOWN``, ``UNBLOCKED`` for a waiter), the
coordinator degrades, and the store's version check guards the appends meanwhile.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from tracker.settings import RedisTarget, parse_redis_url

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

#: how often a Sentinel coordinator asks which server is the primary (when it uses Redis at all)
SENTINEL_CHECK_S = 1.0

# redis-py is imported where Redis is used (a RedisCoordinator, a client), not with this module: a
# process without TRACKER_REDIS_URL (every CLI command on the embedded default) never loads it.


@functools.cache
def _unavailable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "Redis is not there right now" (down, failing over, resharding): run uncoordinated."""
    import redis
    from redis.exceptions import ClusterError, ReadOnlyError, RedisClusterException, TryAgainError

    return (
        redis.ConnectionError,
        redis.TimeoutError,
        OSError,
        ClusterError,  # CLUSTERDOWN, MASTERDOWN
        RedisClusterException,  # no node reachable, slot not covered
        TryAgainError,
        ReadOnlyError,  # a demoted primary behind a fixed address
    )


def _client_errors() -> tuple[type[BaseException], ...]:
    """What a redis-py client raises when its server or connection is gone (for ``except``)."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException, OSError)


def unavailable(exc: BaseException) -> bool:
    """True when ``exc`` says Redis is unreachable or changing hands (not a bug of ours)."""
    from redis.exceptions import ResponseError

    if isinstance(exc, _unavailable_errors()):
        return True
    # a blocked BLPOP is released with "-UNBLOCKED" when its server turns into a replica
    return isinstance(exc, ResponseError) and str(exc).startswith(("UNBLOCKED", "LOADING", "MASTERDOWN"))


def redis_client(url: str | RedisTarget, *, socket_timeout: float | None, connect_timeout: float) -> Any:
    """A redis-py client for any ``TRACKER_REDIS_URL`` topology (the cluster one connects here: may raise)."""
    import redis

    target = parse_redis_url(url) if isinstance(url, str) else url
    if target.kind == "single":
        return redis.Redis.from_url(target.url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.ssl:
        auth["ssl"] = True
    if target.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            **auth,
        )
    from redis.sentinel import Sentinel

    sentinel_kwargs: dict[str, Any] = {"socket_timeout": connect_timeout, "socket_connect_timeout": connect_timeout}
    if target.ssl:
        sentinel_kwargs["ssl"] = True
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    assert target.service is not None  # parse_redis_url requires it
    return sentinel.master_for(
        target.service, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout, db=target.db, **auth
    )


class _Client:
    """One redis-py client, built on first use and rebuilt after building it failed (a cluster that was down)."""

    def __init__(self, target: RedisTarget, socket_timeout: float | None, connect_timeout: float) -> None:
        self._target, self._timeout, self._connect = target, socket_timeout, connect_timeout
        self._client: Any = None
        self._guard = threading.Lock()

    def get(self) -> Any:
        client = self._client
        if client is None:
            with self._guard:
                if self._client is None:
                    try:
                        self._client = redis_client(
                            self._target, socket_timeout=self._timeout, connect_timeout=self._connect
                        )
                    except _client_errors() as exc:
                        from redis import ConnectionError as RedisConnectionError

                        raise RedisConnectionError(f"cannot reach the Redis {self._target.kind}: {exc}") from exc
                client = self._client
        return client

    def built(self) -> Any:
        """The client if it was built, else None (builds nothing)."""
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except _client_errors():  # pragma: no cover - closing a dead client
                pass


def _tag(session_id: str) -> str:
    """The session's hash tag: the id itself, unless braces in it would cut the tag short or empty it."""
    if "{" in session_id or "}" in session_id:
        import hashlib

        return hashlib.sha256(session_id.encode()).hexdigest()[:24]
    return session_id


class RedisCoordinator:
    """Session locks and attempt-ended hints on Redis: one server, a Cluster, or a Sentinel-watched primary.

    Keys: ``<prefix>{<session>}:lock`` and ``<prefix>{<session>}:wake`` (one slot per session on a
    cluster); channel ``<prefix>attempt-ended``.
    """

    def __init__(self, url: str, *, ttl_s: float = 5.0, wait_s: float | None = None, prefix: str = "tracker:") -> None:
        self._target = parse_redis_url(url)
        self._redis = _Client(self._target, 0.5, 0.5)
        # waiting for a wake-up blocks longer than a command may take on the other client
        self._waiter = _Client(self._target, WAKE_CHECK_S + 0.5, 0.5)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._wait_s = ttl_s if wait_s is None else wait_s
        self._prefix = prefix
        self._scripts: dict[int, Any] = {}
        self._channel = prefix + "attempt-ended"
        self._listeners = _Listeners()
        self._subscriber: threading.Thread | None = None
        self._subscriber_guard = threading.Lock()
        self._closed = threading.Event()
        self._down_since: float | None = None
        self._primary_checked = time.monotonic()

    @property
    def topology(self) -> str:
        """``single``, ``cluster`` or ``sentinel``."""
        return self._target.kind

    def keys(self, session_id: str) -> tuple[str, str]:
        """The session's lock key and wake-up list (same hash tag: same cluster slot)."""
        base = f"{self._prefix}{{{_tag(session_id)}}}"
        return base + ":lock", base + ":wake"

    def _degraded(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "Redis unreachable (%s): deciding uncoordinated; the event store's version check still guards", exc
            )

    def _follow_primary(self) -> None:
        """Sentinel: ask for the primary at most every SENTINEL_CHECK_S; idle connections to a former
        one are dropped (redis-py's pool does that when the address changed), so the next command
        goes to the new primary even while the old one still answers."""
        if self._target.kind != "sentinel":
            return
        now = time.monotonic()
        if now - self._primary_checked < SENTINEL_CHECK_S:
            return
        self._primary_checked = now
        for holder in (self._redis, self._waiter):
            client = holder.built()
            if client is not None:
                client.connection_pool.get_master_address()

    def _release(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts.get(id(client))
        if script is None:
            script = self._scripts[id(client)] = client.register_script(_RELEASE)
        return script(keys=keys, args=args)

    @contextmanager
    def session_lock(self, session_id: str) -> Iterator[bool]:
        key, wake = self.keys(session_id)
        token = uuid.uuid4().hex
        held = False
        deadline = time.monotonic() + self._wait_s
        try:
            self._follow_primary()
            client = self._redis.get()
            while True:
                if client.set(key, token, nx=True, px=self._ttl_ms):
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
                self._waiter.get().blpop([wake], timeout=min(WAKE_CHECK_S, max(0.001, deadline - time.monotonic())))
        except Exception as exc:
            if not unavailable(exc):
                raise
            self._degraded(exc)
        try:
            yield held
        finally:
            if held:
                try:
                    self._release(self._redis.get(), [key, wake], [token, self._ttl_ms])
                except Exception as exc:
                    if not unavailable(exc):
                        raise
                    self._degraded(exc)

    # -- attempt-ended hints: Redis pub/sub, one subscriber thread per process --------------------
    def attempt_ended(self, session_id: str) -> None:
        try:
            self._follow_primary()
            self._redis.get().publish(self._channel, session_id)
        except Exception as exc:
            if not unavailable(exc):
                raise
            self._degraded(exc)  # listeners fall back to polling

    def listen(self, listener: Listener) -> Callable[[], None]:
        stop = self._listeners.add(listener)
        with self._subscriber_guard:
            if self._subscriber is None:
                self._subscriber = threading.Thread(target=self._subscribe, name="tracker-attempt-ended", daemon=True)
                self._subscriber.start()
        return stop

    def _subscribe(self) -> None:
        """Receive hints until closed; reconnect with backoff when Redis goes away (or fails over)."""
        from redis import ConnectionError as RedisConnectionError

        backoff = 0.1
        while not self._closed.is_set():
            holder = _Client(self._target, None, 1.0)
            pubsub = None
            try:
                client = holder.get()
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                primary = client.connection_pool.get_master_address() if self.topology == "sentinel" else None
                checked = time.monotonic()
                backoff = 0.1
                while not self._closed.is_set():
                    if primary is not None and time.monotonic() - checked >= SENTINEL_CHECK_S:
                        checked = time.monotonic()
                        if client.connection_pool.get_master_address() != primary:
                            raise RedisConnectionError("the Sentinel primary moved: resubscribing there")
                    message = pubsub.get_message(timeout=min(1.0, SENTINEL_CHECK_S))
                    if message and message.get("type") == "message":
                        data = message["data"]
                        self._listeners.notify(data.decode() if isinstance(data, bytes) else str(data))
            except _client_errors() as exc:
                log.debug("attempt-ended subscription lost (%s); retrying", exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    if pubsub is not None:
                        pubsub.close()
                except _client_errors():  # pragma: no cover - a dead connection
                    pass
                holder.close()

    def close(self) -> None:
        self._closed.set()
        self._redis.close()
        self._waiter.close()


def coordinator_from_url(url: str | None, ttl_s: float = 5.0) -> Coordinator:
    """``RedisCoordinator`` for any ``TRACKER_REDIS_URL`` topology; ``LocalCoordinator`` without one."""
    return RedisCoordinator(url, ttl_s=ttl_s) if url else LocalCoordinator()
