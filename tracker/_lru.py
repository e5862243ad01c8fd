"""One small thread-safe LRU map, shared by the service's state cache and the store's projection cache.

    cache: LRU[str, int] = LRU(1000)
    cache.put("a", 1); cache.get("a")  # -> 1 (and "a" becomes the most recently used)
    cache.pop("a")                     # -> 1; discard(key) is the same without a result

Every method takes one lock, so a cache can be shared by request threads. The lock is
replaced in a forked child (a lock held by another thread at ``fork()`` would otherwise
stay held forever there); the entries are kept, since they are plain values.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

_MISSING = object()


class LRU(Generic[K, V]):
    """A bounded mapping that forgets the least recently used key beyond ``maxsize`` entries."""

    def __init__(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        _LIVE.add(self)

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        """The value for ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Set ``key`` (as the most recently used), dropping the oldest entries beyond ``maxsize``."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or None when it was not cached."""
        with self._lock:
            return self._data.pop(key, None)

    def discard(self, key: K) -> None:
        """Remove ``key`` if present."""
        with self._lock:
            self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


_LIVE: weakref.WeakSet[LRU] = weakref.WeakSet()


def _reset_locks_in_child() -> None:
    for cache in list(_LIVE):
        cache._after_fork()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_reset_locks_in_child)
