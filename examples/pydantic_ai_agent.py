"""A pydantic-ai agent whose context the Context Tracker keeps — runnable offline.

    python examples/pydantic_ai_agent.py                      # embedded: SQLite in a temp dir, in-process counting
    python examples/pydantic_ai_agent.py --json               # the run's report as JSON
    python examples/pydantic_ai_agent.py --failing-summarizer # every summary fails: the run ends in ContextLimitError
    python examples/pydantic_ai_agent.py --database-url postgresql://postgres@127.0.0.1:5432/db \\
        --redis-url redis://127.0.0.1:6379/0 --share-redis --session s1   # one of several processes on one session

The model is pydantic-ai's own ``FunctionModel`` playing a script: read ``--steps`` files one
tool call at a time, then answer. Each file is a few hundred tokens, so with the small input
limit of ``example-agent-small`` (2808 tokens) the request passes the compact level after
about ten steps; the capability summarises the older steps and the agent carries on. The only
lines that concern the tracker are the ones marked ``# <- context tracker``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tracker import ContextLimitError, Tracker
from tracker.core.model import Basis
from tracker.integrations.pydantic_ai import ContextTrackerCapability, revision_of, to_request  # <- context tracker

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_common.py, beside this file
import agent_common  # noqa: E402
from agent_common import MODEL, MODELS, QUESTION, SYSTEM, SummarizerBase, source_file  # noqa: E402, F401


def read_file(path: str) -> str:
    """Read one source file of the repository."""
    return source_file(path)


class Script:
    """The ``FunctionModel`` body: one scripted reply per call; keeps every request it received."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0
        self.requests: list[tuple[list[ModelMessage], AgentInfo]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append((list(messages), info))
        i, self.calls = self.calls, self.calls + 1
        if i < self.steps:
            return ModelResponse(
                parts=[
                    TextPart(f"Step {i}: reading src/module_{i}.py."),
                    ToolCallPart("read_file", {"path": f"src/module_{i}.py"}, tool_call_id=f"call_{i}"),
                ]
            )
        return ModelResponse(
            parts=[TextPart(f"I read {self.steps} files: the lease is renewed after the fence check.")]
        )


class Summarizer(SummarizerBase):
    """A deterministic summariser (a real agent passes an Agent or a model call): lists the files read so far."""

    def files_read(self, messages: list[ModelMessage]) -> list[str]:
        return [
            p.args_as_dict()["path"]
            for m in messages
            if isinstance(m, ModelResponse)
            for p in m.parts
            if isinstance(p, ToolCallPart)
        ]


def build(
    tracker: Tracker, *, steps: int, summarizer: Summarizer, session_id: str | None = None, share: Any = None
) -> tuple[Agent, Script]:
    script = Script(steps)
    capability = ContextTrackerCapability(
        tracker,
        model=MODEL,
        summarizer=summarizer,  # <- context tracker
        session_id=session_id,
        share=share,
        keep_last=4,
    )
    agent = Agent(FunctionModel(script), system_prompt=SYSTEM, tools=[read_file], capabilities=[capability])
    return agent, script


def request_tokens(tracker: Tracker, messages: list[ModelMessage], info: AgentInfo) -> int:
    """What one request the model received counts, with the tracker's own counter."""
    request = to_request(messages, [info.instructions] if info.instructions else [], info.function_tools)
    return tracker.counting.measure(request, model=MODEL, basis=Basis(1, "report"), policy=tracker.policy).input_tokens


def run(
    tracker: Tracker, session: str, *, steps: int = 16, summarizer: Summarizer | None = None, share: Any = None
) -> dict[str, Any]:
    """Run the agent once on ``session``; a report of what happened."""
    summarizer = summarizer or Summarizer()
    agent, script = build(tracker, steps=steps, summarizer=summarizer, session_id=session, share=share)
    report: dict[str, Any] = {"session": session, "answer": None, "error": None}
    try:
        result = agent.run_sync(QUESTION)
        messages = result.all_messages()
        report["answer"] = result.output
        report["revision"] = revision_of(messages)
        report["summary"] = next(
            (m.parts[-1].content for m in messages if (getattr(m, "metadata", None) or {}).get("context_tracker")), None
        )
    except ContextLimitError as exc:  # the tracker refused a request the model could not take
        report["error"] = exc.to_dict()
    report["summarizer_calls"] = summarizer.calls
    report["model_requests"] = [request_tokens(tracker, m, info) for m, info in script.requests]
    report["events"] = agent_common.compaction_events(tracker, session)
    return report


def main(argv: list[str] | None = None) -> int:
    return agent_common.main(
        argv,
        description=__doc__.splitlines()[0],
        session="pydantic-ai-example",
        prefix="ct-pydantic-ai-",
        run=run,
        summarizer=Summarizer,
    )


if __name__ == "__main__":
    agent_common.run_main(main)
