"""The pydantic-ai capability / history processor, in pydantic-ai's own agent loop with ``FunctionModel``.

Real tracker, real store (SQLite file; Postgres and Redis for the two-process test), real
counting: nothing of the tracker is mocked. The agent is ``examples/pydantic_ai_agent.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.capabilities import ProcessHistory  # noqa: E402
from pydantic_ai.exceptions import ModelContextWindowExceededError, ModelHTTPError  # noqa: E402
from pydantic_ai.messages import (  # noqa: E402
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import FunctionModel  # noqa: E402
from pydantic_ai.usage import RequestUsage  # noqa: E402

from tests.support.examples import (
    EXAMPLES,
    INPUT_LIMIT,
    assert_compacted_once,
    events,
    example_tracker,
    load_example,
    run_example_processes,
)
from tests.support.provider_reports import FailingReports, anthropic_context_body, reports
from tracker import ContextLimitError, Tracker  # noqa: E402
from tracker.core.events import ProviderRejected  # noqa: E402
from tracker.integrations.pydantic_ai import ContextTrackerCapability, revision_of  # noqa: E402
from tracker.queries import decode  # noqa: E402
from tracker.settings import Settings  # noqa: E402
from tracker.store.migrate import upgrade  # noqa: E402

EXAMPLE = EXAMPLES / "pydantic_ai_agent.py"


ex = load_example("pydantic_ai_agent")


@pytest.fixture
def tracker(tmp_path):
    with example_tracker(tmp_path, ex.MODELS) as t:
        yield t


def assert_tool_calls_whole(messages):
    made, answered = [], set()
    for m in messages:
        for p in m.parts:
            if isinstance(p, ToolCallPart):
                made.append(p.tool_call_id)
            if isinstance(p, ToolReturnPart):
                assert p.tool_call_id in made, f"result {p.tool_call_id} without its call"
                answered.add(p.tool_call_id)
    assert set(made) <= answered, f"calls without results: {set(made) - answered}"


def system_parts(messages):
    return [
        p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, SystemPromptPart)
    ]


def test_context_growing_past_the_compact_level_is_compacted_and_the_next_request_is_smaller(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    report = ex.run(tracker, session, steps=13)

    assert_compacted_once(tracker, session, report, "pydantic-ai")
    assert report["revision"] == 2 and "Files already read" in report["summary"]


def test_the_model_keeps_the_system_prompt_and_whole_tool_batches(tracker):
    summarizer = ex.Summarizer()
    agent, script = ex.build(tracker, steps=13, summarizer=summarizer, session_id=f"pai-{uuid.uuid4().hex[:8]}")
    result = agent.run_sync("What is wrong?")
    assert summarizer.calls == 1
    for messages, info in script.requests:
        assert system_parts(messages) == [ex.SYSTEM]
        assert [t.name for t in info.function_tools] == ["read_file"]
        assert_tool_calls_whole(messages)
    assert revision_of(result.all_messages()) == 2
    assert system_parts(result.all_messages()) == [ex.SYSTEM]


def test_the_session_defaults_to_the_conversation_id(tracker):
    summarizer = ex.Summarizer()
    script = ex.Script(13)
    agent = Agent(
        FunctionModel(script),
        system_prompt=ex.SYSTEM,
        tools=[ex.read_file],
        capabilities=[ContextTrackerCapability(tracker, model=ex.MODEL, summarizer=summarizer, keep_last=4)],
    )
    result = agent.run_sync("What is wrong?", conversation_id="conv-42")
    assert result.output.startswith("I read 13 files")
    assert [e.type for e in events(tracker, "conv-42", "CompactionStarted", "CompactionCommitted")] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]


def test_as_a_history_processor(tracker):
    """``ProcessHistory(processor)`` (pydantic-ai 2's ``history_processors=``): the messages are observed and compacted."""
    session = f"pai-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer()
    script = ex.Script(13)
    processor = ContextTrackerCapability(
        tracker, model=ex.MODEL, summarizer=summarizer, session_id=session, keep_last=4
    )
    agent = Agent(
        FunctionModel(script), system_prompt=ex.SYSTEM, tools=[ex.read_file], capabilities=[ProcessHistory(processor)]
    )
    result = agent.run_sync("What is wrong?")
    assert result.output.startswith("I read 13 files")
    assert summarizer.calls == 1
    assert [e.type for e in events(tracker, session, "CompactionStarted", "CompactionCommitted")] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]
    assert revision_of(result.all_messages()) == 2


def test_an_async_summariser_runs_on_the_agents_loop(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    seen = []

    async def summarize(messages, budget_tokens):
        seen.append((len(messages), budget_tokens))
        return "The user asked what is wrong; several files were read."

    agent, _ = ex.build(tracker, steps=13, summarizer=summarize, session_id=session)
    assert agent.run_sync("What is wrong?").output.startswith("I read 13 files")
    assert len(seen) == 1 and seen[0][1] > 0
    assert len(events(tracker, session, "CompactionCommitted")) == 1


def test_a_failing_summariser_is_rejected_and_the_run_ends_in_context_limit_error(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer(fail=True)
    agent, script = ex.build(tracker, steps=16, summarizer=summarizer, session_id=session)
    with pytest.raises(ContextLimitError) as err:
        agent.run_sync("What is wrong?")
    assert err.value.details["input_limit"] == INPUT_LIMIT
    rejected = events(tracker, session, "CompactionRejected")
    assert rejected and {e.data["reject_reason"] for e in rejected} == {"summarizer_error"}
    assert summarizer.calls == len(rejected)
    assert events(tracker, session, "ContextLimitReached")
    assert not events(tracker, session, "CompactionCommitted")
    sent = [ex.request_tokens(tracker, m, info) for m, info in script.requests]
    assert max(sent) < INPUT_LIMIT < err.value.details["input_tokens"]


def test_two_agent_processes_on_one_session_compact_once(pg_url, redis_url):
    """Two real processes run the same agent on one session (Postgres + Redis): one summary, both adopt it."""
    upgrade(pg_url)
    session = f"pai2-{uuid.uuid4().hex[:8]}"
    reports = run_example_processes(EXAMPLE, database_url=pg_url, redis_url=redis_url, session=session)

    assert all(r["answer"].startswith("I read 13 files") for r in reports)
    assert sum(r["summarizer_calls"] for r in reports) == 1
    with Tracker.from_settings(Settings.of(database_url=pg_url)) as t:
        assert len(events(t, session, "CompactionStarted")) == 1
        assert len(events(t, session, "CompactionCommitted")) == 1
        assert not events(t, session, "CompactionRejected", "ContextLimitReached")
    assert [r["revision"] for r in reports] == [2, 2]
    assert reports[0]["summary"] == reports[1]["summary"]
    assert all(max(r["model_requests"]) < INPUT_LIMIT for r in reports)


def history_of(steps):
    """A history as the agent leaves it after ``steps`` scripted steps (each a tool call and its file)."""
    out = [ModelRequest(parts=[SystemPromptPart(ex.SYSTEM), UserPromptPart(ex.QUESTION)])]
    for i in range(steps):
        call = ToolCallPart("read_file", {"path": f"src/module_{i}.py"}, tool_call_id=f"call_{i}")
        out += [
            ModelResponse(parts=[TextPart(f"Step {i}: reading src/module_{i}.py."), call]),
            ModelRequest(parts=[ToolReturnPart("read_file", ex.source_file(f"src/module_{i}.py"), f"call_{i}")]),
        ]
    return out


def test_a_compaction_adopted_and_compacted_again_in_one_call_summarises_the_adopted_summary(tracker):
    """Another agent compacted this history; this one adopts that summary and is still past the compact
    level (a long prompt was added): the summariser is given the messages of the adopted view (the
    summary first), not the span at the same indices of the history the call began with."""
    session = f"pai-{uuid.uuid4().hex[:8]}"
    first, _ = ex.build(tracker, steps=0, summarizer=ex.Summarizer(), session_id=session)
    first.run_sync("Go on.", message_history=history_of(9))
    assert [e.type for e in events(tracker, session, "CompactionStarted", "CompactionCommitted")] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]

    spans = []

    def summarize(messages, budget_tokens):
        spans.append(messages)
        return "Summary of both: files were read, then the user pasted the fence log."

    second, script = ex.build(tracker, steps=0, summarizer=summarize, session_id=session)
    pasted = "And the fence check? Here is its log: " + " ".join(f"fence {n} renewed lease" for n in range(320))
    result = second.run_sync(pasted, message_history=history_of(9))
    assert len(events(tracker, session, "CompactionCommitted")) == 2
    (span,) = spans
    prompts = [p.content for m in span if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, UserPromptPart)]
    assert "Files already read" in prompts[0]
    assert ex.QUESTION not in prompts
    assert_tool_calls_whole(span)
    ((sent, _),) = script.requests
    assert system_parts(sent) == [ex.SYSTEM]
    assert revision_of(result.all_messages()) == 3


# -- the provider's side: usage reports, one context-length error recovered ------------------------


CACHE_READ, CACHE_WRITE = 300, 50


class ProviderScript(ex.Script):
    """The scripted ``FunctionModel`` body, as a provider: each reply carries its ``RequestUsage`` (whose
    ``input_tokens`` includes the cache reads and writes), and the calls in ``failures`` raise instead."""

    def __init__(self, steps, failures=None):
        super().__init__(steps)
        self.failures = failures or {}
        self.sent = 0

    def __call__(self, messages, info):
        n, self.sent = self.sent, self.sent + 1
        if n in self.failures:
            self.requests.append((list(messages), info))
            raise self.failures[n]
        self.calls = n - len([k for k in self.failures if k < n])  # the script's step: failed calls are not steps
        response = super().__call__(messages, info)
        response.usage = RequestUsage(
            input_tokens=1000 + n, output_tokens=20 + n, cache_read_tokens=CACHE_READ, cache_write_tokens=CACHE_WRITE
        )
        return response


def too_long(count):
    """What pydantic-ai's Anthropic model raises for a prompt over the limit (its error category, and a 400)."""
    return ModelHTTPError.for_category(
        ModelContextWindowExceededError,
        status_code=400,
        model_name="claude-sonnet-4-5",
        body=anthropic_context_body(count, INPUT_LIMIT),
        provider_error_type="invalid_request_error",
    )


def provider_agent(tracker, steps, failures=None):
    script = ProviderScript(steps, failures)
    capability = ContextTrackerCapability(tracker, model=ex.MODEL, summarizer=ex.Summarizer(), keep_last=4)
    agent = Agent(FunctionModel(script), system_prompt=ex.SYSTEM, tools=[ex.read_file], capabilities=[capability])
    return agent, script


def test_every_model_request_reports_its_usage_on_the_basis_it_was_measured_with(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    agent, script = provider_agent(tracker, steps=13)
    result = agent.run_sync(ex.QUESTION, conversation_id=session)
    assert result.output.startswith("I read 13 files")
    assert events(tracker, session, "CompactionCommitted")
    got = reports(tracker, session)
    assert len(got) == len(script.requests) == 14
    for n, (kind, data, measured) in enumerate(got):
        assert kind == "UsageReported" and data["basis"] == measured
        # RequestUsage.input_tokens includes the cache reads and writes: the tracker's input_tokens is the rest
        assert (data["input_tokens"], data["cache_read_tokens"], data["cache_write_tokens"], data["output_tokens"]) == (
            1000 + n - CACHE_READ - CACHE_WRITE,
            CACHE_READ,
            CACHE_WRITE,
            20 + n,
        )
    assert any(data["basis"].startswith("r2:") for _, data, _ in got)


def test_a_context_length_error_is_reported_compacted_and_retried_once(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    agent, script = provider_agent(tracker, steps=8, failures={6: too_long(3012)})
    result = agent.run_sync(ex.QUESTION, conversation_id=session)
    assert result.output.startswith("I read 8 files")  # the run completed

    kinds = [e.type for e in events(tracker, session, "ProviderRejected", "CompactionStarted", "CompactionCommitted")]
    assert kinds == ["ProviderRejected", "CompactionStarted", "CompactionCommitted"]
    (rejected,) = events(tracker, session, "ProviderRejected")
    assert (rejected.data["input_tokens"], rejected.data["input_limit"], rejected.data["form"]) == (
        3012,
        INPUT_LIMIT,
        "anthropic.prompt_too_long",
    )
    (refused, refused_info), (retried, retried_info) = script.requests[6], script.requests[7]
    assert rejected.data["basis"] == reports(tracker, session)[6][2]
    assert ex.request_tokens(tracker, retried, retried_info) < ex.request_tokens(tracker, refused, refused_info)
    assert revision_of(retried) == 2  # the compacted history was sent
    assert system_parts(retried) == [ex.SYSTEM]
    usage = [(d, basis) for kind, d, basis in reports(tracker, session) if kind == "UsageReported"]
    assert len(usage) == len(script.requests) - 1 == 9
    assert usage[6][0]["basis"] == usage[6][1] and usage[6][1].startswith("r2:")
    assert usage[6][0]["input_tokens"] == 1007 - CACHE_READ - CACHE_WRITE
    assert revision_of(result.all_messages()) == 2  # the run's history is the compacted one


def test_a_second_context_length_error_in_a_row_propagates(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    agent, script = provider_agent(tracker, steps=8, failures={6: too_long(3012), 7: too_long(2990)})
    with pytest.raises(ModelContextWindowExceededError, match="2990 tokens"):
        agent.run_sync(ex.QUESTION, conversation_id=session)
    assert len(script.requests) == 8  # the refused call and its one retry
    assert len(events(tracker, session, "ProviderRejected")) == 1
    assert len(events(tracker, session, "CompactionCommitted")) == 1


def test_another_model_error_is_not_a_rejection(tracker):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    busy = ModelHTTPError(status_code=529, model_name="claude-sonnet-4-5", body={"error": {"type": "overloaded_error"}})
    agent, script = provider_agent(tracker, steps=8, failures={3: busy})
    with pytest.raises(ModelHTTPError, match="529"):
        agent.run_sync(ex.QUESTION, conversation_id=session)
    assert len(script.requests) == 4
    assert not events(tracker, session, "ProviderRejected", "CompactionStarted")


def test_a_usage_report_that_fails_does_not_break_the_call(tracker, caplog):
    session = f"pai-{uuid.uuid4().hex[:8]}"
    failing = FailingReports(tracker)
    agent, script = provider_agent(failing, steps=3)
    with caplog.at_level("WARNING", logger="tracker.integrations"):
        result = agent.run_sync(ex.QUESTION, conversation_id=session)
    assert result.output.startswith("I read 3 files")
    assert failing.failed == len(script.requests) == 4
    assert not events(tracker, session, "UsageReported")
    assert "usage report failed: RuntimeError: the tracker is unreachable" in caplog.text


def test_request_usage_maps_to_the_trackers_uncached_input():
    from tracker.integrations._provider import Usage
    from tracker.integrations.pydantic_ai import usage_of

    def reply(**usage):
        return ModelResponse(parts=[TextPart("x")], usage=RequestUsage(**usage))

    assert usage_of(reply(input_tokens=350, output_tokens=240, cache_read_tokens=100, cache_write_tokens=200)) == (
        Usage(50, 240, 100, 200)
    )
    assert usage_of(reply(input_tokens=350, output_tokens=240)) == Usage(350, 240, None, None)
    assert usage_of(reply()) is None  # nothing billed
    assert usage_of(reply(input_tokens=350, unmeasured_requests=1)) is None  # the response omitted usage


def test_a_streamed_run_recovers_from_a_context_length_error_too(tracker):
    """``run_stream``: the provider's error opening the stream reaches ``on_model_request_error`` the same way."""
    session = f"pai-{uuid.uuid4().hex[:8]}"
    received = []

    async def stream(messages, info):
        received.append(list(messages))
        if len(received) == 1:
            raise too_long(3012)
        yield "The lease is renewed after the fence check."

    capability = ContextTrackerCapability(tracker, model=ex.MODEL, summarizer=ex.Summarizer(), keep_last=4)
    agent = Agent(FunctionModel(stream_function=stream), system_prompt=ex.SYSTEM, capabilities=[capability])

    async def run():
        async with agent.run_stream(ex.QUESTION, conversation_id=session) as result:
            return await result.get_output()

    assert asyncio.run(run()).startswith("The lease is renewed")
    kinds = [e.type for e in events(tracker, session, "ProviderRejected", "CompactionCommitted", "UsageReported")]
    assert kinds == ["ProviderRejected", "CompactionCommitted", "UsageReported"]
    assert len(received) == 2 and revision_of(received[1]) == 2 and revision_of(received[0]) == 1


# -- an async tracker: the AsyncTrackerClient, against a real server on loopback --------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.api import api_server

    models = tmp_path_factory.mktemp("pai-server") / "models.json"
    models.write_text(json.dumps(ex.MODELS))
    # a generous count timeout: the server counts in-process, on a machine the test may share with others
    with api_server(fleets=("pai",), TRACKER_MODELS_FILE=str(models), TRACKER_COUNT_TIMEOUT_S="30") as api:
        yield api, str(models)


@pytest.mark.postgres
@pytest.mark.redis
def test_an_async_tracker_client_reports_compacts_and_retries_in_the_agent_loop(server):
    """``agent.run`` with an ``AsyncTrackerClient``: observe, count, summarise, commit, the usage reports and
    one context-length error recovered, every tracker call awaited on the run's loop."""
    from tracker import AsyncTrackerClient

    api, models_file = server
    session = f"pai-async-{uuid.uuid4().hex[:8]}"
    script = ProviderScript(8, failures={6: too_long(3012)})

    async def main():
        client = AsyncTrackerClient(api.url, api.token_a)
        try:
            capability = ContextTrackerCapability(
                client, model=ex.MODEL, summarizer=ex.Summarizer(), keep_last=4, models_file=models_file
            )
            agent = Agent(
                FunctionModel(script), system_prompt=ex.SYSTEM, tools=[ex.read_file], capabilities=[capability]
            )
            result = await agent.run(ex.QUESTION, conversation_id=session)
            return result, [e async for e in client.history(session)]
        finally:
            await client.aclose()

    result, history = asyncio.run(main())
    assert result.output.startswith("I read 8 files")
    kinds = [e.type for e in history if e.type in ("ProviderRejected", "CompactionStarted", "CompactionCommitted")]
    assert kinds == ["ProviderRejected", "CompactionStarted", "CompactionCommitted"]
    (rejected,) = [r.event for r in map(decode, history) if isinstance(r.event, ProviderRejected)]
    assert (rejected.input_tokens, rejected.input_limit) == (3012, INPUT_LIMIT)
    (refused, _), (retried, _) = script.requests[6], script.requests[7]
    assert revision_of(refused) == 1 and revision_of(retried) == 2  # the compacted history was sent
    # every answered call's usage reported on the basis it was measured with, the retried one on revision 2's
    measured, usage = None, []
    for e in history:
        if e.type == "ContextMeasured":
            measured = e.data["measurement"]["basis"]
        elif e.type == "UsageReported":
            usage.append((e.data["basis"], measured, e.data["input_tokens"]))
    assert len(usage) == len(script.requests) - 1 == 9
    assert all(basis == seen for basis, seen, _ in usage) and usage[6][0].startswith("r2:")
    assert usage[6][2] == 1007 - CACHE_READ - CACHE_WRITE
    assert revision_of(result.all_messages()) == 2
