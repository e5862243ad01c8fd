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

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from pydantic import Field

from tracker import ContextLimitError, Tracker, TrackerError
from tracker.integrations import RedisShare
from tracker.integrations.langchain import ContextTrackerMiddleware, revision_of, to_request  # <- context tracker
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
SYSTEM = "You are a careful engineer. Read the files you need, one at a time, then say what is wrong."
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


@tool
def read_file(path: str) -> str:
    """Read one source file of the repository."""
    rng = random.Random(hashlib.sha256(path.encode()).hexdigest())
    lines = [f"# {path}"]
    for n in range(14):
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"def {a}_{b}_{n}(x):  # {c} handling, see {rng.choice(WORDS)} notes")
    return "\n".join(lines)


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


class Summarizer:
    """A deterministic summariser (a real agent passes a chat model): lists the files read so far."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.delay_s, self.fail, self.calls = delay_s, fail, 0

    def __call__(self, messages: list[BaseMessage], budget_tokens: int) -> str:
        self.calls += 1
        if self.fail:
            raise RuntimeError("the summariser is unavailable")
        time.sleep(self.delay_s)
        read = [tc["args"]["path"] for m in messages if isinstance(m, AIMessage) for tc in m.tool_calls]
        return f"The user asked what is wrong. Files already read ({len(read)}): {', '.join(read)}. Nothing conclusive yet."


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
            {"messages": [HumanMessage("What is wrong with the lease handling?")]},
            config={"configurable": {"thread_id": session}, "recursion_limit": 4 * steps + 20},
        )
        report["answer"] = out["messages"][-1].content
        report["revision"] = revision_of(out["messages"])
        report["summary"] = next((m.content for m in out["messages"] if "context_tracker" in m.additional_kwargs), None)
    except ContextLimitError as exc:  # the tracker refused a request the model could not take
        report["error"] = exc.to_dict()
    report["summarizer_calls"] = summarizer.calls
    report["model_requests"] = [request_tokens(tracker, r) for r in model.requests]
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
    p.add_argument("--session", default="langchain-example")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--failing-summarizer", action="store_true")
    p.add_argument("--summary-delay", type=float, default=0.0, help="seconds the summariser takes")
    p.add_argument("--share-redis", action="store_true", help="publish compactions to Redis for other processes")
    p.add_argument("--no-upgrade", action="store_true", help="the database is already migrated")
    p.add_argument("--start-at", type=float, default=0.0, help="wall-clock time to start at (line processes up)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="ct-langchain-"))
    models_file = workdir / "models.json"
    models_file.write_text(json.dumps(MODELS))
    url = args.database_url or f"sqlite:///{workdir / 'tracker.db'}"
    if not args.no_upgrade:
        upgrade(url)
    settings = Settings.of(database_url=url, redis_url=args.redis_url, models_file=str(models_file))
    share = RedisShare(args.redis_url, prefix=f"ct-example:{args.session}:") if args.share_redis else None
    summarizer = Summarizer(delay_s=args.summary_delay, fail=args.failing_summarizer)
    with Tracker.from_settings(settings) as tracker:
        tracker.counting.warm()  # load the encodings now, not inside the first count's time limit
        time.sleep(max(0.0, args.start_at - time.time()))
        report = run(tracker, args.session, steps=args.steps, summarizer=summarizer, share=share)
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
