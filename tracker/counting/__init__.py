"""Counting: canonical requests, the model registry, counters and counting backends (SPEC §3, §7).

    from tracker.counting import counting_from_settings
    backend = counting_from_settings()          # Celery if TRACKER_BROKER_URL, else in-process
    m = backend.measure(request_dict, model="gpt-4o", basis=Basis(1, "msg-9"), policy=Policy())
"""

from tracker.counting.counters import (
    QUALITY_EXACT_LOCAL,
    QUALITY_EXACT_PROVIDER,
    QUALITY_HEURISTIC,
    Counter,
    CountResult,
    ExactLocalCounter,
    HeuristicCounter,
    chat_tokens,
    heuristic_text_tokens,
    load_encoding,
)
from tracker.counting.http import AnthropicHttpCounter, OpenAIHttpCounter
from tracker.counting.registry import ModelRegistry, ModelSpec
from tracker.counting.request import CanonicalRequest, canonical_json, fingerprint_of
from tracker.counting.service import (
    CeleryCounting,
    CountingBackend,
    InProcessCounting,
    counting_from_settings,
    run_count_task,
    validate_count,
)

__all__ = [
    "AnthropicHttpCounter",
    "CanonicalRequest",
    "CeleryCounting",
    "CountResult",
    "Counter",
    "CountingBackend",
    "ExactLocalCounter",
    "HeuristicCounter",
    "InProcessCounting",
    "ModelRegistry",
    "ModelSpec",
    "OpenAIHttpCounter",
    "QUALITY_EXACT_LOCAL",
    "QUALITY_EXACT_PROVIDER",
    "QUALITY_HEURISTIC",
    "canonical_json",
    "chat_tokens",
    "counting_from_settings",
    "fingerprint_of",
    "heuristic_text_tokens",
    "load_encoding",
    "run_count_task",
    "validate_count",
]
