"""The pure decision core: no I/O, no clock reads, no globals.

Live decisions, replay and what-if all run this same code.
"""

from tracker.core.decide import (
    ACTIONS,
    PRESSURES,
    Decision,
    Outcome,
    decide_commit,
    decide_count_failed,
    decide_manual,
    decide_measure,
    decide_reject,
    expire_leases,
)
from tracker.core.events import EVENT_TYPES, DomainEvent, event_from_data
from tracker.core.model import (
    FULL_SCALE_BP,
    HISTORY_SAFETY_FACTOR,
    MIN_SCOPE_CONFIDENCE,
    WINDOW_CEILING,
    Basis,
    Measurement,
    ModelRef,
    check_session_id,
    occupancy_bp,
    resolve_input_limit,
)
from tracker.core.policy import Policy
from tracker.core.state import Attempt, SessionProjector, SessionState, apply, fold
from tracker.core.thresholds import (
    SCOPE_THRESHOLDS_BP,
    Levels,
    Threshold,
    growth_fired,
    history_budget,
    levels,
    resolve_threshold,
    usage_fraction,
)

__all__ = [name for name in dir() if not name.startswith("_")]
