"""No import cycles inside longspan/, function-level imports included.

Every ``import``/``from ... import`` anywhere in a module (top level, functions, TYPE_CHECKING blocks excepted)
is an edge to the longspan module it names (``from pkg import name`` points at ``pkg.name`` when that is a
module, else at ``pkg``). A strongly connected component with more than one module is a cycle.
"""

from __future__ import annotations

import ast
import sys

from tests.code.import_graph import import_graph, import_statements


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    return {t for stmt in import_statements(tree, module, is_package) for t in stmt.targets}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
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

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_the_detector_sees_function_level_cycles() -> None:
    tree_a = ast.parse("def f():\n    from longspan.b import x\n")
    assert _imports(tree_a, "longspan.a", False) == {"longspan.b", "longspan.b.x"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_longspan_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)
