"""Counting: canonical requests, the model registry, counters and counting backends (behaviour.md "Policy", "Counting").

    from tracker.bootstrap import build_counting
    backend = build_counting(settings)          # Celery if TRACKER_BROKER_URL, else in-process
    m = backend.measure(request_dict, model="gpt-4o", basis=Basis(1, "msg-9"), policy=Policy())

The port (:mod:`tracker.counting.base`), the registry, the shipped counters and both backends
(Celery itself is imported only when a Celery app is made or a count sent).
"""

from tracker.counting.backends import InProcessCounting, MeasuringBackend
from tracker.counting.base import (
    QUALITY_EXACT_LOCAL,
    QUALITY_EXACT_PROVIDER,
    QUALITY_HEURISTIC,
    Counter,
    CountingBackend,
    CountResult,
    ModelSpec,
    deadline_scope,
    remaining_time,
)
from tracker.counting.celery import CeleryCounting
from tracker.counting.counters import (
    ExactLocalCounter,
    HeuristicCounter,
    chat_tokens,
    heuristic_text_tokens,
    load_encoding,
)
from tracker.counting.http import AnthropicHttpCounter, OpenAIHttpCounter
from tracker.counting.registry import ModelRegistry
from tracker.counting.request import CanonicalRequest, canonical_json, fingerprint_of

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
    "MeasuringBackend",
    "ModelRegistry",
    "ModelSpec",
    "OpenAIHttpCounter",
    "QUALITY_EXACT_LOCAL",
    "QUALITY_EXACT_PROVIDER",
    "QUALITY_HEURISTIC",
    "canonical_json",
    "chat_tokens",
    "deadline_scope",
    "fingerprint_of",
    "heuristic_text_tokens",
    "load_encoding",
    "remaining_time",
]
