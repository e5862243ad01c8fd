"""Every setting, read once from the environment (prefix ``TRACKER_``) with pydantic-settings.

This module is the only place in the project that reads ``TRACKER_*``. A process
calls :meth:`Settings.load` once at start and passes the typed sections down:

    Settings
    ├── store          StoreSettings          TRACKER_DATABASE_URL, TRACKER_DATABASE_POOLER,
    │                                         TRACKER_READ_DATABASE_URL, TRACKER_READ_MAX_LAG_S
    ├── coordination   CoordinationSettings   TRACKER_REDIS_URL, TRACKER_LOCK_TTL_S
    ├── counting       CountingSettings       TRACKER_BROKER_URL, TRACKER_RESULT_BACKEND, TRACKER_COUNT_QUEUE,
    │                                         TRACKER_MODELS_FILE
    ├── providers      ProviderSettings       TRACKER_ANTHROPIC_*, TRACKER_OPENAI_*
    ├── policy         Policy (the core's)    TRACKER_<POLICY FIELD>, e.g. TRACKER_COMPACT_AT_BP
    ├── api            ApiSettings            TRACKER_MAX_BODY_BYTES, TRACKER_API_KEY_CACHE_S, TRACKER_API_THREADS
    ├── calibration    CalibrationSettings    TRACKER_CALIBRATION, TRACKER_CALIBRATION_REFRESH_S
    ├── telemetry      TelemetrySettings      TRACKER_LOG_FORMAT, TRACKER_WORKER_METRICS_PORT
    └── bench          BenchSettings          TRACKER_BENCH_*

Variable names are flat (``TRACKER_<FIELD>``) whatever section holds the field, so every
name is unique across the tree (a test checks it). An invalid value raises
:class:`~tracker.errors.InvalidSetting` naming the variable; ``tracker`` (every command),
``tracker serve`` and ``tracker worker`` all stop at start with it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from tracker.core.policy import POLICY_DOCS, Policy
from tracker.errors import InvalidPolicy, InvalidSetting

#: a duration in seconds: a finite number above 0 (``SecondsOrZero``: 0 or more)
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
SecondsOrZero = Annotated[float, Field(ge=0, allow_inf_nan=False)]

ENV_PREFIX = "TRACKER_"
APP_DIR_NAME = "context-tracker"
#: how docs/configuration.md and ``Settings.variables()`` state the default; the effective path is per user
DEFAULT_DATABASE_DOC = "sqlite:///<user data dir>/context-tracker/tracker.db"

# The environment a load reads (set only inside Settings.load): os.environ unless given a mapping.
_ENV: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("tracker_settings_env", default=None)


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading the mapping given to ``Settings.load``."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = _ENV.get()
        if env is None:  # a section built outside Settings.load(): defaults and keywords only
            return {}
        return {
            (k if self.case_sensitive else k.lower()): v
            for k, v in env.items()
            if k[: len(ENV_PREFIX)].upper() == ENV_PREFIX and not (self.env_ignore_empty and v == "")
        }


class Section(BaseSettings):
    """One section of the tree: its fields are read from ``TRACKER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True, env_ignore_empty=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _MappingEnvSource(settings_cls)

    @classmethod
    def variables(cls) -> Iterator[tuple[str, Any, str]]:
        """(variable, default, description) of every field, for documentation and ``tracker info``."""
        for name, info in cls.model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            default = extra["doc_default"] if "doc_default" in extra else info.get_default(call_default_factory=True)
            yield ENV_PREFIX + name.upper(), default, info.description or ""


def normalize_database_url(url: str) -> str:
    """Accept libpq-style URLs (``postgres://``, ``postgresql://``) and point them at psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def user_data_dir(env: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """The per-user data directory of the tracker (where the embedded default database lives).

    Linux and other Unixes: ``$XDG_DATA_HOME/context-tracker`` (default ``~/.local/share/context-tracker``);
    macOS: ``~/Library/Application Support/context-tracker``; Windows: ``%LOCALAPPDATA%\\context-tracker``.
    ``env``: the environment to read ``HOME``, ``XDG_DATA_HOME`` and ``LOCALAPPDATA`` from (default: the
    one ``Settings.load`` is reading); a variable it does not set is read from ``os.environ``.
    """
    given = env if env is not None else (_ENV.get() or {})
    platform = platform or sys.platform

    def get(var: str) -> str:
        return (given[var] if var in given else os.environ.get(var)) or ""

    def home() -> Path:
        for var in ("HOME", "USERPROFILE"):
            if get(var):
                return Path(get(var))
        return Path.home()

    if platform == "win32":
        base = Path(get("LOCALAPPDATA")) if get("LOCALAPPDATA") else home() / "AppData" / "Local"
    elif platform == "darwin":
        base = home() / "Library" / "Application Support"
    else:
        xdg = get("XDG_DATA_HOME")
        base = Path(xdg) if xdg and Path(xdg).is_absolute() else home() / ".local" / "share"
    return base / APP_DIR_NAME


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for other databases and in-memory SQLite)."""
    if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(url[len("sqlite:///") :].split("?", 1)[0])


def default_database_url(env: Mapping[str, str] | None = None) -> str:
    """The embedded default: a SQLite file in the per-user data directory (one database per user)."""
    return "sqlite:///" + (user_data_dir(env) / "tracker.db").as_posix()


REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


@dataclasses.dataclass(frozen=True)
class RedisTarget:
    """What a ``TRACKER_REDIS_URL`` points at (parsed by :func:`parse_redis_url`; credentials kept out of repr).

    ``kind``: ``single`` (``redis://``, ``rediss://``, ``unix://``: ``url`` is handed to the client as it is),
    ``cluster`` (``nodes`` are startup nodes) or ``sentinel`` (``nodes`` are the sentinels, ``service``
    the monitored primary's name).
    """

    kind: Literal["single", "cluster", "sentinel"]
    url: str = dataclasses.field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    ssl: bool = False
    db: int = 0
    username: str | None = dataclasses.field(default=None, repr=False)
    password: str | None = dataclasses.field(default=None, repr=False)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a Redis URL of one of ``REDIS_SCHEMES``; ``ValueError`` says what is wrong (never the password).

    ``redis+cluster://[user:password@]host:port[,host:port…][/0]``: any reachable node will do, the
    client learns the others. ``redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]``:
    the credentials are the primary's (the sentinels are asked without). ``rediss+…``: TLS to every node.
    """
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"unknown scheme {scheme if sep else url[:20]!r}: use one of " + ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        )
    if scheme in ("redis", "rediss", "unix"):
        if scheme != "unix":
            _nodes(rest.split("/", 1)[0].rsplit("@", 1)[-1] or "localhost", 6379, allow_many=False)
        return RedisTarget("single", url, ssl=scheme == "rediss")
    netloc, _, path = rest.partition("/")
    path, _, _query = path.partition("?")
    username = password = None
    if "@" in netloc:
        creds, netloc = netloc.rsplit("@", 1)
        user, has_password, secret = creds.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if has_password else None)
    ssl = scheme.startswith("rediss")
    if scheme.endswith("+cluster"):
        nodes = _nodes(netloc, 6379)
        if path.strip("/") not in ("", "0"):
            raise ValueError(f"a Redis Cluster has only database 0, got /{path}")
        return RedisTarget("cluster", url, nodes, ssl=ssl, username=username, password=password)
    nodes = _nodes(netloc, 26379)
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError("a Sentinel URL names the primary's service: redis+sentinel://host:port[,host:port…]/service")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"the database after the service name must be a number, got {parts[1]!r}")
        db = int(parts[1])
    return RedisTarget(
        "sentinel", url, nodes, service=unquote(parts[0]), ssl=ssl, db=db, username=username, password=password
    )


def _nodes(netloc: str, default_port: int, allow_many: bool = True) -> tuple[tuple[str, int], ...]:
    items = netloc.split(",") if allow_many else [netloc]
    nodes = []
    for item in items:
        item = item.strip()
        if item.startswith("["):  # [v6]:port
            host, _, tail = item[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else ""
        else:
            host, _, port_text = item.partition(":") if item.count(":") <= 1 else (item, "", "")
        if not host:
            raise ValueError("a node without a host: give host:port[,host:port…]")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"not a port: {port_text!r} (node {host})")
        nodes.append((host, int(port_text) if port_text else default_port))
    return tuple(nodes)


class StoreSettings(Section):
    database_url: str = Field(
        default_factory=default_database_url,
        description="event store: a SQLAlchemy URL (`postgresql://…` uses psycopg 3; default an embedded SQLite "
        "file in the per-user data directory, see `tracker info`)",
        json_schema_extra={"doc_default": DEFAULT_DATABASE_DOC},
    )
    database_pooler: Literal["none", "transaction"] = Field(
        "none",
        description="`transaction`: the database URL is a transaction pooler (PgBouncer `pool_mode = transaction`): "
        "no server-side prepared statements",
    )

    read_database_url: str | None = Field(
        None,
        description="the read side (history, sessions listing, replay, export, the event feed, the console) on a "
        "streaming replica of the database, opened read-only; writes and decisions never read it (none: the "
        "reads go to TRACKER_DATABASE_URL)",
    )
    read_max_lag_s: Seconds = Field(
        30.0,
        description="`/readyz` answers 503 while the replica of TRACKER_READ_DATABASE_URL is more than this many "
        "seconds behind",
    )

    def model_post_init(self, _: Any) -> None:
        object.__setattr__(self, "database_url", normalize_database_url(self.database_url))
        if self.read_database_url is not None:
            object.__setattr__(self, "read_database_url", normalize_database_url(self.read_database_url))


class CoordinationSettings(Section):
    redis_url: str | None = Field(
        None,
        description="Redis for cross-process coordination: `redis://`, `rediss://`, `unix://`, "
        "`redis+cluster://host:port[,host:port…]`, `redis+sentinel://host:port[,…]/service` (and `rediss+…`); "
        "none: in-process locks",
    )
    lock_ttl_s: Seconds = Field(5.0, description="time to live of a Redis session lock, seconds")

    @field_validator("redis_url")
    @classmethod
    def _valid_redis_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_redis_url(value)  # a ValueError names what is wrong; Settings.load names the variable
        return value


class CountingSettings(Section):
    broker_url: str | None = Field(
        None, description="Celery broker for counting workers, Redis or RabbitMQ (none: count in-process)"
    )
    result_backend: str | None = Field(
        None, description="Celery result backend (default: the broker when it is Redis, else Redis on localhost)"
    )
    count_queue: str = Field(
        "tracker.count", min_length=1, description="queue the counts go to and the workers consume"
    )
    models_file: str | None = Field(None, description="JSON file of model registry entries to add or override")


class ProviderSettings(Section):
    anthropic_base_url: str = Field("https://api.anthropic.com", description="Anthropic API base URL (token counting)")
    anthropic_api_key: SecretStr | None = Field(
        None, description="Anthropic API key: exact counts for Anthropic models"
    )
    anthropic_version: str = Field("2023-06-01", description="`anthropic-version` header sent with count requests")
    openai_base_url: str = Field("https://api.openai.com", description="OpenAI API base URL (token counting)")
    openai_api_key: SecretStr | None = Field(None, description="OpenAI API key: provider counts for OpenAI models")


def _policy_section() -> type[Section]:
    """The policy section, generated from the core's ``Policy`` so its defaults live in one place."""
    defaults = Policy()
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(Policy):
        annotation = {"automatic": bool, "counter_policy": str, "turn_delta": float | None}.get(f.name)
        if annotation is None:
            annotation = type(getattr(defaults, f.name))
        fields[f.name] = (annotation, Field(getattr(defaults, f.name), description=POLICY_DOCS[f.name]))

    def off_is_none(value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() in ("none", "null", "off") else value

    validators = {"turn_delta_off": field_validator("turn_delta", mode="before")(off_is_none)}
    return create_model("PolicySettings", __base__=Section, __validators__=validators, **fields)


PolicySettings = _policy_section()


class ApiSettings(Section):
    max_body_bytes: int = Field(1 << 20, ge=1, description="HTTP bodies larger than this get 413 before parsing")
    api_key_cache_s: SecondsOrZero = Field(
        1.0,
        description="how long a server trusts a looked-up key (a revoked key works at most this long)",
    )
    api_threads: int = Field(40, ge=1, description="request threads per `tracker serve` process")
    max_waits_per_fleet: int = Field(
        100, ge=1, description="concurrent `wait` long-polls one fleet may hold per server process (beyond: 429)"
    )
    body_timeout_s: Seconds = Field(
        10.0,
        description="seconds a request body may take to arrive (beyond: 408 `body_timeout`, connection closed)",
    )


class CalibrationSettings(Section):
    calibration: bool = Field(
        True,
        description="decide on estimated counts corrected by the provider's billed usage (`off`: raw counts; "
        "usage and rejections are still recorded, and learned limits still apply)",
    )
    calibration_refresh_s: SecondsOrZero = Field(
        2.0,
        description="how often a process's background refresh reads new usage reports and rejections of other "
        "processes from the log (decisions never read it; at least 0.05 s apart)",
    )


class TelemetrySettings(Section):
    log_format: Literal["text", "json"] = Field(
        "text", description="`json`: one JSON object per log line, with fleet, session, attempt and trace ids"
    )
    worker_metrics_port: int | None = Field(
        None, ge=0, le=65535, description="port of a count worker's own Prometheus `/metrics` (none: not served)"
    )
    metrics: bool = Field(
        True,
        description="count decisions as Prometheus metrics (`tracker serve`: on its `/metrics`; the library and CLI: "
        "on prometheus_client's default registry)",
    )


class BenchSettings(Section):
    bench_pg: str | None = Field(
        None,
        description="Postgres server the bench makes scratch databases on (default: TRACKER_DATABASE_URL when Postgres)",
    )
    bench_redis: str | None = Field(None, description="Redis for the bench (default: TRACKER_REDIS_URL)")
    bench_broker: str | None = Field(None, description="Celery broker for the bench (default: TRACKER_BROKER_URL)")


class Settings(BaseModel):
    """The whole tree. ``Settings.load()`` reads the environment; ``Settings()`` is all defaults."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    SECTIONS: ClassVar[dict[str, type[Section]]] = {
        "store": StoreSettings,
        "coordination": CoordinationSettings,
        "counting": CountingSettings,
        "providers": ProviderSettings,
        "policy": PolicySettings,
        "api": ApiSettings,
        "calibration": CalibrationSettings,
        "telemetry": TelemetrySettings,
        "bench": BenchSettings,
    }

    store: StoreSettings = Field(default_factory=StoreSettings)
    coordination: CoordinationSettings = Field(default_factory=CoordinationSettings)
    counting: CountingSettings = Field(default_factory=CountingSettings)
    providers: ProviderSettings = Field(default_factory=ProviderSettings)
    policy: Policy = Field(default_factory=Policy)
    api: ApiSettings = Field(default_factory=ApiSettings)
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    bench: BenchSettings = Field(default_factory=BenchSettings)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every section from ``env`` (default ``os.environ``); raise ``InvalidSetting`` naming the variable."""
        token = _ENV.set(os.environ if env is None else env)
        try:
            sections: dict[str, Any] = {}
            for name, section in cls.SECTIONS.items():
                try:
                    sections[name] = section()
                except ValidationError as exc:
                    err = exc.errors()[0]
                    field = str(err["loc"][0]) if err["loc"] else name
                    raise InvalidSetting(ENV_PREFIX + field.upper(), _problem(err)) from None
            try:
                sections["policy"] = Policy(**sections["policy"].model_dump())
            except InvalidPolicy as exc:
                raise InvalidSetting(ENV_PREFIX + exc.field.upper(), exc.problem) from None
            return cls(**sections)
        finally:
            _ENV.reset(token)

    @classmethod
    def of(cls, **values: Any) -> Settings:
        """Settings from keyword values named like the variables, without ``TRACKER_`` (tests, embedding).

        ``Settings.of(database_url="sqlite:///x.db", redis_url=None, compact_at_bp=7000)`` – values are
        validated exactly as the environment's are.
        """
        return cls.load({ENV_PREFIX + k.upper(): _env_text(v) for k, v in values.items() if v is not None})

    @classmethod
    def variables(cls) -> Iterator[tuple[str, str, Any, str]]:
        """(section, variable, default, description) for every setting, in tree order."""
        for name, section in cls.SECTIONS.items():
            for variable, default, doc in section.variables():
                yield name, variable, default, doc

    def describe(self) -> list[tuple[str, str, str]]:
        """(variable, effective value, section) of every setting, secrets and passwords masked."""
        rows = []
        for name, section in self.SECTIONS.items():
            values = self.policy.to_data() if name == "policy" else getattr(self, name).model_dump()
            for field in section.model_fields:
                rows.append((ENV_PREFIX + field.upper(), mask(values.get(field)), name))
        return rows


def _problem(err: Mapping[str, Any]) -> str:
    value = err.get("input")
    if isinstance(value, str):
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        return f"{msg}, got {mask(value) if '://' in value else value!r}"
    return str(err.get("msg"))


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def mask(value: Any) -> str:
    """A value as text with any secret hidden: API keys entirely, the password inside a URL."""
    if value is None:
        return "(none)"
    if isinstance(value, SecretStr):
        return "********" if value.get_secret_value() else "(none)"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if "://" in text and "@" in text.split("://", 1)[1]:
        scheme, rest = text.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        if ":" in creds:
            creds = creds.split(":", 1)[0] + ":********"
        text = f"{scheme}://{creds}@{host}"
    return text
