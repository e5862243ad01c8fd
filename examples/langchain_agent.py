"""A LangChain agent whose context the Context Tracker keeps — runnable offline.

    python examples/langchain_agent.py                     # embedded: SQLite in a temp dir, in-process counting
    python examples/langchain_agent.py --json              # the run's report as JSON
    python examples/langchain_agent.py --failing-summarizer  # every summary fails: the run ends in ContextLimitError
    python examples/langchain_agent.py --database-url postgresql://postgres@127.0.0.1:5432/db \\
        --redis-url redis://127.0.0.1:6379/0 --share-redis --session s1   # one of several processes on one session

The model is LangChain's own ``GenericFakeChatModel`` playing a script: read ``--steps`` files
one tool call at a time, then answer. Each file is a few hundred tokens, so with the small
input limit of ``example-agent-small`` (2808 tokens) the request passes the compact level after about ten steps;
the middleware summarises the older steps and the agent carries on. The only lines that
concern the tracker are the ones marked ``# <- context tracker``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from pydantic import Field

from tracker import ContextLimitError, Tracker
from tracker.integrations.langchain import ContextTrackerMiddleware, revision_of, to_request  # <- context tracker

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_common.py, beside this file
import agent_common  # noqa: E402
from agent_common import MODEL, MODELS, QUESTION, SYSTEM, SummarizerBase, source_file  # noqa: E402, F401


@tool
def read_file(path: str) -> str:
    """Read one source file of the repository."""
    return source_file(path)


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's ``GenericFakeChatModel`` that accepts bound tools and keeps every request it received."""

    requests: list[list[BaseMessage]] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        self.requests.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


def script(steps: int) -> list[AIMessage]:
    calls = [
        AIMessage(
            content=f"Step {i}: reading src/module_{i}.py.",
            tool_calls=[{"name": "read_file", "args": {"path": f"src/module_{i}.py"}, "id": f"call_{i}"}],
        )
        for i in range(steps)
    ]
    return calls + [AIMessage(content=f"I read {steps} files: the lease is renewed after the fence check.")]


class Summarizer(SummarizerBase):
    """A deterministic summariser (a real agent passes a chat model): lists the files read so far."""

    def files_read(self, messages: list[BaseMessage]) -> list[str]:
        return [tc["args"]["path"] for m in messages if isinstance(m, AIMessage) for tc in m.tool_calls]


def build(
    tracker: Tracker, *, steps: int, summarizer: Summarizer, session_id: str | None = None, share: Any = None
) -> tuple[Any, ScriptedChatModel]:
    model = ScriptedChatModel(messages=iter(script(steps)))
    middleware = ContextTrackerMiddleware(
        tracker,
        model=MODEL,
        summarizer=summarizer,  # <- context tracker
        session_id=session_id,
        share=share,
        keep_last=4,
    )
    agent = create_agent(model, tools=[read_file], system_prompt=SYSTEM, middleware=[middleware])
    return agent, model


def request_tokens(tracker: Tracker, messages: list[BaseMessage]) -> int:
    """What one request the model received counts, with the tracker's own counter."""
    system = messages[0] if messages and isinstance(messages[0], SystemMessage) else None
    request = to_request(messages[1:] if system is not None else messages, system, [read_file])
    from tracker.core.model import Basis

    return tracker.counting.measure(request, model=MODEL, basis=Basis(1, "report"), policy=tracker.policy).input_tokens


def run(
    tracker: Tracker, session: str, *, steps: int = 16, summarizer: Summarizer | None = None, share: Any = None
) -> dict[str, Any]:
    """Run the agent once on ``session`` (its thread id); a report of what happened."""
    summarizer = summarizer or Summarizer()
    agent, model = build(tracker, steps=steps, summarizer=summarizer, share=share)
    report: dict[str, Any] = {"session": session, "answer": None, "error": None}
    try:
        out = agent.invoke(
            {"messages": [HumanMessage(QUESTION)]},
            config={"configurable": {"thread_id": session}, "recursion_limit": 4 * steps + 20},
        )
        report["answer"] = out["messages"][-1].content
        report["revision"] = revision_of(out["messages"])
        report["summary"] = next((m.content for m in out["messages"] if "context_tracker" in m.additional_kwargs), None)
    except ContextLimitError as exc:  # the tracker refused a request the model could not take
        report["error"] = exc.to_dict()
    report["summarizer_calls"] = summarizer.calls
    report["model_requests"] = [request_tokens(tracker, r) for r in model.requests]
    report["events"] = agent_common.compaction_events(tracker, session)
    return report


def main(argv: list[str] | None = None) -> int:
    return agent_common.main(
        argv,
        description=__doc__.splitlines()[0],
        session="langchain-example",
        prefix="ct-langchain-",
        run=run,
        summarizer=Summarizer,
    )


if __name__ == "__main__":
    agent_common.run_main(main)
