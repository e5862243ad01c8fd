"""The LangChain v1 middleware, in LangChain's own agent loop with its own fake chat model.

Real tracker, real store (SQLite file; Postgres and Redis for the two-process test), real
counting: nothing of the tracker is mocked. The agent is ``examples/langchain_agent.py``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

pytest.importorskip("langchain.agents")

import httpx  # noqa: E402
import openai  # noqa: E402
from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware.types import ModelResponse  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from pydantic import Field  # noqa: E402

from tests.support.examples import (
    EXAMPLES,
    INPUT_LIMIT,
    ROOT,
    assert_compacted_once,
    events,
    example_tracker,
    load_example,
    run_example_processes,
)
from tests.support.provider_reports import FailingReports, openai_context_error, reports
from tracker import ContextLimitError, StaleBasis, Tracker  # noqa: E402
from tracker.core.events import CompactionCommitted  # noqa: E402
from tracker.errors import InvalidInput  # noqa: E402
from tracker.integrations import Item, cut_points, default_counter  # noqa: E402
from tracker.integrations._provider import Usage  # noqa: E402
from tracker.integrations.langchain import ContextTrackerMiddleware, revision_of  # noqa: E402
from tracker.queries import decode  # noqa: E402
from tracker.settings import Settings  # noqa: E402
from tracker.store.migrate import upgrade  # noqa: E402

EXAMPLE = EXAMPLES / "langchain_agent.py"


ex = load_example("langchain_agent")


@pytest.fixture
def tracker(tmp_path):
    with example_tracker(tmp_path, ex.MODELS) as t:
        yield t


def assert_tool_calls_whole(messages):
    """Every tool result follows the call it answers; every call made before the last turn has its result."""
    made, answered = [], set()
    for m in messages:
        if isinstance(m, AIMessage):
            made.extend(tc["id"] for tc in m.tool_calls)
        if isinstance(m, ToolMessage):
            assert m.tool_call_id in made, f"result {m.tool_call_id} without its call"
            answered.add(m.tool_call_id)
    assert set(made) <= answered, f"calls without results: {set(made) - answered}"


# -- the agent loop ------------------------------------------------------------------------------


def test_context_growing_past_the_compact_level_is_compacted_and_the_next_request_is_smaller(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    report = ex.run(tracker, session, steps=13)

    _, after = assert_compacted_once(tracker, session, report, "langchain")

    # the agent state holds the compacted history at revision 2; the model always got the
    # system message, and never a tool call apart from its result
    assert report["revision"] == 2 and "Files already read" in report["summary"]
    # the compacted request is counted on a new basis (revision 2) and proceeds
    measured = [e.data for e in events(tracker, session, "ContextMeasured")]
    assert any(
        m["measurement"]["basis"].startswith("r2:")
        and m["measurement"]["input_tokens"] == after
        and m["action"] == "proceed"
        for m in measured
    )


def test_the_model_keeps_the_system_message_and_whole_tool_batches(tracker):
    summarizer = ex.Summarizer()
    agent, model = ex.build(tracker, steps=13, summarizer=summarizer, session_id=f"lc-{uuid.uuid4().hex[:8]}")
    out = agent.invoke({"messages": [HumanMessage("What is wrong?")]})
    assert summarizer.calls == 1
    for request in model.requests:
        assert isinstance(request[0], SystemMessage) and request[0].content == ex.SYSTEM
        assert_tool_calls_whole(request[1:])
    assert_tool_calls_whole(out["messages"])
    assert revision_of(out["messages"]) == 2
    # the tail was kept verbatim: the newest messages before compaction are still there
    assert [m.content for m in out["messages"] if isinstance(m, ToolMessage)][-1] == ex.read_file.invoke(
        {"path": "src/module_12.py"}
    )


def test_async_agent_loop_compacts_too(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer()
    agent, model = ex.build(tracker, steps=13, summarizer=summarizer)
    out = asyncio.run(
        agent.ainvoke(
            {"messages": [HumanMessage("What is wrong?")]},
            config={"configurable": {"thread_id": session}, "recursion_limit": 80},
        )
    )
    assert out["messages"][-1].content.startswith("I read 13 files")
    assert [e.type for e in events(tracker, session, "CompactionStarted", "CompactionCommitted")] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]
    assert summarizer.calls == 1


def test_a_failing_summariser_is_rejected_and_the_run_ends_in_context_limit_error(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer(fail=True)
    agent, model = ex.build(tracker, steps=16, summarizer=summarizer, session_id=session)
    with pytest.raises(ContextLimitError) as err:
        agent.invoke({"messages": [HumanMessage("What is wrong?")]}, config={"recursion_limit": 80})
    assert err.value.details["input_limit"] == INPUT_LIMIT
    rejected = events(tracker, session, "CompactionRejected")
    assert rejected and {e.data["reject_reason"] for e in rejected} == {"summarizer_error"}
    assert summarizer.calls == len(rejected)
    assert events(tracker, session, "ContextLimitReached")
    assert not events(tracker, session, "CompactionCommitted")
    # the request the tracker refused never reached the model
    sent = [ex.request_tokens(tracker, r) for r in model.requests]
    assert max(sent) < INPUT_LIMIT < err.value.details["input_tokens"]


def test_an_oversized_summary_is_rejected_as_summary_over_budget(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    calls = []

    def verbose(messages, budget_tokens):
        calls.append(budget_tokens)
        return "lease fence " * 3000

    agent, model = ex.build(tracker, steps=16, summarizer=verbose, session_id=session)
    with pytest.raises(ContextLimitError):
        agent.invoke({"messages": [HumanMessage("What is wrong?")]}, config={"recursion_limit": 80})
    rejected = events(tracker, session, "CompactionRejected")
    assert rejected and {e.data["reject_reason"] for e in rejected} == {"summary_over_budget"}
    assert calls and all(0 < b < INPUT_LIMIT for b in calls)


def test_two_agent_processes_on_one_session_compact_once(pg_url, redis_url, tmp_path):
    """Two real processes run the same agent on one session (Postgres + Redis): one summary, both adopt it."""
    upgrade(pg_url)
    session = f"lc2-{uuid.uuid4().hex[:8]}"
    reports = run_example_processes(EXAMPLE, database_url=pg_url, redis_url=redis_url, session=session)

    assert all(r["answer"].startswith("I read 13 files") for r in reports)
    assert sum(r["summarizer_calls"] for r in reports) == 1  # one summary written, in one process
    with Tracker.from_settings(Settings.of(database_url=pg_url)) as t:
        started = events(t, session, "CompactionStarted")
        committed = events(t, session, "CompactionCommitted")
        assert len(started) == 1 and len(committed) == 1
        assert not events(t, session, "CompactionRejected", "ContextLimitReached")
    # both agents carry on from the same summary at revision 2, and neither sent an oversized request
    assert [r["revision"] for r in reports] == [2, 2]
    assert reports[0]["summary"] == reports[1]["summary"]
    assert all(max(r["model_requests"]) < INPUT_LIMIT for r in reports)


def test_a_new_conversation_on_a_compacted_session_is_refused_as_stale(tracker):
    """A session names one conversation: after it compacted, a different history at revision 1 is stale."""
    session = f"lc-{uuid.uuid4().hex[:8]}"
    ex.run(tracker, session, steps=13)
    agent, model = ex.build(tracker, steps=3, summarizer=ex.Summarizer(), session_id=session)
    with pytest.raises(StaleBasis):
        agent.invoke({"messages": [HumanMessage("Another question entirely.")]})
    assert model.requests == []  # nothing was sent


def history_of(steps):
    """A history as the agent leaves it after ``steps`` scripted steps (each a tool call and its file)."""
    out = [HumanMessage(ex.QUESTION)]
    for i in range(steps):
        call = {"name": "read_file", "args": {"path": f"src/module_{i}.py"}, "id": f"call_{i}"}
        out += [
            AIMessage(content=f"Step {i}: reading src/module_{i}.py.", tool_calls=[call]),
            ToolMessage(ex.source_file(f"src/module_{i}.py"), tool_call_id=f"call_{i}"),
        ]
    return out


def test_a_compaction_adopted_and_compacted_again_in_one_call_summarises_the_adopted_summary(tracker):
    """Another agent compacted this history; this one adopts that summary and is still past the compact
    level (a long message was added): the summariser is given the messages of the adopted view (the
    summary first), not the span at the same indices of the history the call began with."""
    session = f"lc-{uuid.uuid4().hex[:8]}"
    first, _ = ex.build(tracker, steps=0, summarizer=ex.Summarizer(), session_id=session)
    first.invoke({"messages": [*history_of(9), HumanMessage("Go on.")]})
    assert [e.type for e in events(tracker, session, "CompactionStarted", "CompactionCommitted")] == [
        "CompactionStarted",
        "CompactionCommitted",
    ]

    spans = []

    def summarize(messages, budget_tokens):
        spans.append(messages)
        return "Summary of both: files were read, then the user pasted the fence log."

    second, model = ex.build(tracker, steps=0, summarizer=summarize, session_id=session)
    pasted = "And the fence check? Here is its log: " + " ".join(f"fence {n} renewed lease" for n in range(320))
    out = second.invoke({"messages": [*history_of(9), HumanMessage(pasted)]})
    assert len(events(tracker, session, "CompactionCommitted")) == 2
    (span,) = spans
    assert isinstance(span[0], HumanMessage) and "Files already read" in span[0].content
    assert not any(isinstance(m, HumanMessage) and m.content == ex.QUESTION for m in span)
    assert_tool_calls_whole(span)
    (sent,) = model.requests
    assert "Summary of both" in sent[1].content  # (after the system message)
    assert revision_of(out["messages"]) == 3


def test_the_default_counter_of_a_remote_client_counts_like_the_embedded_tracker(tracker, tmp_path):
    """Without an embedded counting backend (a TrackerClient), tokens_after is counted in-process
    over the model registry: the same number the tracker's own counter gives."""
    request = ex.to_request([HumanMessage("hello there"), AIMessage("hi")], SystemMessage(ex.SYSTEM), [ex.read_file])
    models = tmp_path / "models.json"
    models.write_text(json.dumps(ex.MODELS))
    remote = default_counter(object(), ex.MODEL, models_file=models)
    embedded = default_counter(tracker, ex.MODEL)
    assert remote(request) == embedded(request) > 0


# -- framework-free parts ------------------------------------------------------------------------


def test_cut_points_never_split_a_tool_batch():
    def it(calls=(), results=(), pinned=False):
        return Item(({"role": "user", "content": "x"},), frozenset(calls), frozenset(results), pinned)

    items = [
        it(pinned=True),
        it(),
        it(calls={"a", "b"}),
        it(results={"a"}),
        it(results={"b"}),
        it(),
        it(calls={"c"}),
        it(results={"c"}),
    ]
    cuts = cut_points(items, keep_last=3)
    assert cuts and all(c > 1 for c in cuts)  # the pinned system entry is never summarised
    for end in cuts:
        made = set().union(*(i.calls for i in items[:end]))
        assert not made & set().union(*(i.results for i in items[end:]))
    assert 3 not in cuts and 4 not in cuts and 7 not in cuts  # inside the batches
    assert cuts[0] == 5  # keep the last three entries: the cut lands just before them


def test_a_recent_tail_over_the_budget_is_summarised_into_not_rejected(tracker):
    """When even the last ``keep_last`` entries leave no room within the budget, the summary reaches
    into the tail (down to summarising everything) instead of a ``summary_over_budget`` rejection."""
    from tracker.integrations import ContextGuard, View

    def entry(i: int, words: int) -> Item:
        return Item(({"role": "assistant" if i % 2 else "user", "content": f"note {i}: " + "lease " * words},))

    # twelve small entries (more than eight cuts keep the tail), then four big ones
    items = tuple(entry(i, 6) for i in range(12)) + tuple(entry(12 + i, 660) for i in range(4))
    view = View(system=ex.SYSTEM, items=items)
    session = f"tail-{uuid.uuid4().hex[:8]}"
    count = default_counter(tracker, ex.MODEL)
    tail = count({"system": ex.SYSTEM, "messages": [m for it in items[-4:] for m in it.messages], "tools": []})
    guard = ContextGuard(tracker, model=ex.MODEL, keep_last=4)
    cuts: list[tuple[int, int]] = []
    out = guard.before_call(session, view, lambda start, end, room: cuts.append((start, end)) or "Notes 0-8: leases.")
    started = events(tracker, session, "CompactionStarted")[0].data
    assert tail > started["history_budget"]  # the case: keeping the last four cannot fit
    assert [e.type for e in events(tracker, session, "CompactionCommitted", "CompactionRejected")] == [
        "CompactionCommitted"
    ]
    assert cuts and cuts[0][1] > len(items) - 4  # the summary reached into the tail
    (rep,) = out.replacements
    assert rep.tokens_after <= started["history_budget"] and len(out.view.items) == len(items) - rep.end + 1


def test_the_core_install_does_not_import_the_frameworks():
    for base in ("tracker", "workers"):
        for path in (ROOT / base).rglob("*.py"):
            if "integrations" in path.relative_to(ROOT).parts and path.name != "__init__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                )
                for name in names:
                    assert name.split(".")[0] not in {"langchain", "langchain_core", "langgraph", "pydantic_ai"}, (
                        f"{path} imports {name}"
                    )
    code = (
        "import sys, tracker, tracker.client, tracker.protocol, tracker.service, tracker.http.app, "
        "tracker.integrations; frameworks = ('langchain', 'langchain_core', 'langgraph', 'pydantic_ai'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in frameworks))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- the provider's side: usage reports, one context-length error recovered ------------------------


CACHE_READ, CACHE_WRITE = 300, 50


class ProviderChatModel(ex.ScriptedChatModel):
    """The scripted model, as a provider: every reply carries ``usage_metadata`` (LangChain's input total
    includes the cached tokens), and the calls listed in ``failures`` raise the given exception instead."""

    failures: dict[int, Any] = Field(default_factory=dict)

    def _generate(self, messages, *args, **kwargs):
        self.requests.append(list(messages))
        n = len(self.requests) - 1
        if n in self.failures:
            raise self.failures[n]
        result = super(ex.ScriptedChatModel, self)._generate(messages, *args, **kwargs)
        total = 1000 + n  # a distinct number per call
        result.generations[0].message.usage_metadata = {
            "input_tokens": total,
            "output_tokens": 20 + n,
            "total_tokens": total + 20 + n,
            "input_token_details": {"cache_read": CACHE_READ, "cache_creation": CACHE_WRITE},
        }
        return result


def provider_agent(tracker, steps, failures=None, summarizer=None):
    model = ProviderChatModel(messages=iter(ex.script(steps)), failures=failures or {})
    summarizer = summarizer or ex.Summarizer()
    middleware = ContextTrackerMiddleware(tracker, model=ex.MODEL, summarizer=summarizer, keep_last=4)
    return create_agent(model, tools=[ex.read_file], system_prompt=ex.SYSTEM, middleware=[middleware]), model


def invoke(agent, session, steps):
    return agent.invoke(
        {"messages": [HumanMessage(ex.QUESTION)]},
        config={"configurable": {"thread_id": session}, "recursion_limit": 4 * steps + 20},
    )


def test_every_model_call_reports_its_usage_on_the_basis_it_was_measured_with(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    agent, model = provider_agent(tracker, steps=13)
    out = invoke(agent, session, 13)
    assert out["messages"][-1].content.startswith("I read 13 files")
    assert events(tracker, session, "CompactionCommitted")  # the usage of compacted requests is reported too
    got = reports(tracker, session)
    assert len(got) == len(model.requests) == 14
    for n, (kind, data, measured) in enumerate(got):
        assert kind == "UsageReported" and data["basis"] == measured
        # LangChain's input_tokens counts the cached tokens: the tracker's input_tokens is the rest
        assert (data["input_tokens"], data["cache_read_tokens"], data["cache_write_tokens"]) == (
            1000 + n - CACHE_READ - CACHE_WRITE,
            CACHE_READ,
            CACHE_WRITE,
        )
        assert data["output_tokens"] == 20 + n
    assert any(data["basis"].startswith("r2:") for _, data, _ in got)


@pytest.mark.parametrize("run", ["sync", "async"])
def test_a_context_length_error_is_reported_compacted_and_retried_once(tracker, run):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    error = openai_context_error(count=2950, limit=INPUT_LIMIT)  # as langchain-openai lets it through
    agent, model = provider_agent(tracker, steps=8, failures={6: error})
    if run == "sync":
        out = invoke(agent, session, 8)
    else:
        out = asyncio.run(
            agent.ainvoke(
                {"messages": [HumanMessage(ex.QUESTION)]},
                config={"configurable": {"thread_id": session}, "recursion_limit": 60},
            )
        )
    assert out["messages"][-1].content.startswith("I read 8 files")  # the run completed

    kinds = [e.type for e in events(tracker, session, "ProviderRejected", "CompactionStarted", "CompactionCommitted")]
    assert kinds == ["ProviderRejected", "CompactionStarted", "CompactionCommitted"]
    (rejected,) = events(tracker, session, "ProviderRejected")
    assert (rejected.data["input_tokens"], rejected.data["input_limit"], rejected.data["form"]) == (
        2950,
        INPUT_LIMIT,
        "openai.messages",
    )
    # the refused request was well under the tracker's compact level: only the provider knew
    refused, retried = model.requests[6], model.requests[7]
    assert rejected.data["basis"] == reports(tracker, session)[6][2]
    assert ex.request_tokens(tracker, retried) < ex.request_tokens(tracker, refused)
    assert any("context_tracker" in m.additional_kwargs for m in retried)  # the compacted history was sent
    # the retried call's usage is reported on the compacted basis (revision 2)
    usage = [(d, basis) for kind, d, basis in reports(tracker, session) if kind == "UsageReported"]
    assert len(usage) == len(model.requests) - 1 == 9
    assert usage[6][0]["basis"] == usage[6][1] and usage[6][1].startswith("r2:")
    assert revision_of(out["messages"]) == 2


def test_a_second_context_length_error_in_a_row_propagates(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    agent, model = provider_agent(
        tracker,
        steps=8,
        failures={6: openai_context_error(2950, INPUT_LIMIT), 7: openai_context_error(2900, INPUT_LIMIT)},
    )
    with pytest.raises(openai.BadRequestError, match="2900 tokens"):
        invoke(agent, session, 8)
    assert len(model.requests) == 8  # the refused call and its one retry
    assert len(events(tracker, session, "ProviderRejected")) == 1
    assert len(events(tracker, session, "CompactionCommitted")) == 1


def test_a_rejection_that_cannot_be_compacted_ends_in_context_limit_error(tracker):
    """The provider refused the request and every summary fails: the tracker refuses the request
    (ContextLimitError, at the hard limit for the rejected basis) and it is not sent again."""
    session = f"lc-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer(fail=True)
    agent, model = provider_agent(
        tracker, steps=8, failures={6: openai_context_error(2950, INPUT_LIMIT)}, summarizer=summarizer
    )
    with pytest.raises(ContextLimitError) as err:
        invoke(agent, session, 8)
    assert isinstance(err.value.__context__, openai.BadRequestError)  # raised while handling the provider's error
    assert len(model.requests) == 7  # the refused request was not sent again
    assert len(events(tracker, session, "ProviderRejected")) == 1
    assert summarizer.calls >= 1
    assert {e.data["reject_reason"] for e in events(tracker, session, "CompactionRejected")} == {"summarizer_error"}
    assert events(tracker, session, "ContextLimitReached") and not events(tracker, session, "CompactionCommitted")


def test_another_error_of_the_model_is_not_a_rejection(tracker):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    agent, model = provider_agent(
        tracker,
        steps=8,
        failures={3: openai.APIConnectionError(request=httpx.Request("POST", "https://api.openai.com/v1/responses"))},
    )
    with pytest.raises(openai.APIConnectionError):
        invoke(agent, session, 8)
    assert len(model.requests) == 4
    assert not events(tracker, session, "ProviderRejected", "CompactionStarted")


def test_a_usage_report_that_fails_does_not_break_the_call(tracker, caplog):
    session = f"lc-{uuid.uuid4().hex[:8]}"
    failing = FailingReports(tracker)
    agent, model = provider_agent(failing, steps=3)
    with caplog.at_level("WARNING", logger="tracker.integrations"):
        out = invoke(agent, session, 3)
    assert out["messages"][-1].content.startswith("I read 3 files")
    assert failing.failed == len(model.requests) == 4
    assert not events(tracker, session, "UsageReported")
    assert "usage report failed: RuntimeError: the tracker is unreachable" in caplog.text


def test_usage_metadata_maps_to_the_trackers_uncached_input():
    from tracker.integrations.langchain import usage_of

    def msg(meta):
        return ModelResponse(result=[AIMessage("x", usage_metadata=meta)])

    inclusive = {"input_tokens": 350, "output_tokens": 240, "total_tokens": 590}
    details = {"input_token_details": {"audio": 10, "cache_creation": 200, "cache_read": 100}}
    assert usage_of(msg({**inclusive, **details})) == Usage(50, 240, 100, 200)
    assert usage_of(msg(inclusive)) == Usage(350, 240, None, None)
    # cache counts larger than the total cannot be inside it: an adapter reporting them beside it
    beside = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, **details}
    assert usage_of(msg(beside)) == Usage(10, 5, 100, 200)
    assert usage_of(msg({"input_tokens": 0, "output_tokens": 0, "total_tokens": 0})) is None  # a fake model's
    assert usage_of(ModelResponse(result=[AIMessage("no usage")])) is None


# -- an async tracker: the AsyncTrackerClient, against a real server on loopback --------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.api import api_server

    models = tmp_path_factory.mktemp("lc-server") / "models.json"
    models.write_text(json.dumps(ex.MODELS))
    # a generous count timeout: the server counts in-process, on a machine the test may share with others
    with api_server(fleets=("lc",), TRACKER_MODELS_FILE=str(models), TRACKER_COUNT_TIMEOUT_S="30") as api:
        yield api, str(models)


@pytest.mark.postgres
@pytest.mark.redis
def test_an_async_tracker_client_compacts_in_the_async_agent_loop(server):
    """``ainvoke`` with an ``AsyncTrackerClient``: every tracker call is awaited on the agent's loop, the
    async summariser too, and the run compacts once as with the embedded tracker."""
    from tracker import AsyncTrackerClient

    api, models_file = server
    session = f"lc-async-{uuid.uuid4().hex[:8]}"
    summarizer = ex.Summarizer()
    loops = []

    async def summarize(messages, budget_tokens):
        loops.append(asyncio.get_running_loop())
        return summarizer(messages, budget_tokens)

    async def main():
        client = AsyncTrackerClient(api.url, api.token_a)
        try:
            model = ex.ScriptedChatModel(messages=iter(ex.script(13)))
            middleware = ContextTrackerMiddleware(
                client, model=ex.MODEL, summarizer=summarize, keep_last=4, models_file=models_file
            )
            agent = create_agent(model, tools=[ex.read_file], system_prompt=ex.SYSTEM, middleware=[middleware])
            out = await agent.ainvoke(
                {"messages": [HumanMessage(ex.QUESTION)]},
                config={"configurable": {"thread_id": session}, "recursion_limit": 80},
            )
            return out, model, [e async for e in client.history(session)], asyncio.get_running_loop()
        finally:
            await client.aclose()

    out, model, history, loop = asyncio.run(main())
    assert out["messages"][-1].content.startswith("I read 13 files")
    assert summarizer.calls == 1 and loops == [loop]  # the async summariser ran on the agent's own loop
    assert [e.type for e in history if e.type.startswith("Compaction")] == ["CompactionStarted", "CompactionCommitted"]
    (committed,) = [r.event for r in map(decode, history) if isinstance(r.event, CompactionCommitted)]
    # tokens_after counted in this process with the registry equals the server's own count of that request
    measured = [e.data["measurement"]["input_tokens"] for e in history if e.type == "ContextMeasured"]
    assert committed.tokens_after in measured and committed.tokens_after < (committed.tokens_before or 0) / 2
    assert revision_of(out["messages"]) == 2
    assert any("context_tracker" in m.additional_kwargs for m in model.requests[-1])  # the model got the summary
    assert_tool_calls_whole(out["messages"])


@pytest.mark.postgres
@pytest.mark.redis
def test_a_sync_invoke_with_an_async_tracker_is_refused_naming_the_tracker(server):
    from tracker import AsyncTrackerClient

    api, models_file = server
    client = AsyncTrackerClient(api.url, api.token_a)
    try:
        model = ex.ScriptedChatModel(messages=iter(ex.script(3)))
        middleware = ContextTrackerMiddleware(
            client, model=ex.MODEL, summarizer=ex.Summarizer(), models_file=models_file
        )
        agent = create_agent(model, tools=[ex.read_file], system_prompt=ex.SYSTEM, middleware=[middleware])
        with pytest.raises(InvalidInput) as err:
            agent.invoke({"messages": [HumanMessage(ex.QUESTION)]}, config={"configurable": {"thread_id": "lc-sync"}})
        assert err.value.field == "tracker" and "async path" in str(err.value)
        assert model.requests == []  # nothing was sent unobserved
    finally:
        asyncio.run(client.aclose())
