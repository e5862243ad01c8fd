"""Requests the counting tests share: ``AGENT_REQUEST`` (a coding agent's request with tools, a tool
result, code and an image, counted exactly in tests/unit/test_counting_exact.py and by other processes in
tests/e2e/test_counting_processes.py) and the texts it is made of (``CODE``, ``JSON_OUTPUT``)."""

from __future__ import annotations

import inspect
import json
import textwrap
import uuid

CODE = inspect.getsource(textwrap)

JSON_OUTPUT = json.dumps(
    {
        "results": [
            {
                "id": str(uuid.UUID(int=i * 7919)),
                "path": f"src/module_{i}.py",
                "score": round(1 / (i + 1), 4),
                "ok": i % 3 != 0,
            }
            for i in range(40)
        ],
        "next_cursor": "eyJwYWdlIjogMn0=",
    },
    indent=2,
)

AGENT_REQUEST = {
    "system": "You are a coding agent. Use tools.",
    "messages": [
        {"role": "user", "content": "Find the failing test and fix it."},
        {
            "role": "assistant",
            "content": "Running the tests.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run", "arguments": '{"cmd": "pytest -x", "timeout": 120}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "FAILED tests/test_api.py::test_limit - assert 3 == 4\n" + JSON_OUTPUT[:1500],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading the file."},
                {"type": "tool_use", "id": "call_2", "name": "read", "input": {"path": "src/api.py", "lines": [1, 80]}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": CODE[:3000]}]}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here is a screenshot."},
                {"type": "image", "width": 1024, "height": 768, "detail": "high"},
            ],
        },
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "run",
                "description": "Run a shell command",
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
                },
            },
        },
        {
            "name": "read",
            "description": "Read a file",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "lines": {"type": "array", "items": {"type": "integer"}}},
            },
        },
    ],
}
