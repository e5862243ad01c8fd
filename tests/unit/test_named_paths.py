"""Every test file a docstring or a comment names (``tests/<tier>/<name>.py``) exists: a test that moves takes its
mentions along (the Markdown files' links are tests/unit/test_docs.py's)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"\btests/[\w/*.-]*?\.py\b")


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def named_paths(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    if "tests/" not in source:
        return []
    return [(line, m) for line, text in _prose(source) for m in NAMED.findall(text)]


def test_every_test_path_a_docstring_or_comment_names_exists():
    sources = [p for d in ("tracker", "workers", "tests", "examples") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 100
    missing = [
        f"{p.relative_to(ROOT)}:{line}: {named}"
        for p in sources
        for line, named in named_paths(p)
        if not any(ROOT.glob(named))
    ]
    assert missing == [], "\n".join(missing)


def test_the_check_finds_a_named_path_in_a_docstring_and_a_comment(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""See tests/unit/nothing_here.py."""\n\nx = "tests/not_prose.py"  # and tests/e2e/gone.py\n')
    assert named_paths(module) == [(1, "tests/unit/nothing_here.py"), (3, "tests/e2e/gone.py")]
