"""The decision core stays pure: no I/O, no clock, no randomness, no globals.

Live decisions, replay and what-if are the same code only while this holds,
so it is checked on the source itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "tracker" / "core"
ALLOWED = {
    "__future__",
    "dataclasses",
    "typing",
    "fractions",
    "math",
    "re",
    "functools",
    "collections.abc",
    "decimal",
    "tracker.errors",
}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name in ALLOWED or alias.name.startswith("tracker.core"), (
                    f"{path.name} imports {alias.name}"
                )
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            assert mod in ALLOWED or mod.startswith("tracker.core"), f"{path.name} imports from {mod}"
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            raise AssertionError(f"{path.name}:{node.lineno} uses global/nonlocal state")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS, f"{path.name}:{node.lineno} calls {node.func.id}()"
