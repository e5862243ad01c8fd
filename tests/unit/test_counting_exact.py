"""Exact local counting (vs tiktoken), the heuristic's conservativeness, fingerprints, the registry."""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import random
import textwrap
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.agent_request import AGENT_REQUEST, CODE, JSON_OUTPUT
from tests.support.counters import SleepCounter, counter_path
from tracker.bootstrap import build_registry
from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.counting import CanonicalRequest, ExactLocalCounter, HeuristicCounter, InProcessCounting, ModelRegistry
from tracker.counting.counters import ENCODINGS, heuristic_text_tokens, load_encoding, load_rank_bytes
from tracker.errors import ContextLimitUnknown, InvalidInput
from tracker.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGISTRY = ModelRegistry.load()
O200K_MODEL = REGISTRY.get("gpt-4o")
CL100K_MODEL = REGISTRY.get("gpt-4-turbo")


# -- tiktoken itself, fed the same rank data through its own cache (no network) --------------


@pytest.fixture(scope="module")
def tiktoken_encodings(tmp_path_factory):
    """``tiktoken.get_encoding`` built by tiktoken's own constructor (its pat_str, special tokens,
    hash check) from a private cache holding the rank files bpe-openai ships."""
    import tiktoken
    import tiktoken.registry

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    urls = {
        "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    }
    for name, url in urls.items():
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(load_rank_bytes(name))
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        for name in urls:
            tiktoken.registry.ENCODINGS.pop(name, None)  # build it now, from our cache
        yield {name: tiktoken.get_encoding(name) for name in urls}
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def test_encoding_definitions_are_tiktokens(monkeypatch):
    """Split pattern, special tokens and pinned SHA-256 are exactly tiktoken_ext.openai_public's."""
    from tiktoken_ext import openai_public

    seen: dict[str, str] = {}

    def fake_load(url, expected_hash=None):
        seen["hash"] = expected_hash
        return {}

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", fake_load)
    for name, source in ENCODINGS.items():
        definition = getattr(openai_public, name)()
        assert definition["pat_str"] == source.pat_str
        assert definition["special_tokens"] == source.special_tokens
        assert seen["hash"] == source.sha256
        assert hashlib.sha256(load_rank_bytes(name)).hexdigest() == source.sha256


def cookbook_count(enc, messages: list[dict[str, str]]) -> int:
    """OpenAI's documented num_tokens_from_messages (3 per message, +1 per name, +3 priming)."""
    n = 0
    for message in messages:
        n += 3
        for key, value in message.items():
            n += len(enc.encode(value, disallowed_special=()))
            if key == "name":
                n += 1
    return n + 3


PROSE = textwrap.dedent(json.__doc__ or "") + "\n" + (inspect.getdoc(random.Random) or "")
BLOB = base64.b64encode(random.Random(4).randbytes(2400)).decode()
MULTILINGUAL = (
    "Die Würde des Menschen ist unantastbar. Tous les êtres humains naissent libres et égaux. "
    "Все люди рождаются свободными и равными. 人人生而自由，在尊严和权利上一律平等。"
    "すべての人間は、生まれながらにして自由である。 모든 인간은 태어날 때부터 자유로우며. "
    "يولد جميع الناس أحرارًا. सभी मनुष्यों को गौरव प्राप्त है। Great job 🎉 — ship it 🚀!"
)

# string-content requests: the cookbook rule applies literally
COOKBOOK_REQUESTS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a senior Python reviewer. Be terse."},
        {"role": "user", "content": "Review this module:\n\n```python\n" + CODE[:6000] + "\n```"},
        {"role": "assistant", "content": "Two issues: the regex is compiled per call, and dedent ignores tabs."},
        {"role": "user", "content": "Fix the first one."},
    ],
    [{"role": "user", "content": "Summarise:\n" + PROSE}],
    [
        {"role": "system", "content": "Answer in the user's language."},
        {"role": "user", "name": "maria", "content": MULTILINGUAL},
        {"role": "assistant", "name": "helper_bot", "content": "Gern — voilà: 要点如下。"},
    ],
    [{"role": "user", "content": "What does this tool output say?\n" + JSON_OUTPUT}],
    [{"role": "user", "content": "Decode this attachment: " + BLOB}],
    [{"role": "user", "content": "Special-looking text <|endoftext|> and <|fim_prefix|> stays text."}],
    [
        {"role": "developer", "content": "Follow the style guide."},
        {"role": "user", "content": "   leading spaces\n\n\ttabs\r\nCRLF  "},
    ],
]


def as_request(messages: list[dict[str, str]]) -> dict:
    return {"messages": messages}


@pytest.mark.parametrize("index", range(len(COOKBOOK_REQUESTS)))
@pytest.mark.parametrize("encoding,model", [("o200k_base", O200K_MODEL), ("cl100k_base", CL100K_MODEL)])
def test_exact_count_equals_tiktoken_cookbook(tiktoken_encodings, index, encoding, model):
    messages = COOKBOOK_REQUESTS[index]
    expected = cookbook_count(tiktoken_encodings[encoding], messages)
    result = ExactLocalCounter().count(CanonicalRequest.from_dict(as_request(messages)), model)
    assert result.input_tokens == expected
    assert result.quality == "exact_local" and result.model == model.name


def reference_agent_count(enc) -> int:
    """The documented rule, written out independently for AGENT_REQUEST with tiktoken."""

    def t(s: str) -> int:
        return len(enc.encode(s, disallowed_special=()))

    def cj(v) -> str:
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    n = 0
    n += 3 + t("system") + t("You are a coding agent. Use tools.")
    n += 3 + t("user") + t("Find the failing test and fix it.")
    n += 3 + t("assistant") + t("Running the tests.") + t("run") + t(cj({"cmd": "pytest -x", "timeout": 120}))
    n += 3 + t("tool") + t(AGENT_REQUEST["messages"][2]["content"])
    n += 3 + t("assistant") + t("Reading the file.") + t("read") + t(cj({"path": "src/api.py", "lines": [1, 80]}))
    n += 3 + t("user") + t(CODE[:3000])
    # 1024x768 high: short side to 768 -> 1024x768 -> 2x2 tiles -> 85 + 4*170
    n += 3 + t("user") + t("Here is a screenshot.") + 85 + 170 * 4
    n += 3
    n += t(
        cj(
            {
                "name": "run",
                "description": "Run a shell command",
                "parameters": AGENT_REQUEST["tools"][0]["function"]["parameters"],
            }
        )
    )
    n += t(cj({"name": "read", "description": "Read a file", "parameters": AGENT_REQUEST["tools"][1]["input_schema"]}))
    return n


@pytest.mark.parametrize("encoding,model", [("o200k_base", O200K_MODEL), ("cl100k_base", CL100K_MODEL)])
def test_exact_count_of_agent_request_with_tools(tiktoken_encodings, encoding, model):
    result = ExactLocalCounter().count(CanonicalRequest.from_dict(AGENT_REQUEST), model)
    assert result.input_tokens == reference_agent_count(tiktoken_encodings[encoding])


def test_exact_tokens_of_large_text_equal_tiktoken(tiktoken_encodings):
    text = (CODE + PROSE + MULTILINGUAL + JSON_OUTPUT + BLOB) * 20
    for name, enc in tiktoken_encodings.items():
        assert len(load_encoding(name).encode_ordinary(text)) == len(enc.encode_ordinary(text))
        assert load_encoding(name).encode_ordinary(text[:5000]) == enc.encode_ordinary(text[:5000])


# -- the heuristic never undercounts realistic requests --------------------------------------


def realistic_corpus() -> list[dict]:
    """Realistic requests: prose, code, JSON tool output, non-ASCII text, base64-ish blobs."""
    import argparse
    import collections
    import email.message
    import http.client

    rng = random.Random(11)
    requests = [as_request(m) for m in COOKBOOK_REQUESTS] + [AGENT_REQUEST]
    sources = [inspect.getsource(m) for m in (argparse, collections, http.client, email.message)]
    docs = [
        inspect.getdoc(obj) or ""
        for obj in (argparse.ArgumentParser, collections.OrderedDict, http.client.HTTPConnection, dict, str, list)
    ]
    for i in range(30):
        src = rng.choice(sources)
        start = rng.randrange(0, len(src) - 4000)
        blob = base64.b64encode(rng.randbytes(rng.randint(50, 1500))).decode()
        hexes = " ".join(rng.randbytes(16).hex() for _ in range(rng.randint(1, 20)))
        tool_json = json.dumps(
            {
                "rows": [
                    {
                        "id": str(uuid.UUID(int=rng.getrandbits(128))),
                        "name": rng.choice(["alpha", "Beta", "γάμμα", "δ"]),
                        "n": rng.random(),
                    }
                    for _ in range(rng.randint(1, 30))
                ]
            },
            ensure_ascii=rng.random() < 0.5,
        )
        requests.append(
            {
                "system": rng.choice(docs),
                "messages": [
                    {"role": "user", "content": src[start : start + rng.randint(200, 4000)]},
                    {
                        "role": "assistant",
                        "content": rng.choice(docs)[:800],
                        "tool_calls": [
                            {
                                "id": f"c{i}",
                                "type": "function",
                                "function": {
                                    "name": "query",
                                    "arguments": json.dumps({"q": f"select * from t where id = {i}"}),
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": f"c{i}", "content": tool_json},
                    {
                        "role": "user",
                        "content": rng.choice([MULTILINGUAL, "attachment: " + blob, "hashes: " + hexes, PROSE[:2000]]),
                    },
                ],
                "tools": [
                    {
                        "name": "query",
                        "description": "Run SQL",
                        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
                    }
                ],
            }
        )
    return requests


def test_heuristic_never_undercounts_realistic_requests():
    heuristic = HeuristicCounter()
    ratios = []
    for raw in realistic_corpus():
        req = CanonicalRequest.from_dict(raw)
        for model in (O200K_MODEL, CL100K_MODEL):
            exact = ExactLocalCounter().count(req, model).input_tokens
            estimate = heuristic.count(req, model).input_tokens
            assert estimate >= exact, (model.name, estimate, exact, raw["messages"][0]["content"][:80])
            ratios.append(estimate / exact)
    ratios.sort()
    # conservative, but not absurdly so: the median request is over-counted by less than 2x
    assert ratios[len(ratios) // 2] < 2.0, ratios


_WORDS = sorted({w for w in "".join(c if c.isalpha() else " " for c in PROSE + (inspect.getdoc(dict) or "")).split()})
_NON_ASCII_WORDS = MULTILINGUAL.split()
_PUNCT = [
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ";",
    ":",
    ",",
    ".",
    "==",
    "->",
    "=>",
    "!=",
    "&&",
    "||",
    "//",
    "#",
    '"',
    "'",
    "`",
    "**",
    "/*",
    "*/",
    "<",
    ">",
    "=",
    "+",
    "-",
    "_",
    "...",
    "?",
    "!",
    "@",
    "${",
    "</",
    "/>",
]
_JARGON = [
    "kubectl",
    "nginx",
    "ctx",
    "argv",
    "kwargs",
    "mkdir",
    "chmod",
    "stdout",
    "stderr",
    "regex",
    "lru",
    "utf8",
    "sha256",
    "ffmpeg",
    "pytest",
    "numpy",
    "pydantic",
    "Kubernetes",
    "PostgreSQL",
    "sqlalchemy",
    "asyncio",
    "lxml",
    "xkcd",
    "OAuth2",
    "gRPC",
    "protobuf",
    "kwarg",
    "tmpfs",
    "cgroups",
    "eBPF",
    "WebSocket",
    "nullptr",
    "std::vector",
    "i18n",
    "l10n",
    "a11y",
]
_WS = [" ", " ", " ", "\n", "\n\n", "    ", "\t", "\r\n"]


def _ident(words: list[str], style: int) -> str:
    if style == 0:
        return "_".join(w.lower() for w in words)
    if style == 1:
        return words[0].lower() + "".join(w.capitalize() for w in words[1:])
    return "".join(w.capitalize() for w in words)


_chunk = st.one_of(
    st.sampled_from(_WORDS),
    st.sampled_from(_WORDS).map(str.capitalize),
    st.sampled_from(_WORDS).map(str.upper),
    st.builds(_ident, st.lists(st.sampled_from(_WORDS), min_size=2, max_size=4), st.integers(0, 2)),
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(_PUNCT),
    st.sampled_from(_WS),
    st.sampled_from(_NON_ASCII_WORDS),
    st.sampled_from(["🎉", "🚀", "👍🏽", "❤️", "✅", "→", "—", "…", "“", "”", "•", "│", "├──", "é", "ß", "ñ"]),
    st.binary(min_size=4, max_size=400).map(lambda b: base64.b64encode(b).decode()),
    st.binary(min_size=4, max_size=64).map(bytes.hex),
    st.uuids().map(str),
    st.sampled_from(_JARGON),
)
_text = st.lists(st.tuples(_chunk, st.sampled_from([" ", " ", "", "\n", ", "])), min_size=1, max_size=120).map(
    lambda pairs: "".join(c + sep for c, sep in pairs)
)


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_text)
def test_heuristic_at_least_exact_on_generated_text(text):
    estimate = heuristic_text_tokens(text)
    for name in ("o200k_base", "cl100k_base"):
        assert estimate >= len(load_encoding(name).encode_ordinary(text)), name


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), _text), min_size=1, max_size=6))
def test_heuristic_at_least_exact_on_generated_requests(turns):
    req = CanonicalRequest.from_dict({"messages": [{"role": r, "content": t} for r, t in turns]})
    for model in (O200K_MODEL, CL100K_MODEL):
        assert HeuristicCounter().count(req, model).input_tokens >= ExactLocalCounter().count(req, model).input_tokens


# -- fingerprints ----------------------------------------------------------------------------


def test_fingerprint_is_sha256_of_canonical_json():
    req = CanonicalRequest.from_dict(AGENT_REQUEST)
    encoded = json.dumps(req.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert req.fingerprint == hashlib.sha256(encoded).hexdigest()
    assert "ü" in CanonicalRequest.from_dict({"messages": [{"role": "user", "content": "Grüße"}]}).canonical_json()


def test_equivalent_spellings_share_a_fingerprint():
    a = {"system": "S", "messages": [{"role": "user", "content": "hello"}]}
    b = {
        "system": [{"type": "text", "text": "S"}],
        "messages": [{"content": [{"text": "hello", "type": "text"}], "role": "user"}],
        "model": "x",
        "max_tokens": 5,
    }
    assert CanonicalRequest.from_dict(a).fingerprint == CanonicalRequest.from_dict(b).fingerprint
    openai_call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{ "b": [1, 2],  "a": "x" }'}}
        ],
    }
    anthropic_call = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": "x", "b": [1, 2]}}],
    }
    assert (
        CanonicalRequest.from_dict({"messages": [openai_call]}).fingerprint
        == CanonicalRequest.from_dict({"messages": [anthropic_call]}).fingerprint
    )
    tool_a = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    tool_b = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    assert (
        CanonicalRequest.from_dict({"messages": [], "tools": [tool_a]}).fingerprint
        == CanonicalRequest.from_dict({"messages": [], "tools": [tool_b]}).fingerprint
    )


def test_round_trip_and_any_change_changes_the_fingerprint():
    req = CanonicalRequest.from_dict(AGENT_REQUEST)
    again = CanonicalRequest.from_dict(req.to_dict())
    assert again == req and again.fingerprint == req.fingerprint
    base = {"messages": [{"role": "user", "content": "hello"}]}
    variants = [
        {"messages": [{"role": "user", "content": "hello "}]},
        {"messages": [{"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hello", "name": "bob"}]},
        {"messages": [{"role": "user", "content": "hello"}], "system": "s"},
        {"messages": [{"role": "user", "content": "hello"}], "tools": [{"name": "t", "input_schema": {}}]},
        {"messages": [{"role": "user", "content": ["hel", "lo"]}]},
    ]
    prints = {CanonicalRequest.from_dict(v).fingerprint for v in variants}
    assert len(prints) == len(variants) and CanonicalRequest.from_dict(base).fingerprint not in prints


@pytest.mark.parametrize(
    "raw,field",
    [
        ([], "request"),
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "user", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": 5}]},
                ]
            },
            "messages[1].content[0].text",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "width": -3}]}]}, "messages[0].content[0].width"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
            "messages[0].tool_calls[0].name",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": "", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"x": float("nan")}}],
                    }
                ]
            },
            "messages[0].content[0].input.x",
        ),
        (
            {"messages": [], "tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),
        ({"messages": [], "system": 7}, "system"),
    ],
)
def test_bad_requests_name_the_field(raw, field):
    with pytest.raises(InvalidInput) as info:
        CanonicalRequest.from_dict(raw)
    assert info.value.field == field


# -- registry: input limits per behaviour.md "Policy" ------------------------------------------------------


def test_input_limits_per_spec():
    p = Policy()  # reserved_output 16384, safety_margin 8192
    assert REGISTRY.input_limit("claude-sonnet-4-5", p) == 200_000 - 16_384 - 8_192 == 175_424
    assert REGISTRY.input_limit("claude-sonnet-4-5-1m", p) == 1_000_000 - 16_384 - 8_192
    assert REGISTRY.input_limit("gpt-4.1", p) == 1_047_576 - 16_384 - 8_192
    assert REGISTRY.input_limit("gpt-4o", p) == 128_000 - 16_384 - 8_192
    # max_input_tokens smaller than window - reserve: it wins
    assert REGISTRY.input_limit("gpt-5", p) == 272_000 - 8_192
    # max_output_tokens below reserved_output: only max_output is reserved
    assert REGISTRY.input_limit("gpt-3.5-turbo", p) == 16_385 - 4_096 - 8_192
    assert REGISTRY.input_limit("gpt-4o-2024-08-06", p) == REGISTRY.input_limit("gpt-4o", p)  # alias
    for name in (
        "gpt-4o",
        "gpt-4o-mini",
        "o3",
        "o4-mini",
        "gpt-5",
        "claude-opus-4-1",
        "claude-haiku-4-5",
        "gemini-2.5-pro",
        "gemini-2.5-flash",
    ):
        assert name in REGISTRY


def test_input_limit_fails_closed():
    with pytest.raises(ContextLimitUnknown):
        REGISTRY.input_limit("claude-sonnet-4-5", Policy(reserved_output=200_000))  # reserved_output >= window
    with pytest.raises(ContextLimitUnknown):
        REGISTRY.input_limit("gpt-3.5-turbo", Policy(safety_margin=12_289))  # safety_margin >= raw
    with pytest.raises(ContextLimitUnknown):
        REGISTRY.input_limit("gpt-9-ultra", Policy())
    with pytest.raises(ContextLimitUnknown):
        REGISTRY.get("gpt-4o-2099-01-01")  # no prefix guessing


def test_unknown_model_and_unknown_limit_fail_before_any_counting():
    slow = {"provider": "test", "window": 200_000, "counter": counter_path(SleepCounter), "options": {"sleep_s": 5}}
    registry = ModelRegistry.load({"slow": slow})
    backend = InProcessCounting(registry)
    for model, policy in (("no-such-model", Policy()), ("slow", Policy(reserved_output=200_000))):
        started = time.monotonic()
        with pytest.raises(ContextLimitUnknown):
            backend.measure(
                {"messages": [{"role": "user", "content": "hi"}]}, model=model, basis=Basis(1, "a"), policy=policy
            )
        assert time.monotonic() - started < 0.2  # the 5 s counter never ran


def test_models_file_overrides(tmp_path):
    path = tmp_path / "models.json"
    path.write_text(
        json.dumps(
            {
                "models": {
                    "gpt-4o": {"window": 64_000},
                    "gemini-2.5-flash-lite": None,
                    "my-local-llm": {
                        "provider": "local",
                        "window": 32_768,
                        "max_output_tokens": 4096,
                        "counter": "exact_local",
                        "encoding": "cl100k_base",
                    },
                }
            }
        )
    )
    registry = build_registry(Settings.of(models_file=str(path)))
    assert registry.input_limit("gpt-4o", Policy()) == 64_000 - 16_384 - 8_192
    assert registry.get("gpt-4o").encoding == "o200k_base"  # merged, not replaced
    assert "gemini-2.5-flash-lite" not in registry
    assert registry.input_limit("my-local-llm", Policy()) == 32_768 - 4_096 - 8_192
    passed = ModelRegistry.load({"tiny": {"provider": "x", "window": 50_000, "counter": "heuristic"}})
    assert passed.input_limit("tiny", Policy()) == 50_000 - 16_384 - 8_192


@pytest.mark.parametrize(
    "entry,field",
    [
        ({"provider": "x", "counter": "heuristic"}, "models.bad.window"),
        ({"provider": "x", "window": 0, "counter": "heuristic"}, "models.bad.window"),
        ({"provider": "x", "window": 10, "counter": "guess"}, "models.bad.counter"),
        ({"provider": "x", "window": 10, "counter": "exact_local"}, "models.bad.encoding"),
        ({"provider": "x", "window": 10, "counter": "exact_local", "encoding": "p50k_base"}, "models.bad.encoding"),
        ({"provider": "x", "window": 10, "counter": "heuristic", "colour": "red"}, "models.bad.colour"),
        # a counter named by import path must import, be a counter class and declare a known quality
        ({"provider": "x", "window": 10, "counter": "tests.support.no_such_module:Counter"}, "models.bad.counter"),
        ({"provider": "x", "window": 10, "counter": "tests.support.counters:NoSuchCounter"}, "models.bad.counter"),
        ({"provider": "x", "window": 10, "counter": "tests.support.counters:test_models"}, "models.bad.counter"),
        (
            {"provider": "x", "window": 10, "counter": "tests.support.counters:UnknownQualityCounter"},
            "models.bad.counter",
        ),
    ],
)
def test_bad_registry_entries_name_the_field(entry, field):
    with pytest.raises(InvalidInput) as info:
        ModelRegistry.load({"bad": entry})
    assert info.value.field == field


def test_unreadable_models_file_is_refused(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{nope")
    with pytest.raises(InvalidInput) as info:
        build_registry(Settings.of(models_file=str(bad)))
    assert info.value.field == "TRACKER_MODELS_FILE"
    with pytest.raises(InvalidInput):
        build_registry(Settings.of(models_file=str(tmp_path / "missing.json")))


def test_a_long_texts_count_is_remembered_by_its_content_and_equals_a_fresh_count():
    from tracker.counting.counters import MEMO_MIN_CHARS, memoized

    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return heuristic_text_tokens(text)

    counted = memoized(count, maxsize=2)
    long_a = "ERROR export batch 17 timed out after 30 s\n" * 20
    long_b = long_a.replace("17", "18")  # same length, other content
    assert len(long_a) == len(long_b) >= MEMO_MIN_CHARS
    short = "hello there"
    for text in (long_a, "".join(list(long_a)), long_b, short, short):  # the second: an equal, distinct string
        assert counted(text) == heuristic_text_tokens(text)
    assert calls == [long_a, long_b, short, short]  # equal content counted once; short texts always counted
    counted("x" * MEMO_MIN_CHARS)  # a third long text: the least recently used one (long_a) is forgotten
    counted(long_a)
    assert calls[-1] == long_a and len(calls) == 6


def test_counting_a_growing_conversation_again_gives_the_same_counts():
    """The counters remember long texts: a request counted after its predecessors (whose messages it
    repeats) gets the count a fresh count of it gives."""
    from tracker.counting import counters

    registry = build_registry(Settings.of())
    rng = random.Random(5)
    messages: list[dict[str, str]] = []
    requests = []
    for turn in range(6):
        body = " ".join(
            rng.choice(["build", "export", "Zeitüberschreitung", "超时", "4096", '{"k": 1}']) for _ in range(300)
        )
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": f"turn {turn}: {body}"})
        requests.append(CanonicalRequest.from_dict({"system": "Be brief.", "messages": list(messages)}))
    for counter, model in ((ExactLocalCounter(), "gpt-4o"), (HeuristicCounter(), "claude-sonnet-4-5")):
        spec = registry.get(model)
        remembered = [counter.count(r, spec).input_tokens for r in requests]
        counters._exact_text_tokens.cache_clear()  # a fresh memo for the exact counter
        fresh = [counters.chat_tokens(r, _fresh_text_count(counter, spec), lambda i: 0) for r in requests]
        assert remembered == fresh and remembered == sorted(remembered), (counter.name, remembered, fresh)


def _fresh_text_count(counter, spec):
    if isinstance(counter, ExactLocalCounter):
        encode = load_encoding(spec.encoding).encode_ordinary
        return lambda text: len(encode(text)) if text else 0
    return heuristic_text_tokens
