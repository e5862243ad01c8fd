"""The demo's slow counter: counts like the heuristic counter, after a pause.

``tracker demo`` names it in its models file (``"counter": "tracker.demo.counters:SlowCounter"``)
for one model, so now and then a count takes longer than ``count_timeout_s`` and the demo
shows a real, recorded ``CountTimeout``.
"""

from __future__ import annotations

import time

from tracker.counting.base import CountResult, ModelSpec
from tracker.counting.counters import HeuristicCounter
from tracker.counting.request import CanonicalRequest


class SlowCounter(HeuristicCounter):
    """Sleeps ``options.sleep_s`` seconds (default 3), then counts heuristically."""

    name = "demo_slow"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        time.sleep(float(model.options.get("sleep_s", 3.0)))
        return super().count(request, model)
