"""The tests' one harness (never shipped in the wheel). ``plugin`` (registered by tests/conftest.py) owns
the fixtures, the markers (``feed``, ``serial``) and the parallel run; test modules import the rest from
here, never from another test module.

* ``db``, ``pg_cluster``  scratch PostgreSQL databases, the private cluster; ``api``: ``tracker serve``
  (``api_server(**settings)``) with fleets and keys, and the HTTP calls the API tests make
* ``cli``, ``zygote``  ``Cli``: the one runner of ``tracker …`` commands, forked from a pre-imported interpreter
* ``procs``, ``workers``, ``browser``  free ports, private Redis servers, the PostgreSQL log, racing
  processes; a Celery count worker the tests can kill; Chromium for the console
* ``bench``  what the tests use of the shipped bench (servers, workers, the simulated provider, ...)
* ``loopback``, ``redis_topologies``, ``pgbouncer``, ``replicas``, ``races``  production topologies started
  for real, and the races run through them
* ``service_suite``  the service tests every store runs; ``measurements``, ``requests``, ``toy_store``,
  ``whatif_traces``, ``core_caller``, ``counters``, ``fake_provider``, ... shared inputs and test doubles
"""
