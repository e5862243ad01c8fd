"""The OpenAI Agents SDK filter and hooks, in the SDK's own ``Runner.run`` loop with a fake ``Model``.

Real tracker, real store (a SQLite file), real counting: nothing of the tracker is mocked. The
model is a subclass of the SDK's ``Model`` playing a script (``function_call`` items, then a final
message); ``Runner.run`` executes the tool and feeds the ``function_call_output`` items back. The
agent is ``examples/openai_agents_agent.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

pytest.importorskip("agents")

from agents import Agent, ModelResponse, RunConfig, Runner, SQLiteSession, Usage  # noqa: E402
from openai.types.responses import ResponseOutputMessage, ResponseOutputText  # noqa: E402
from openai.types.responses.response_usage import InputTokensDetails  # noqa: E402

from tests.support.examples import (
    COMPACTION_EVENTS,
    EXAMPLES,
    INPUT_LIMIT,
    assert_compacted_once,
    events,
    example_tracker,
    load_example,
    run_example_processes,
)
from tests.support.provider_reports import FailingReports, openai_context_error, reports
from tracker import ContextLimitError, Tracker  # noqa: E402
from tracker.errors import InvalidInput  # noqa: E402
from tracker.integrations.compaction import SUMMARY_PREFIX  # noqa: E402
from tracker.integrations.openai_agents import (  # noqa: E402
    ContextTrackerFilter,
    ContextTrackerHooks,
    input_item,
    items_of,
)
from tracker.settings import Settings  # noqa: E402
from tracker.store.migrate import upgrade  # noqa: E402

EXAMPLE = EXAMPLES / "openai_agents_agent.py"
QUESTION = "What is wrong with the lease handling?"


ex = load_example("openai_agents_agent")


@pytest.fixture
def tracker(tmp_path):
    with example_tracker(tmp_path, ex.MODELS) as t:
        yield t


def new_session(prefix: str = "oa") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def kinds(tracker, session):
    return [e.type for e in events(tracker, session, *COMPACTION_EVENTS)]


def assert_calls_whole(items):
    """No output without its call before it in the same input, and no call without its output."""
    made, answered = [], set()
    for item in items:
        if item.get("type") == "function_call":
            made.append(item["call_id"])
        if item.get("type") == "function_call_output":
            assert item["call_id"] in made, f"output {item['call_id']} reached the model without its function_call"
            answered.add(item["call_id"])
    assert set(made) <= answered, f"calls without outputs: {set(made) - answered}"


def is_summary(item):
    return item.get("role") == "user" and str(item.get("content", "")).startswith(SUMMARY_PREFIX)


def sent_tokens(tracker, model):
    return [ex.request_tokens(tracker, ins, items, tools) for ins, items, tools in model.received]


# -- the loop compacts through the tracker ----------------------------------------------------


def test_the_run_compacts_through_the_tracker_and_the_model_then_gets_a_shorter_input(tracker):
    session = new_session()
    report = asyncio.run(ex.run(tracker, session, steps=13))

    assert_compacted_once(tracker, session, report, "openai-agents")


def test_every_input_keeps_the_instructions_the_tools_and_each_call_with_its_output(tracker):
    session = new_session()
    summarizer = ex.Summarizer()
    agent, config, hooks, model = ex.build(tracker, steps=13, summarizer=summarizer, session_id=session)
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=20))

    assert result.final_output.startswith("I read 13 files")
    assert summarizer.calls == 1 and len(model.received) == 14
    summarised_from = None
    for n, (instructions, items, tools) in enumerate(model.received):
        assert instructions == ex.INSTRUCTIONS
        assert [t.name for t in tools] == ["read_file"]
        assert_calls_whole(items)
        if any(is_summary(i) for i in items):
            summarised_from = n if summarised_from is None else summarised_from
            assert is_summary(items[0]) and sum(map(is_summary, items)) == 1
            assert "Files already read" in items[0]["content"]
    assert summarised_from is not None
    # once compacted, every later input carries the summary and is shorter than the one before it
    before = model.received[summarised_from - 1][1]
    after = model.received[summarised_from][1]
    assert len(after) < len(before) and not any(is_summary(i) for i in before)
    assert all(any(is_summary(i) for i in items) for _, items, _ in model.received[summarised_from:])
    # the summary replaced the oldest items, the question first, and whole call/output pairs only
    full = before + after[-2:]  # the history at the compacted call: the input before it and the newest pair
    kept = len(after) - 1
    cut = len(full) - kept
    assert after[1:] == full[cut:] and cut >= 3 and full[0] == {"role": "user", "content": QUESTION}
    assert (full[cut - 1]["type"], full[cut]["type"]) == ("function_call_output", "function_call")


def test_parallel_call_batches_are_never_split(tracker):
    session = new_session()
    summarizer = ex.Summarizer()
    agent, config, hooks, model = ex.build(tracker, steps=6, summarizer=summarizer, session_id=session, batch=3)
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=20))
    assert result.final_output.startswith("I read 18 files")
    assert "CompactionCommitted" in kinds(tracker, session)
    for _, items, _ in model.received:
        assert_calls_whole(items)
        types = [i.get("type", "message") for i in items if not is_summary(i) and i.get("role") != "user"]
        # after the summary the kept tail starts with a whole batch: three calls, then three outputs
        while types:
            assert types[:6] == ["function_call"] * 3 + ["function_call_output"] * 3 or types == ["message"], types
            types = types[6:]


# -- a failing summariser ---------------------------------------------------------------------


def test_a_summariser_failure_is_rejected_and_the_run_goes_on(tracker):
    session = new_session()
    summarizer = ex.Summarizer(fail=1)  # the first summary fails, the next one works
    report = asyncio.run(ex.run(tracker, session, steps=13, summarizer=summarizer))

    assert report["answer"].startswith("I read 13 files")
    assert kinds(tracker, session) == [
        "CompactionStarted",
        "CompactionRejected",
        "CompactionStarted",
        "CompactionCommitted",
    ]
    (rejected,) = events(tracker, session, "CompactionRejected")
    assert rejected.data["reject_reason"] == "summarizer_error"
    assert summarizer.calls == 2
    assert max(report["model_requests"]) < INPUT_LIMIT


def test_the_hard_limit_raises_context_limit_error_out_of_the_run(tracker):
    session = new_session()
    summarizer = ex.Summarizer(fail=-1)
    agent, config, hooks, model = ex.build(tracker, steps=16, summarizer=summarizer, session_id=session)
    with pytest.raises(ContextLimitError) as err:
        asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=25))

    assert err.value.details["input_limit"] == INPUT_LIMIT
    rejected = events(tracker, session, "CompactionRejected")
    assert rejected and {e.data["reject_reason"] for e in rejected} == {"summarizer_error"}
    assert summarizer.calls == len(rejected)
    assert events(tracker, session, "ContextLimitReached")
    assert not events(tracker, session, "CompactionCommitted")
    sent = sent_tokens(tracker, model)  # the refused input never reached the model
    assert max(sent) < INPUT_LIMIT < err.value.details["input_tokens"]
    for _, items, _ in model.received:
        assert_calls_whole(items)


def test_a_streamed_run_compacts_the_same_way_and_the_hard_limit_ends_its_stream(tracker):
    async def stream(summarizer, steps):
        session = new_session("stream")
        agent, config, hooks, model = ex.build(tracker, steps=steps, summarizer=summarizer, session_id=session)
        result = Runner.run_streamed(agent, QUESTION, run_config=config, hooks=hooks, max_turns=steps + 5)
        try:
            async for _ in result.stream_events():
                pass
        except ContextLimitError as exc:
            return session, None, model, hooks, exc
        return session, result.final_output, model, hooks, None

    session, answer, model, hooks, error = asyncio.run(stream(ex.Summarizer(), 13))
    assert error is None and answer.startswith("I read 13 files")
    assert kinds(tracker, session) == ["CompactionStarted", "CompactionCommitted"]
    assert any(is_summary(items[0]) for _, items, _ in model.received)
    for _, items, _ in model.received:
        assert_calls_whole(items)
    assert [u.input_tokens for u in hooks.usages] == [
        len(json.dumps(i, default=str)) // 4 for _, i, _ in model.received
    ]

    session, answer, model, _, error = asyncio.run(stream(ex.Summarizer(fail=-1), 16))
    assert answer is None and isinstance(error, ContextLimitError)
    assert error.details["input_limit"] == INPUT_LIMIT < error.details["input_tokens"]
    assert {e.data["reject_reason"] for e in events(tracker, session, "CompactionRejected")} == {"summarizer_error"}
    assert max(sent_tokens(tracker, model)) < INPUT_LIMIT


# -- summarisers --------------------------------------------------------------------------------


def test_an_async_summariser_runs_on_the_agents_loop(tracker):
    session = new_session()
    seen = []

    async def summarize(items, budget_tokens):
        seen.append((len(items), budget_tokens, asyncio.get_running_loop()))
        return "The user asked what is wrong; several files were read."

    async def main():
        agent, config, hooks, _ = ex.build(tracker, steps=13, summarizer=summarize, session_id=session)
        result = await Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=20)
        return result, asyncio.get_running_loop()

    result, loop = asyncio.run(main())
    assert result.final_output.startswith("I read 13 files")
    assert len(seen) == 1 and seen[0][1] > 0 and seen[0][2] is loop
    assert len(events(tracker, session, "CompactionCommitted")) == 1


class SummarisingModel(ex.ScriptedModel):
    """The agent's own model, which also writes the summary when it is asked for one."""

    def __init__(self, steps):
        super().__init__(steps)
        self.summary_prompts = []

    async def get_response(self, system_instructions, input, *args, **kwargs):
        first = input[0] if isinstance(input, list) and input else {}
        if str(first.get("content", "")).startswith("Summarise the conversation"):
            self.summary_prompts.append(first["content"])
            text = "The user asked about the lease handling; src/module_0.py and later files were read."
            message = ResponseOutputMessage(
                type="message",
                id="msg_summary",
                role="assistant",
                status="completed",
                content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
            )
            return ModelResponse(output=[message], usage=Usage(requests=1), response_id="resp_summary")
        return await super().get_response(system_instructions, input, *args, **kwargs)


@pytest.mark.parametrize("how", ["default", "model"])
def test_the_summary_is_written_by_the_agents_model_or_a_given_sdk_model(tracker, how):
    session = new_session()
    model = SummarisingModel(13)
    agent = Agent(name="engineer", instructions=ex.INSTRUCTIONS, model=model, tools=[ex.read_file])
    tracker_filter = ContextTrackerFilter(
        tracker, model=ex.MODEL, session_id=session, summarizer=None if how == "default" else model, keep_last=4
    )
    config = RunConfig(call_model_input_filter=tracker_filter, tracing_disabled=True)
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, max_turns=20))
    assert result.final_output.startswith("I read 13 files")
    assert len(model.summary_prompts) == 1 and "src/module_0.py" in model.summary_prompts[0]
    assert len(events(tracker, session, "CompactionCommitted")) == 1
    later = [items for _, items, _ in model.received if any(is_summary(i) for i in items)]
    assert later and "lease handling" in later[0][0]["content"]


# -- the session id -----------------------------------------------------------------------------


def test_the_session_is_the_sdk_sessions_id_and_a_second_run_continues_the_compacted_history(tracker, tmp_path):
    sdk_session = SQLiteSession(new_session("sdk"), str(tmp_path / "agents.db"))
    summarizer = ex.Summarizer()
    agent, config, hooks, model = ex.build(tracker, steps=13, summarizer=summarizer, session=sdk_session)
    first = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, session=sdk_session, max_turns=20))
    assert first.final_output.startswith("I read 13 files")
    assert kinds(tracker, sdk_session.session_id) == ["CompactionStarted", "CompactionCommitted"]

    # the next run on the SDK session replays the whole stored history: the filter re-applies its summary
    model.steps, model.calls, model.received = 1, 0, []
    second = asyncio.run(
        Runner.run(agent, "And the fence check?", run_config=config, hooks=hooks, session=sdk_session, max_turns=5)
    )
    assert second.final_output.startswith("I read 1 files")
    assert summarizer.calls == 1
    for _, items, _ in model.received:
        assert is_summary(items[0]) and sum(map(is_summary, items)) == 1
        assert_calls_whole(items)
        assert {"role": "user", "content": "And the fence check?"} in items
    assert max(sent_tokens(tracker, model)) < INPUT_LIMIT
    assert kinds(tracker, sdk_session.session_id) == ["CompactionStarted", "CompactionCommitted"]
    assert {u.session_id for u in hooks.usages} == {sdk_session.session_id}


def test_another_process_compaction_is_adopted(tracker, tmp_path):
    """A filter with no memory of the compaction (another process) adopts it from the tracker and the share."""
    sdk_session = SQLiteSession(new_session("sdk"), str(tmp_path / "agents.db"))
    agent, config, hooks, _ = ex.build(tracker, steps=13, summarizer=ex.Summarizer(), session=sdk_session)
    asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, session=sdk_session, max_turns=20))

    other = ex.Summarizer()
    agent2, config2, hooks2, model2 = ex.build(tracker, steps=1, summarizer=other, session=sdk_session)
    result = asyncio.run(
        Runner.run(agent2, "And the fence check?", run_config=config2, hooks=hooks2, session=sdk_session, max_turns=5)
    )
    assert result.final_output.startswith("I read 1 files")
    assert other.calls == 0  # nothing summarised again: the first process's summary was adopted
    assert all(is_summary(items[0]) for _, items, _ in model2.received)
    assert kinds(tracker, sdk_session.session_id) == ["CompactionStarted", "CompactionCommitted"]


def test_a_compaction_adopted_and_compacted_again_in_one_call_summarises_the_adopted_summary(tracker, tmp_path):
    """The other process's summary is adopted, and the input is still past the compact level: the
    summariser is given the items of the adopted view (the summary first), not the raw ones."""
    sdk_session = SQLiteSession(new_session("sdk"), str(tmp_path / "agents.db"))
    agent, config, hooks, _ = ex.build(tracker, steps=13, summarizer=ex.Summarizer(), session=sdk_session)
    asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, session=sdk_session, max_turns=20))

    spans = []

    def summarize(items, budget_tokens):
        spans.append(items)
        return "Summary of both: files were read, then the user pasted the fence log."

    agent2, config2, hooks2, model2 = ex.build(tracker, steps=0, summarizer=summarize, session=sdk_session)
    pasted = "And the fence check? Here is its log: " + " ".join(f"fence {n} renewed lease" for n in range(320))
    result = asyncio.run(Runner.run(agent2, pasted, run_config=config2, hooks=hooks2, session=sdk_session, max_turns=5))
    assert result.final_output.startswith("I read 0 files")
    assert kinds(tracker, sdk_session.session_id) == ["CompactionStarted", "CompactionCommitted"] * 2
    (span,) = spans
    assert is_summary(span[0]) and "Files already read" in span[0]["content"]
    assert_calls_whole(span)
    ((_, items, _),) = model2.received
    assert is_summary(items[0]) and "Summary of both" in items[0]["content"]
    assert_calls_whole(items)
    assert max(sent_tokens(tracker, model2)) < INPUT_LIMIT


def test_the_session_comes_from_the_run_context(tracker):
    summarizer = ex.Summarizer()
    agent, config, hooks, _ = ex.build(tracker, steps=13, summarizer=summarizer)
    context = {"session_id": new_session("ctx")}
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, context=context, max_turns=20))
    assert result.final_output.startswith("I read 13 files")
    assert kinds(tracker, context["session_id"]) == ["CompactionStarted", "CompactionCommitted"]


def test_the_session_comes_from_the_trace_group_while_tracing_is_on(tracker):
    """``RunConfig(group_id=...)`` names the conversation in the SDK's traces; with tracing on it is the session."""
    from agents.tracing import get_trace_provider, set_trace_processors

    provider = get_trace_provider()
    saved = list(provider._multi_processor._processors)
    set_trace_processors([])  # traces stay in this process: no exporter
    try:
        agent, _, _, model = ex.build(tracker, steps=3, summarizer=ex.Summarizer())
        group = new_session("group")
        tracker_filter = ContextTrackerFilter(tracker, model=ex.MODEL, summarizer=ex.Summarizer())
        config = RunConfig(call_model_input_filter=tracker_filter, group_id=group, tracing_disabled=False)
        result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, max_turns=10))
    finally:
        set_trace_processors(saved)
    assert result.final_output.startswith("I read 3 files")
    measured = events(tracker, group, "ContextMeasured")
    assert len(measured) == len(model.received) == 4


def test_a_run_with_no_session_is_refused_naming_the_field(tracker):
    agent, config, hooks, model = ex.build(tracker, steps=2, summarizer=ex.Summarizer())
    with pytest.raises(InvalidInput) as err:
        asyncio.run(Runner.run(agent, QUESTION, run_config=config, max_turns=5))
    assert err.value.field == "session_id"
    assert model.received == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": ""}, "model"),
        ({"model": ex.MODEL, "keep_last": -1}, "keep_last"),
        ({"model": ex.MODEL, "session_id": ""}, "session_id"),
        ({"model": ex.MODEL, "summarizer": "gpt-4o"}, "summarizer"),
        ({"model": ex.MODEL, "max_sessions": 0}, "max_sessions"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(tracker, kwargs, field):
    with pytest.raises(InvalidInput) as err:
        ContextTrackerFilter(tracker, **kwargs)
    assert err.value.field == field
    if field == "model":
        with pytest.raises(InvalidInput):
            ContextTrackerHooks(tracker, model="")


# -- two runs at once on one session --------------------------------------------------------------


def test_two_concurrent_runs_on_one_session_compact_once(tracker):
    """Two agents in one process on one session with the same history: one summary, the other waits and adopts."""
    session = new_session()
    summarizer = ex.Summarizer(delay_s=0.5)

    async def both():
        runs = [ex.build(tracker, steps=13, summarizer=summarizer, session_id=session) for _ in range(2)]
        return await asyncio.gather(
            *(Runner.run(a, QUESTION, run_config=c, hooks=h, max_turns=20) for a, c, h, _ in runs)
        ), [m for *_, m in runs]

    results, models = asyncio.run(both())
    assert all(r.final_output.startswith("I read 13 files") for r in results)
    assert summarizer.calls == 1
    assert kinds(tracker, session) == ["CompactionStarted", "CompactionCommitted"]
    for model in models:
        assert any(is_summary(items[0]) for _, items, _ in model.received)
        for _, items, _ in model.received:
            assert_calls_whole(items)
        assert max(sent_tokens(tracker, model)) < INPUT_LIMIT


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_two_agent_processes_on_one_session_compact_once(pg_url, redis_url):
    """Two real processes run the same agent on one session (Postgres + Redis): one summary, both adopt it."""
    upgrade(pg_url)
    session = new_session("oa2")
    reports = run_example_processes(EXAMPLE, database_url=pg_url, redis_url=redis_url, session=session)

    assert all(r["answer"].startswith("I read 13 files") for r in reports)
    assert sum(r["summarizer_calls"] for r in reports) == 1
    with Tracker.from_settings(Settings.of(database_url=pg_url)) as t:
        assert kinds(t, session) == ["CompactionStarted", "CompactionCommitted"]
        assert not events(t, session, "ContextLimitReached")
    assert all(max(r["model_requests"]) < INPUT_LIMIT for r in reports)
    # each process's input drops to less than half at one call: the compacted history, made or adopted
    for r in reports:
        sent = r["model_requests"]
        assert any(b < a / 2 for a, b in zip(sent, sent[1:], strict=False)), sent


# -- usage hooks ----------------------------------------------------------------------------------


def test_the_hooks_report_each_calls_usage_on_the_basis_it_was_observed_with(tracker):
    session = new_session()
    agent, config, hooks, model = ex.build(tracker, steps=13, summarizer=ex.Summarizer(), session_id=session)
    asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=20))

    assert hooks.reports_usage
    assert len(hooks.usages) == len(model.received) == 14
    # each call ends in one observation that proceeds: the basis of what was sent, as the tracker recorded it
    proceeded = [
        e.data["measurement"]["basis"]
        for e in events(tracker, session, "ContextMeasured")
        if e.data["action"] == "proceed"
    ]
    bases = [u.basis for u in hooks.usages]
    assert bases == proceeded
    revisions = [int(b.split(":")[0][1:]) for b in bases]
    assert revisions == sorted(revisions) and revisions[0] == 1 and revisions[-1] == 2
    got = reports(tracker, session)
    assert len(got) == 14
    for u, (_, items, _), (kind, data, measured) in zip(hooks.usages, model.received, got, strict=True):
        size = len(json.dumps(items, default=str)) // 4  # the fake model's own usage figure (no cached tokens)
        assert u.input_tokens == size and u.output_tokens == 20 and u.session_id == session and u.model == ex.MODEL
        assert kind == "UsageReported" and data["basis"] == measured == u.basis
        assert (data["input_tokens"], data["output_tokens"], data["cache_read_tokens"]) == (size, 20, None)


CACHED = 8


class ProviderModel(ex.ScriptedModel):
    """The scripted SDK ``Model``, as a provider: its usage counts ``CACHED`` cached input tokens (inside
    ``input_tokens``, as OpenAI's does), and the calls in ``failures`` raise instead."""

    def __init__(self, steps, failures=None):
        super().__init__(steps)
        self.failures = failures or {}
        self.sent = 0

    async def get_response(self, system_instructions, input, model_settings, tools, output_schema, handoffs, *a, **kw):
        n, self.sent = self.sent, self.sent + 1
        if n in self.failures:
            items = [{"role": "user", "content": input}] if isinstance(input, str) else [dict(i) for i in input]
            self.received.append((system_instructions, items, [*tools, *handoffs]))
            raise self.failures[n]
        response = await super().get_response(
            system_instructions, input, model_settings, tools, output_schema, handoffs, *a, **kw
        )
        u = response.usage
        response.usage = Usage(
            requests=1,
            input_tokens=u.input_tokens,
            output_tokens=u.output_tokens,
            total_tokens=u.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=CACHED, cache_write_tokens=0),
        )
        return response


def provider_run(tracker, session, steps, failures=None, streamed=False):
    model = ProviderModel(steps, failures)
    tracker_filter = ContextTrackerFilter(
        tracker, model=ex.MODEL, session_id=session, summarizer=ex.Summarizer(), keep_last=4
    )
    agent = Agent(
        name="engineer", instructions=ex.INSTRUCTIONS, model=tracker_filter.wrap_model(model), tools=[ex.read_file]
    )
    config = RunConfig(call_model_input_filter=tracker_filter, tracing_disabled=True)
    hooks = ContextTrackerHooks(tracker, model=ex.MODEL, session_id=session)
    if not streamed:
        result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=steps + 5))
        return result, model, hooks

    async def stream():
        result = Runner.run_streamed(agent, QUESTION, run_config=config, hooks=hooks, max_turns=steps + 5)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(stream()), model, hooks


def test_cached_input_tokens_are_reported_as_cache_reads_beside_the_uncached_input(tracker):
    session = new_session()
    _, model, hooks = provider_run(tracker, session, steps=3)
    got = reports(tracker, session)
    assert len(got) == len(model.received) == 4
    for u, (kind, data, measured) in zip(hooks.usages, got, strict=True):
        assert u.cached_input_tokens == CACHED
        assert kind == "UsageReported" and data["basis"] == measured
        assert (data["input_tokens"], data["cache_read_tokens"]) == (u.input_tokens - CACHED, CACHED)


def test_a_context_length_error_is_reported_compacted_and_retried_once(tracker):
    session = new_session()
    result, model, hooks = provider_run(
        tracker, session, steps=8, failures={6: openai_context_error(2950, INPUT_LIMIT)}
    )
    assert result.final_output.startswith("I read 8 files")  # the run completed

    kinds_ = [e.type for e in events(tracker, session, "ProviderRejected", "CompactionStarted", "CompactionCommitted")]
    assert kinds_ == ["ProviderRejected", "CompactionStarted", "CompactionCommitted"]
    (rejected,) = events(tracker, session, "ProviderRejected")
    assert (rejected.data["input_tokens"], rejected.data["input_limit"], rejected.data["form"]) == (
        2950,
        INPUT_LIMIT,
        "openai.messages",
    )
    refused, retried = model.received[6], model.received[7]
    assert rejected.data["basis"] == reports(tracker, session)[6][2]
    assert ex.request_tokens(tracker, *retried) < ex.request_tokens(tracker, *refused)
    assert is_summary(retried[1][0]) and not any(is_summary(i) for i in refused[1])
    assert_calls_whole(retried[1])
    # the retried call's usage is reported on the basis of the compacted input it sent (revision 2)
    usage = [(d, basis) for kind, d, basis in reports(tracker, session) if kind == "UsageReported"]
    assert len(usage) == len(hooks.usages) == len(model.received) - 1 == 9
    assert usage[6][0]["basis"] == usage[6][1] and usage[6][1].startswith("r2:")
    # the next turns re-apply the compaction: every later input starts with the summary
    assert all(is_summary(items[0]) for _, items, _ in model.received[7:])


def test_a_streamed_run_recovers_from_a_context_length_error_before_its_first_event(tracker):
    session = new_session("stream")
    failures = {6: openai_context_error(2950, INPUT_LIMIT)}
    result, model, hooks = provider_run(tracker, session, steps=8, failures=failures, streamed=True)
    assert result.final_output.startswith("I read 8 files")
    kinds_ = [e.type for e in events(tracker, session, "ProviderRejected", "CompactionCommitted")]
    assert kinds_ == ["ProviderRejected", "CompactionCommitted"]
    assert is_summary(model.received[7][1][0]) and not any(is_summary(i) for i in model.received[6][1])
    assert len(events(tracker, session, "UsageReported")) == len(model.received) - 1


def test_a_second_context_length_error_in_a_row_propagates(tracker):
    import openai

    session = new_session()
    failures = {6: openai_context_error(2950, INPUT_LIMIT), 7: openai_context_error(2900, INPUT_LIMIT)}
    with pytest.raises(openai.BadRequestError, match="2900 tokens"):
        provider_run(tracker, session, steps=8, failures=failures)
    assert len(events(tracker, session, "ProviderRejected")) == 1
    assert len(events(tracker, session, "CompactionCommitted")) == 1


def test_a_usage_report_that_fails_does_not_break_the_run(tracker, caplog):
    session = new_session()
    failing = FailingReports(tracker)
    agent, config, _, model = ex.build(tracker, steps=3, summarizer=ex.Summarizer(), session_id=session)
    hooks = ContextTrackerHooks(failing, model=ex.MODEL, session_id=session)
    with caplog.at_level("WARNING", logger="tracker.integrations"):
        result = asyncio.run(Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=10))
    assert result.final_output.startswith("I read 3 files")
    assert failing.failed == len(model.received) == 4
    assert not events(tracker, session, "UsageReported")
    assert "usage report failed: RuntimeError: the tracker is unreachable" in caplog.text


# -- the item mapping -----------------------------------------------------------------------------


def test_items_map_to_the_trackers_request_shape_and_pair_calls_with_outputs():
    items = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}', "id": "fc_1"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "computer_call", "call_id": "c2", "id": "cu_1", "action": {"type": "screenshot"}},
        {"type": "computer_call_output", "call_id": "c2", "output": {"type": "computer_screenshot"}},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    its = items_of(items)
    assert its[0].pinned and not its[1].pinned
    assert its[3].calls == {"c1"} and its[4].results == {"c1"}
    assert its[5].calls == {"c2"} and its[6].results == {"c2"}
    assert its[2].calls & its[3].results  # the reasoning item stays with the call after it
    assert input_item(items[3]).messages == (
        {
            "role": "assistant",
            "content": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}],
        },
    )
    assert input_item(items[4]).messages == ({"role": "tool", "tool_call_id": "c1", "content": "ok"},)
    from tracker.counting.request import CanonicalRequest

    request = ex.to_request(items, "sys", [ex.read_file])
    CanonicalRequest.from_dict(request)  # the tracker accepts every item
    assert request["tools"][0]["name"] == "read_file"


# -- a remote tracker: the async HTTP client, against a real server on loopback --------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.api import api_server

    models = tmp_path_factory.mktemp("oa-server") / "models.json"
    models.write_text(json.dumps(ex.MODELS))
    with api_server(fleets=(f"oa-{uuid.uuid4().hex[:6]}",), clean=True, TRACKER_MODELS_FILE=str(models)) as s:
        yield s.url, s.tokens[0], str(models)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("client", ["async", "sync"])
def test_a_remote_tracker_async_or_sync_client_compacts_the_same_way(server, client):
    from tracker import AsyncTrackerClient, TrackerClient

    url, token, models_file = server
    session = new_session(f"oa-{client}")
    summarizer = ex.Summarizer(fail=1)

    async def main():
        remote = AsyncTrackerClient(url, token) if client == "async" else TrackerClient(url, token)
        try:
            model = ex.ScriptedModel(13)
            agent = Agent(name="engineer", instructions=ex.INSTRUCTIONS, model=model, tools=[ex.read_file])
            tracker_filter = ContextTrackerFilter(
                remote, model=ex.MODEL, session_id=session, summarizer=summarizer, keep_last=4, models_file=models_file
            )
            config = RunConfig(call_model_input_filter=tracker_filter, tracing_disabled=True)
            result = await Runner.run(agent, QUESTION, run_config=config, max_turns=20)
            history = [e async for e in remote.history(session)] if client == "async" else list(remote.history(session))
            return result, model, history
        finally:
            await remote.aclose() if client == "async" else remote.close()

    result, model, history = asyncio.run(main())
    assert result.final_output.startswith("I read 13 files")
    compactions = [e for e in history if e.type.startswith("Compaction")]
    assert [e.type for e in compactions] == [
        "CompactionStarted",
        "CompactionRejected",
        "CompactionStarted",
        "CompactionCommitted",
    ]
    assert compactions[1].data["reject_reason"] == "summarizer_error"
    committed = compactions[-1].data
    # tokens_after counted in this process with the registry equals the server's own count of that input
    measured = [e.data["measurement"]["input_tokens"] for e in history if e.type == "ContextMeasured"]
    assert committed["tokens_after"] in measured and committed["tokens_after"] < committed["tokens_before"] / 2
    for _, items, _ in model.received:
        assert_calls_whole(items)
    assert any(is_summary(items[0]) for _, items, _ in model.received)
