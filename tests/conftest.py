"""The tiers: ``tests/unit`` (no service, no subprocess), ``tests/integration`` (real PostgreSQL, Redis,
a Celery worker), ``tests/e2e`` (the CLI, ``tracker serve``, a browser). The fixtures, markers and the
parallel run are tests/support/plugin.py's; the helpers are in ``tests/support`` and test modules
import them from there, never from another test module.
"""

pytest_plugins = ["tests.support.plugin"]
