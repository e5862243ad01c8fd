"""A simulated coding agent for ``tracker demo``: requests that grow with realistic tool output.

Deterministic per seed. The agent keeps a real message history (system prompt,
user task, assistant tool calls, tool results with code, logs, JSON and diffs),
sends the *complete* request to the tracker to be counted, and compacts for
real when told to: it replaces old turns with a summary and counts again.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

SYSTEM = (
    "You are a careful senior software engineer working in a monorepo. Use the tools to read files, run tests "
    "and search code. Explain what you change and why. Never invent file contents; read them first."
)

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file from the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run_tests",
        "description": "Run the test suite, optionally filtered.",
        "input_schema": {"type": "object", "properties": {"filter": {"type": "string"}}},
    },
    {
        "name": "search",
        "description": "Search the code base with a regular expression.",
        "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
    },
]

TASKS = [
    "The nightly export job times out on large tenants. Find out why and fix it.",
    "Add retry with jitter to the webhook sender and make sure we never double-send.",
    "Users report that invoices in EUR are rounded wrongly. Investigate the money handling.",
    "Migrate the session cache from memcached to Redis without downtime.",
    "The search endpoint is slow for queries with many filters; profile and improve it.",
    "Replace the hand-written CSV parser with the standard library and keep behaviour identical.",
]

_WORDS = [
    "tenant",
    "invoice",
    "export",
    "batch",
    "retry",
    "cursor",
    "offset",
    "window",
    "session",
    "cache",
    "token",
    "handler",
    "queue",
    "worker",
    "schema",
    "column",
    "index",
    "query",
    "filter",
    "request",
    "response",
    "timeout",
    "budget",
    "limit",
    "metric",
    "span",
    "trace",
]


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        w1, w2, w3 = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        kind = rng.random()
        if kind < 0.15:
            out.append(f"def {w1}_{w2}(self, {w3}: int, *, timeout: float = {rng.randint(1, 30)}.0) -> list[str]:")
        elif kind < 0.3:
            out.append(f"    if {w1}.{w2} is None or len({w3}) > {rng.randint(2, 5000)}:")
        elif kind < 0.45:
            out.append(f'        raise {w1.title()}Error(f"{w2} {{{w3}!r}} exceeded the {w1} limit")')
        elif kind < 0.6:
            out.append(f"    {w1}_{w2} = await self._{w3}.fetch({w1}={w2}, limit={rng.randint(10, 1000)})")
        elif kind < 0.75:
            out.append(f"    # {w1} {w2} must stay below the {w3} budget (see ADR-{rng.randint(10, 99)})")
        else:
            out.append(f"    return [{w1} for {w1} in {w2}_{w3} if {w1}.id != {rng.randint(1, 99999)}]")
    return "\n".join(out)


def _log(rng: random.Random, lines: int) -> str:
    levels = ["INFO", "INFO", "INFO", "WARNING", "ERROR", "DEBUG"]
    return "\n".join(
        f"2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z "
        f"{rng.choice(levels):7s} {rng.choice(_WORDS)}.{rng.choice(_WORDS)} tenant={rng.randint(1, 900)} "
        f"duration_ms={rng.randint(1, 90000)} {rng.choice(_WORDS)}={rng.choice(_WORDS)}"
        for _ in range(lines)
    )


def _json_rows(rng: random.Random, rows: int) -> str:
    return json.dumps(
        [
            {
                "id": rng.randint(1, 10**6),
                "tenant": f"t-{rng.randint(1, 900)}",
                "status": rng.choice(["ok", "failed", "retry"]),
                "amount": round(rng.uniform(0, 5000), 2),
                "currency": rng.choice(["EUR", "USD", "GBP"]),
                "note": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))),
            }
            for _ in range(rows)
        ],
        indent=1,
    )


def tool_output(rng: random.Random, size: int) -> tuple[str, dict[str, Any], str]:
    kind = rng.choice(["read_file", "run_tests", "search"])
    if kind == "read_file":
        return kind, {"path": f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"}, _code(rng, size)
    if kind == "run_tests":
        return kind, {"filter": rng.choice(_WORDS)}, _log(rng, size)
    return kind, {"pattern": rng.choice(_WORDS)}, _json_rows(rng, max(1, size // 6))


@dataclass
class Agent:
    """One agent session: its message history, its revision and basis ids."""

    session_id: str
    seed: int
    output_scale: int = 60  # lines of tool output per step, on average
    messages: list[dict[str, Any]] = field(default_factory=list)
    step_no: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.messages = [{"role": "user", "content": self.rng.choice(TASKS)}]

    def request(self) -> dict[str, Any]:
        return {"system": SYSTEM, "messages": self.messages, "tools": TOOLS}

    @property
    def through(self) -> str:
        return f"m{len(self.messages)}-s{self.step_no}"

    def step(self) -> None:
        """One agent turn: a tool call and its (often large) result."""
        self.step_no += 1
        name, args, output = tool_output(self.rng, max(5, int(self.rng.expovariate(1 / self.output_scale))))
        call_id = f"call_{self.step_no}"
        self.messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Step {self.step_no}: let me look at {json.dumps(args)}."},
                    {"type": "tool_call", "id": call_id, "name": name, "arguments": args},
                ],
            }
        )
        self.messages.append(
            {"role": "tool", "content": [{"type": "tool_result", "tool_call_id": call_id, "content": output}]}
        )

    def compact(self, keep_last: int = 4) -> None:
        """Replace all but the task and the last turns with a short summary (what a compactor would do)."""
        head, tail = self.messages[:1], self.messages[-keep_last:]
        dropped = len(self.messages) - len(head) - len(tail)
        summary = (
            f"Summary of {dropped} earlier messages: inspected "
            + ", ".join(sorted({self.rng.choice(_WORDS) for _ in range(12)}))
            + ". Findings so far: the timeout budget is exceeded in the batch path; a fix is in progress."
        )
        self.messages = head + [{"role": "user", "content": summary}] + tail
