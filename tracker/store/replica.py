"""How far a read replica is behind its primary: :class:`LagProbe` (``/readyz``, the lag gauge).

The read side may read a PostgreSQL hot standby (``TRACKER_READ_DATABASE_URL``) that streams
the primary's WAL. A probe asks both servers, the primary first:

* ``lag_bytes``: WAL the primary has flushed (``pg_current_wal_flush_lsn()``, read first: every
  acknowledged commit under ``synchronous_commit`` on; only flushed WAL is streamed) that the
  standby has not replayed yet (``pg_last_wal_replay_lsn()``, read after): never more than the
  true figure at the second read.
* ``lag_s``: 0 when the standby has replayed everything the primary had flushed at the first
  read. Otherwise the smallest of these upper bounds of the age of the oldest commit it has not
  replayed: the time until it did replay that much, when it does within ``CATCH_UP_WAIT_S``
  (re-read a few times: WAL that keeps flowing, a bulk load or a vacuum without commits, is
  then measured in milliseconds, not as the age of the last commit); the age of the last
  commit it replayed (``now() - pg_last_xact_replay_timestamp()``, which alone would call an
  idle primary's one new non-commit record minutes of lag); and the time since this probe last
  saw it caught up (everything flushed before that moment was replayed). ``None`` when none is
  known (no commit replayed yet, never seen caught up).

A database that is not in recovery (the primary itself, SQLite, a promoted standby) has no lag:
0, 0. Errors are the store's typed errors (``StoreUnavailable`` when a server does not answer).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from tracker.store.errors import map_db_errors

__all__ = ["CATCH_UP_WAIT_S", "LagProbe", "ReplicaLag", "lsn_to_int"]

#: how long a probe re-reads a standby that is behind, waiting for it to reach the primary's position
#: long enough for WAL a background process wrote (flushed by the WAL writer every `wal_writer_delay`,
#: 200 ms by default, then streamed) to be replayed: a shorter wait called such a record lag
CATCH_UP_WAIT_S = 0.5

_PRIMARY_LSN = text("SELECT pg_current_wal_flush_lsn()::text")
_REPLAYED = text("SELECT pg_last_wal_replay_lsn()::text")
_REPLICA = text(
    "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text, "
    "extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8"
)


def lsn_to_int(lsn: str) -> int:
    """A WAL location as PostgreSQL prints it (``16/B374D848``) as a byte offset."""
    hi, _, lo = lsn.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


@dataclass(frozen=True)
class ReplicaLag:
    """One measurement: ``lag_s`` (None: not known yet), ``lag_bytes``, whether the read database is a standby."""

    lag_s: float | None
    lag_bytes: int
    in_recovery: bool

    def to_data(self) -> dict[str, Any]:
        data = asdict(self)
        if self.lag_s is not None:
            data["lag_s"] = round(self.lag_s, 3)
        return data


class LagProbe:
    """Measures the read database of ``replica`` against the primary ``primary`` (two engines;
    the same engine, or a non-PostgreSQL one, measures 0). Thread-safe; keeps only the time it
    last saw the standby caught up."""

    def __init__(self, primary: Engine, replica: Engine) -> None:
        self._primary, self._replica = primary, replica
        self._lock = threading.Lock()
        self._caught_up_at: float | None = None  # time.monotonic()

    def measure(self) -> ReplicaLag:
        if self._replica is self._primary or self._replica.dialect.name != "postgresql":
            with map_db_errors("replica_lag"), self._replica.connect() as conn:
                conn.execute(text("SELECT 1"))
            return ReplicaLag(0.0, 0, False)
        started = time.monotonic()
        with map_db_errors("replica_lag"):
            with self._replica.connect() as conn:  # a standby first: a primary here needs no second server
                in_recovery = bool(conn.execute(text("SELECT pg_is_in_recovery()")).scalar())
            if not in_recovery:
                return ReplicaLag(0.0, 0, False)
            with self._primary.connect() as conn:
                primary_lsn = lsn_to_int(str(conn.execute(_PRIMARY_LSN).scalar()))
            with self._replica.connect() as conn:
                in_recovery, replayed, replay_age = conn.execute(_REPLICA).one()
            if not in_recovery:  # promoted in between
                return ReplicaLag(0.0, 0, False)
            lag_bytes = max(0, primary_lsn - lsn_to_int(replayed)) if replayed else primary_lsn
            reached_after = None if lag_bytes else 0.0
            pause = 0.01
            while reached_after is None and time.monotonic() - started < CATCH_UP_WAIT_S:
                time.sleep(pause)
                pause *= 2
                with self._replica.connect() as conn:
                    again = conn.execute(_REPLAYED).scalar()
                if again is not None and lsn_to_int(str(again)) >= primary_lsn:
                    reached_after = time.monotonic() - started
        now = time.monotonic()
        with self._lock:
            if lag_bytes == 0:
                self._caught_up_at = max(self._caught_up_at or started, started)
                return ReplicaLag(0.0, 0, True)
            bounds = [max(0.0, float(replay_age))] if replay_age is not None else []
            if reached_after is not None:  # caught up with where the primary was at the start
                bounds.append(reached_after)
                self._caught_up_at = max(self._caught_up_at or started, started)
            if self._caught_up_at is not None:
                bounds.append(now - self._caught_up_at)
        return ReplicaLag(min(bounds) if bounds else None, lag_bytes, True)
