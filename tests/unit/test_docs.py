"""The documents say what the code does: defaults, the configuration table, links inside the repository;
and the README stays short enough to read in ten minutes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tracker.core.policy import Policy
from tracker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _table_rows(text: str, header_first_cell: str) -> list[list[str]]:
    """Rows of the first markdown table whose header starts with ``header_first_cell``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and line.strip("| ").startswith(header_first_cell):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"no table headed {header_first_cell!r}")


def _doc_value(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_behaviour_doc_states_the_policy_defaults_of_the_code():
    rows = _table_rows((ROOT / "docs" / "behaviour.md").read_text(encoding="utf-8"), "field")
    documented = {r[0].strip("`"): r[1].split()[0].strip("`") for r in rows}
    defaults = Policy()
    assert set(documented) == {f.name for f in dataclasses.fields(Policy)}
    for name, text in documented.items():
        assert text == _doc_value(getattr(defaults, name)), name


def test_configuration_table_lists_every_setting_with_its_default():
    rows = _table_rows((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"), "variable")
    documented = {r[0].strip("`"): r for r in rows}
    expected = {variable: default for _, variable, default, _ in Settings.variables()}
    assert set(documented) == set(expected), (
        f"missing from docs/configuration.md: {sorted(set(expected) - set(documented))}; "
        f"not settings: {sorted(set(documented) - set(expected))}"
    )
    for variable, default in expected.items():
        cell = documented[variable][1].strip("`")
        want = "none" if default is None else _doc_value(default)
        assert cell == want or cell.startswith(want), (
            f"{variable}: docs/configuration.md says {cell!r}, the code {want!r}"
        )


def test_readme_reads_in_ten_minutes():
    """At about 230 words a minute: 250 lines and 2,300 words at most; the rest lives in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines, words = len(text.splitlines()), len(text.split())
    assert lines <= 250, f"README.md has {lines} lines (at most 250): move detail into docs/"
    assert words <= 2300, f"README.md has {words} words, {words / 230:.1f} minutes to read (at most 10)"


def test_every_variable_name_is_unique_across_sections():
    names = [variable for _, variable, _, _ in Settings.variables()]
    assert len(names) == len(set(names))


def test_documents_link_only_inside_the_repository():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text and "shared/SPEC" not in text, doc
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (doc.parent / target).resolve().is_relative_to(ROOT), f"{doc.name} links outside: {target}"
            assert (doc.parent / target).exists(), f"{doc.name} links to a missing file: {target}"


def test_ci_runs_exactly_the_readmes_test_command_and_every_test_path_in_the_docs_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    top = readme.split("## ", 1)[0]
    command = next(line.split("#")[0].strip() for line in top.splitlines() if "-m pytest" in line)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert any(line == command or line.startswith(command + " ||") for line in ci), (command, ci)
    docs = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        for path in re.findall(r"tests/[\w/*]+\.py", doc.read_text(encoding="utf-8")):
            assert list(ROOT.glob(path)), f"{doc.name} names {path}, which does not exist"
