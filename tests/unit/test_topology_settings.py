"""The settings of the production topologies, parsed in-process: Redis URLs (single, Cluster, Sentinel)
and the read replica's URL and lag (the topologies themselves run in tests/integration/test_topology_*.py)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from tracker.bootstrap import read_only_url
from tracker.errors import InvalidSetting
from tracker.settings import Settings, parse_redis_url


@pytest.mark.parametrize(
    "url",
    ["redis+foo://h:1", "http://h:1", "redis+cluster://", "redis+cluster://h:notaport", "redis+sentinel://h:26379"],
)
def test_an_unknown_or_malformed_redis_url_is_a_setting_error_naming_the_variable(url):
    with pytest.raises(InvalidSetting) as err:
        Settings.of(redis_url=url)
    assert err.value.field == "TRACKER_REDIS_URL"


def test_every_topology_url_parses():
    assert parse_redis_url("redis+cluster://a:7000,b:7001").nodes == (("a", 7000), ("b", 7001))
    s = parse_redis_url("rediss+sentinel://:pw@a,b:26380/main/2")
    assert (s.kind, s.nodes, s.service, s.db, s.ssl, s.password) == (
        "sentinel",
        (("a", 26379), ("b", 26380)),
        "main",
        2,
        True,
        "pw",
    )
    assert "pw" not in repr(s)
    assert parse_redis_url("redis://localhost:6379/0").kind == "single"


def test_the_settings_and_the_read_only_url():
    s = Settings.of(read_database_url="postgres://u:secret@replica:5432/db", read_max_lag_s=5)
    assert s.store.read_database_url == "postgresql+psycopg://u:secret@replica:5432/db"
    assert s.store.read_max_lag_s == 5.0 and Settings().store.read_database_url is None
    assert ("TRACKER_READ_DATABASE_URL", "postgresql+psycopg://u:********@replica:5432/db", "store") in s.describe()
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(InvalidSetting, match="TRACKER_READ_MAX_LAG_S"):
            Settings.load({"TRACKER_READ_MAX_LAG_S": bad})
    url = read_only_url("postgresql+psycopg://u@h/db?options=-c%20statement_timeout%3D5s")
    assert make_url(url).query["options"] == "-c statement_timeout=5s -c default_transaction_read_only=on"
    assert read_only_url(url) == url  # once
    assert read_only_url("postgresql+psycopg://u@h/db", "transaction") == "postgresql+psycopg://u@h/db"
    assert read_only_url("sqlite:///x.db") == "sqlite:///x.db"
