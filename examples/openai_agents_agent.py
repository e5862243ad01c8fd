"""An OpenAI Agents SDK agent whose context the Context Tracker keeps — runnable offline.

    python examples/openai_agents_agent.py                      # embedded: SQLite in a temp dir, in-process counting
    python examples/openai_agents_agent.py --json               # the run's report as JSON
    python examples/openai_agents_agent.py --failing-summarizer # every summary fails: the run ends in ContextLimitError
    python examples/openai_agents_agent.py --database-url postgresql://postgres@127.0.0.1:5432/db \\
        --redis-url redis://127.0.0.1:6379/0 --share-redis --session s1   # one of several processes on one session

The model is a fake of the SDK's ``Model`` interface playing a script (no network): read
``--steps`` files one ``function_call`` at a time, then answer. ``Runner.run`` executes the tool
calls and feeds the ``function_call_output`` items back, as it does with a real model. Each file
is a few hundred tokens, so with the small input limit of ``example-agent-small`` (2808 tokens)
the request passes the compact level after about ten steps; the filter summarises the older
steps and the agent carries on. The only lines that concern the tracker are the ones marked
``# <- context tracker``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agents import Agent, Model, ModelResponse, RunConfig, Runner, Usage, function_tool
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseUsage,
)
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from tracker import ContextLimitError, Tracker
from tracker.core.model import Basis
from tracker.integrations.openai_agents import (  # <- context tracker
    ContextTrackerFilter,
    ContextTrackerHooks,
    to_request,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_common.py, beside this file
import agent_common  # noqa: E402
from agent_common import MODEL, MODELS, QUESTION, SummarizerBase, compaction_events, source_file  # noqa: E402, F401

INSTRUCTIONS = agent_common.SYSTEM


@function_tool
def read_file(path: str) -> str:
    """Read one source file of the repository."""
    return source_file(path)


class ScriptedModel(Model):
    """A fake of the SDK's ``Model``: one scripted reply per call; keeps every input it received.

    ``batch`` > 1 makes each step a batch of parallel calls (several ``function_call`` items, then
    their outputs), as a real model may. Its usage is made up (characters / 4): a real model's
    usage is the provider's.
    """

    def __init__(self, steps: int, batch: int = 1) -> None:
        self.steps, self.batch = steps, batch
        self.calls = 0
        self.received: list[tuple[str | None, list[Any], list[Any]]] = []  # (instructions, input, tools)

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: Any = None,
    ) -> ModelResponse:
        items = [{"role": "user", "content": input}] if isinstance(input, str) else [dict(i) for i in input]
        self.received.append((system_instructions, items, [*tools, *handoffs]))
        i, self.calls = self.calls, self.calls + 1
        output: list[Any]
        if i < self.steps:
            output = [
                ResponseFunctionToolCall(
                    type="function_call",
                    id=f"fc_{i}_{j}",
                    call_id=f"call_{i}_{j}",
                    name="read_file",
                    arguments=json.dumps(
                        {"path": f"src/module_{i}_{j}.py" if self.batch > 1 else f"src/module_{i}.py"}
                    ),
                    status="completed",
                )
                for j in range(self.batch)
            ]
        else:
            text = f"I read {self.steps * self.batch} files: the lease is renewed after the fence check."
            output = [
                ResponseOutputMessage(
                    type="message",
                    id=f"msg_{i}",
                    role="assistant",
                    status="completed",
                    content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
                )
            ]
        size = len(json.dumps(items, default=str)) // 4
        return ModelResponse(
            output=output,
            usage=Usage(requests=1, input_tokens=size, output_tokens=20, total_tokens=size + 20),
            response_id=f"resp_{i}",
        )

    async def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: Any = None,
    ) -> AsyncIterator[Any]:
        """``Runner.run_streamed``: the same reply, as one ``response.completed`` event."""
        r = await self.get_response(system_instructions, input, model_settings, tools, output_schema, handoffs, tracing)
        usage = ResponseUsage(
            input_tokens=r.usage.input_tokens,
            output_tokens=r.usage.output_tokens,
            total_tokens=r.usage.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        )
        response = Response.model_construct(
            id=r.response_id,
            created_at=time.time(),
            model=MODEL,
            object="response",
            output=r.output,
            parallel_tool_calls=True,
            tool_choice="auto",
            tools=[],
            usage=usage,
        )
        yield ResponseCompletedEvent(type="response.completed", response=response, sequence_number=0)


class Summarizer(SummarizerBase):
    """A deterministic summariser (a real agent leaves ``summarizer=None``: the agent's own model
    writes the summary): lists the files read so far. ``fail`` = how many calls fail first (-1: all)."""

    def files_read(self, messages: list[Any]) -> list[str]:
        return [json.loads(i["arguments"])["path"] for i in messages if i.get("type") == "function_call"]


def build(
    tracker: Any,
    *,
    steps: int,
    summarizer: Any,
    session_id: str | None = None,
    session: Any = None,
    share: Any = None,
    batch: int = 1,
) -> tuple[Agent[Any], RunConfig, ContextTrackerHooks, ScriptedModel]:
    model = ScriptedModel(steps, batch)
    tracker_filter = ContextTrackerFilter(  # <- context tracker
        tracker, model=MODEL, session_id=session_id, session=session, summarizer=summarizer, share=share, keep_last=4
    )
    agent = Agent(
        name="engineer",
        instructions=INSTRUCTIONS,
        model=tracker_filter.wrap_model(model),  # <- context tracker: one context-length error is recovered
        tools=[read_file],
    )
    config = RunConfig(call_model_input_filter=tracker_filter, tracing_disabled=True)  # <- context tracker
    hooks = ContextTrackerHooks(tracker, model=MODEL, session_id=session_id, session=session)  # <- context tracker
    return agent, config, hooks, model


def request_tokens(tracker: Tracker, instructions: str | None, items: list[Any], tools: list[Any]) -> int:
    """What one input the model received counts, with the tracker's own counter."""
    request = to_request(items, instructions, tools)
    return tracker.counting.measure(request, model=MODEL, basis=Basis(1, "report"), policy=tracker.policy).input_tokens


async def run(
    tracker: Tracker,
    session: str,
    *,
    steps: int = 16,
    summarizer: Summarizer | None = None,
    share: Any = None,
    batch: int = 1,
) -> dict[str, Any]:
    """Run the agent once on ``session``; a report of what happened."""
    summarizer = summarizer or Summarizer()
    agent, config, hooks, model = build(
        tracker, steps=steps, summarizer=summarizer, session_id=session, share=share, batch=batch
    )
    report: dict[str, Any] = {"session": session, "answer": None, "error": None}
    try:
        result = await Runner.run(agent, QUESTION, run_config=config, hooks=hooks, max_turns=steps + 5)
        report["answer"] = result.final_output
    except ContextLimitError as exc:  # the tracker refused a request the model could not take
        report["error"] = exc.to_dict()
    report["summarizer_calls"] = summarizer.calls
    report["model_requests"] = [request_tokens(tracker, ins, items, tools) for ins, items, tools in model.received]
    report["usage_reports"] = hooks.reports_usage  # each call's usage is reported to the tracker
    report["usages"] = [{"basis": u.basis, "input_tokens": u.input_tokens} for u in hooks.usages]
    report["events"] = compaction_events(tracker, session)
    return report


def main(argv: list[str] | None = None) -> int:
    return agent_common.main(
        argv,
        description=__doc__.splitlines()[0],
        session="openai-agents-example",
        prefix="ct-openai-agents-",
        run=lambda *args, **kwargs: asyncio.run(run(*args, **kwargs)),
        summarizer=Summarizer,
    )


if __name__ == "__main__":
    agent_common.run_main(main)
