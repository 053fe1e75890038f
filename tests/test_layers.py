"""ftrt's packages import one another without cycles, and the worker API stays clear of the agent.

Every import counts, also one inside a function (it runs sooner or later, and it is how cycles
hide). Nodes are ftrt's subpackages (``ftrt.agents``, ``ftrt.store``, ...) and each module directly
in ``ftrt/`` (``ftrt.runtime``, ``ftrt.reports``, ...); the ``ftrt`` package itself (its
``__init__``, the public facade) is a node too. A cycle between two of them fails with the modules
that make each edge.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"ftrt": "ftrt", "agents": "ftrt.agents", "checkpoint": "ftrt.checkpoint", "chaos": "ftrt.chaos"}
"""Source folders and the package each installs as (pyproject's package-dir)."""
GENERATED = "ftrt.v1"


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if not name.startswith(GENERATED):
                found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every ftrt module ``path`` imports, at module level or in a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from pkg import mod` imports the module, `from mod import x` the module
                out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module)
    return {name for name in out if name.split(".")[0] == "ftrt" and not name.startswith(GENERATED)}


def _node(module: str) -> str:
    """The package (or top-level module) ``module`` belongs to."""
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def _edges() -> dict[str, dict[str, set[str]]]:
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, path in MODULES.items():
        for target in _imports(path):
            if _node(target) != _node(module):
                edges[_node(module)][_node(target)].add(module)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_the_tree():
    assert {"ftrt.runtime", "ftrt.agents.agent", "ftrt.checkpoint.checkpointer", "ftrt.store.concurrency",
            "ftrt.policy.spec", "ftrt.chaos.runner"} <= set(MODULES)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_packages():
    edges = _edges()
    cycles = _cycles({src: set(dsts) for src, dsts in edges.items()})
    lines = [f"{' <-> '.join(c)}:\n" + "\n".join(f"  {a} -> {b} (in {', '.join(sorted(edges[a][b]))})"
                                                  for a in c for b in c if b in edges[a]) for c in cycles]
    assert not cycles, "import cycles between packages:\n" + "\n".join(lines)


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        todo.extend(_imports(MODULES[module]))
    return seen


def test_the_worker_api_does_not_import_the_agent():
    for api in ("ftrt", "ftrt.runtime", "ftrt.roundend", "ftrt.checkpoint.checkpointer", "ftrt.integrations.hf"):
        agent_side = sorted(m for m in _reach(api) if m.startswith("ftrt.agents"))
        assert not agent_side, f"{api} reaches {agent_side}"
