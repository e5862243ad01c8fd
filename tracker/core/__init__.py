"""The pure decision core: no I/O, no clock reads, no globals.

Live decisions, replay and what-if all run this same code.
"""

from tracker.core.attempts import decide_commit, decide_manual, decide_reject, expire_leases
from tracker.core.calibration import Calibration, CalibrationSample, CalibrationState
from tracker.core.decide import Result, decide_count_failed, decide_measure
from tracker.core.events import EVENT_TYPES, DomainEvent
from tracker.core.ledger import CalibrationLedger, ModelSummary
from tracker.core.loopguard import LoopGuardEntry, ReclaimPlan, plan_reclaim
from tracker.core.model import (
    ACTIONS,
    EXACT_QUALITIES,
    FULL_SCALE_BP,
    HISTORY_SAFETY_FACTOR,
    MIN_SCOPE_CONFIDENCE,
    PRESSURES,
    QUALITIES,
    WINDOW_CEILING,
    Action,
    Basis,
    Measurement,
    ModelRef,
    Pressure,
    Quality,
    Reason,
    Trigger,
    check_session_id,
    check_text,
    occupancy_bp,
    resolve_input_limit,
)
from tracker.core.outcome import Decision, Outcome, outcome
from tracker.core.policy import POLICY_DOCS, Policy
from tracker.core.recorded import recorded_outcome
from tracker.core.reports import decide_rejection, decide_usage
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

__all__ = [
    # constants and vocabularies
    "FULL_SCALE_BP",
    "WINDOW_CEILING",
    "HISTORY_SAFETY_FACTOR",
    "MIN_SCOPE_CONFIDENCE",
    "QUALITIES",
    "EXACT_QUALITIES",
    "PRESSURES",
    "ACTIONS",
    "Quality",
    "Pressure",
    "Action",
    "Trigger",
    "Reason",
    # values
    "Basis",
    "Measurement",
    "ModelRef",
    "check_session_id",
    "check_text",
    "occupancy_bp",
    "resolve_input_limit",
    "Policy",
    "POLICY_DOCS",
    # thresholds (behaviour.md "Thresholds")
    "SCOPE_THRESHOLDS_BP",
    "Levels",
    "Threshold",
    "growth_fired",
    "history_budget",
    "levels",
    "resolve_threshold",
    "usage_fraction",
    # events and state
    "EVENT_TYPES",
    "DomainEvent",
    "Attempt",
    "SessionProjector",
    "SessionState",
    "apply",
    "fold",
    # decisions
    "Decision",
    "Result",
    "Outcome",
    "outcome",
    "decide_commit",
    "decide_count_failed",
    "decide_manual",
    "decide_measure",
    "decide_reject",
    "decide_rejection",
    "decide_usage",
    "expire_leases",
    "recorded_outcome",
    # calibration (behaviour.md "Calibration")
    "Calibration",
    "CalibrationLedger",
    "CalibrationSample",
    "CalibrationState",
    "ModelSummary",
    # the loop guard (behaviour.md "Loop-guard reclaim plan")
    "LoopGuardEntry",
    "ReclaimPlan",
    "plan_reclaim",
]
