"""The import graph of src/tierkv: no cycles, config a leaf, registries agree with config.

The graph is read from the source (every ``import`` / ``from ... import``,
including ones inside functions and under ``TYPE_CHECKING``), so a circle that
only a lazy import hides still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tierkv
from tierkv import config, hashing, policy

ROOT = Path(tierkv.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _graph() -> dict[str, set[str]]:
    """module -> the tierkv modules it imports (``from a import b`` is a.b when b is a module)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        edges.add(sub)
                    elif base in mods:
                        edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_known_edges():
    graph = _graph()
    assert "tierkv.index" in graph["tierkv.policy.base"]
    assert "tierkv.config" in graph["tierkv.cost"]
    assert "tierkv.tiers.remote.rdma" in graph["tierkv.tiers.remote.mooncake"]  # from pkg import submodule
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_tierkv():
    assert _cycles(_graph()) == []


def test_config_is_a_leaf():
    assert _graph()["tierkv.config"] == set()


def test_registries_match_config():
    assert sorted(policy.POLICIES) == sorted(config.POLICY_NAMES)
    assert tuple(hashing.ALGORITHMS) == config.HASH_ALGORITHMS
