"""What a provider's context-length rejection says: the real input count and the real limit.

``parse_context_length_error(message)`` reads the message text of a rejection (as the
provider sent it, or as an SDK or gateway wraps it: ``Error code: 400 - {...}``, a JSON
body, a Bedrock ``The model returned the following errors: ...``) and returns a
:class:`ParsedRejection`, or None when the text is not a context-length rejection of a
known wording. Pure, and bounded: only the first ``MAX_MESSAGE_CHARS`` characters are
read, every pattern is anchored on a literal phrase with bounded repetitions (no nested
quantifiers), so hostile input (megabytes, control characters) costs linear time.

Wordings recognised (``form``; the sources of each are in
tests/unit/vectors/provider_rejections.json):

==============================  ======================================================================
form                            wording (``N`` input, ``O`` output, ``T`` total, ``M`` limit)
==============================  ======================================================================
``anthropic.prompt_too_long``   ``prompt is too long: N tokens > M maximum``
``anthropic.input_and_output``  ``input length and `max_tokens` exceed context limit: N + O > M``
``anthropic.unsized``           ``Prompt is too long`` and nothing after it (Vertex AI's 413)
``openai.messages``             ``maximum context length is M tokens. However, your messages resulted in N tokens``
``openai.breakdown``            ``... However, you requested T tokens (N in the messages, [F in the functions,] O in the completion)``
``openai.prompt_breakdown``     ``... however you requested T tokens (N in your prompt; O for the completion)`` (legacy completions)
``openai.configured_limit``     ``Input tokens exceed the configured limit of M tokens. Your messages resulted in N tokens``
``openai.context_window``       ``Your input exceeds the context window of this model`` (Responses API; no numbers)
``openai.limit_only``           ``maximum context length is M tokens`` with no count this parser trusts
``gemini.input_token_count``    ``The input token count (N) exceeds the maximum number of tokens allowed (M)``
``gemini.limit_only``           ``The input token count exceeds the maximum number of tokens allowed (M)``
``gemini.supports_up_to``       ``the input token count is N but model only supports up to M`` (Vertex AI)
==============================  ======================================================================

Never fooled: numbers are ASCII digits only (``[0-9]``, optionally grouped by commas), at
most 15 of them, taken only from their place in the wording (a request id, an HTTP status
or a byte size elsewhere in the text is never read), and a sized form whose numbers
contradict it (a total that is not the sum of its parts, a count that does not exceed the
limit) is not trusted: the next, less specific form is tried instead. ``provider`` names
whose *wording* it is (OpenAI-compatible servers such as vLLM or DeepSeek use OpenAI's).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracker.core.model import JSON_SAFE_INT
from tracker.errors import InvalidInput

__all__ = ["MAX_MESSAGE_CHARS", "PROVIDERS", "ParsedRejection", "parse_context_length_error"]

#: only this much of a message is read (the wording comes first in every known wrapper)
MAX_MESSAGE_CHARS = 65_536
PROVIDERS = ("anthropic", "openai", "gemini")


@dataclass(frozen=True)
class ParsedRejection:
    """A context-length rejection. Numbers are None where the wording does not state them.

    ``limit`` is the number the message names as the maximum; when ``limit_includes_output``
    it bounds input + requested output (``output_tokens``), and ``input_limit`` is what
    was left for the input: ``limit - output_tokens``.
    """

    provider: str
    form: str
    input_tokens: int | None = None
    limit: int | None = None
    output_tokens: int | None = None
    limit_includes_output: bool = False

    @property
    def input_limit(self) -> int | None:
        if self.limit is None:
            return None
        if self.limit_includes_output:
            if self.output_tokens is None:
                return None
            return max(0, self.limit - self.output_tokens)
        return self.limit

    def to_data(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "form": self.form,
            "input_tokens": self.input_tokens,
            "input_limit": self.input_limit,
            "limit": self.limit,
            "output_tokens": self.output_tokens,
            "limit_includes_output": self.limit_includes_output,
        }


# a count: 1-15 ASCII digits, or comma-grouped thousands; never followed by another digit
_N = r"([0-9]{1,3}(?:,[0-9]{3}){1,4}|[0-9]{1,15})(?![0-9]|,[0-9])"
_S = r"\s{1,16}"  # some whitespace (a wrapped message may break a line between words)
_O = r"\s{0,16}"  # optional whitespace
_FLAGS = re.IGNORECASE


def _num(text: str) -> int | None:
    value = int(text.replace(",", ""))
    return value if value <= JSON_SAFE_INT else None


_Builder = Callable[["re.Match[str]"], ParsedRejection | None]


def _anthropic_with_output(m: re.Match[str]) -> ParsedRejection | None:
    n, out, limit = _num(m[1]), _num(m[2]), _num(m[3])
    if n is None or out is None or limit is None or n + out <= limit:
        return None
    return ParsedRejection("anthropic", "anthropic.input_and_output", n, limit, out, limit_includes_output=True)


def _unsized(provider: str, form: str) -> _Builder:
    """A wording that states no numbers."""

    def build(m: re.Match[str]) -> ParsedRejection | None:
        return ParsedRejection(provider, form)

    return build


def _sized(provider: str, form: str, *, count: int = 1, limit: int = 2) -> _Builder:
    """A wording that states the input count (group ``count``) and the limit (group ``limit``):
    trusted only when the count exceeds the limit."""

    def build(m: re.Match[str]) -> ParsedRejection | None:
        n, max_ = _num(m[count]), _num(m[limit])
        if n is None or max_ is None or n <= max_:
            return None
        return ParsedRejection(provider, form, n, max_)

    return build


def _limit_only(provider: str, form: str) -> _Builder:
    """A wording that states the limit (group 1) and no count this parser trusts."""

    def build(m: re.Match[str]) -> ParsedRejection | None:
        limit = _num(m[1])
        return None if limit is None else ParsedRejection(provider, form, None, limit)

    return build


def _openai_breakdown(m: re.Match[str]) -> ParsedRejection | None:
    limit, total, messages, out = _num(m[1]), _num(m[2]), _num(m[3]), _num(m[5])
    functions = _num(m[4]) if m[4] is not None else 0
    if limit is None or total is None or messages is None or functions is None or out is None:
        return None
    n = messages + functions
    if n + out != total or total <= limit:
        return None
    return ParsedRejection("openai", "openai.breakdown", n, limit, out, limit_includes_output=True)


def _openai_prompt_breakdown(m: re.Match[str]) -> ParsedRejection | None:
    limit, total, n, out = _num(m[1]), _num(m[2]), _num(m[3]), _num(m[4])
    if limit is None or total is None or n is None or out is None or n + out != total or total <= limit:
        return None
    return ParsedRejection("openai", "openai.prompt_breakdown", n, limit, out, limit_includes_output=True)


_MAX_CTX = rf"maximum{_S}context{_S}length{_S}is{_S}{_N}{_S}tokens"

# most specific first; the first form whose pattern matches and whose numbers hold wins
_FORMS: tuple[tuple[re.Pattern[str], _Builder], ...] = (
    (
        re.compile(rf"prompt{_S}is{_S}too{_S}long:{_O}{_N}{_S}tokens{_O}>{_O}{_N}{_S}maximum", _FLAGS),
        _sized("anthropic", "anthropic.prompt_too_long"),
    ),
    (
        re.compile(
            rf"input{_S}length{_S}and{_S}`?max_tokens`?{_S}exceed{_S}context{_S}limit:{_O}{_N}{_O}\+{_O}{_N}{_O}>{_O}{_N}",
            _FLAGS,
        ),
        _anthropic_with_output,
    ),
    (
        re.compile(
            rf"{_MAX_CTX}\.{_S}However,{_S}you{_S}requested{_S}{_N}{_S}tokens{_O}\({_O}{_N}{_S}in{_S}the{_S}messages,"
            rf"(?:{_O}{_N}{_S}in{_S}the{_S}functions,)?{_O}{_N}{_S}in{_S}the{_S}completion{_O}\)",
            _FLAGS,
        ),
        _openai_breakdown,
    ),
    (
        re.compile(
            rf"{_MAX_CTX},{_S}however{_S}you{_S}requested{_S}{_N}{_S}tokens{_O}\({_O}{_N}{_S}in{_S}your{_S}prompt[;,]"
            rf"{_O}{_N}{_S}for{_S}the{_S}completion{_O}\)",
            _FLAGS,
        ),
        _openai_prompt_breakdown,
    ),
    (
        re.compile(rf"{_MAX_CTX}\.{_S}However,{_S}your{_S}messages{_S}resulted{_S}in{_S}{_N}{_S}tokens", _FLAGS),
        _sized("openai", "openai.messages", count=2, limit=1),
    ),
    (
        re.compile(
            rf"input{_S}tokens{_S}exceed{_S}the{_S}configured{_S}limit{_S}of{_S}{_N}{_S}tokens\.{_S}"
            rf"your{_S}messages{_S}resulted{_S}in{_S}{_N}{_S}tokens",
            _FLAGS,
        ),
        _sized("openai", "openai.configured_limit", count=2, limit=1),
    ),
    (
        re.compile(
            rf"the{_S}input{_S}token{_S}count{_O}\({_O}{_N}{_O}\){_O}exceeds{_S}the{_S}maximum{_S}number{_S}of{_S}"
            rf"tokens{_S}allowed{_O}\({_O}{_N}{_O}\)",
            _FLAGS,
        ),
        _sized("gemini", "gemini.input_token_count"),
    ),
    (
        re.compile(
            rf"the{_S}input{_S}token{_S}count{_S}is{_S}{_N}{_S}but{_S}(?:the{_S})?model{_S}only{_S}supports{_S}up{_S}to{_S}{_N}",
            _FLAGS,
        ),
        _sized("gemini", "gemini.supports_up_to"),
    ),
    (
        re.compile(
            rf"the{_S}input{_S}token{_S}count{_S}exceeds{_S}the{_S}maximum{_S}number{_S}of{_S}tokens{_S}allowed"
            rf"{_O}\(?{_O}{_N}",
            _FLAGS,
        ),
        _limit_only("gemini", "gemini.limit_only"),
    ),
    (re.compile(_MAX_CTX, _FLAGS), _limit_only("openai", "openai.limit_only")),
    (
        re.compile(rf"your{_S}input{_S}exceeds{_S}the{_S}context{_S}window{_S}of{_S}this{_S}model", _FLAGS),
        _unsized("openai", "openai.context_window"),
    ),
    # "Prompt is too long" as the whole message: end of text, a closing quote, a period or a brace next
    (
        re.compile(rf"prompt{_S}is{_S}too{_S}long(?={_O}(?:$|[\"'.}}\\]))", _FLAGS),
        _unsized("anthropic", "anthropic.unsized"),
    ),
)


def parse_context_length_error(message: str) -> ParsedRejection | None:
    """The rejection a provider's message states, or None when it is no known context-length wording."""
    if not isinstance(message, str):
        raise InvalidInput("message", f"must be a string, got {type(message).__name__}")
    text = message[:MAX_MESSAGE_CHARS]
    for pattern, build in _FORMS:
        for m in pattern.finditer(text):
            parsed = build(m)
            if parsed is not None:
                return parsed
    return None
