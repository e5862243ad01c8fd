"""The simulated provider lives in tracker/bench/sim_provider.py (the calibration bench uses it too)."""

from tracker.bench.sim_provider import *  # noqa: F403
from tracker.bench.sim_provider import TOOLS, Profile, SimProvider, Workload  # noqa: F401
