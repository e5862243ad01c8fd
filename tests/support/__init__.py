"""The tests' one harness (never shipped in the wheel).

* ``db``       scratch PostgreSQL databases (``scratch_database``), the test servers' URLs
* ``api``      ``api_server(**settings)``: ``tracker serve`` over a fresh database, with fleets and keys
* ``cli``      ``Cli``: the one runner of ``tracker …`` subprocesses; ``clean_env``
* ``procs``    free ports, a port probe, private Redis servers, the PostgreSQL server's log
* ``workers``  a Celery count worker the tests can kill
* ``counters``, ``fake_provider``  test doubles (misbehaving counters, a fake token-counting provider)
"""
