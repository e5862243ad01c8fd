"""The tests' one harness (never shipped in the wheel).

* ``db``       scratch PostgreSQL databases (``scratch_database``), the test servers' URLs
* ``api``      ``api_server(**settings)``: ``tracker serve`` over a fresh database, with fleets and keys
* ``cli``      ``Cli``: the one runner of ``tracker …`` commands (``run_tracker``); ``clean_env``
* ``zygote``   the pre-imported interpreter each ``tracker …`` command is forked from
* ``procs``    free ports, a port probe, private Redis servers, the PostgreSQL server's log,
               ``racing_context()`` (racing processes forked from a preloaded server)
* ``workers``  a Celery count worker the tests can kill
* ``counters``, ``fake_provider``  test doubles (misbehaving counters, a fake token-counting provider)
"""
