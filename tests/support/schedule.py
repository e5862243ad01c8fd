"""Which tests run alone, beside what, and in what order: the lists ``tests/conftest.py`` schedules the
parallel run by (its module doc says how).
"""

from __future__ import annotations

# CPU-sensitive tests (16-process races, latency ratios, wall-clock budgets): one group, so they never
# race each other for the machine's cores. (A test may also say so itself: @pytest.mark.xdist_group("serial").)
SERIAL_MODULES = {
    "tests.integration.test_service_race",
    "tests.integration.test_store_concurrency",
    "tests.integration.test_hot_path",
    "tests.integration.test_fleets_race",
    # the topologies' races: processes racing through a restarted PgBouncer or a failing-over Redis, on a
    # replica's feed under writers (their counts of acknowledged writes and killed connections need the CPU)
    "tests.integration.test_topology_pgbouncer",
    "tests.integration.test_topology_redis",
    "tests.integration.test_topology_replica",
    # a LangChain and an AI SDK agent process racing for one basis (tests/e2e/test_cross_language_race.py)
    "tests.e2e.test_cross_language_race",
}
# Tests that write on PostgreSQL and read the event feed at once: the feed shows an event only when every
# transaction older than it has ended on the whole server (any database), so another test's migration or
# open transaction beside them would hide their own writes. They run alone too.
SERIAL_TESTS = {
    "tests.integration.test_store_contract": {
        "test_read_all_is_ordered_and_pages",
        "test_read_all_session_prefix_filters_exactly_and_pages",
    },
    # holds a transaction open to hold the feed back (which would hide every other test's feed reads)
    "tests.integration.test_calibration_book": {"test_own_reports_count_at_once_and_others_after_a_refresh"},
}


# Serial tests that must not share the CPU either (the ``cpu`` lock, exclusively).
ALONE_MODULES = {
    "tests.integration.test_hot_path",  # wake-up counts and the scale bench's timings
    "tests.integration.test_topology_replica",  # replication lag within a bound
    "tests.e2e.test_topology_balancer",  # each replica's share of a fleet's requests
}
ALONE_TESTS = {
    "tests.e2e.test_api_hostile": {"test_open_waits_of_one_fleet_leave_another_fleets_observe_p99_within_2x"}
}
# Integration and e2e modules that never touch the PostgreSQL server (SQLite, Redis, a broker, node):
# they need no ``pg`` lock, so the second worker runs them while the first runs the races.
NO_POSTGRES_MODULES = {
    "tests.e2e.test_typescript_client",
    "tests.e2e.test_streaming",
    "tests.integration.test_counting_celery",
    "tests.integration.test_calibration_fleets",
    "tests.e2e.test_cli_hostile",
    "tests.e2e.test_cli_output",
    "tests.e2e.test_replay_html",
    "tests.e2e.test_whatif_cli",
    "tests.e2e.test_store_scope",
    "tests.e2e.test_counting_processes",
    "tests.e2e.test_console_views",
    "tests.e2e.test_packaging",
    "tests.integration.test_provider_metrics",
    "tests.integration.test_story_why",
}
# The modules that take longest (minutes of CPU between them) go first in their tier, so that no
# worker is left alone with one of them at the end.
LONGEST_FIRST = (
    "test_typescript_client",
    "test_streaming",
    "test_counting_celery",
    "test_calibration_fleets",
    "test_readme",
    "test_console",
    "test_cli_e2e",
    "test_api_hostile",
    "test_integrations_openai_agents",
    "test_counting_celery",
    "test_api",
    "test_api_fuzz",
    "test_cli_hostile",
    "test_integrations_langchain",
    "test_story_reads",
    "test_service",
)
