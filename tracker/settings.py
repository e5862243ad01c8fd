"""Settings from the environment (prefix ``TRACKER_``), one place for every default.

=========================  ===============================================  ==========================
variable                   meaning                                          default
=========================  ===============================================  ==========================
TRACKER_DATABASE_URL       SQLAlchemy URL of the event store                ``sqlite:///.tracker/tracker.db``
TRACKER_REDIS_URL          Redis for cross-process coordination             none: in-process locks
TRACKER_BROKER_URL         Celery broker for counting workers               none: count in-process
TRACKER_RESULT_BACKEND     Celery result backend                            the broker if Redis, else Redis on localhost
TRACKER_MODELS_FILE        JSON file of extra / overriding model entries     none
TRACKER_LOCK_TTL_S         Redis session-lock time to live                  5
TRACKER_<POLICY FIELD>     every Policy field, e.g. TRACKER_COMPACT_AT_BP   SPEC §3 defaults
=========================  ===============================================  ==========================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from tracker.core.policy import Policy
from tracker.errors import InvalidInput

DEFAULT_DATABASE_URL = "sqlite:///.tracker/tracker.db"


def normalise_database_url(url: str) -> str:
    """Accept libpq-style URLs and point them at psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str | None = None
    broker_url: str | None = None
    result_backend: str | None = None
    models_file: str | None = None
    lock_ttl_s: float = 5.0
    policy: Policy = field(default_factory=Policy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get("TRACKER_" + name)
            return value if value else None

        ttl = get("LOCK_TTL_S")
        try:
            lock_ttl = float(ttl) if ttl else 5.0
        except ValueError:
            raise InvalidInput("TRACKER_LOCK_TTL_S", f"must be a number, got {ttl!r}") from None
        return cls(
            database_url=normalise_database_url(get("DATABASE_URL") or DEFAULT_DATABASE_URL),
            redis_url=get("REDIS_URL"),
            broker_url=get("BROKER_URL"),
            result_backend=get("RESULT_BACKEND"),
            models_file=get("MODELS_FILE"),
            lock_ttl_s=lock_ttl,
            policy=Policy.from_env(env),
        )

    def env(self) -> dict[str, str]:
        """The same settings as environment variables (for child processes)."""
        out = {"TRACKER_DATABASE_URL": self.database_url}
        for key, value in (("REDIS_URL", self.redis_url), ("BROKER_URL", self.broker_url),
                           ("RESULT_BACKEND", self.result_backend), ("MODELS_FILE", self.models_file)):
            if value:
                out["TRACKER_" + key] = value
        for name, value in self.policy.to_data().items():
            out["TRACKER_" + name.upper()] = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        return out
