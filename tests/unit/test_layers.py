"""Imports point one way: the layers contract of the whole package, checked on the source.

Every import counts — at module level, inside functions, and under ``TYPE_CHECKING`` — so a
lazy import cannot hide an upward edge. The layers, bottom first (a module may import its
own layer and the layers below it; sibling packages of one layer may not import each other):

    errors → core → hooks → {settings, _lru, telemetry, metrics} → {store, counting, coordination}
      → {idempotent, calibrations} → {recording, protocol} → {service, queries} → audit → bootstrap
      → {http, client, integrations, workers} → {demo, bench} → cli

The composition root (``bootstrap``) sits above everything it wires (the service, the read
side, the adapters) and below every entry point that asks it for parts. The CLI is the
outermost shell: it dispatches to the HTTP server, the worker, the demo and the bench.
Besides the layers, the module graph must have no cycle at all.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS: list[set[str]] = [
    {"tracker.errors"},
    {"tracker.core"},
    {"tracker.hooks"},  # the service's hook interface: metrics and telemetry implement it
    {"tracker.settings", "tracker._lru", "tracker.telemetry", "tracker.metrics"},
    {"tracker.store", "tracker.counting", "tracker.coordination"},
    {"tracker.idempotent", "tracker.calibrations"},  # the service's answers to retries; its calibration ledger
    # how the service records a decision (the optimistic/locked record loop); the typed public calls
    {"tracker.recording", "tracker.protocol"},
    {"tracker.service", "tracker.queries"},
    {"tracker.audit"},
    {"tracker.bootstrap"},  # the composition root: wires everything below, asked by everything above
    {"tracker.http", "tracker.client", "tracker.integrations", "workers"},
    {"tracker.demo", "tracker.bench"},
    {"tracker.cli"},
]


def component(module: str) -> str | None:
    """The layer component a module belongs to (``tracker.store.sql`` → ``tracker.store``)."""
    parts = module.split(".")
    for n in (2, 1):
        name = ".".join(parts[:n])
        if any(name in layer for layer in LAYERS):
            return name
    return None


def level(comp: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if comp in layer)


def modules() -> dict[str, Path]:
    found = {}
    for base in ("tracker", "workers"):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports (resolved to the most specific known module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                out.add(name)
    return out


@functools.cache
def _parsed_graph() -> dict[str, frozenset[str]]:
    mods = modules()
    known = set(mods)
    return {m: frozenset(imports_of(p, m, known)) for m, p in mods.items()}


def graph() -> dict[str, set[str]]:
    """The import graph of ``tracker`` and ``workers`` (parsed once per process; each call a fresh copy a
    test may add edges to)."""
    return {m: set(targets) for m, targets in _parsed_graph().items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    problems = []
    for src, targets in sorted(edges.items()):
        if src == "tracker":
            continue  # the public facade re-exports from every layer (lazily)
        a = component(src)
        for dst in sorted(targets):
            if dst == "tracker":
                problems.append(f"{src} imports the root package `tracker` (import the module that defines the name)")
                continue
            b = component(dst)
            if a is None or b is None:
                problems.append(f"{src} -> {dst}: module outside the layer map")
            elif a != b and level(b) > level(a):
                problems.append(f"{src} -> {dst}: upward import ({a} is below {b})")
            elif a != b and level(b) == level(a):
                problems.append(f"{src} -> {dst}: sibling packages of one layer import each other")
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between modules, without those into a package's own facade (``__init__``) from inside it."""
    return {src: {d for d in dsts if not src.startswith(d + ".")} for src, dsts in edges.items() if src != "tracker"}


def test_every_module_is_in_a_layer():
    missing = sorted(m for m in graph() if m != "tracker" and component(m) is None)
    assert not missing, f"put these modules in a layer of tests/unit/test_layers.py: {missing}"


def test_imports_point_one_way():
    problems = violations(graph())
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    found = cycles(package_edges(graph()))
    assert not found, f"import cycles: {found}"


@pytest.mark.parametrize(
    "src, dst",
    [
        ("tracker.core.model", "tracker.service"),  # the pure core reaching up to the service
        ("tracker.store.sql", "tracker.counting.registry"),  # one adapter into another
        ("tracker.counting.backends", "workers.app"),  # counting importing the Celery app
        ("tracker.service", "tracker.http.app"),  # the service layer into an entry point
        ("tracker.errors", "tracker"),  # the root package from inside
        ("tracker.hooks", "tracker.service"),  # the hook interface reaching up to what emits it
        ("tracker.metrics", "tracker.telemetry"),  # one hook implementation into a sibling
        ("tracker.service", "tracker.bootstrap"),  # the service reaching up to the composition root
        ("tracker.queries", "tracker.bootstrap"),  # the read side likewise
        ("tracker.store.sql", "tracker.bootstrap"),  # an adapter asking the root for its parts
        ("tracker.bootstrap", "tracker.http.app"),  # the root reaching up to an entry point
        ("tracker.bootstrap", "tracker.cli"),
    ],
)
def test_the_contract_catches_an_added_upward_import(src, dst):
    """The checks above can fail: one upward edge added to the real graph is reported."""
    edges = graph()
    assert not any(dst_ == dst for dst_ in edges.get(src, set()))
    edges.setdefault(src, set()).add(dst)
    assert any(p.startswith(f"{src} -> {dst}") or p.startswith(f"{src} imports the root") for p in violations(edges))


def test_the_cycle_check_catches_a_cycle():
    edges = package_edges(graph())
    edges["tracker.core.model"] = set(edges.get("tracker.core.model", set())) | {"tracker.core.decide"}
    assert any("tracker.core.model" in scc for scc in cycles(edges))
