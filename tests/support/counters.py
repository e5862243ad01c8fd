"""Counters that misbehave on purpose, for tests.

The product knows nothing of them: a model reaches one only through a models file / dict
the test supplies, naming the counter by its import path (``"counter":
"tests.support.counters:SleepCounter"``), the way any extra counter is named. So every
failure kind can be produced by a real cause, in process or through a real Celery worker
(whose subprocess has the repository root on ``PYTHONPATH``, see
``tracker.bench.procs.WorkerProcess``).

=============================  ==================================  ===========================
model (counter class)          does                                caller sees
=============================  ==================================  ===========================
``sleep`` (SleepCounter)       sleeps ``options.sleep_s`` (5 s),   ``CountTimeout`` when slower
                               then counts heuristically           than ``count_timeout_s``
``test_wrong_model``           reports ``options.report_model``    ``InvalidCountModel``
``test_wrong_quality``         declares heuristic, reports         ``QualityMismatch``
                               ``exact_provider``
``test_negative_tokens``       reports ``-1`` tokens               ``MalformedMeasurement``
``test_float_tokens``          reports ``12.5`` tokens             ``MalformedMeasurement``
``test_missing_tokens``        reports no ``input_tokens``         ``MalformedMeasurement``
``test_wrong_fingerprint``     reports another request's          ``MalformedMeasurement``
                               fingerprint
``test_crash``                 raises ``RuntimeError``             ``CountTimeout`` (cause
                                                                   ``counter_error``)
=============================  ==================================  ===========================
"""

from __future__ import annotations

import time
from typing import Any

from tracker.counting.base import QUALITY_HEURISTIC, CountResult, ModelSpec
from tracker.counting.counters import heuristic_request_tokens
from tracker.counting.request import CanonicalRequest, Message, TextPart


class _TestCounter:
    name = "test"
    quality = QUALITY_HEURISTIC

    def honest(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        return CountResult(heuristic_request_tokens(request, model), model.name, self.quality, request.fingerprint)


class SleepCounter(_TestCounter):
    name = "sleep"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        time.sleep(float(model.options.get("sleep_s", 5.0)))
        return self.honest(request, model)


class WrongModelCounter(_TestCounter):
    name = "test_wrong_model"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        r = self.honest(request, model)
        return CountResult(
            r.input_tokens, str(model.options.get("report_model", "some-other-model")), r.quality, r.fingerprint
        )


class WrongQualityCounter(_TestCounter):
    name = "test_wrong_quality"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        r = self.honest(request, model)
        return CountResult(
            r.input_tokens, r.model, str(model.options.get("report_quality", "exact_provider")), r.fingerprint
        )


class NegativeTokensCounter(_TestCounter):
    name = "test_negative_tokens"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        r = self.honest(request, model)
        return CountResult(-1, r.model, r.quality, r.fingerprint)


class FloatTokensCounter(_TestCounter):
    name = "test_float_tokens"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        r = self.honest(request, model)
        return CountResult(12.5, r.model, r.quality, r.fingerprint)  # type: ignore[arg-type]


class MissingTokensCounter(_TestCounter):
    name = "test_missing_tokens"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> Any:
        r = self.honest(request, model)
        data = r.to_data()
        del data["input_tokens"]
        return data  # breaks the Counter contract on purpose


class WrongFingerprintCounter(_TestCounter):
    name = "test_wrong_fingerprint"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        # counts a different request (the one without its last message, as a stale cache would)
        other = CanonicalRequest(
            request.system, request.messages[:-1] or (Message("user", (TextPart("x"),)),), request.tools
        )
        r = self.honest(other, model)
        return CountResult(r.input_tokens, r.model, r.quality, other.fingerprint)


class CrashCounter(_TestCounter):
    name = "test_crash"

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        raise RuntimeError("the test counter crashed on purpose")


class UnknownQualityCounter(_TestCounter):
    """Declares a quality the core does not know: the registry refuses a model naming it."""

    name = "test_unknown_quality"
    quality = "roughly"  # type: ignore[assignment]

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:  # pragma: no cover - never loaded
        return self.honest(request, model)


TEST_COUNTERS: tuple[type[_TestCounter], ...] = (
    SleepCounter,
    WrongModelCounter,
    WrongQualityCounter,
    NegativeTokensCounter,
    FloatTokensCounter,
    MissingTokensCounter,
    WrongFingerprintCounter,
    CrashCounter,
)


def counter_path(cls: type) -> str:
    """The import path a models file names a counter class by: ``"module:Class"``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def test_models(sleep_s: float = 5.0) -> dict[str, Any]:
    """A models dict (for ``ModelRegistry.load`` or a TRACKER_MODELS_FILE): one model per test counter,
    named like the counter (``sleep``, ``test_crash`` …) and naming it by import path."""
    base = {"provider": "test", "window": 200_000, "max_output_tokens": 8192}
    models: dict[str, Any] = {cls.name: {**base, "counter": counter_path(cls)} for cls in TEST_COUNTERS}
    models["sleep"]["options"] = {"sleep_s": sleep_s}
    return {"models": models}


test_models.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
