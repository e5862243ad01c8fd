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

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
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

from tracker import ContextLimitError, Tracker, TrackerError
from tracker.core.model import Basis
from tracker.integrations import RedisShare
from tracker.integrations.openai_agents import (  # <- context tracker
    ContextTrackerFilter,
    ContextTrackerHooks,
    to_request,
)
from tracker.settings import Settings
from tracker.store.migrate import upgrade

MODEL = "example-agent-small"  # the tracker's registry name for the agent's model
# input limit = min(window - max_output_tokens, max_input_tokens) - safety_margin = 11000 - 8192 = 2808 tokens
MODELS = {
    "models": {
        MODEL: {
            "provider": "openai",
            "window": 20000,
            "max_output_tokens": 1000,
            "max_input_tokens": 11000,
            "counter": "exact_local",
            "encoding": "o200k_base",
        }
    }
}
INSTRUCTIONS = "You are a careful engineer. Read the files you need, one at a time, then say what is wrong."
WORDS = (
    "timeout",
    "retry",
    "budget",
    "batch",
    "cache",
    "lock",
    "queue",
    "worker",
    "parse",
    "flush",
    "index",
    "token",
    "window",
    "commit",
    "lease",
    "fence",
    "shard",
    "replica",
    "cursor",
    "stream",
)


@function_tool
def read_file(path: str) -> str:
    """Read one source file of the repository."""
    rng = random.Random(hashlib.sha256(path.encode()).hexdigest())
    lines = [f"# {path}"]
    for n in range(14):
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"def {a}_{b}_{n}(x):  # {c} handling, see {rng.choice(WORDS)} notes")
    return "\n".join(lines)


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


class Summarizer:
    """A deterministic summariser (a real agent leaves ``summarizer=None``: the agent's own model
    writes the summary): lists the files read so far. ``fail`` = how many calls fail first (-1: all)."""

    def __init__(self, delay_s: float = 0.0, fail: int = 0) -> None:
        self.delay_s, self.fail, self.calls = delay_s, fail, 0

    def __call__(self, items: list[Any], budget_tokens: int) -> str:
        self.calls += 1
        if self.fail < 0 or self.calls <= self.fail:
            raise RuntimeError("the summariser is unavailable")
        time.sleep(self.delay_s)
        read = [json.loads(i["arguments"])["path"] for i in items if i.get("type") == "function_call"]
        return f"The user asked what is wrong. Files already read ({len(read)}): {', '.join(read)}. Nothing conclusive yet."


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
    agent = Agent(name="engineer", instructions=INSTRUCTIONS, model=model, tools=[read_file])
    tracker_filter = ContextTrackerFilter(  # <- context tracker
        tracker, model=MODEL, session_id=session_id, session=session, summarizer=summarizer, share=share, keep_last=4
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
        result = await Runner.run(
            agent, "What is wrong with the lease handling?", run_config=config, hooks=hooks, max_turns=steps + 5
        )
        report["answer"] = result.final_output
    except ContextLimitError as exc:  # the tracker refused a request the model could not take
        report["error"] = exc.to_dict()
    report["summarizer_calls"] = summarizer.calls
    report["model_requests"] = [request_tokens(tracker, ins, items, tools) for ins, items, tools in model.received]
    report["usage_reports"] = hooks.reports_usage  # False until the tracker has report_usage
    report["usages"] = [{"basis": u.basis, "input_tokens": u.input_tokens} for u in hooks.usages]
    report["events"] = [
        {
            "type": e.type,
            **{
                k: e.data[k]
                for k in ("attempt_id", "tokens_before", "tokens_after", "reject_reason", "basis", "input_tokens")
                if k in e.data
            },
        }
        for e in tracker.history(session)
        if e.type.startswith("Compaction") or e.type == "ContextLimitReached"
    ]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="default: a SQLite file in a temporary directory")
    p.add_argument("--redis-url")
    p.add_argument("--session", default="openai-agents-example")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--failing-summarizer", action="store_true")
    p.add_argument("--summary-delay", type=float, default=0.0, help="seconds the summariser takes")
    p.add_argument("--share-redis", action="store_true", help="publish compactions to Redis for other processes")
    p.add_argument("--no-upgrade", action="store_true", help="the database is already migrated")
    p.add_argument("--start-at", type=float, default=0.0, help="wall-clock time to start at (line processes up)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="ct-openai-agents-"))
    models_file = workdir / "models.json"
    models_file.write_text(json.dumps(MODELS))
    url = args.database_url or f"sqlite:///{workdir / 'tracker.db'}"
    if not args.no_upgrade:
        upgrade(url)
    settings = Settings.of(database_url=url, redis_url=args.redis_url, models_file=str(models_file))
    share = RedisShare(args.redis_url, prefix=f"ct-example:{args.session}:") if args.share_redis else None
    summarizer = Summarizer(delay_s=args.summary_delay, fail=-1 if args.failing_summarizer else 0)
    with Tracker.from_settings(settings) as tracker:
        tracker.counting.warm()  # load the encodings now, not inside the first count's time limit
        time.sleep(max(0.0, args.start_at - time.time()))
        report = asyncio.run(run(tracker, args.session, steps=args.steps, summarizer=summarizer, share=share))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"answer: {report['answer']}" if report["answer"] else f"stopped: {report['error']['message']}")
        print("model requests (tokens):", report["model_requests"])
        for e in report["events"]:
            print(" ", e)
    return 0 if report["answer"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TrackerError as exc:
        print(json.dumps(exc.to_dict()), file=sys.stderr)
        sys.exit(2)
