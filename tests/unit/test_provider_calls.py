"""The framework-free side of a model call (tracker/integrations/_provider.py): which errors are a
provider's context-length rejection, and how an inclusive input total maps to the tracker's fields."""

from __future__ import annotations

import pytest

from tracker.integrations._provider import Usage, context_length_error, report_usage_kwargs

ANTHROPIC = "prompt is too long: 201234 tokens > 200000 maximum"


class BadRequest(Exception):
    """An SDK error shaped like openai's: ``code`` and ``body`` beside the message."""

    def __init__(self, message, code=None, body=None):
        super().__init__(message)
        self.code, self.body = code, body


class ModelContextWindowExceededError(Exception):
    """pydantic-ai's category, by name."""


@pytest.mark.parametrize(
    "exc",
    [
        Exception(ANTHROPIC),
        BadRequest(f"Error code: 400 - {{'type': 'error', 'error': {{'message': '{ANTHROPIC}'}}}}"),
        BadRequest("Error code: 400 - {'error': {...}}", code="context_length_exceeded"),
        BadRequest("Error code: 400", body={"error": {"code": "context_length_exceeded"}}),
        ModelContextWindowExceededError("status_code: 400, model_name: m, body: {}"),
    ],
)
def test_a_context_length_rejection_is_recognised(exc):
    assert context_length_error(exc) == str(exc)


def test_a_wrapped_rejection_is_found_in_the_cause_chain():
    try:
        try:
            raise Exception(ANTHROPIC)
        except Exception as inner:
            raise RuntimeError("the model call failed") from inner
    except RuntimeError as outer:
        assert context_length_error(outer) == ANTHROPIC


@pytest.mark.parametrize(
    "exc",
    [
        Exception("Error code: 429 - rate limited"),
        BadRequest("Error code: 400 - invalid tool schema", code="invalid_request_error"),
        Exception("prompt is too long: 100 tokens > 200000 maximum"),  # a count under the limit is not trusted
        Exception(""),
    ],
)
def test_other_errors_are_not(exc):
    assert context_length_error(exc) is None


def test_an_inclusive_total_loses_its_cache_counts():
    assert Usage.inclusive(350, output_tokens=240, cache_read_tokens=100, cache_write_tokens=200) == Usage(
        50, 240, 100, 200
    )
    assert Usage.inclusive(350).billed_tokens == 350
    # cache counts above the total cannot be inside it: they were reported beside it
    assert Usage.inclusive(10, cache_read_tokens=100) == Usage(10, None, 100, None)
    assert Usage.inclusive(None) is None and Usage.inclusive(0) is None and Usage.inclusive(-3) is None
    assert Usage.inclusive(True) is None


def test_the_report_sends_only_what_is_known():
    assert report_usage_kwargs("r1:habc", Usage(50, None, 100, None)) == {
        "basis": "r1:habc",
        "input_tokens": 50,
        "cache_read_tokens": 100,
    }
