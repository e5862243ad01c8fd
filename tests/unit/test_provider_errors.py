"""Context-length rejections (tracker/core/provider_errors.py) over real messages and hostile input.

The real messages are in tests/unit/vectors/provider_rejections.json, each with the public
thread it was reported in and the numbers it states.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracker.core.provider_errors import MAX_MESSAGE_CHARS, PROVIDERS, ParsedRejection, parse_context_length_error
from tracker.errors import InvalidInput

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "vectors" / "provider_rejections.json").read_text(encoding="utf-8")
)["vectors"]


def _as_expected(parsed: ParsedRejection | None) -> dict[str, Any] | None:
    if parsed is None:
        return None
    return {
        "form": parsed.form,
        "input_tokens": parsed.input_tokens,
        "input_limit": parsed.input_limit,
        "limit": parsed.limit,
        "output_tokens": parsed.output_tokens,
    }


@pytest.mark.parametrize("vector", VECTORS, ids=[f"{i}:{v['provider']}" for i, v in enumerate(VECTORS)])
def test_real_messages(vector: dict[str, Any]) -> None:
    parsed = parse_context_length_error(vector["message"])
    assert _as_expected(parsed) == vector["expected"], vector["source"]
    if parsed is not None:
        assert parsed.provider == vector["provider"]
        data = parsed.to_data()
        assert data["input_limit"] == parsed.input_limit and data["provider"] == parsed.provider
        json.dumps(data)


def test_the_vectors_cover_every_provider_and_name_their_source() -> None:
    for v in VECTORS:
        assert "github.com/" in v["source"], v
    for provider in PROVIDERS:
        parsed = [v for v in VECTORS if v["provider"] == provider]
        assert len(parsed) >= 8, provider
        assert any(v["expected"]["input_tokens"] is not None for v in parsed), provider
    assert sum(1 for v in VECTORS if v["expected"] is None) >= 8


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # the total requested is not the input: the messages' share is
        (
            "This model's maximum context length is 4000 tokens. However, you requested 5000 tokens "
            "(4000 in the messages, 1000 in the completion).",
            ("openai.breakdown", 4000, 3000),
        ),
        # functions count as input
        (
            "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
            "(6000 in the messages, 1000 in the functions, 2000 in the completion).",
            ("openai.breakdown", 7000, 6192),
        ),
        # parts that do not add up to the total are not trusted: only the limit is read
        (
            "This model's maximum context length is 4000 tokens. However, you requested 6000 tokens "
            "(4000 in the messages, 1000 in the completion).",
            ("openai.limit_only", None, 4000),
        ),
        # a count that does not exceed the limit contradicts the wording: not trusted
        ("prompt is too long: 5 tokens > 200000 maximum", None),
        ("The input token count (100) exceeds the maximum number of tokens allowed (1048576).", None),
        # comma-grouped numbers
        ("prompt is too long: 1,050,000 tokens > 1,000,000 maximum", ("anthropic.prompt_too_long", 1050000, 1000000)),
        # badly grouped or overlong numbers are not numbers
        ("prompt is too long: 1,05,000 tokens > 1000000 maximum", None),
        ("prompt is too long: 12345678901234567890 tokens > 200000 maximum", None),
        ("prompt is too long: 2012345678901234 tokens > 200000 maximum", None),  # 16 digits
        # digits of other scripts are not read as numbers
        (
            "prompt is too long: \u0662\u0660\u0661\u0662\u0663\u0664 tokens > \u0662\u0660\u0660\u0660\u0660\u0660 maximum",
            None,
        ),
        ("prompt is too long: \uff12\uff10\uff11\uff12\uff13\uff14 tokens > 200000 maximum", None),
        # a control character splits a number: not a number
        ("prompt is too long: 201\x00234 tokens > 200000 maximum", None),
        ("prompt is too long:\x0b201234 tokens > 200000 maximum", ("anthropic.prompt_too_long", 201234, 200000)),
        # case does not matter
        ("PROMPT IS TOO LONG: 201234 TOKENS > 200000 MAXIMUM", ("anthropic.prompt_too_long", 201234, 200000)),
        # other numbers around the wording are never read
        (
            "req 999999999 at 2026-01-01 12:00:00: HTTP 400: prompt is too long: 201234 tokens > 200000 maximum (retry 3 of 5)",
            ("anthropic.prompt_too_long", 201234, 200000),
        ),
        ("", None),
        ("rate limit: Requested 50000 tokens, limit 30000 tokens per min (TPM)", None),
        (
            "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 50000.",
            None,
        ),
    ],
)
def test_never_fooled(message: str, expected: tuple[str, int | None, int | None] | None) -> None:
    parsed = parse_context_length_error(message)
    if expected is None:
        assert parsed is None
    else:
        assert parsed is not None
        assert (parsed.form, parsed.input_tokens, parsed.input_limit) == expected


@pytest.mark.parametrize(
    "message",
    [
        "prompt is too long: " * 500_000,  # 10 MB of the opening words
        "prompt is too long: " + "9" * 5_000_000 + " tokens > 1 maximum",
        "prompt is too long:" + " " * 5_000_000 + "1 tokens > 0 maximum",
        "This model's maximum context length is " + "1," * 2_000_000,
        "The input token count (" + "(" * 3_000_000,
        "input length and `max_tokens` exceed context limit: " + "1 + " * 1_000_000,
        "\x00\x1f\x7f\ud800" * 1_000_000,
        "a" * 10_000_000,
    ],
    ids=["opening-words", "digits", "spaces", "commas", "parens", "pluses", "control", "letters"],
)
def test_hostile_input_is_handled_in_bounded_time(message: str) -> None:
    start = time.perf_counter()
    parse_context_length_error(message)
    assert time.perf_counter() - start < 2.0


def test_only_the_head_of_a_message_is_read() -> None:
    wording = "prompt is too long: 201234 tokens > 200000 maximum"
    assert parse_context_length_error(" " * (MAX_MESSAGE_CHARS - len(wording)) + wording) is not None
    assert parse_context_length_error(" " * MAX_MESSAGE_CHARS + wording) is None


def test_a_message_that_is_not_text_is_refused() -> None:
    for bad in (None, 42, b"prompt is too long: 201234 tokens > 200000 maximum", {"message": "x"}):
        with pytest.raises(InvalidInput) as err:
            parse_context_length_error(bad)  # type: ignore[arg-type]
        assert err.value.field == "message"


def test_the_input_limit_when_the_limit_bounds_input_and_output() -> None:
    parsed = parse_context_length_error("input length and `max_tokens` exceed context limit: 1000 + 64000 > 60000")
    assert parsed is not None and parsed.limit_includes_output
    assert (parsed.input_tokens, parsed.output_tokens, parsed.limit, parsed.input_limit) == (1000, 64000, 60000, 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "prompt is too long: ",
                    " tokens > ",
                    " maximum",
                    "This model's maximum context length is ",
                    " tokens. However, you requested ",
                    " in the messages, ",
                    " in the completion)",
                    "The input token count (",
                    ") exceeds the maximum number of tokens allowed (",
                    "input length and `max_tokens` exceed context limit: ",
                    " + ",
                    " > ",
                    "(",
                    ")",
                    ",",
                ]
            ),
            st.integers(min_value=0, max_value=10**17).map(str),
            st.text(max_size=20),
        ),
        max_size=30,
    )
)
def test_any_text_parses_to_none_or_to_numbers_it_states(pieces: list[str]) -> None:
    message = "".join(pieces)
    parsed = parse_context_length_error(message)
    if parsed is None:
        return
    assert parsed.provider in PROVIDERS
    digits = message.replace(",", "")
    for n in (parsed.input_tokens, parsed.limit, parsed.output_tokens):
        assert n is None or (0 <= n < 10**15 and str(n) in digits)
    if parsed.input_tokens is not None and parsed.limit is not None:
        used = parsed.input_tokens + (parsed.output_tokens or 0 if parsed.limit_includes_output else 0)
        assert used > parsed.limit
