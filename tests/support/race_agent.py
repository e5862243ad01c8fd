"""One side of the cross-language race (tests/e2e/test_cross_language_race.py): a LangChain agent.

    python tests/support/race_agent.py SPEC.json

``SPEC.json`` gives the tracker (``url``, ``token``), the ``session``, the registry ``model``, the ``share_dir`` (a :class:`~tracker.integrations.DirectoryShare`), the ``system``
prompt and the ``history`` in a framework-neutral form (``user`` / ``assistant`` with ``calls`` /
``tool`` with ``results``), which this script holds as LangChain messages (one ``ToolMessage`` per
result). clients/typescript/test/support/race-agent.mjs is the other side, in the AI SDK.

The test drives it on stdin and reads it on stdout, one line each:

* it prints ``ready`` once the agent is built, then waits for a line (``go``) before its one model call;
* its summariser prints ``summarizing`` (the tracker opened an attempt for this process) and waits for
  a line (``summarize``) before writing the summary; its client prints ``waiting`` before it waits on
  another holder's attempt;
* last, one JSON line: the history the model received (canonical form and digest), the summariser's
  calls, the summary text the model read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import Field

from tracker.client import TrackerClient
from tracker.counting.counters import heuristic_request_tokens
from tracker.counting.request import CanonicalRequest
from tracker.integrations import DirectoryShare
from tracker.integrations.compaction import SUMMARY_PREFIX
from tracker.integrations.langchain import ContextTrackerMiddleware, to_request


def say(line: str) -> None:
    print(line, flush=True)


class RecordingModel(GenericFakeChatModel):
    requests: list[list[BaseMessage]] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kwargs: Any) -> RecordingModel:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        self.requests.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


class SayingClient(TrackerClient):
    def wait(self, session_id: str, attempt_id: str, timeout: float = 30.0) -> str:
        say("waiting")
        return super().wait(session_id, attempt_id, timeout)


def langchain_history(history: list[dict[str, Any]]) -> list[BaseMessage]:
    out: list[BaseMessage] = []
    for turn in history:
        if turn["role"] == "user":
            out.append(HumanMessage(turn["text"]))
        elif turn["role"] == "assistant":
            calls = [{"id": c["id"], "name": c["name"], "args": c["args"]} for c in turn.get("calls", [])]
            out.append(AIMessage(content=turn.get("text", ""), tool_calls=calls))
        else:
            out.extend(ToolMessage(r["text"], tool_call_id=r["id"]) for r in turn["results"])
    return out


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    calls = {"summarizer": 0}

    def summarizer(messages: list[BaseMessage], budget: int) -> str:
        calls["summarizer"] += 1
        say("summarizing")
        sys.stdin.readline()  # "summarize"
        return f"Written by the Python agent: {len(messages)} messages, the weather of ten cities read."

    model = RecordingModel(messages=iter([AIMessage("All ten cities read.")]))
    middleware = ContextTrackerMiddleware(
        SayingClient(spec["url"], spec["token"]),
        model=spec["model"],
        session_id=spec["session"],
        summarizer=summarizer,
        share=DirectoryShare(spec["share_dir"]),
        # the tracker's heuristic counter, as the TypeScript side's estimateTokens (the default counter of a
        # remote client measures with the default policy, whose reserved output is over this small window)
        count_tokens=lambda request: heuristic_request_tokens(CanonicalRequest.from_dict(request)),
    )
    agent = create_agent(model, tools=[], system_prompt=spec["system"], middleware=[middleware])
    history = langchain_history(spec["history"])
    say("ready")
    sys.stdin.readline()  # "go"
    agent.invoke({"messages": history})
    sent = model.requests[0]
    messages = to_request([m for m in sent if not isinstance(m, SystemMessage)])["messages"]
    canonical = CanonicalRequest.from_dict({"messages": messages})
    summaries = [m.content for m in sent if isinstance(m.content, str) and m.content.startswith(SUMMARY_PREFIX)]
    report = {
        "side": "python",
        "history_canonical": canonical.canonical_json(),
        "history_digest": canonical.fingerprint[:32],
        "summarizer_calls": calls["summarizer"],
        "prompts": len(model.requests),
        "summaries": [s[len(SUMMARY_PREFIX) :] for s in summaries],
    }
    say(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
